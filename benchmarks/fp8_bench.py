#!/usr/bin/env python3
"""FP8 forward speed, same process and inputs for every row.

Rows per shape: ``fp8-kernel`` (the FP8 forward that ``precision="fp8"``
runs, on pre-quantized e4m3 inputs + scales with V^T from the pre-pass: the
kernel alone), ``fp8-kernel-xposeV`` (the FP8 forward of ``attention_fp8``,
V as [B, S, K, H] transposed in shared memory by the kernel: alone),
``fp8+prepass`` (``attention(precision="fp8")``: the fused quantize pre-pass +
the kernel), ``fp8-prepass`` (the pre-pass alone), ``bf16`` (our bf16 kernel)
and ``cudnn`` (jax.nn's cuDNN path, bf16).
Shapes: the FA3-paper sweep (16k tokens, hidden 2048) at seqlen >= 4k, head
dims 128 and 256, causal off/on.  FLOPs ``4 b h s^2 d`` (/2 causal) for every
row (also for the pre-pass rows, so TFLOP/s are comparable).  Timing:
``bench.time_fn`` (min over repeats of the mean of back-to-back jitted calls,
``block_until_ready``), rotating over input sets.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seqlens", default="4096,8192,16384")
  ap.add_argument("--hdims", default="128,256")
  ap.add_argument("--causal", default="0,1")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--rotate", type=int, default=2)
  ap.add_argument("--min-run-ms", type=float, default=200)
  args = ap.parse_args(argv)

  import jax
  import jax.numpy as jnp
  jax_fa3 = bench._import_jax_fa3()
  from jax_fa3 import fp8

  print(bench.header_line(bench.environment()))
  print("| hdim | causal | seqlen | batch x heads | impl | ms | TFLOP/s | vs bf16 | vs cuDNN |")
  print("|---|---|---|---|---|---|---|---|---|")
  for hd in bench._int_list(args.hdims):
    for causal in (bool(int(c)) for c in args.causal.split(",")):
      for s in bench._int_list(args.seqlens):
        b, h = max(1, bench.TOTAL_TOKENS // s), bench.HIDDEN // hd
        shape = bench.Shape(hdim=hd, causal=causal, seqlen=s, batch=b, heads=h)
        sets = bench.make_inputs(shape, jnp.bfloat16, args.rotate)
        quant = jax.jit(lambda q, k, v: fp8.quantize_qkv(q, k, v, use_kernel=True,
                                                          v_transposed=True))
        quant_x = jax.jit(lambda q, k, v: fp8.quantize_qkv(q, k, v, use_kernel=True))
        qsets = [quant(*x[:3]) for x in sets]
        qsets_x = [quant_x(*x[:3]) for x in sets]
        wr = 0 if causal else -1
        fns = {
            "fp8-kernel": (jax.jit(lambda *a, wr=wr: fp8.attention_quantized(
                *a, None, None, hd ** -0.5, -1, wr, jnp.bfloat16, "fa3",
                v_transposed=True)[0]), qsets),
            "fp8-kernel-xposeV": (jax.jit(lambda *a, c=causal: jax_fa3.attention_fp8(
                *a, is_causal=c, implementation="fa3")), qsets_x),
            "fp8+prepass": (jax.jit(lambda q, k, v, c=causal: jax_fa3.attention(
                q, k, v, is_causal=c, precision="fp8", implementation="fa3")),
                            [x[:3] for x in sets]),
            "fp8-prepass": (quant, [x[:3] for x in sets]),
            "bf16": (jax.jit(lambda q, k, v, c=causal: jax_fa3.attention(
                q, k, v, is_causal=c, implementation="fa3")), [x[:3] for x in sets]),
            "cudnn": (jax.jit(lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                q, k, v, is_causal=c, implementation="cudnn")), [x[:3] for x in sets]),
        }
        flops = bench.attn_flops(b, h, s, hd, causal)
        ms = {}
        for name, (fn, argsets) in fns.items():
          try:
            t, _ = bench.time_fn(fn, argsets, warmup=3, repeats=args.repeats,
                                 min_run_s=args.min_run_ms / 1e3, max_iters=1000)
            ms[name] = t * 1e3
          except Exception as e:  # report and continue
            print(f"<!-- {name} hd{hd} s{s} causal={causal}: {type(e).__name__}: {e} -->")
        for name, t in ms.items():
          tf = flops / (t * 1e-3) / 1e12
          rb = ms["bf16"] / t if "bf16" in ms else float("nan")
          rc = ms["cudnn"] / t if "cudnn" in ms else float("nan")
          print(f"| {hd} | {int(causal)} | {s} | {b}x{h} | {name} | {t:.3f} | "
                f"{tf:.0f} | {rb:.2f}x | {rc:.2f}x |")
        sys.stdout.flush()
  return 0


if __name__ == "__main__":
  sys.exit(main())

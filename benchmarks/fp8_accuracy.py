#!/usr/bin/env python3
"""FP8 accuracy table: RMSE and max error against float64.

Problem: b=2, s=2048, h=8, d=128, non-causal, bf16 inputs, fixed seeds.
Inputs (a) N(0,1); (b) N(0,1) plus N(0, 10^2) added on 0.1% of the entries
(independently for Q, K, V).  Rows:

* bf16 kernel: ``jax_fa3.attention`` in bf16.
* FP8 per-tensor / block only / Hadamard only / block + Hadamard: our FP8
  kernel (``precision="fp8"`` with ``fp8_block_scales`` / ``fp8_hadamard``).
* FP8 block + Hadamard, JAX emulation: the same quantization emulated in
  pure JAX (``implementation="reference"``), computed on the CPU.
* paper-style baseline: standard attention with per-tensor e4m3 Q/K/V
  (scale amax/448) and the softmax probabilities cast to e4m3 *unscaled*,
  emulated in NumPy + ml_dtypes (no XLA, so no FP8 round trip can be elided).

Without an sm_90 GPU the FP8 rows fall back to the JAX emulation (the table
says which implementation ran).  Prints markdown; ``--json`` also dumps the
numbers.
"""
from __future__ import annotations

import argparse
import json
import sys

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)


def make_inputs(kind, b, s, h, d, seed):
  rng = np.random.default_rng(seed)
  xs = []
  for _ in range(3):
    x = rng.standard_normal((b, s, h, d))
    if kind == "b":
      mask = rng.random(x.shape) < 1e-3
      x = x + mask * rng.normal(0.0, 10.0, x.shape)
    xs.append(x.astype(np.float32).astype(BF16))
  return xs


def ref64(q, k, v):
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  d = q.shape[-1]
  out = np.empty(q.shape)
  for b in range(q.shape[0]):
    for n in range(q.shape[2]):
      s = q[b, :, n] @ k[b, :, n].T / np.sqrt(d)
      p = np.exp(s - s.max(axis=1, keepdims=True))
      out[b, :, n] = (p / p.sum(axis=1, keepdims=True)) @ v[b, :, n]
  return out


def paper_baseline(q, k, v):
  """Per-tensor e4m3 Q/K/V, FP32 softmax, P cast to e4m3 unscaled."""
  def quant(x):
    x = np.asarray(x, np.float32)
    sc = np.float32(np.abs(x).max() / 448.0)
    return (x / sc).astype(E4M3).astype(np.float32), sc
  (q8, qs), (k8, ks), (v8, vs) = quant(q), quant(k), quant(v)
  d = q8.shape[-1]
  out = np.empty(q8.shape, np.float32)
  for b in range(q8.shape[0]):
    for n in range(q8.shape[2]):
      s = (q8[b, :, n] @ k8[b, :, n].T) * (qs * ks / np.sqrt(d))
      p = np.exp(s - s.max(axis=1, keepdims=True))
      p = (p / p.sum(axis=1, keepdims=True)).astype(E4M3).astype(np.float32)
      out[b, :, n] = (p @ v8[b, :, n]) * vs
  return out.astype(BF16)


def errors(out, ref):
  e = np.asarray(out, np.float64) - ref
  return float(np.sqrt(np.mean(e ** 2))), float(np.max(np.abs(e)))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seqlen", type=int, default=2048)
  ap.add_argument("--heads", type=int, default=8)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--json", default=None, help="also write the numbers here")
  args = ap.parse_args(argv)

  import jax
  import jax_fa3
  from jax_fa3 import fp8

  blocker = fp8.fp8_kernel_blocker(np.dtype(BF16), args.head_dim)
  impl = "fa3" if blocker is None else "reference"
  print(f"# FP8 accuracy: b={args.batch} s={args.seqlen} h={args.heads} "
        f"d={args.head_dim}, non-causal, bf16 inputs; FP8 rows ran: "
        f"{impl}{'' if blocker is None else ' (' + blocker + ')'}\n")

  rows = [("bf16 kernel", dict(precision=None)),
          ("FP8 per-tensor", dict(precision="fp8", fp8_block_scales=False, fp8_hadamard=False)),
          ("FP8 block only", dict(precision="fp8", fp8_block_scales=True, fp8_hadamard=False)),
          ("FP8 Hadamard only", dict(precision="fp8", fp8_block_scales=False, fp8_hadamard=True)),
          ("FP8 block + Hadamard", dict(precision="fp8", fp8_block_scales=True, fp8_hadamard=True))]
  results = {}
  for kind, seed in (("a", args.seed + 1), ("b", args.seed + 2)):
    q, k, v = make_inputs(kind, args.batch, args.seqlen, args.heads,
                          args.head_dim, seed)
    r = ref64(q, k, v)
    res = {}
    for name, kw in rows:
      use = impl if kw["precision"] == "fp8" else None
      f = jax.jit(lambda q, k, v, kw=kw, use=use: jax_fa3.attention(
          q, k, v, implementation=use, **kw))
      res[name] = errors(np.asarray(f(q, k, v)), r)
    with jax.default_device(jax.devices("cpu")[0]):
      out = jax_fa3.attention(q, k, v, precision="fp8", implementation="reference")
    res["FP8 block + Hadamard, JAX emulation (CPU)"] = errors(np.asarray(out), r)
    res["paper-style baseline (per-tensor, P unscaled; NumPy)"] = errors(
        paper_baseline(q, k, v), r)
    results[kind] = res

  print("| method | (a) RMSE | (a) max err | (b) RMSE | (b) max err |")
  print("|---|---|---|---|---|")
  for name in results["a"]:
    a, b = results["a"][name], results["b"][name]
    print(f"| {name} | {a[0]:.2e} | {a[1]:.2e} | {b[0]:.2e} | {b[1]:.2e} |")
  rb = results["b"]
  bh = rb["FP8 block + Hadamard"][0]
  print(f"\n(b) ratios: per-tensor / block+Hadamard = "
        f"{rb['FP8 per-tensor'][0] / bh:.2f}x (bar >= 1.7x); paper baseline / "
        f"block+Hadamard = "
        f"{rb['paper-style baseline (per-tensor, P unscaled; NumPy)'][0] / bh:.2f}x "
        f"(bar >= 2.6x); block+Hadamard RMSE {bh:.2e} (bar <= 9e-3)")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump({"impl": impl, "args": vars(args), "results": results}, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

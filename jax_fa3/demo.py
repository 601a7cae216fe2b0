"""The main job: ``python -m jax_fa3.demo``.

Runs jax_fa3 attention the way a training step uses it (jit + grad, GQA,
causal) on whatever JAX sees, checks it against ``jax.nn.dot_product_attention``
in float32, and times it against jax.nn's own backend (cuDNN on a GPU, XLA
elsewhere). On an H100/H200 with the kernels built this is the FA3 kernel;
anywhere else it is the pure-JAX reference path.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa3
from jax_fa3 import _native


def _time(fn, *args, iters=10):
  jax.block_until_ready(fn(*args))  # compile + warm-up
  t0 = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters


def main(argv=None):
  on_gpu = _native.available() and _native.sm90_gpu_present()
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batch", type=int, default=4 if on_gpu else 2)
  ap.add_argument("--seqlen", type=int, default=4096 if on_gpu else 256)
  ap.add_argument("--heads", type=int, default=16 if on_gpu else 4)
  ap.add_argument("--kv-heads", type=int, default=4 if on_gpu else 2)
  ap.add_argument("--head-dim", type=int, default=128 if on_gpu else 64)
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
  args = ap.parse_args(argv)

  b, s, n, kh, d = args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim
  dtype = jnp.dtype(args.dtype)
  path = "FA3 kernel" if on_gpu and (args.dtype, d) in _native.compiled_configs() else "reference"
  print(f"jax_fa3 {jax_fa3.__version__} | jax {jax.__version__} | device {jax.devices()[0].device_kind} "
        f"| kernels built: {_native.available()} | path: {path}")
  print(f"shape: batch {b}, seqlen {s}, heads {n}/{kh} (GQA), head dim {d}, {args.dtype}, causal")

  kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(kq, (b, s, n, d), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (b, s, kh, d), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (b, s, kh, d), jnp.float32).astype(dtype)
  g = jax.random.normal(kg, (b, s, n, d), jnp.float32).astype(dtype)

  def loss(attn, q, k, v):
    return jnp.sum(attn(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))

  ours = lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True)
  # The yardstick users have today: cuDNN on a GPU, XLA elsewhere.
  their_impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
  theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        implementation=their_impl)
  fwd = jax.jit(ours)
  step = jax.jit(jax.value_and_grad(lambda q, k, v: loss(ours, q, k, v), argnums=(0, 1, 2)))

  out = fwd(q, k, v)
  with jax.default_matmul_precision("highest"):
    ref = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
  same = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla").astype(jnp.float32)
  err_xla = float(jnp.max(jnp.abs(same - ref)))
  _, grads = step(q, k, v)
  finite = all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in grads)
  print(f"forward max|out - ref_fp32| = {err:.2e} (jax.nn in {args.dtype}: {err_xla:.2e}); "
        f"grads finite: {finite}")

  flops = 4 * b * n * s * s * d / 2
  t_ours = _time(fwd, q, k, v)
  t_theirs = _time(jax.jit(theirs), q, k, v)
  print(f"forward: jax_fa3 {t_ours * 1e3:.3f} ms ({flops / t_ours / 1e12:.1f} TFLOP/s) | "
        f"jax.nn ({their_impl}) {t_theirs * 1e3:.3f} ms ({flops / t_theirs / 1e12:.1f} TFLOP/s)")
  ok = err <= 2 * err_xla + 2e-2 and finite
  print("demo:", "OK" if ok else "MISMATCH")
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())

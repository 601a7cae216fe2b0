#!/usr/bin/env python3
"""One small FP8 call per compiled head dim (issue 5): prints the error of the
kernel against float64 attention of the dequantized inputs, and of the
pre-pass against the pure-JAX quantization.  Small on purpose, so it can run
under compute-sanitizer:

  compute-sanitizer --tool racecheck --target-processes all python3 scripts/fp8_smoke.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_fa3  # noqa: E402
from jax_fa3 import fp8  # noqa: E402


def main():
  dims = sorted({h for _, h in fp8.compiled_fp8_configs()})
  print("FP8 kernels:", sorted(fp8.compiled_fp8_configs()))
  ok = True
  for h in dims:
    for causal in (False, True):
      B, T, S, N, K = 1, 200, 300, 2, 1
      key = jax.random.split(jax.random.key(h), 3)
      q = jax.random.normal(key[0], (B, T, N, h)).astype(jnp.bfloat16)
      k = jax.random.normal(key[1], (B, S, K, h)).astype(jnp.bfloat16)
      v = jax.random.normal(key[2], (B, S, K, h)).astype(jnp.bfloat16)
      got = fp8.quantize_qkv(q, k, v, use_kernel=True)
      want = fp8.quantize_qkv(q, k, v, use_kernel=False)
      qerr = max(float(jnp.max(jnp.abs(a - b) / b)) for a, b in zip(got[3:], want[3:]))
      mism = max(float(jnp.mean((a.astype(jnp.float32) != b.astype(jnp.float32))))
                 for a, b in zip(got[:3], want[:3]))
      out = jax_fa3.attention_fp8(*got, is_causal=causal, implementation="fa3")
      bn = fp8.kv_block_rows(h)
      deq = lambda x, s, r: np.asarray(x, np.float32) * np.repeat(
          np.swapaxes(np.asarray(s), 1, 2), r, axis=1)[:, :x.shape[1], :, None]
      qd, kd, vd = deq(got[0], got[3], 128), deq(got[1], got[4], bn), deq(got[2], got[5], bn)
      ref = np.zeros((B, T, N, h))
      for n in range(N):
        s = qd[0, :, n].astype(np.float64) @ kd[0, :, n // (N // K)].T.astype(np.float64) / np.sqrt(h)
        if causal:
          s = np.where(np.arange(S)[None] <= np.arange(T)[:, None], s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        ref[0, :, n] = (p / p.sum(1, keepdims=True)) @ vd[0, :, n // (N // K)]
      e = np.asarray(out, np.float64) - ref
      rmse, mx = float(np.sqrt(np.mean(e ** 2))), float(np.abs(e).max())
      good = np.isfinite(e).all() and rmse < 1e-2 and mx < 0.1 and qerr < 1e-5 and mism < 2e-3
      ok &= bool(good)
      print(f"d{h} causal={causal}: kernel rmse {rmse:.2e} max {mx:.2e}; pre-pass "
            f"scale rel err {qerr:.1e}, e4m3 mismatches {mism:.1e} -> "
            f"{'ok' if good else 'FAIL'}")
  print("PASSED" if ok else "FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())

#!/usr/bin/env python3
"""NumPy emulation of the FP8 kernel's block loop on fp8_accuracy.py's input (b),
to compare ways of handling V's block scales before touching the kernel
(RESULTS.md, "Tried and lost": the V-scale fold). Per (batch, head, 128-row tile) the 128-key blocks run
high to low as in cc/fp8/mainloop.h: e4m3 operands, FP32 scores in log2 units,
P = 2^8 exp2(s - max) cast to e4m3, FP32 row sums. Methods:

  rescale  the kernel before the fold: O *= correction * vs_prev / vs_j per block
  fold     P_j scaled by vs_j / (largest vs of the tile) before its cast, so O
           needs no per-block rescale for V
  fold+lazy  also: a warp (16 rows) moves its max only when a block max exceeds
           it by > 0.8 (log2 units), so most blocks skip the O rescale

each with V block scales amax/448 ("exact") or rounded up to a power of two
("pow2"). Prints RMSE / max error against float64. CPU only, about 3 minutes.
"""
from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
B, S, H, D, BLK = 2, 2048, 8, 128, 128


def e4m3(x):
  return np.clip(x, -448, 448).astype(E4M3).astype(np.float32)


def quantize_v(v, pow2):
  """V [B, S, N, D] -> (e4m3 values as f32, scales [B, N, S/BLK])."""
  vb = np.asarray(v, np.float32).reshape(B, S // BLK, BLK, H, D)
  amax = np.abs(vb).max(axis=(2, 4))
  sc = amax / 448.0
  if pow2:
    sc = np.exp2(np.ceil(np.log2(sc)))
  sc = np.where(amax > 0, sc, np.float32(np.finfo(np.float32).tiny)).astype(np.float32)
  v8 = e4m3(vb / sc[:, :, None, :, None]).reshape(B, S, H, D)
  return v8, np.transpose(sc, (0, 2, 1))


def attend(q8, qs, k8, ks, v8, vs, method):
  fold, lazy = method != "rescale", method == "fold+lazy"
  out = np.empty((B, S, H, D), np.float32)
  nb, c0 = S // BLK, np.log2(np.e) / np.sqrt(D)
  for bi in range(B):
    for hi in range(H):
      vref = vs[bi, hi].max()
      for mt in range(nb):
        q = q8[bi, mt * BLK:(mt + 1) * BLK, hi]
        m = np.full(BLK, -np.inf, np.float32)
        rsum = np.zeros(BLK, np.float32)
        o = np.zeros((BLK, D), np.float32)
        v_prev = None
        for j in reversed(range(nb)):
          k, v = (x[bi, j * BLK:(j + 1) * BLK, hi] for x in (k8, v8))
          s = (q @ k.T) * np.float32(c0 * qs[bi, hi, mt] * ks[bi, hi, j])
          m_blk = s.max(axis=1)
          m_new = np.maximum(m, m_blk)
          if lazy:  # per warp of 16 rows: keep the stale max unless it grew enough
            grow = (m_blk > m + 0.8).reshape(-1, 16).any(axis=1).repeat(16)
            m_new = np.where(grow, m_new, m)
          corr = np.where(np.isfinite(m), np.exp2(m - m_new), 0.0).astype(np.float32)
          lv = np.log2(vs[bi, hi, j] / vref) if fold else 0.0
          p = np.exp2(s - (m_new - 8 - lv)[:, None]).astype(np.float32)
          rsum = rsum * corr + p.sum(axis=1) / np.float32(2.0 ** lv)
          if not fold and v_prev is not None:
            corr = corr * (v_prev / vs[bi, hi, j])
          o = o * corr[:, None] + e4m3(p) @ v
          m, v_prev = m_new, vs[bi, hi, j]
        out[bi, mt * BLK:(mt + 1) * BLK, hi] = o * (vref if fold else v_prev) / rsum[:, None]
  return out


def main():
  import jax
  jax.config.update("jax_platform_name", "cpu")
  import jax.numpy as jnp
  import jax_fa3
  from jax_fa3 import fp8
  from fp8_accuracy import errors, make_inputs, ref64

  q, k, v = make_inputs("b", B, S, H, D, 0)
  ref = ref64(q, k, v)
  signs = fp8.hadamard_signs(D, 0)
  q8, qs = jax_fa3.quantize_fp8(jnp.asarray(q), block_rows=BLK, hadamard=True, signs=signs)
  k8, ks = jax_fa3.quantize_fp8(jnp.asarray(k), block_rows=BLK, hadamard=True, signs=signs)
  q8, k8 = (np.asarray(x.astype(jnp.float32)) for x in (q8, k8))
  qs, ks = np.asarray(qs), np.asarray(ks)
  print("| V scales | method | RMSE | max err |\n|---|---|---|---|")
  for pow2 in (False, True):
    v8, vs = quantize_v(v, pow2)
    for method in ("rescale", "fold", "fold+lazy"):
      rmse, mx = errors(attend(q8, qs, k8, ks, v8, vs, method).astype(ml_dtypes.bfloat16), ref)
      print(f"| {'pow2' if pow2 else 'exact'} | {method} | {rmse:.3e} | {mx:.3e} |", flush=True)


if __name__ == "__main__":
  main()

"""GPU tests of the FP8 kernels (issue 5): the fused quantize pre-pass and the
FP8 forward (QGMMA), against host NumPy float64 references.

The FP8 attention kernel is on by default; with ``JAX_FA3_FP8_KERNEL=0`` the
kernel-core test skips and the end-to-end tests run the pure-JAX emulation
on the GPU instead.  The quantize pre-pass tests always run.

Tolerances (stated, FA3-style "no worse than an emulation of the same
method", plus a small atol):

* Kernel core (``attention_fp8`` on given e4m3 inputs + scales): the truth is
  float64 attention of the *dequantized* inputs, so only the kernel's own
  rounding counts (P to e4m3, FP32 accumulation, output to bf16/fp16).  Bound:
  ``max|out - ref64| <= 2 * max|emu - ref64| + 4e-3`` and the same for the
  RMSE with ``+ 2e-4``, where ``emu`` is a NumPy emulation that rounds P to
  e4m3 exactly as the kernel does (``2**8 * exp(s - rowmax)``, with the final
  rather than the running row max) and the output to the output dtype.  A
  wrong P/V permutation, transpose or scale fold gives errors of O(0.1-1).
* End to end (``attention(precision="fp8")`` on bf16/fp16 N(0,1) inputs, vs
  float64 of the original inputs): RMSE <= 2e-2, and <= 1.5x the RMSE of the
  pure-JAX emulation of the same quantization (computed on the CPU, where no
  FP8 round trip is elided) + 2e-3.
* Outliers ((b): N(0,1) plus N(0, 10^2) on 0.1% of entries): finite output;
  ordering block+Hadamard < block only, Hadamard only < per-tensor, and
  per-tensor / (block+Hadamard) >= 1.7 (the issue's bar at b=2, s=2048,
  h=8, d=128).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import fp8
from _gpu_ref import attention_refs, make_inputs, np_dtype, seed_of

pytestmark = pytest.mark.gpu

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
DIMS = sorted({h for _, h in fp8.compiled_fp8_configs()}) or [128]
KERNEL = fp8.fp8_kernel_enabled()
# The path attention(precision="fp8") takes: the kernel unless switched off.
IMPL = "fa3" if KERNEL else None
needs_kernel = pytest.mark.skipif(
    not KERNEL, reason=f"the FP8 attention kernel is switched off ({fp8.KERNEL_ENV}=0)")


def _rmse(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2))) if a.size else 0.0


def _maxerr(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b))) if a.size else 0.0


def _expand(scales, rows, seq):
  return np.repeat(np.swapaxes(np.asarray(scales), 1, 2), rows, axis=1)[:, :seq, :, None]


def _dequant(x8, scales, rows):
  return np.asarray(x8).astype(np.float32) * _expand(scales, rows, x8.shape[1])


def _visible(t, s, ql, kl, window):
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  vis = (i < ql) & (j < kl)
  wl, wr = window
  if wl >= 0:
    vis &= j >= i - wl
  if wr >= 0:
    vis &= j <= i + wr
  return vis


def _np_emulation(qd, kd, vd, q_lens, kv_lens, window, scale, out_dt):
  """NumPy FP8-kernel emulation on dequantized f32 operands (see docstring)."""
  B, T, N, H = qd.shape
  S, K = kd.shape[1], kd.shape[2]
  G = N // K
  out = np.zeros(qd.shape, np.float32)
  for b in range(B):
    vis = _visible(T, S, q_lens[b], kv_lens[b], window)
    for n in range(N):
      s = (qd[b, :, n] @ kd[b, :, n // G].T) * np.float32(scale)
      s = np.where(vis, s, -np.inf)
      m = s.max(axis=1, keepdims=True)
      m = np.where(np.isfinite(m), m, 0)
      p = np.exp(s - m) * 256
      den = p.sum(axis=1, keepdims=True)
      pq = p.astype(E4M3).astype(np.float32)
      o = pq @ vd[b, :, n // G]
      out[b, :, n] = np.where(den > 0, o / np.where(den > 0, den, 1), 0)
  return out.astype(out_dt)


def _window(causal, window):
  wl, wr = window if window is not None else (-1, -1)
  if causal:
    wr = 0 if wr < 0 else min(wr, 0)
  return wl, wr


_quant_jit = jax.jit(fp8.quantize_qkv, static_argnames=(
    "block_scales", "hadamard", "seed", "use_kernel", "v_transposed"))


@pytest.mark.parametrize("h", DIMS)
@pytest.mark.parametrize("s", [77, 128, 300])
def test_quantize_kernel_vt_layout(h, s):
  """The pre-pass's V^T output (what precision="fp8" feeds the kernel) holds
  exactly the bytes of its [B, S, K, H] output, permuted and zero-padded."""
  q, k, v = make_inputs(seed_of(h, s, "vt"), 2, 200, s, 4, 2, h, "bfloat16")
  a = _quant_jit(q, k, v, use_kernel=True)
  b = _quant_jit(q, k, v, use_kernel=True, v_transposed=True)
  assert b[2].shape == (2, 2, h, -(-s // 128) * 128)
  want = np.asarray(fp8.to_vt_layout(a[2])).view(np.uint8)
  np.testing.assert_array_equal(np.asarray(b[2]).view(np.uint8), want)
  for x, y in zip(a[:2] + a[3:], b[:2] + b[3:]):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


@pytest.mark.parametrize("h", DIMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("block_scales,hadamard", [(True, True), (False, True), (True, False)])
def test_quantize_kernel_matches_emulation(h, dtype, block_scales, hadamard):
  q, k, v = make_inputs(seed_of(h, dtype, 1), 2, 300, 200, 4, 2, h, dtype)
  q, k, v = (x * 3 for x in (q, k, v))
  kw = dict(block_scales=block_scales, hadamard=hadamard, seed=1)
  got = _quant_jit(q, k, v, use_kernel=True, **kw)
  with jax.default_device(jax.devices("cpu")[0]):
    want = fp8.quantize_qkv(q, k, v, use_kernel=False, **kw)
  for a, b in zip(got[3:], want[3:]):  # scales
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5)
  for a, b in zip(got[:3], want[:3]):  # e4m3 values: equal but for rare ties
    a = np.asarray(a).astype(np.float32)
    b = np.asarray(b).astype(np.float32)
    diff = a != b
    assert diff.mean() < 2e-3, diff.mean()
    assert np.all(np.abs(a - b)[diff] <= np.abs(b[diff]) * 0.13 + 2.0 ** -9)


CORE_CASES = [
    # B, T, S, N, K, causal, window, q_lens, kv_lens
    (1, 128, 128, 2, 2, False, None, None, None),
    (2, 257, 300, 4, 2, False, None, None, None),
    (2, 257, 300, 4, 2, True, None, None, None),
    (1, 1, 77, 2, 1, False, None, None, None),
    (2, 384, 513, 2, 2, True, None, [100, 384], [513, 7]),
    (1, 300, 300, 2, 2, False, (32, 16), None, None),
    (1, 1024, 1100, 4, 4, False, None, None, None),
]


def _check_kernel_core(h, case, q, k, v, v_scales="pow2", layout="default"):
  """attention_fp8 on quantized q, k, v against float64 attention of the
  dequantized inputs (module docstring). v_scales: "pow2" (what quantize_qkv
  gives V) or "amax" (plain amax / 448 block scales, which a caller of
  attention_fp8 may pass). layout "vt": the same operands with V in the V^T
  layout, through the kernel precision="fp8" runs."""
  B, T, S, N, K, causal, window, ql, kl = case
  dtype = "bfloat16"
  q8, k8, v8, qs, ks, vs = _quant_jit(q, k, v, block_scales=True, hadamard=True,
                                      seed=0, use_kernel=True)
  bn = fp8.kv_block_rows(h)
  if v_scales == "amax":
    v8, vs = fp8.quantize_fp8(v, block_rows=bn)
  q_lens = np.array(ql if ql else [T] * B, np.int32)
  kv_lens = np.array(kl if kl else [S] * B, np.int32)
  if layout == "vt":
    wl, wr = _window(causal, window)
    f = jax.jit(lambda *a: fp8._fp8_core(
        *a, 1 / np.sqrt(h), wl, wr, jnp.bfloat16, "fa3", v_transposed=True)[0])
    v8_in = (_quant_jit(q, k, v, use_kernel=True, v_transposed=True)[2]
             if v_scales == "pow2" else fp8.to_vt_layout(v8))
  else:
    f = jax.jit(lambda *a: jax_fa3.attention_fp8(
        *a[:6], query_seq_lengths=a[6], key_value_seq_lengths=a[7],
        is_causal=causal, local_window_size=window, implementation="fa3"))
    v8_in = v8
  out = np.asarray(f(q8, k8, v8_in, qs, ks, vs, q_lens, kv_lens)).astype(np.float32)
  qd, kd, vd = _dequant(q8, qs, 128), _dequant(k8, ks, bn), _dequant(v8, vs, bn)
  wl, wr = _window(causal, window)
  refs = attention_refs(qd, kd, vd, q_lens, kv_lens, causal=causal,
                        window=(wl, wr), same=False)
  ref64 = np.asarray(refs.ref64)
  emu = _np_emulation(qd, kd, vd, q_lens, kv_lens, (wl, wr), 1 / np.sqrt(h),
                      np_dtype(dtype)).astype(np.float32)
  assert np.all(np.isfinite(out))
  valid = np.asarray(refs.valid)  # [B, T, N] rows that see a key
  assert np.all(out[~valid] == 0)
  assert _maxerr(out, ref64) <= 2 * _maxerr(emu, ref64) + 4e-3, (
      _maxerr(out, ref64), _maxerr(emu, ref64))
  assert _rmse(out, ref64) <= 2 * _rmse(emu, ref64) + 2e-4, (
      _rmse(out, ref64), _rmse(emu, ref64))


@needs_kernel
@pytest.mark.parametrize("h", DIMS)
@pytest.mark.parametrize("case", CORE_CASES, ids=str)
@pytest.mark.parametrize("v_scales", ["pow2", "amax"])
@pytest.mark.parametrize("layout", ["default", "vt"])
def test_fp8_kernel_core(h, case, v_scales, layout):
  B, T, S, N, K = case[:5]
  q, k, v = make_inputs(seed_of(h, case), B, T, S, N, K, h, "bfloat16")
  _check_kernel_core(h, case, q, k, v, v_scales, layout)


@needs_kernel
@pytest.mark.parametrize("h", DIMS)
@pytest.mark.parametrize("layout", ["default", "vt"])
def test_fp8_kernel_core_zero_v_block_next_to_large_v(h, layout):
  """An all-zero 128-row V block (its power-of-two scale is FLT_MIN) in a
  tile whose largest V block scale is 4 or more (|V| up to ~3000): the
  kernel's un-scaling of that block's probability sum, 2^-log2(FLT_MIN / 4),
  overflowed float32 before it was clamped (mainloop.h)."""
  case = (1, 300, 640, 2, 2, False, None, None, None)
  q, k, v = make_inputs(seed_of(h, "zero-v-block"), 1, 300, 640, 2, 2, h, "bfloat16")
  v = v.astype(np.float32) * 1000
  v[:, 128:256] = 0
  _check_kernel_core(h, case, q, k, v.astype(np_dtype("bfloat16")), layout=layout)


@pytest.mark.parametrize("h", DIMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_end_to_end(h, dtype, causal):
  q, k, v = make_inputs(seed_of(h, dtype, causal), 2, 640, 700, 4, 2, h, dtype)
  f = jax.jit(lambda q, k, v: jax_fa3.attention(
      q, k, v, is_causal=causal, precision="fp8", implementation=IMPL))
  out = np.asarray(f(q, k, v)).astype(np.float32)
  assert np.all(np.isfinite(out))
  ref64 = np.asarray(attention_refs(q, k, v, causal=causal, same=False).ref64)
  with jax.default_device(jax.devices("cpu")[0]):
    emu = np.asarray(jax_fa3.attention(q, k, v, is_causal=causal, precision="fp8",
                                       implementation="reference")).astype(np.float32)
  e, e_emu = _rmse(out, ref64), _rmse(emu, ref64)
  assert e <= 2e-2, e
  assert e <= 1.5 * e_emu + 2e-3, (e, e_emu)


def _outlier_inputs(seed, b, s, h, d):
  rng = np.random.default_rng(seed)
  xs = []
  for _ in range(3):
    x = rng.standard_normal((b, s, h, d))
    mask = rng.random(x.shape) < 1e-3
    x = x + mask * rng.normal(0, 10, x.shape)
    xs.append(x.astype(np.float32).astype(ml_dtypes.bfloat16))
  return xs


def test_fp8_outliers_ordering_and_no_nan():
  if 128 not in DIMS:
    pytest.skip("needs the d128 FP8 kernel")
  q, k, v = _outlier_inputs(2026, 2, 2048, 8, 128)
  ref64 = np.asarray(attention_refs(q, k, v, same=False).ref64)
  err = {}
  for bs in (False, True):
    for hd in (False, True):
      f = jax.jit(lambda q, k, v, bs=bs, hd=hd: jax_fa3.attention(
          q, k, v, precision="fp8", fp8_block_scales=bs, fp8_hadamard=hd,
          implementation=IMPL))
      out = np.asarray(f(q, k, v)).astype(np.float32)
      assert np.all(np.isfinite(out)), (bs, hd)
      err[bs, hd] = _rmse(out, ref64)
  print("FP8 outlier RMSE (block, hadamard) ->", err)
  assert err[True, True] < err[True, False] < err[False, False], err
  assert err[True, True] < err[False, True] < err[False, False], err
  assert err[False, False] >= 1.7 * err[True, True], err


def test_fp8_grad_runs_straight_through():
  h = DIMS[0]
  q, k, v = make_inputs(seed_of("grad", h), 1, 256, 256, 2, 2, h, "bfloat16")
  g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_fa3.attention(
      q, k, v, precision="fp8").astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
  g16 = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_fa3.attention(
      q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
  for a, b in zip(g(q, k, v), g16(q, k, v)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.all(np.isfinite(a))
    assert _rmse(a, b) < 0.1 * np.sqrt(np.mean(b ** 2)) + 1e-3


def test_fp8_switched_off_launches_no_fp8_kernel():
  """The switch: with JAX_FA3_FP8_KERNEL=0, precision='fp8' lowers to XLA ops only."""
  if KERNEL:
    pytest.skip(f"{fp8.KERNEL_ENV} is not 0")
  q, k, v = make_inputs(seed_of("gate"), 1, 256, 256, 2, 2, 128, "bfloat16")
  hlo = jax.jit(lambda q, k, v: jax_fa3.attention(
      q, k, v, precision="fp8")).lower(q, k, v).as_text()
  assert fp8.FWD_TARGET not in hlo and fp8.QUANT_TARGET not in hlo
  with pytest.raises(ValueError, match=fp8.KERNEL_ENV):
    jax_fa3.attention(q, k, v, precision="fp8", implementation="fa3")

"""GPU tests of the FP8 kernels: the fused quantize pre-pass and the FP8
forward (QGMMA), against host NumPy float64 references.

``implementation="fa3"`` insists on the kernels (an error instead of a silent
fallback); the pure-JAX emulation (``implementation="reference"``) is the
baseline some checks compare against.

Tolerances (stated, FA3-style "no worse than an emulation of the same
method", plus a small atol):

* Kernel core (``attention_fp8`` on given e4m3 inputs + scales): the truth is
  float64 attention of the *dequantized* inputs, so only the kernel's own
  rounding counts (P to e4m3, FP32 accumulation, output to bf16/fp16).  Bound:
  ``max|out - ref64| <= 2 * max|emu - ref64| + 4e-3`` and the same for the
  RMSE with ``+ 2e-4``, where ``emu`` is a NumPy emulation that rounds P to
  e4m3 exactly as the kernel does (``2**8 * exp(s - rowmax)``, with the final
  rather than the running row max) and the output to the output dtype
  (:func:`host_reference.fp8_kernel_emulation`).  A
  wrong P/V permutation, transpose or scale fold gives errors of O(0.1-1).
* End to end (``attention(precision="fp8")`` on bf16/fp16 N(0,1) inputs, vs
  float64 of the original inputs): RMSE <= 2e-2, and <= 1.5x the RMSE of the
  pure-JAX emulation of the same quantization (computed on the CPU, where no
  FP8 round trip is elided) + 2e-3.
* Outliers ((b): N(0,1) plus N(0, 10^2) on 0.1% of entries): finite output;
  ordering block+Hadamard < block only, Hadamard only < per-tensor, and
  per-tensor / (block+Hadamard) >= 1.7 (at b=2, s=2048, h=8, d=128).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import fp8
from fa3_testing import kernel_configs
from host_reference import (attention_refs, dequantize, fold_causal,
                            fp8_kernel_emulation, make_inputs, max_abs_diff,
                            np_dtype, rmse, seed_of)

DIMS = sorted({h for _, h in kernel_configs("fp8")})
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not DIMS, reason="no FP8 kernel compiled")]
# FFI targets (the C++ contract): the quantize pre-pass and the FP8 forward.
QUANT_TARGET = "jax_fa3_fp8_quantize"
FWD_TARGET = "jax_fa3_fp8_fwd"


_quant_jit = jax.jit(fp8.quantize_qkv, static_argnames=(
    "block_scales", "hadamard", "seed", "use_kernel", "v_transposed"))


def _assert_quantized_match(got, want):
  """The pre-pass's (q8, k8, v8, scales...) against the emulation's: scales
  to float32 rounding, e4m3 values equal but for rare ties (one e4m3 step)."""
  for a, b in zip(got[3:], want[3:]):  # scales
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5)
  for a, b in zip(got[:3], want[:3]):
    a = np.asarray(a).astype(np.float32)
    b = np.asarray(b).astype(np.float32)
    assert a.shape == b.shape
    diff = a != b
    assert diff.mean() < 2e-3, diff.mean()
    assert np.all(np.abs(a - b)[diff] <= np.abs(b[diff]) * 0.13 + 2.0 ** -9)


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
  _assert_quantized_match(got, want)


@pytest.mark.parametrize("v_transposed", [False, True])
def test_quantize_kernel_batch_past_one_grid(v_transposed):
  """3 x 22000 (tensor, batch) pairs are more than a grid's z dimension
  holds (65535): the pre-pass launches in batch slices; every row of every
  slice must match the emulation."""
  h = DIMS[0]
  q, k, v = make_inputs(seed_of(h, "batch"), 22000, 2, 3, 1, 1, h, "bfloat16")
  kw = dict(block_scales=True, hadamard=True, seed=1)
  got = _quant_jit(q, k, v, use_kernel=True, v_transposed=v_transposed, **kw)
  with jax.default_device(jax.devices("cpu")[0]):
    want = fp8.quantize_qkv(q, k, v, use_kernel=False, **kw)
    if v_transposed:
      want = want[:2] + (fp8.to_vt_layout(want[2]),) + want[3:]
  _assert_quantized_match(got, want)


@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_kernel_tiny_block_is_finite(hadamard):
  """A block whose amax / 448 is below the smallest normal float: the scale's
  floor keeps 1 / scale finite (else 0 * inf = NaN in the zero entries)."""
  h = DIMS[0]
  q, k, v = make_inputs(seed_of(h, "tiny"), 1, 256, 256, 2, 2, h, "bfloat16")
  def tiny(x):  # the first block of head 0: zeros and one 1e-37
    x = x.copy()
    x[:, :128, 0] = 0
    x[:, 0, 0, 0] = 1e-37
    return jnp.asarray(x)
  q, k, v = tiny(q), tiny(k), tiny(v)
  kw = dict(block_scales=True, hadamard=hadamard, seed=1)
  got = _quant_jit(q, k, v, use_kernel=True, **kw)
  with jax.default_device(jax.devices("cpu")[0]):
    want = fp8.quantize_qkv(q, k, v, use_kernel=False, **kw)
  for a, b in zip(got, want):
    a, b = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, rtol=0.13, atol=2.0 ** -9)


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


# How the kernel gets its operands: attention_fp8 on a [B, S, K, H] e4m3 V
# with the pre-pass's power-of-two V scales ("pow2") or plain amax / 448
# block scales, which a caller's own quantization may give ("amax"); or
# attention(precision="fp8"), whose pre-pass writes V^T for the kernel.
PATHS = ["attention_fp8-pow2", "attention_fp8-amax", "precision_fp8"]


def _check_kernel_core(h, case, q, k, v, path):
  """The FP8 kernel on the pre-pass's e4m3 operands against float64
  attention of the dequantized operands (module docstring)."""
  B, T, S, N, K, causal, window, ql, kl = case
  dtype = "bfloat16"
  # The pre-pass with precision="fp8"'s options (block scales, Hadamard,
  # seed 0); its V^T output holds the same bytes (test_quantize_kernel_vt_layout).
  q8, k8, v8, qs, ks, vs = _quant_jit(q, k, v, block_scales=True, hadamard=True,
                                      seed=0, use_kernel=True)
  bn = fp8.kv_block_rows(h)
  if path == "attention_fp8-amax":
    v8, vs = fp8.quantize_fp8(v, block_rows=bn)
  q_lens = np.array(ql if ql else [T] * B, np.int32)
  kv_lens = np.array(kl if kl else [S] * B, np.int32)
  kw = dict(query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
            is_causal=causal, local_window_size=window, implementation="fa3")
  if path == "precision_fp8":
    out = jax.jit(lambda q, k, v: jax_fa3.attention(
        q, k, v, precision="fp8", **kw))(q, k, v)
  else:
    out = jax.jit(lambda *a: jax_fa3.attention_fp8(*a, **kw))(
        q8, k8, v8, qs, ks, vs)
  out = np.asarray(out).astype(np.float32)
  qd, kd, vd = dequantize(q8, qs, 128), dequantize(k8, ks, bn), dequantize(v8, vs, bn)
  wl, wr = fold_causal(causal, window)
  refs = attention_refs(qd, kd, vd, q_lens, kv_lens, causal=causal,
                        window=(wl, wr), same=False)
  ref64 = np.asarray(refs.ref64)
  emu = fp8_kernel_emulation(qd, kd, vd, q_lens, kv_lens, (wl, wr),
                             1 / np.sqrt(h), np_dtype(dtype)).astype(np.float32)
  assert np.all(np.isfinite(out))
  valid = np.asarray(refs.valid)  # [B, T] rows that see a key
  assert np.all(out[~valid] == 0)
  assert max_abs_diff(out, ref64) <= 2 * max_abs_diff(emu, ref64) + 4e-3, (
      max_abs_diff(out, ref64), max_abs_diff(emu, ref64))
  assert rmse(out, ref64) <= 2 * rmse(emu, ref64) + 2e-4, (
      rmse(out, ref64), rmse(emu, ref64))


@pytest.mark.parametrize("h", DIMS)
@pytest.mark.parametrize("case", CORE_CASES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_fp8_kernel_core(h, case, path):
  B, T, S, N, K = case[:5]
  q, k, v = make_inputs(seed_of(h, case), B, T, S, N, K, h, "bfloat16")
  _check_kernel_core(h, case, q, k, v, path)


@pytest.mark.parametrize("h", DIMS)
@pytest.mark.parametrize("path", ["attention_fp8-pow2", "precision_fp8"])
def test_fp8_kernel_core_zero_v_block_next_to_large_v(h, path):
  """An all-zero 128-row V block (its power-of-two scale is FLT_MIN) in a
  tile whose largest V block scale is 4 or more (|V| up to ~3000): the
  kernel's un-scaling of that block's probability sum, 2^-log2(FLT_MIN / 4),
  overflowed float32 before it was clamped (mainloop.h)."""
  case = (1, 300, 640, 2, 2, False, None, None, None)
  q, k, v = make_inputs(seed_of(h, "zero-v-block"), 1, 300, 640, 2, 2, h, "bfloat16")
  v = v.astype(np.float32) * 1000
  v[:, 128:256] = 0
  _check_kernel_core(h, case, q, k, v.astype(np_dtype("bfloat16")), path)


@pytest.mark.parametrize("h", DIMS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_fp8_end_to_end(h, dtype, causal):
  q, k, v = make_inputs(seed_of(h, dtype, causal), 2, 640, 700, 4, 2, h, dtype)
  f = jax.jit(lambda q, k, v: jax_fa3.attention(
      q, k, v, is_causal=causal, precision="fp8", implementation="fa3"))
  out = np.asarray(f(q, k, v)).astype(np.float32)
  assert np.all(np.isfinite(out))
  ref64 = np.asarray(attention_refs(q, k, v, causal=causal, same=False).ref64)
  with jax.default_device(jax.devices("cpu")[0]):
    emu = np.asarray(jax_fa3.attention(q, k, v, is_causal=causal, precision="fp8",
                                       implementation="reference")).astype(np.float32)
  e, e_emu = rmse(out, ref64), rmse(emu, ref64)
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
          implementation="fa3"))
      out = np.asarray(f(q, k, v)).astype(np.float32)
      assert np.all(np.isfinite(out)), (bs, hd)
      err[bs, hd] = rmse(out, ref64)
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
    assert rmse(a, b) < 0.1 * np.sqrt(np.mean(b ** 2)) + 1e-3


def test_fp8_routing_kernel_by_default_reference_on_request():
  """precision="fp8" lowers to the pre-pass and the FP8 kernel when they can
  run; implementation="reference" to XLA ops only. The same for
  attention_fp8 on e4m3 operands."""
  h = DIMS[0]
  q, k, v = make_inputs(seed_of("routing", h), 1, 256, 256, 2, 2, h, "bfloat16")

  def hlo(f, *args):
    return jax.jit(f).lower(*args).as_text()

  for impl in (None, "fa3"):
    text = hlo(lambda q, k, v: jax_fa3.attention(
        q, k, v, precision="fp8", implementation=impl), q, k, v)
    assert FWD_TARGET in text and QUANT_TARGET in text, impl
  text = hlo(lambda q, k, v: jax_fa3.attention(
      q, k, v, precision="fp8", implementation="reference"), q, k, v)
  assert FWD_TARGET not in text and QUANT_TARGET not in text
  ops = fp8.quantize_qkv(q, k, v)
  assert FWD_TARGET in hlo(lambda *a: jax_fa3.attention_fp8(*a), *ops)
  assert FWD_TARGET not in hlo(lambda *a: jax_fa3.attention_fp8(
      *a, implementation="reference"), *ops)

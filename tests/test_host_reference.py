"""CPU checks of the host references the GPU tests judge kernels against.

Not marked ``gpu``: the NumPy references (:mod:`host_reference`) are checked
against ``jax.nn.dot_product_attention(..., implementation="xla")`` on XLA:CPU
in float32 (HIGHEST matmul precision) on a handful of small shapes, so the
GPU truth tests rest on a reference that CI itself proves.
"""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import fp8
from host_reference import (attention_grad_refs, attention_refs,
                            dense_reference_jax, dequantize, fold_causal,
                            fp8_kernel_emulation, make_inputs, np_dtype,
                            roundoff, row_valid)

# XLA:CPU on every host: float32 here means float32 (no TF32), and jax.nn's
# xla path accepts its fp16 dot algorithm.
pytestmark = pytest.mark.usefixtures("cpu_backend")

# (b, t, s, n, k, h, causal, window, q_lens, kv_lens)
CASES = [
    pytest.param(2, 37, 53, 2, 2, 16, False, None, None, None, id="plain"),
    pytest.param(2, 37, 53, 2, 2, 16, True, None, None, None, id="causal"),
    pytest.param(2, 70, 41, 2, 2, 16, True, None, None, None, id="causal-t>s"),
    pytest.param(2, 37, 53, 2, 2, 16, False, (5, 3), None, None,
                 id="window"),
    pytest.param(2, 60, 20, 2, 2, 16, False, (2, 0), None, None,
                 id="window-empty-rows"),
    pytest.param(3, 37, 53, 6, 2, 16, True, None, [37, 20, 0], [53, 0, 30],
                 id="gqa-seqlens-causal"),
    pytest.param(3, 29, 53, 6, 1, 16, False, (9, 4), [29, 11, 5], [7, 53, 40],
                 id="mqa-seqlens-window"),
]


@functools.lru_cache(maxsize=None)
def _nn(causal, window, lens, residual):
  def f(q, k, v, ql, kl):
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, local_window_size=window,
        query_seq_lengths=ql if lens else None,
        key_value_seq_lengths=kl if lens else None, implementation="xla",
        return_residual=residual)
  return jax.jit(f)


def _nn_call(q, k, v, ql, kl, causal, window, residual=False):
  lens = ql is not None
  if lens:
    ql, kl = (jnp.asarray(np.asarray(x, np.int32)) for x in (ql, kl))
  else:
    ql = kl = jnp.zeros((q.shape[0],), jnp.int32)  # unused
  with jax.default_matmul_precision("highest"):
    return _nn(causal, window, lens, residual)(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), ql, kl)


@pytest.mark.parametrize("b,t,s,n,k,h,causal,window,ql,kl", CASES)
def test_numpy_reference_matches_jax_nn_f32(b, t, s, n, k, h, causal, window,
                                            ql, kl):
  q, kk, v = make_inputs(7, b, t, s, n, k, h, "float32")
  refs = attention_refs(q, kk, v, ql, kl, causal=causal, window=window)
  out, lse = _nn_call(q, kk, v, ql, kl, causal, window, residual=True)
  valid = row_valid(b, t, s, ql, kl, causal, window)
  np.testing.assert_array_equal(refs.valid, valid)
  # Library semantics: rows without a visible key are 0 (jax.nn: mean(V)).
  nn = np.where(valid[:, :, None, None], np.asarray(out), 0)
  np.testing.assert_allclose(refs.ref64, nn, atol=2e-6, rtol=1e-5)
  np.testing.assert_allclose(refs.same, nn, atol=2e-6, rtol=1e-5)
  assert np.all(refs.ref64[~valid] == 0) and np.all(refs.same[~valid] == 0)
  # lse: +inf on rows without keys (library), jax.nn's value elsewhere.
  lse_nn = np.asarray(lse)
  v3 = np.broadcast_to(valid[:, :, None], lse_nn.shape)
  np.testing.assert_allclose(refs.lse64[v3], lse_nn[v3], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(refs.lse_same[v3], lse_nn[v3], atol=1e-5,
                             rtol=1e-5)
  assert np.all(np.isposinf(refs.lse64[~v3]))


def test_numpy_reference_softcap_and_scale():
  """softcap / custom scale: float64 reference vs the jnp dense reference."""
  b, t, s, n, k, h = 3, 37, 53, 6, 2, 16
  ql, kl = [37, 20, 0], [53, 0, 30]
  q, kk, v = make_inputs(3, b, t, s, n, k, h, "float32")
  for causal, window, cap, scale in ((True, None, 5.0, None),
                                     (False, (9, 4), 2.0, 0.7)):
    refs = attention_refs(q, kk, v, ql, kl, scale=scale, causal=causal,
                          window=window, softcap=cap)
    f = jax.jit(functools.partial(dense_reference_jax, scale=scale,
                                  causal=causal, window=window, softcap=cap))
    lens = [jnp.asarray(np.asarray(x, np.int32)) for x in (ql, kl)]
    dense = np.asarray(f(*(jnp.asarray(x) for x in (q, kk, v)), *lens))
    np.testing.assert_allclose(refs.ref64, dense, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(refs.same, dense, atol=2e-6, rtol=1e-5)
    # softcap actually matters here
    plain = attention_refs(q, kk, v, ql, kl, scale=scale, causal=causal,
                           window=window)
    assert np.max(np.abs(plain.ref64 - refs.ref64)) > 1e-2


def test_dense_jax_reference_matches_jax_nn():
  """The jnp gradient reference equals jax.nn (f32) without softcap."""
  b, t, s, n, k, h = 3, 37, 53, 6, 2, 16
  ql, kl = [37, 20, 0], [53, 0, 30]
  q, kk, v = make_inputs(5, b, t, s, n, k, h, "float32")
  valid = row_valid(b, t, s, ql, kl, True, (9, 4))
  nn = np.where(valid[:, :, None, None],
                np.asarray(_nn_call(q, kk, v, ql, kl, True, (9, 4))), 0)
  f = jax.jit(functools.partial(dense_reference_jax, scale=None, causal=True,
                                window=(9, 4), softcap=None))
  lens = [jnp.asarray(np.asarray(x, np.int32)) for x in (ql, kl)]
  dense = np.asarray(f(*(jnp.asarray(x) for x in (q, kk, v)), *lens))
  np.testing.assert_allclose(dense, nn, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_same_dtype_emulation(dtype):
  """The input-dtype emulation rounds like jax.nn's xla path (on CPU)."""
  b, t, s, n, k, h = 2, 37, 53, 6, 2, 16
  q, kk, v = make_inputs(11, b, t, s, n, k, h, dtype)
  refs = attention_refs(q, kk, v, causal=True)
  # the emulation is in the input dtype: its values are representable there
  dt = np_dtype(dtype)
  np.testing.assert_array_equal(refs.same.astype(dt).astype(np.float32),
                                refs.same)
  # and it is a real low-precision baseline (FA3's rule needs one)
  base = np.max(np.abs(refs.same - refs.ref64))
  assert 0 < base < 0.05, base
  # jnp dense reference in the same dtype (what jax.nn does, minus the
  # DotAlgorithmPreset): agrees to ~ one rounding of the output.
  f = jax.jit(functools.partial(dense_reference_jax, scale=None, causal=True,
                                window=None, softcap=None))
  args = tuple(jnp.asarray(x) for x in (q, kk, v))
  dense = np.asarray(f(*args, None, None))
  assert dense.dtype == dt
  # Bit-exact on XLA:CPU; allow ~one output rounding (accumulation order).
  tol = 2 * roundoff(refs.ref64, dt)
  np.testing.assert_allclose(dense.astype(np.float32), refs.same, atol=tol,
                             rtol=0)
  nn = np.asarray(jax.nn.dot_product_attention(*args, is_causal=True,
                                               implementation="xla"))
  np.testing.assert_allclose(nn.astype(np.float32), refs.same, atol=tol,
                             rtol=0)


def _jax_grads(q, kk, v, do, ql, kl, **kw):
  f = functools.partial(dense_reference_jax, **kw)

  @jax.jit
  def g(q, kk, v, do, ql, kl):
    _, pull = jax.vjp(lambda a, b, c: f(a, b, c, ql, kl), q, kk, v)
    return pull(do)
  lens = [None if x is None else jnp.asarray(np.asarray(x, np.int32))
          for x in (ql, kl)]
  return [np.asarray(x) for x in g(*(jnp.asarray(x) for x in (q, kk, v, do)),
                                   *lens)]


GRAD_CASES = [
    pytest.param(dict(causal=True, window=None, softcap=None), None, None,
                 id="gqa-causal"),
    pytest.param(dict(causal=False, window=(9, 4), softcap=None),
                 [37, 20, 0], [53, 0, 30], id="gqa-window-seqlens"),
    pytest.param(dict(causal=True, window=None, softcap=5.0), [37, 11, 2],
                 None, id="gqa-softcap-qlens"),
]


@pytest.mark.parametrize("kw,ql,kl", GRAD_CASES)
def test_numpy_grad_reference(kw, ql, kl):
  """float64 NumPy gradients == JAX autodiff (f32, HIGHEST) of the dense
  reference; the input-dtype emulation tracks JAX autodiff in bf16/fp16."""
  b, t, s, n, k, h = 3, 37, 53, 6, 2, 16
  kw = dict(kw, scale=None)
  q, kk, v, do = make_inputs(13, b, t, s, n, k, h, "float32", with_dout=True)
  g64, g32 = attention_grad_refs(q, kk, v, do, ql, kl, **kw)
  gj = _jax_grads(q, kk, v, do, ql, kl, **kw)
  for a, c, j in zip(g64, g32, gj):
    np.testing.assert_allclose(a, j, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(c, j, atol=1e-5, rtol=1e-4)
  for dtype in ("bfloat16", "float16"):
    dt = np_dtype(dtype)
    xs = [x.astype(dt) for x in (q, kk, v, do)]
    g64, gsm = attention_grad_refs(*xs, ql, kl, **kw)
    gj = _jax_grads(*xs, ql, kl, **kw)
    for a, c, j in zip(g64, gsm, gj):
      assert j.dtype == dt
      j = j.astype(np.float32)
      np.testing.assert_array_equal(c.astype(dt).astype(np.float32), c)
      base = np.max(np.abs(c - a))
      assert base > 0
      # same rounding points as JAX: far closer to it than to float64
      tol = 2 * roundoff(a, dt)
      np.testing.assert_allclose(c, j, atol=tol, rtol=0)


@pytest.mark.parametrize("causal,window", [(False, None), (True, (40, 0)),
                                           (False, (9, 4))])
def test_fp8_kernel_emulation_matches_jax_emulation(causal, window):
  """The NumPy FP8 kernel emulation (and its dequantize of the block-scale
  layout) equals the library's pure-JAX emulation on the same e4m3 operands
  but for rare ties in P's e4m3 rounding."""
  b, t, s, n, k, h = 2, 150, 300, 4, 2, 64  # several Q and K/V scale blocks
  q, kk, v = make_inputs(17, b, t, s, n, k, h, "bfloat16")
  ops = fp8.quantize_qkv(q, kk, v)
  ql, kl = np.array([150, 77], np.int32), np.array([300, 131], np.int32)
  out = np.asarray(jax_fa3.attention_fp8(
      *ops, query_seq_lengths=ql, key_value_seq_lengths=kl, is_causal=causal,
      local_window_size=window, implementation="reference")).astype(np.float32)
  q8, k8, v8, qs, ks, vs = (np.asarray(x) for x in ops)
  bn = fp8.kv_block_rows(h)
  emu = fp8_kernel_emulation(
      dequantize(q8, qs, fp8.Q_BLOCK_ROWS), dequantize(k8, ks, bn),
      dequantize(v8, vs, bn), ql, kl, fold_causal(causal, window),
      1 / np.sqrt(h), np_dtype("bfloat16")).astype(np.float32)
  diff = out != emu
  assert diff.mean() < 1e-3, diff.mean()
  np.testing.assert_allclose(out, emu, rtol=0,
                             atol=2 * roundoff(emu, "bfloat16"))
  assert np.all(emu[1, 77:] == 0)  # past q length

"""GPU truth tests of attention sinks on the kernels
(``jax_fa3.attention(..., sinks=)``): output and the gradients with respect
to q, k, v and the sinks, by the rule of tests/test_gpu_forward.py (error
against float32 at most 2x, gradients 3x, the same-dtype XLA computation's
error plus a small atol); the lowered HLO holds the FFI calls."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import core, primitives
from fa3_testing import cid, kernel_configs
from host_reference import assert_out_and_grads, max_abs_diff, np_dtype
from test_sinks import sink_reference

pytestmark = pytest.mark.gpu

BWD_CONFIGS = kernel_configs("bwd")
PRIMARY = [c for c in BWD_CONFIGS if c == ("bfloat16", 128)] or BWD_CONFIGS[:1]
IMPL = "fa3"


def _inputs(seed, dtype, B, T, S, N, K, H):
  ks = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.float32)
  w = jax.random.normal(ks[3], (B, T, N, H), jnp.float32)
  sinks = 2.0 * jax.random.normal(ks[4], (N,), jnp.float32)
  return tuple(x.astype(dtype) for x in (q, k, v)) + (w, sinks)


def _check(cfg, *, B=2, T=517, S=517, N=4, K=2, seed=0, ref_kw=None, **kw):
  dtype_name, hd = cfg
  dtype = np_dtype(dtype_name)
  q, k, v, w, sinks = _inputs(seed, dtype, B, T, S, N, K, hd)
  ref_kw = {} if ref_kw is None else ref_kw

  def kernel(q, k, v, s):
    out, pull = jax.vjp(lambda q, k, v, s: jax_fa3.attention(
        q, k, v, sinks=s, implementation=IMPL, **kw), q, k, v, s)
    return (out,) + pull(w.astype(dtype))

  def ref(q, k, v, s, same):
    out, pull = jax.vjp(lambda *a: sink_reference(
        *a, same_dtype=same, **ref_kw), q, k, v, s)
    return (out,) + pull(w.astype(out.dtype))

  fn = jax.jit(kernel)
  hlo = fn.lower(q, k, v, sinks).as_text()
  assert primitives.FWD_TARGET in hlo and primitives.BWD_TARGET in hlo
  got = fn(q, k, v, sinks)
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
  want = jax.jit(lambda *a: ref(*a, False))(*f32, sinks)
  same = jax.jit(lambda *a: ref(*a, True))(q, k, v, sinks)
  # dsinks sums P_sink * rowsum(dout * out) over every row, from the output as
  # stored in q.dtype, whose rounding it inherits: its same-dtype baseline is
  # the worse of XLA's autodiff and that formula on XLA's same-dtype output
  # (with the float32 LSE).
  lse = jax.jit(lambda *a: sink_reference(*a, return_lse=True, **ref_kw)[1])(
      *f32, sinks)
  formula = core._dsinks(same[0], lse, w.astype(dtype), sinks)
  same = same[:4] + (max((same[4], formula), key=lambda x: max_abs_diff(
      np.asarray(x, np.float32), np.asarray(want[4], np.float32))),)
  assert_out_and_grads(("out", "dq", "dk", "dv", "dsinks"), got, want, same,
                       dtype)
  return got


# Every head dim once (causal, bf16 where built) and the other dtype once,
# non-causal: the fold is the same code for all, the kernels are not.
_EVERY = sorted({c[1]: c for c in BWD_CONFIGS[::-1]}.values(), key=lambda c: c[1])
_OTHER = [c for c in BWD_CONFIGS if c not in _EVERY][:1]


@pytest.mark.parametrize("cfg,causal", [(c, True) for c in _EVERY]
                         + [(c, False) for c in _OTHER],
                         ids=lambda x: cid(x) if isinstance(x, tuple) else str(x))
def test_sinks_every_head_dim(cfg, causal):
  _check(cfg, is_causal=causal, ref_kw=dict(causal=causal))


def _compose_case(name):
  """``_check`` keywords of one composition (one test each, so that a
  parallel run spreads them over its workers)."""
  if name == "gqa_t_ne_s":  # T != S, odd, GQA 3
    return dict(T=300, S=333, N=6, K=2, seed=1)
  if name == "lens_row_without_keys":
    ql = jnp.array([300, 129], jnp.int32)
    kl = jnp.array([200, 0], jnp.int32)  # row 1 sees no key: out 0, no NaN
    return dict(T=300, S=333, seed=2, is_causal=True, query_seq_lengths=ql,
                key_value_seq_lengths=kl,
                ref_kw=dict(causal=True, q_lens=ql, kv_lens=kl))
  if name == "window_softcap":
    return dict(T=777, S=777, seed=3, local_window_size=(100, 0),
                softcap=5.0, ref_kw=dict(window=(100, 0), softcap=5.0))
  if name == "deterministic":
    return dict(seed=4, is_causal=True, deterministic=True,
                ref_kw=dict(causal=True))
  assert name == "segment_ids", name
  ids = jnp.asarray(np.repeat([0, 1, 2], [1, 300, 216])[None].repeat(2, 0),
                    jnp.int32)
  mask = (ids[:, :, None] == ids[:, None, :])[:, None]
  return dict(seed=5, is_causal=True, q_segment_ids=ids,
              ref_kw=dict(causal=True, mask=mask))


@pytest.mark.parametrize("case", ["gqa_t_ne_s", "lens_row_without_keys",
                                  "window_softcap", "deterministic",
                                  "segment_ids"])
@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
def test_sinks_compose(cfg, case):
  got = _check(cfg, **_compose_case(case))
  if case == "lens_row_without_keys":
    assert np.all(np.asarray(got[0])[1] == 0)


@pytest.mark.parametrize("cfg", kernel_configs("fp8")[:1], ids=cid)
def test_sinks_fp8_forward(cfg):
  # FP8's error with sinks is that of FP8 without them (the fold is exact).
  dtype = np_dtype(cfg[0])
  q, k, v, _, sinks = _inputs(6, dtype, 2, 1024, 1024, 4, 2, cfg[1])
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
  errs = []
  for s in (None, sinks):
    out = jax.jit(lambda q, k, v: jax_fa3.attention(
        q, k, v, sinks=s, is_causal=True, precision="fp8",
        implementation="fa3"))(q, k, v)
    ref = sink_reference(*f32, s, causal=True)
    errs.append(float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))))
  assert errs[1] <= 1.5 * errs[0] + 1e-3, errs

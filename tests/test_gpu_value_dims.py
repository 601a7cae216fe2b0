"""GPU truth tests of a value head dim unlike the query/key one on the
kernels (``v [B, S, K, Hv]``, ``out [B, T, N, Hv]``: 192/128 latent
attention, 128/64): the forward runs the "dv" tiles (the lowered HLO holds
the forward FFI call), the gradients the backward kernel where one was
built for the pair (``_native.compiled_bwd_value_configs``), otherwise the
reference backward on the kernel's output and LSE. Judged by the rule of
tests/test_gpu_forward.py against a float32 softmax (error at most 2x,
gradients 3x, the same-dtype XLA computation's error plus a small atol)."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import _native, primitives
from host_reference import assert_out_and_grads, np_dtype
from test_sinks import inputs, sink_reference

pytestmark = pytest.mark.gpu

CONFIGS = sorted(_native.compiled_value_configs(), key=lambda c: (c[1], c[2], c[0]))
# Without a build the ids still list what a full build runs.
IDS = CONFIGS or [("bfloat16", 192, 128), ("bfloat16", 128, 64)]
PRIMARY = [c for c in IDS if c[0] == "bfloat16"][:2]


def _cid(c):
  return f"{'bf16' if c[0] == 'bfloat16' else 'fp16'}-d{c[1]}-dv{c[2]}"


def _check(cfg, *, B=2, T=517, S=517, N=4, K=2, seed=0, sinks=False,
           ref_kw=None, **kw):
  if cfg not in CONFIGS:
    pytest.skip(f"{_cid(cfg)} not compiled")
  dtype_name, hd, hdv = cfg
  dtype = np_dtype(dtype_name)
  q, k, v, w, s = inputs(seed, B, T, S, N, K, hd, hdv)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  s = s if sinks else None
  ref_kw = {} if ref_kw is None else ref_kw

  def kernel(q, k, v):
    out, pull = jax.vjp(lambda q, k, v: jax_fa3.attention(
        q, k, v, sinks=s, implementation="fa3", **kw), q, k, v)
    return (out,) + pull(w.astype(dtype))

  def ref(q, k, v, same):
    out, pull = jax.vjp(lambda *a: sink_reference(
        *a, s, same_dtype=same, **ref_kw), q, k, v)
    return (out,) + pull(w.astype(out.dtype))

  fn = jax.jit(kernel)
  hlo = fn.lower(q, k, v).as_text()
  assert primitives.FWD_TARGET in hlo
  assert (primitives.BWD_TARGET in hlo) == (
      cfg in _native.compiled_bwd_value_configs())
  got = fn(q, k, v)
  assert got[0].shape == (B, T, N, hdv) and got[3].shape == v.shape
  if kw.get("deterministic"):  # bit-identical gradients on a second call
    again = fn(q, k, v)
    for a, b in zip(got[1:], again[1:]):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
  want = jax.jit(lambda *a: ref(*a, False))(*f32)
  same = jax.jit(lambda *a: ref(*a, True))(q, k, v)
  assert_out_and_grads(("out", "dq", "dk", "dv"), got, want, same, dtype)
  return got


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cfg", IDS, ids=_cid)
def test_value_head_dim(cfg, causal):
  _check(cfg, is_causal=causal, ref_kw=dict(causal=causal))


def _compose_case(name):
  """``_check`` keywords of one composition (one test each, so that a
  parallel run spreads them over its workers)."""
  if name == "gqa_deterministic":
    # T != S, GQA 3, a partial tile; deterministic: the same gradients twice
    return dict(T=300, S=701, N=6, K=2, seed=1, is_causal=True,
                deterministic=True, ref_kw=dict(causal=True))
  if name == "lens_row_without_keys":
    ql = jnp.array([300, 129], jnp.int32)
    kl = jnp.array([200, 0], jnp.int32)  # row 1 sees no key: 0, no NaN
    return dict(T=300, S=333, seed=2, query_seq_lengths=ql,
                key_value_seq_lengths=kl, ref_kw=dict(q_lens=ql, kv_lens=kl))
  if name == "window_softcap":
    return dict(T=777, S=777, seed=3, local_window_size=(100, 0),
                softcap=5.0, ref_kw=dict(window=(100, 0), softcap=5.0))
  if name == "sinks":
    return dict(seed=4, is_causal=True, sinks=True, ref_kw=dict(causal=True))
  if name == "segment_ids":
    ids = jnp.asarray(np.repeat([0, 1, 2], [1, 300, 216])[None].repeat(2, 0),
                      jnp.int32)
    mask = (ids[:, :, None] == ids[:, None, :])[:, None]
    return dict(seed=5, is_causal=True, q_segment_ids=ids,
                ref_kw=dict(causal=True, mask=mask))
  assert name == "decode_mqa", name
  return dict(T=1, S=999, N=8, K=1, seed=6)


@pytest.mark.parametrize("case", ["gqa_deterministic", "lens_row_without_keys",
                                  "window_softcap", "sinks", "segment_ids",
                                  "decode_mqa"])
@pytest.mark.parametrize("cfg", PRIMARY, ids=_cid)
def test_value_head_dim_compose(cfg, case):
  got = _check(cfg, **_compose_case(case))
  if case == "lens_row_without_keys":
    assert np.all(np.asarray(got[0])[1] == 0)

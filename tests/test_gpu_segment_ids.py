"""GPU truth tests of segment ids (packed sequences) on the kernels.

The same rules as tests/test_gpu_forward.py and test_gpu_backward.py: the
kernel's error against a float64 host reference of the dense equivalent mask
(equal ids, causal / window, lengths) is at most 2x (gradients 3x) the error
of the same-dtype XLA emulation, plus a small atol; rows that see no key are
exactly 0 and everything is finite.  Every call here runs the kernels
(``implementation="fa3"``; the lowered HLO is checked to hold the FFI calls).
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import fp8, primitives
from fa3_testing import cid, kernel_configs, packed_ids, seq_lens, to_device
from host_reference import (FWD_FACTOR, GRAD_FACTOR, assert_fa3_rule,
                            attention_grad_refs, attention_refs, make_inputs,
                            np_dtype, rmse, roundoff, seed_of)

pytestmark = pytest.mark.gpu

FWD_ATOL = {"bfloat16": 2e-3, "float16": 1e-3}
GRAD_ATOL = {"bfloat16": 2e-3, "float16": 1e-3}
FWD_CONFIGS = kernel_configs("fwd")
BWD_CONFIGS = kernel_configs("bwd")
PRIMARY = [c for c in BWD_CONFIGS if c == ("bfloat16", 128)] or BWD_CONFIGS[:1]


def _run(q, k, v, do, q_ids, kv_ids, grads, **kw):
  """One jitted call: the output (and the vjp of do when ``grads``)."""
  def f(q, k, v, do, qi, ki):
    att = lambda a, b, c: jax_fa3.attention(  # noqa: E731
        a, b, c, q_segment_ids=qi, kv_segment_ids=ki, implementation="fa3", **kw)
    if not grads:
      return att(q, k, v), ()
    out, pull = jax.vjp(att, q, k, v)
    return out, pull(do)
  args = to_device(q, k, v, do) + (jnp.asarray(q_ids), jnp.asarray(kv_ids))
  fn = jax.jit(f)
  hlo = fn.lower(*args).as_text()
  assert primitives.FWD_TARGET in hlo
  if grads:
    assert primitives.BWD_TARGET in hlo
  return fn(*args)


def _check(cfg, q_ids, kv_ids, *, n=2, k=2, causal=False, window=None,
           lens=None, grads=True, deterministic=False, softcap=None):
  dtype_name, hd = cfg
  dtype = np_dtype(dtype_name)
  B, T = q_ids.shape
  S = kv_ids.shape[1]
  q, kk, v, do = make_inputs(seed_of("seg", cfg, T, S, n, k, causal, window, lens),
                             B, T, S, n, k, hd, dtype_name, with_dout=True)
  ql, kl = (None, None) if lens is None else lens
  out, g = _run(q, kk, v, do, q_ids, kv_ids, grads, is_causal=causal,
                local_window_size=window, query_seq_lengths=seq_lens(ql),
                key_value_seq_lengths=seq_lens(kl), deterministic=deterministic,
                softcap=softcap)
  win = window
  seg = (q_ids, kv_ids)
  refs = attention_refs(q, kk, v, ql, kl, causal=causal, window=win,
                        softcap=softcap, segment_ids=seg)
  out = np.asarray(out).astype(np.float32)
  assert np.all(np.isfinite(out)), "NaN/Inf in the output"
  assert np.all(out[~refs.valid] == 0), "rows that see no key must be 0"
  assert_fa3_rule("out", out, refs.ref64, refs.same, FWD_ATOL[dtype_name],
                  FWD_FACTOR)
  if not grads:
    return out, g
  g64, gsame = attention_grad_refs(q, kk, v, do, ql, kl, causal=causal,
                                   window=win, softcap=softcap, segment_ids=seg)
  for name, gr, gs, gr64 in zip(("dq", "dk", "dv"), g, gsame, g64):
    gr = np.asarray(gr).astype(np.float32)
    assert np.all(np.isfinite(gr)), f"{name}: NaN/Inf"
    atol = GRAD_ATOL[dtype_name] + 2 * roundoff(gr64, dtype)
    assert_fa3_rule(name, gr, gr64, gs, atol, GRAD_FACTOR)
  return out, g


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_docs", [1, 2, 7, 31])
def test_packed_documents(cfg, n_docs, causal):
  ids = packed_ids(n_docs, 2, 1031, n_docs)  # odd length
  _check(cfg, ids, ids, causal=causal)


@pytest.mark.parametrize("cfg", BWD_CONFIGS, ids=cid)
def test_every_head_dim(cfg):
  ids = packed_ids(5, 2, 517, 7)
  _check(cfg, ids, ids, causal=True)


@pytest.mark.parametrize("cfg", [c for c in FWD_CONFIGS if c not in BWD_CONFIGS],
                         ids=cid)
def test_forward_only_head_dims(cfg):
  ids = packed_ids(6, 2, 517, 7)
  _check(cfg, ids, ids, causal=True, grads=False)


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
@pytest.mark.parametrize("kind", ["gqa", "mqa", "window", "window-sym",
                                  "lens", "softcap", "cross", "long-docs"])
def test_variants(cfg, kind):
  ids = packed_ids(seed_of(kind) % 1000, 2, 777, 7)
  kw = {}
  q_ids = kv_ids = ids
  if kind == "gqa":
    kw = dict(n=8, k=2, causal=True)
  elif kind == "mqa":
    kw = dict(n=4, k=1)
  elif kind == "window":
    kw = dict(window=(100, 0))
  elif kind == "window-sym":
    kw = dict(window=(64, 64))
  elif kind == "lens":
    kw = dict(causal=True, lens=(np.array([777, 400], np.int32),
                                 np.array([777, 611], np.int32)))
  elif kind == "softcap":
    kw = dict(softcap=20.0, causal=True)
  elif kind == "cross":  # T != S: queries of each document see its keys
    q_ids = np.repeat(np.arange(5, dtype=np.int32), [1, 60, 100, 90, 49])[None]
    kv_ids = np.repeat(np.arange(5, dtype=np.int32), [3, 200, 7, 300, 123])[None]
    q_ids, kv_ids = np.repeat(q_ids, 2, 0), np.repeat(kv_ids, 2, 0)
  elif kind == "long-docs":  # few boundaries, many whole blocks
    q_ids = kv_ids = packed_ids(3, 1, 4099, 3)
  _check(cfg, q_ids, kv_ids, **kw)


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
@pytest.mark.parametrize("causal", [False, True])
def test_non_contiguous_and_negative_ids(cfg, causal):
  # Ids that recur after other ids (one id's keys are not one run) take the
  # id-by-id comparison; negative ids match as any other value.
  rng = np.random.default_rng(7)
  ids = rng.integers(-2, 2, size=(2, 611)).astype(np.int32)
  ids[1, :300] = -1  # a long run, then interleaved ids
  _check(cfg, ids, ids, causal=causal)


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
def test_rows_without_keys_are_zero(cfg):
  # Query ids that no key has, and a kv length that cuts a document off.
  q_ids = np.repeat(np.arange(4, dtype=np.int32), [200, 1, 150, 160])[None]
  kv_ids = np.repeat(np.array([0, 2, 9], np.int32), [180, 150, 181])[None]
  q_ids, kv_ids = np.repeat(q_ids, 2, 0), np.repeat(kv_ids, 2, 0)
  out, _ = _check(cfg, q_ids, kv_ids, causal=True,
                  lens=(np.array([511, 511], np.int32), np.array([511, 200], np.int32)))
  assert np.all(out[:, 200] == 0) and np.all(np.any(out[:, 201:351] != 0, axis=-1))


@pytest.mark.parametrize("cfg", PRIMARY + [c for c in BWD_CONFIGS if c == ("bfloat16", 256)],
                         ids=cid)
def test_deterministic(cfg):
  ids = packed_ids(11, 2, 1500, 9)
  _, g1 = _check(cfg, ids, ids, causal=True, deterministic=True)
  _, g2 = _check(cfg, ids, ids, causal=True, deterministic=True)
  for a, b in zip(g1, g2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_segments_equal_separate_calls():
  # Packing is exact: each document of a packed row equals attention over
  # that document alone (same kernel, causal).
  cfg = PRIMARY[0]
  lens = [1, 129, 300, 70, 524]
  ids = np.repeat(np.arange(len(lens), dtype=np.int32), lens)[None]
  q, k, v = make_inputs(3, 1, sum(lens), sum(lens), 4, 2, cfg[1], cfg[0])
  packed = np.asarray(jax.jit(lambda q, k, v, i: jax_fa3.attention(
      q, k, v, is_causal=True, q_segment_ids=i, implementation="fa3"))(
          q, k, v, ids)).astype(np.float32)
  one = jax.jit(lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True,
                                                  implementation="fa3"))
  start = 0
  for n in lens:
    sl = slice(start, start + n)
    alone = np.asarray(one(q[:, sl], k[:, sl], v[:, sl])).astype(np.float32)
    np.testing.assert_allclose(packed[:, sl], alone, atol=2e-2, rtol=0)
    start += n


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_forward(causal):
  # precision="fp8" with segment ids on the FP8 kernel: the end-to-end rule
  # of tests/test_gpu_fp8.py (RMSE vs float64 of the 16-bit inputs).
  blocker = fp8.fp8_kernel_blocker("bfloat16", 128)
  if blocker is not None:
    pytest.skip(blocker)
  ids = packed_ids(21, 2, 1100, 7)
  q, k, v = make_inputs(seed_of("seg-fp8", causal), 2, 1100, 1100, 4, 2, 128,
                        "bfloat16")
  kw = dict(is_causal=causal, precision="fp8", q_segment_ids=ids)
  f = jax.jit(lambda q, k, v, i: jax_fa3.attention(
      q, k, v, **dict(kw, q_segment_ids=i), implementation="fa3"))
  assert primitives.FP8_FWD_TARGET in f.lower(q, k, v, ids).as_text()
  out = np.asarray(f(q, k, v, ids)).astype(np.float32)
  refs = attention_refs(q, k, v, causal=causal, same=False,
                        segment_ids=(ids, ids))
  assert np.all(np.isfinite(out))
  assert np.all(out[~refs.valid] == 0)
  with jax.default_device(jax.devices("cpu")[0]):
    emu = np.asarray(jax_fa3.attention(q, k, v, implementation="reference",
                                       **kw)).astype(np.float32)
  e, e_emu = rmse(out, refs.ref64), rmse(emu, refs.ref64)
  assert e <= 2e-2, e
  assert e <= 1.5 * e_emu + 2e-3, (e, e_emu)

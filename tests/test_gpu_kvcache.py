"""GPU truth tests of ``attention_with_kvcache`` on the kernels: decode,
speculative verification and chunked prefill against jax.nn on the gathered
dense cache with the bottom-right mask spelled out, float32, by the FA3 rule
(error at most 2x the same-dtype XLA computation's, plus a small atol); the
lowered HLO holds the FFI call; the appended rows land where they should and
nothing else in the cache changes (unused pages hold NaN, which a stray read
would carry into the output)."""
from __future__ import annotations

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import primitives
from jax_fa3.kvcache import KEY_BLOCK
from fa3_testing import cid, kernel_configs
from host_reference import FA3_ATOL, assert_fa3_rule, np_dtype
from test_kvcache import appends_past_bad_pages, bottom_right_visible

pytestmark = pytest.mark.gpu

CONFIGS = kernel_configs("fwd")
PRIMARY = [c for c in CONFIGS if c == ("bfloat16", 128)] or CONFIGS[:1]


def _setup(seed, dtype, B, Tq, N, K, H, cap, page_size, lens=None):
  """q, caches (paged: a shuffled table over the rows' pages plus two unused
  pages of NaN), new rows, ragged lengths incl. 0 and full."""
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
  q, k_new, v_new = f(B, Tq, N, H), f(B, Tq, K, H), f(B, Tq, K, H)
  if lens is None:
    lens = rng.integers(0, cap - Tq + 1, B).astype(np.int32)
    lens[0] = 0
    if B > 1:
      lens[1] = cap - Tq  # full after the append
  if page_size is None:
    kc, vc, table = f(B, cap, K, H), f(B, cap, K, H), None
  else:
    per = cap // page_size
    pool = B * per + 2
    table = rng.permutation(pool)[:B * per].reshape(B, per).astype(np.int32)
    kc, vc = f(pool, page_size, K, H), f(pool, page_size, K, H)
    unused = np.setdiff1d(np.arange(pool), table)
    kc[unused] = np.nan
    vc[unused] = np.nan
  cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
  return (cast(q), cast(kc), cast(vc), cast(k_new), cast(v_new),
          jnp.asarray(lens), None if table is None else jnp.asarray(table))


def _dense(cache, table):
  cache = np.asarray(cache, np.float32)
  if table is None:
    return cache
  table = np.asarray(table)
  return cache[table].reshape(table.shape[0], -1, *cache.shape[2:])


def _expected(q, kc, vc, k_new, v_new, lens, table, dtype, *, causal=True,
              window=None, softcap=None):
  """(float32 reference, the same computation in ``dtype`` by XLA, the
  expected dense caches) on the gathered cache with the new rows written."""
  k, v = _dense(kc, table).copy(), _dense(vc, table).copy()
  B, Tq, N, H = q.shape
  L = np.clip(np.array(lens), 0, k.shape[1])  # the kernel clamps to the capacity
  if k_new is not None:
    for b in range(B):
      k[b, L[b]:L[b] + Tq] = np.asarray(k_new, np.float32)[b]
      v[b, L[b]:L[b] + Tq] = np.asarray(v_new, np.float32)[b]
    L = L + Tq
  vis = bottom_right_visible(L, Tq, k.shape[1], causal, window)
  seen = vis.any(-1)[:, :, None, None]  # [B, Tq, 1, 1]: rows that see a key
  # NaN only in pages no row maps; the dense view holds none, but positions
  # past a row's length are real memory: zero them for the references.
  k = np.where(vis.any(1)[..., None, None], k, 0.0)
  v = np.where(vis.any(1)[..., None, None], v, 0.0)

  def xla(dt, prec):
    with jax.default_matmul_precision(prec):
      kw = dict(mask=jnp.asarray(vis)[:, None], implementation="xla")
      if softcap:  # jax.nn has no softcap: spell the scores out
        G = N // k.shape[2]
        qq, kk, vv = (jnp.asarray(x, dt) for x in (q, k, v))
        s = jnp.einsum("btnh,bsnh->bnts", qq, jnp.repeat(kk, G, 2)).astype(jnp.float32)
        s = softcap * jnp.tanh(s / np.sqrt(H) / softcap)
        s = jnp.where(jnp.asarray(vis)[:, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(dt)
        out = jnp.einsum("bnts,bsnh->btnh", p, jnp.repeat(vv, G, 2))
      else:
        out = jax.nn.dot_product_attention(*(jnp.asarray(x, dt) for x in (q, k, v)), **kw)
    return np.where(seen, np.asarray(out, np.float32), 0.0)

  return xla(jnp.float32, "highest"), xla(dtype, "default"), k, v


def _run(cfg, *, B=3, Tq=1, heads=(8, 2), cap=1280, paged=True, append=True,
         seed=0, lens=None, num_splits=None, **kw):
  dtype_name, H = cfg
  dtype = np_dtype(dtype_name)
  N, K = heads
  page = 2 * KEY_BLOCK[H] if paged else None
  cap = cap // (page or 1) * (page or 1)
  q, kc, vc, kn, vn, lens, table = _setup(seed, dtype, B, Tq, N, K, H, cap, page, lens)
  kn, vn = (kn, vn) if append else (None, None)

  def call(q, kc, vc, lens, kn, vn, table):
    return jax_fa3.attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=vn,
                                          page_table=table, num_splits=num_splits, **kw)

  f = jax.jit(call, donate_argnums=(1, 2) if append else ())
  args = (q, kc, vc, lens, kn, vn, table)
  hlo = f.lower(*args).as_text()
  assert primitives.KVCACHE_TARGET in hlo, "the kernel did not run"
  assert (primitives.KVCACHE_APPEND_TARGET in hlo) == append, "the append kernel"
  kc_host, vc_host = np.asarray(kc, np.float32), np.asarray(vc, np.float32)
  ekw = {k2: v2 for k2, v2 in dict(causal=kw.get("is_causal", True),
                                   window=kw.get("local_window_size"),
                                   softcap=kw.get("softcap")).items()}
  if isinstance(ekw["window"], int):
    ekw["window"] = (ekw["window"], ekw["window"])
  ref, same, k_want, v_want = _expected(q, kc_host, vc_host, kn, vn, lens, table, dtype, **ekw)
  res = f(*args)
  out = res[0] if append else res
  got = np.asarray(out, np.float32)
  assert np.isfinite(got).all()
  assert_fa3_rule("out", got, ref, same, FA3_ATOL)
  if append:
    kc2, vc2 = np.asarray(res[1], np.float32), np.asarray(res[2], np.float32)
    Ls = np.asarray(lens)
    new_k, new_v = _dense(kc2, table), _dense(vc2, table)
    old_k, old_v = _dense(kc_host, table), _dense(vc_host, table)
    for b in range(B):  # written rows, and every other position unchanged
      np.testing.assert_array_equal(new_k[b, Ls[b]:Ls[b] + Tq], np.asarray(kn, np.float32)[b])
      np.testing.assert_array_equal(new_v[b, Ls[b]:Ls[b] + Tq], np.asarray(vn, np.float32)[b])
      keep = np.ones(new_k.shape[1], bool)
      keep[Ls[b]:Ls[b] + Tq] = False
      np.testing.assert_array_equal(new_k[b, keep], old_k[b, keep])
      np.testing.assert_array_equal(new_v[b, keep], old_v[b, keep])
    if table is not None:  # unused pages untouched (still NaN)
      unused = np.setdiff1d(np.arange(kc_host.shape[0]), np.asarray(table))
      assert np.isnan(kc2[unused]).all() and np.isnan(vc2[unused]).all()
  return got


@pytest.mark.parametrize("cfg", CONFIGS, ids=cid)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_every_head_dim(cfg, paged):
  _run(cfg, paged=paged, heads=(8, 2), seed=cfg[1])


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
@pytest.mark.parametrize("Tq", [1, 2, 5, 16, 128])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_query_counts(cfg, Tq, paged):
  _run(cfg, Tq=Tq, paged=paged, heads=(32, 8), B=2, seed=Tq)


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
@pytest.mark.parametrize("kind", ["gqa64_8", "mqa", "group6", "window", "window_noncausal",
                                  "softcap", "no_append", "lens_out_of_range", "noncausal_tq5"])
def test_variants(cfg, kind):
  kw = dict(seed=len(kind))
  if kind == "gqa64_8":
    kw.update(heads=(64, 8), B=2, Tq=4)
  elif kind == "mqa":
    kw.update(heads=(16, 1), Tq=3)
  elif kind == "group6":  # not a power of two: heads stay unpacked
    kw.update(heads=(24, 4), Tq=3)
  elif kind == "window":
    kw.update(local_window_size=(300, 0), Tq=4)
  elif kind == "window_noncausal":
    kw.update(local_window_size=(200, 3), is_causal=False, Tq=4)
  elif kind == "softcap":
    kw.update(softcap=8.0, Tq=2)
  elif kind == "no_append":
    kw.update(append=False, lens=np.array([0, 1280, 517], np.int32))
  elif kind == "lens_out_of_range":  # the kernel clamps them: empty, full, valid
    kw.update(append=False, Tq=2, lens=np.array([-4, 1280 + 700, 517], np.int32))
  elif kind == "noncausal_tq5":
    kw.update(is_causal=False, Tq=5, paged=False)
  _run(cfg, **kw)


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
def test_append_to_a_bad_page_is_dropped(cfg):
  # The append kernel drops rows bound for a page id outside the pool
  # instead of writing another row's page.
  dtype_name, H = cfg
  q, kc, vc, kn, vn, _, table = _setup(3, np_dtype(dtype_name), 2, 4, 8, 2, H,
                                       4 * KEY_BLOCK[H], KEY_BLOCK[H])
  f = jax.jit(lambda lens, t: jax_fa3.attention_with_kvcache(
      q, kc, vc, lens, k_new=kn, v_new=vn, page_table=t))
  assert primitives.KVCACHE_APPEND_TARGET in f.lower(
      jnp.zeros(2, jnp.int32), table).as_text()
  appends_past_bad_pages(f, kc, vc, kn, vn, np.asarray(table))


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
def test_splits_agree(cfg):
  # One long row: the automatic split, a forced one and none all pass the
  # rule; a fixed num_splits is bit-reproducible.
  lens = np.array([30000], np.int32)
  outs = [_run(cfg, B=1, Tq=1, heads=(32, 8), cap=32768, paged=True, append=False,
               lens=lens, num_splits=s) for s in (None, 1, 7, 7)]
  np.testing.assert_array_equal(outs[2], outs[3])


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("append", [False, True], ids=["read", "append"])
def test_decode_step_compiles_to_the_kernels_alone(cfg, paged, append):
  # A decode step hands the cache lengths to the kernels as they are (they
  # clamp them; attention places the queries itself) and appends in place
  # (donated caches): no fusion or copy runs around the custom calls, each of
  # which would cost a launch per step (one part: split-KV adds the merge by
  # design).
  dtype_name, H = cfg
  page = 2 * KEY_BLOCK[H] if paged else None
  q, kc, vc, kn, vn, lens, table = _setup(0, np_dtype(dtype_name), 4, 1, 32, 8, H,
                                          4 * KEY_BLOCK[H], page)
  new = (kn, vn) if append else (None, None)
  f = jax.jit(lambda q, kc, vc, lens, table, kn, vn: jax_fa3.attention_with_kvcache(
      q, kc, vc, lens, k_new=kn, v_new=vn, page_table=table, num_splits=1),
      donate_argnums=(1, 2) if append else ())
  text = f.lower(q, kc, vc, lens, table, *new).compile().as_text()
  launches = re.findall(r"\b(fusion|copy|custom-call|transpose|broadcast)\(", text)
  assert launches == ["custom-call"] * (2 if append else 1), (launches, text)

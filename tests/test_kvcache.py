"""attention_with_kvcache (pure-JAX path) against jax.nn on the gathered
dense cache with the explicit bottom-right mask, float32, XLA:CPU; the cache
update; validation."""
import re

import numpy as np
import pytest
import jax
import jax.numpy as jnp

import jax_fa3

from fa3_testing import close

pytestmark = pytest.mark.usefixtures("cpu_backend")


def _setup(seed, B, Tq, N, K, H, cap, page_size=None, dtype=jnp.float32):
  """Random q, caches (contiguous, or paged through a random non-contiguous
  page table), new rows, ragged cache lengths incl. 0 and full."""
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
  q = f(B, Tq, N, H)
  k_new, v_new = f(B, Tq, K, H), f(B, Tq, K, H)
  lens = rng.integers(0, cap - Tq + 1, B).astype(np.int32)
  lens[0] = 0
  if B > 1:
    lens[1] = cap - Tq  # full after the append
  if page_size is None:
    return q, f(B, cap, K, H), f(B, cap, K, H), k_new, v_new, lens, None
  per = cap // page_size
  num_pages = B * per + 3
  table = rng.permutation(num_pages)[:B * per].reshape(B, per).astype(np.int32)
  return (q, f(num_pages, page_size, K, H), f(num_pages, page_size, K, H),
          k_new, v_new, lens, table)


def _dense(cache, table, page_size):
  cache = np.asarray(cache)
  if table is None:
    return cache
  return cache[table].reshape(table.shape[0], -1, *cache.shape[2:])


def bottom_right_visible(L, Tq, C, causal, window):
  """bool [B, Tq, C]: key j is visible from query i of row b (L[b] keys,
  query i at position L[b] - Tq + i)."""
  qpos = L[:, None] - Tq + np.arange(Tq)[None]
  j = np.arange(C)[None, None]
  vis = j < L[:, None, None]
  if causal:
    vis = vis & (j <= qpos[..., None])
  if window is not None:
    vis = vis & (j >= qpos[..., None] - window[0])
    if not causal:
      vis = vis & (j <= qpos[..., None] + window[1])
  return vis


def _expected(q, kc, vc, k_new, v_new, lens, table, page_size, *, causal=True,
              window=None, softcap=None, scale=None):
  """jax.nn (xla, f32) on the dense cache with the new rows written and the
  bottom-right mask spelled out; rows that see nothing are 0."""
  k, v = _dense(kc, table, page_size).copy(), _dense(vc, table, page_size).copy()
  B, Tq = q.shape[:2]
  C = k.shape[1]
  L = np.array(lens)
  if k_new is not None:
    for b in range(B):
      k[b, L[b]:L[b] + Tq] = np.asarray(k_new)[b]
      v[b, L[b]:L[b] + Tq] = np.asarray(v_new)[b]
    L = L + Tq
  vis = bottom_right_visible(L, Tq, C, causal, window)
  with jax.default_matmul_precision("highest"):
    s = jnp.einsum("btnh,bsnh->bnts", jnp.asarray(q, jnp.float32),
                   jnp.repeat(jnp.asarray(k, jnp.float32), q.shape[2] // k.shape[2], 2))
    s = s * (scale if scale is not None else 1 / np.sqrt(q.shape[-1]))
    if softcap:
      s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(vis[:, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(vis[:, None].any(-1, keepdims=True), p, 0.0)
    out = jnp.einsum("bnts,bsnh->btnh", p,
                     jnp.repeat(jnp.asarray(v, jnp.float32), q.shape[2] // k.shape[2], 2))
  return np.asarray(out), k, v


@pytest.mark.parametrize("Tq", [1, 2, 5, 16])
@pytest.mark.parametrize("page_size", [None, 4, 16])
@pytest.mark.parametrize("heads", [(8, 2), (4, 1), (4, 4)])
def test_append_and_attend(Tq, page_size, heads):
  N, K = heads
  B, H, cap = 3, 16, 64
  q, kc, vc, kn, vn, lens, table = _setup(Tq * 7 + (page_size or 0), B, Tq, N,
                                          K, H, cap, page_size)
  f = jax.jit(lambda *a: jax_fa3.attention_with_kvcache(
      a[0], a[1], a[2], a[3], k_new=a[4], v_new=a[5],
      page_table=None if page_size is None else a[6]))
  out, kc2, vc2 = f(q, kc, vc, lens, kn, vn, table)
  want, k_want, v_want = _expected(q, kc, vc, kn, vn, lens, table, page_size)
  close(out, want, rtol=1e-5, atol=1e-5)
  close(_dense(kc2, table, page_size), k_want, rtol=0, atol=0)
  close(_dense(vc2, table, page_size), v_want, rtol=0, atol=0)
  if page_size is not None:  # pages outside the table are untouched
    unused = np.setdiff1d(np.arange(kc.shape[0]), table)
    np.testing.assert_array_equal(np.asarray(kc2)[unused], np.asarray(kc)[unused])


@pytest.mark.parametrize("kind", ["no_append", "window", "window_noncausal",
                                  "softcap", "noncausal", "chunk128"])
def test_variants(kind):
  B, N, K, H, cap = 2, 4, 2, 16, 160
  Tq = 128 if kind == "chunk128" else 3
  q, kc, vc, kn, vn, lens, table = _setup(len(kind), B, Tq, N, K, H, cap, 8)
  kw, ekw = {}, {}
  if kind == "no_append":
    kn = vn = None
    lens = np.array([0, 100], np.int32)  # row 0 sees nothing: zeros
  if kind in ("window", "window_noncausal"):
    kw["local_window_size"] = ekw["window"] = (7, 2)
  if kind in ("noncausal", "window_noncausal"):
    kw["is_causal"] = ekw["causal"] = False
  if kind == "softcap":
    kw["softcap"] = ekw["softcap"] = 5.0
  res = jax_fa3.attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=vn,
                                       page_table=table, **kw)
  out = res if kn is None else res[0]
  want = _expected(q, kc, vc, kn, vn, lens, table, 8, **ekw)[0]
  close(out, want, rtol=1e-5, atol=1e-5)
  if kind == "no_append":
    np.testing.assert_array_equal(np.asarray(out)[0], 0.0)


def test_bf16_and_out_of_range_values_stay_in_the_cache():
  # cache_seqlens past the capacity clamp; new rows past it are dropped;
  # page ids past the pool clamp: nothing outside the cache changes shape
  # or reads out of bounds, and the output stays finite.
  B, Tq, N, K, H, cap = 2, 4, 4, 2, 16, 32
  q, kc, vc, kn, vn, _, table = _setup(3, B, Tq, N, K, H, cap, 8, jnp.bfloat16)
  lens = np.array([cap + 50, cap - 2], np.int32)
  bad = table.copy()
  bad[1, -1] = 10_000
  out, kc2, vc2 = jax_fa3.attention_with_kvcache(q, kc, vc, lens, k_new=kn,
                                                 v_new=vn, page_table=bad)
  assert out.dtype == jnp.bfloat16 and kc2.shape == kc.shape
  assert np.isfinite(np.asarray(out, np.float32)).all()


def appends_past_bad_pages(call, kc, vc, kn, vn, table):
  """Check ``call(lens, table) -> (out, k_cache, v_cache)`` drops the new
  rows bound for a page id outside the pool (-1, unallocated; past the end)
  and writes the others: row 0 appends into its first page, row 1 across its
  second, and those table entries are made bad in turn."""
  ps, pool = kc.shape[1], kc.shape[0]
  Tq = kn.shape[1]
  lens = np.array([0, ps - Tq // 2], np.int32)
  for bad_id in (-1, pool, 2**31 - 1):
    bad = np.array(table)
    bad[0, 0] = bad[1, 1] = bad_id
    _, kc2, vc2 = call(jnp.asarray(lens), jnp.asarray(bad))
    for old, new, rows in ((kc, kc2, kn), (vc, vc2, vn)):
      old, new, rows = (np.asarray(x, np.float32) for x in (old, new, rows))
      want = old.copy()  # row 1's first new rows still fill its first page
      want[table[1, 0], ps - Tq // 2:] = rows[1, :Tq // 2]
      np.testing.assert_array_equal(new, want, err_msg=f"page id {bad_id}")


def test_append_to_a_bad_page_is_dropped():
  B, Tq, N, K, H, cap, ps = 2, 4, 4, 2, 16, 32, 8
  q, kc, vc, kn, vn, _, table = _setup(6, B, Tq, N, K, H, cap, ps)
  appends_past_bad_pages(
      lambda lens, t: jax_fa3.attention_with_kvcache(
          q, kc, vc, lens, k_new=kn, v_new=vn, page_table=t),
      kc, vc, kn, vn, table)


def test_deterministic_and_num_splits_accepted():
  q, kc, vc, kn, vn, lens, table = _setup(4, 2, 1, 4, 2, 16, 64, None)
  a = jax_fa3.attention_with_kvcache(q, kc, vc, lens, num_splits=3)
  b = jax_fa3.attention_with_kvcache(q, kc, vc, lens, num_splits=3)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("change,match", [
    (dict(q=np.zeros((2, 1, 4))), r"q must be \[B, Tq, N, H\]"),
    (dict(q=np.zeros((2, 1, 4, 16), jnp.float8_e4m3fn),
          k_cache=np.zeros((2, 64, 2, 16), jnp.float8_e4m3fn),
          v_cache=np.zeros((2, 64, 2, 16), jnp.float8_e4m3fn)), "q must have dtype"),
    (dict(softcap=1e39), "finite in float32"),
    (dict(k_new=np.zeros((2, 1, 2, 16), np.float32)), "k_new and v_new go together"),
    (dict(cache_seqlens=np.zeros((3,), np.int32)), r"cache_seqlens must be .* \[2\]"),
    (dict(cache_seqlens=np.zeros((2,), np.float32)), "cache_seqlens must be an integer"),
    (dict(k_cache=np.zeros((2, 64, 3, 16), np.float32),
          v_cache=np.zeros((2, 64, 3, 16), np.float32)), "multiple of the cache's kv heads"),
    (dict(k_cache=np.zeros((3, 64, 2, 16), np.float32),
          v_cache=np.zeros((3, 64, 2, 16), np.float32)), "contiguous cache needs batch 2"),
    (dict(page_table=np.zeros((2,), np.int32)), "page_table must be"),
    (dict(page_table=np.zeros((2, 0), np.int32)), "at least one page per row"),
    (dict(num_splits=0), "num_splits"),
    (dict(local_window_size=-1), "local_window_size"),
    (dict(k_cache=np.zeros((2, 64, 2, 16), jnp.bfloat16),
          v_cache=np.zeros((2, 64, 2, 16), jnp.bfloat16)), "share one dtype"),
    (dict(v_cache=np.zeros((2, 64, 2, 16), jnp.bfloat16)), "share one dtype"),
    (dict(k_new=np.zeros((2, 1, 2, 16), np.float32),
          v_new=np.zeros((2, 1, 2, 16), jnp.bfloat16)), "share one dtype"),
    (dict(k_cache=np.zeros((2, 0, 2, 16), np.float32),
          v_cache=np.zeros((2, 0, 2, 16), np.float32)), "capacity S_max >= 1"),
    (dict(q=np.zeros((2, 1, 4, 0), np.float32),
          k_cache=np.zeros((2, 64, 2, 0), np.float32),
          v_cache=np.zeros((2, 64, 2, 0), np.float32)), "head_dim must be positive"),
])
def test_validation(change, match):
  q, kc, vc, _, _, lens, _ = _setup(5, 2, 1, 4, 2, 16, 64, None)
  args = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=lens)
  args.update(change)
  with pytest.raises(ValueError, match=match):
    jax_fa3.attention_with_kvcache(args.pop("q"), args.pop("k_cache"),
                                   args.pop("v_cache"), args.pop("cache_seqlens"),
                                   **args)


def test_wide_cache_seqlens_clamp_not_wrap():
  # Documented: lengths past the capacity (or below 0) are clamped; a cast of
  # a wider integer type to int32 would wrap them first.
  q, kc, vc, _, _, _, _ = _setup(8, 2, 1, 4, 2, 16, 8, None)
  full = jax_fa3.attention_with_kvcache(q, kc, vc, np.array([8, 8], np.int32))
  none = jax_fa3.attention_with_kvcache(q, kc, vc, np.array([0, 0], np.int32))
  for lens in (np.array([2**32 + 1, 2**40], np.int64),
               np.array([2**32 - 1, 2**31], np.uint32)):
    close(jax_fa3.attention_with_kvcache(q, kc, vc, lens), full)
  close(jax_fa3.attention_with_kvcache(
      q, kc, vc, np.array([-2**40, -2**33], np.int64)), none)


def test_wide_page_ids_clamp_not_wrap():
  # Documented: page ids past the pool are clamped; a cast of a wider integer
  # type to int32 would wrap them into the pool first (2**32 + 1 -> page 1).
  rng = np.random.default_rng(9)
  q = jnp.asarray(rng.standard_normal((1, 1, 2, 8)), jnp.float32)
  pool = jnp.asarray(rng.standard_normal((4, 4, 1, 8)), jnp.float32)
  page = lambda t: jax_fa3.attention_with_kvcache(  # noqa: E731
      q, pool, pool, np.array([4], np.int32), page_table=t)
  last, first = page(np.array([[3]], np.int32)), page(np.array([[0]], np.int32))
  for ids in (np.array([[2**32 + 1]], np.int64),
              np.array([[2**32 - 3]], np.uint32)):
    close(page(ids), last)
  close(page(np.array([[-2**32 + 2]], np.int64)), first)



@pytest.mark.parametrize("B,Tq", [(2, 0), (0, 1)])
@pytest.mark.parametrize("page_size", [None, 64])
def test_empty_query(B, Tq, page_size):
  # The kernel path's dtype and head dim with nothing to compute: an empty
  # output (and unchanged caches), not a split count divided by zero tiles.
  q, kc, vc, kn, vn, lens, table = _setup(7, max(B, 1), max(Tq, 1), 4, 2, 64,
                                          128, page_size, jnp.bfloat16)
  q, kn, vn = (x[:B, :Tq] for x in (q, kn, vn))
  lens = lens[:B]
  if table is not None:
    table = table[:B]
  else:
    kc, vc = kc[:B], vc[:B]
  out = jax_fa3.attention_with_kvcache(q, kc, vc, lens, page_table=table)
  assert out.shape == (B, Tq, 4, 64) and out.dtype == jnp.bfloat16
  out, kc2, vc2 = jax_fa3.attention_with_kvcache(
      q, kc, vc, lens, k_new=kn, v_new=vn, page_table=table)
  assert out.shape == (B, Tq, 4, 64)
  np.testing.assert_array_equal(np.asarray(kc2, np.float32), np.asarray(kc, np.float32))
  np.testing.assert_array_equal(np.asarray(vc2, np.float32), np.asarray(vc, np.float32))


def test_new_rows_must_fit():
  q, kc, vc, kn, vn, lens, _ = _setup(6, 1, 8, 4, 2, 16, 8, None)
  with pytest.raises(ValueError, match="do not fit"):
    jax_fa3.attention_with_kvcache(q, kc[:, :4], vc[:, :4], lens, k_new=kn, v_new=vn)


def test_demo_generation_agrees_with_the_full_forward(capsys):
  # The demo's --generate path: a chunked prefill and one-token steps through
  # a paged cache give the logits of the training forward on the same tokens.
  import flax.linen as nn
  from jax_fa3 import demo
  args = demo.parse_args(["--layers", "2", "--batch", "8", "--seq-len", "64",
                          "--period", "8", "--generate", "6", "--page-size", "4"],
                         on_gpu=False)
  mesh = demo.make_mesh(args)
  model = demo._build(args, mesh, "fa3")
  x = jnp.zeros((args.batch, args.seq_len), jnp.int32)
  params = nn.unbox(model.init(jax.random.key(0), x, x)["params"])
  assert demo.generate(args, model, params)
  assert "decode logits vs full forward" in capsys.readouterr().out


def _runs_kernel_path(fn, *args):
  return "kvcache_fwd" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("page_size", [None, 128])
@pytest.mark.parametrize("Tq,heads", [(1, (8, 2)), (5, (4, 1)), (16, (4, 4)),
                                      (3, (12, 2))])  # a group of 6: not packed
def test_kernel_path(splits, page_size, Tq, heads):
  # bfloat16 at a kernel head dim takes the kernel call (here its pure-JAX
  # lowering): packed GQA rows, bottom-right positions, split parts merged.
  N, K = heads
  B, H, cap = 3, 64, 384
  q, kc, vc, kn, vn, lens, table = _setup(Tq + N, B, Tq, N, K, H, cap, page_size,
                                          jnp.bfloat16)
  fn = lambda *a: jax_fa3.attention_with_kvcache(  # noqa: E731
      *a[:4], k_new=a[4], v_new=a[5], page_table=a[6], num_splits=splits)
  assert _runs_kernel_path(fn, q, kc, vc, lens, kn, vn, table)
  out, kc2, _ = jax.jit(fn)(q, kc, vc, lens, kn, vn, table)
  want, k_want, _ = _expected(q, kc, vc, kn, vn, lens, table, page_size)
  close(out, want, rtol=2e-2, atol=2e-2)
  close(_dense(kc2, table, page_size), k_want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["window", "window_noncausal", "softcap",
                                  "no_append"])
def test_kernel_path_variants(kind):
  B, Tq, N, K, H, cap = 2, 4, 8, 2, 128, 512
  q, kc, vc, kn, vn, lens, table = _setup(len(kind) + 40, B, Tq, N, K, H, cap, 128,
                                          jnp.bfloat16)
  kw, ekw = {}, {}
  if kind == "no_append":
    kn = vn = None
    lens = np.array([0, 300], np.int32)
  if kind.startswith("window"):
    kw["local_window_size"] = ekw["window"] = (70, 3)
  if kind == "window_noncausal":
    kw["is_causal"] = ekw["causal"] = False
  if kind == "softcap":
    kw["softcap"] = ekw["softcap"] = 3.0
  res = jax_fa3.attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=vn,
                                       page_table=table, num_splits=2, **kw)
  out = res if kn is None else res[0]
  want = _expected(q, kc, vc, kn, vn, lens, table, 128, **ekw)[0]
  close(out, want, rtol=2e-2, atol=2e-2)


def test_page_size_off_the_key_block_takes_the_dense_path():
  q, kc, vc, _, _, lens, table = _setup(8, 2, 1, 4, 2, 64, 128, 16, jnp.bfloat16)
  fn = lambda *a: jax_fa3.attention_with_kvcache(*a[:4], page_table=a[4])  # noqa: E731
  assert not _runs_kernel_path(fn, q, kc, vc, lens, table)
  pages = jnp.zeros((3, 128, 2, 64), jnp.bfloat16)
  assert _runs_kernel_path(fn, q, pages, pages, lens, np.array([[0], [2]], np.int32))


def test_auto_splits():
  from jax_fa3.kvcache import auto_splits
  assert auto_splits(64, 8, 4, 4096, 128, num_sms=132) == 1     # 512 tiles
  assert auto_splits(1, 8, 4, 131072, 128, num_sms=132) == 16   # 8 tiles
  assert auto_splits(1, 8, 4, 1024, 128, num_sms=132) == 2      # 8 blocks
  assert auto_splits(1, 1, 1, 64, 64, num_sms=132) == 1         # one block


@pytest.mark.parametrize("paged", [False, True])
def test_sharded_batch_and_heads_equal_unsharded(paged):
  # The kernel call's rule keeps batch and kv-head shards local (no gather
  # of the cache); the result equals one device's.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = np.array(jax.devices("cpu")[:4]).reshape(2, 2)
  mesh = Mesh(devs, ("b", "k"))
  B, Tq, N, K, H, cap = 4, 2, 8, 4, 64, 256
  q, kc, vc, kn, vn, lens, table = _setup(11, B, Tq, N, K, H, cap, 128 if paged else None,
                                          jnp.bfloat16)
  fn = lambda *a: jax_fa3.attention_with_kvcache(  # noqa: E731
      *a[:4], k_new=a[4], v_new=a[5], page_table=a[6], num_splits=2)
  want = jax.jit(fn)(q, kc, vc, lens, kn, vn, table)
  heads = NamedSharding(mesh, P("b", None, "k", None))
  cache = NamedSharding(mesh, P(None, None, "k", None)) if paged else heads
  rows = NamedSharding(mesh, P("b"))
  shard = (heads, cache, cache, rows, heads, heads,
           NamedSharding(mesh, P("b", None)) if paged else None)
  args = [x if s is None else jax.device_put(x, s)
          for x, s in zip((q, kc, vc, lens, kn, vn, table), shard)]
  f = jax.jit(fn)
  got = f(*args)
  for g, w in zip(got, want):
    close(g, w, rtol=0, atol=0)
  hlo = f.lower(*args).compile().as_text()
  # Gathered: at most the new rows (a paged pool is whole on every batch
  # shard, so each writes every row's), lengths and the table; never a cache.
  for m in re.finditer(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo):
    assert np.prod([int(x) for x in m.group(1).split(",") if x]) <= kn.size, m.group(0)


@pytest.mark.parametrize("dtype,H", [(jnp.float32, 16), (jnp.bfloat16, 64)])
def test_query_heads_sharded_past_the_kv_heads_with_append(dtype, H):
  # 8 query heads over a 4-device axis, 2 kv heads: the dense path's
  # attention splits the kv heads over part of that axis, which reaches the
  # appended caches (the partitioned append could not take it).
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = np.array(jax.devices("cpu")[:8])
  if len(devs) < 8:
    pytest.skip("needs 8 devices")
  mesh = Mesh(devs.reshape(2, 4), ("b", "h"))
  q, kc, vc, kn, vn, lens, _ = _setup(12, 4, 1, 8, 2, H, 16, None, dtype)
  fn = lambda q, kc, vc, lens, kn, vn: jax_fa3.attention_with_kvcache(  # noqa: E731
      q, kc, vc, lens, k_new=kn, v_new=vn)
  want = jax.jit(fn)(q, kc, vc, lens, kn, vn)
  qs = jax.device_put(q, NamedSharding(mesh, P("b", None, "h", None)))
  got = jax.jit(fn)(qs, kc, vc, lens, kn, vn)
  for g, w in zip(got, want):
    close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("page_size", [None, 128])
def test_donated_caches_update_in_place(page_size):
  # Under jit with the caches donated, the appended caches alias the inputs:
  # no copy of either cache is made.
  q, kc, vc, kn, vn, lens, table = _setup(12, 2, 1, 8, 2, 64, 1024, page_size, jnp.bfloat16)
  f = jax.jit(lambda *a: jax_fa3.attention_with_kvcache(
      *a[:4], k_new=a[4], v_new=a[5], page_table=a[6]), donate_argnums=(1, 2))
  ma = f.lower(q, kc, vc, lens, kn, vn, table).compile().memory_analysis()
  assert ma.alias_size_in_bytes >= kc.nbytes + vc.nbytes, ma


@pytest.mark.parametrize("page_size", [None, 128])
def test_vmap_equals_a_loop(page_size):
  # vmap over independent caches (each element its own pool and table).
  ins = [_setup(20 + i, 2, 2, 8, 2, 64, 256, page_size, jnp.bfloat16) for i in range(3)]
  fn = lambda q, kc, vc, l, kn, vn, t: jax_fa3.attention_with_kvcache(  # noqa: E731
      q, kc, vc, l, k_new=kn, v_new=vn, page_table=t, num_splits=2)
  stack = [None if x[0] is None else jnp.stack(x) for x in zip(*ins)]
  order = (0, 1, 2, 5, 3, 4, 6)  # _setup's order -> fn's
  got = jax.vmap(fn)(*[stack[i] for i in order])
  for e, one in enumerate(ins):
    want = fn(*[one[i] for i in order])
    for g, w in zip(got, want):
      close(g[e], w, rtol=0, atol=0)


def _kvcache_cuda_module(monkeypatch, Tq, N, K, H=128, B=2, cap=256):
  """The CUDA lowering of a call (exported without a GPU), kernels assumed
  compiled for bfloat16 at head dim H."""
  from jax_fa3 import _native, primitives
  monkeypatch.setattr(_native, "_CONFIGS", frozenset({("bfloat16", H)}))
  q = jnp.ones((B, Tq, N, H), jnp.bfloat16)
  kc = jnp.ones((B, cap, K, H), jnp.bfloat16)
  lens = jnp.full((B,), 100, jnp.int32)
  fn = jax.jit(lambda q, k, v, l: jax_fa3.attention_with_kvcache(q, k, v, l))
  checks = [jax.export.DisabledSafetyCheck.custom_call(primitives.KVCACHE_TARGET)]
  return jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(
      q, kc, kc, lens).mlir_module()


def _moving_transposes(text):
  """Transposes that reorder axes longer than 1 (a real copy; moving
  size-1 axes is a reshape)."""
  import re
  moving = []
  for m in re.finditer(r"stablehlo\.transpose %\S+, dims = \[([\d, ]+)\] : "
                       r"\(tensor<([\dx]+)x\w+>\)", text):
    perm = [int(x) for x in m.group(1).split(",")]
    shape = [int(x) for x in m.group(2).split("x")]
    if [a for a in perm if shape[a] > 1] != sorted(a for a in perm if shape[a] > 1):
      moving.append(m.group(0))
  return moving


@pytest.mark.parametrize("Tq,N,K,heads_major,q_type", [
    (1, 32, 8, 1, "2x8x4x128"),     # decode: q read where it lies
    (5, 32, 8, 1, "2x8x20x128"),    # verification: q transposed in, out back
    (1, 12, 2, 0, "2x1x12x128"),    # a group of 6 is not packed
])
def test_cuda_lowering_reads_decode_queries_in_place(monkeypatch, Tq, N, K,
                                                     heads_major, q_type):
  text = _kvcache_cuda_module(monkeypatch, Tq, N, K)
  calls = [l for l in text.splitlines() if "@jax_fa3_kvcache_fwd" in l]
  assert len(calls) == 1, calls
  assert f"heads_major = {heads_major} : i32" in calls[0]
  assert f"(tensor<{q_type}xbf16>" in calls[0]
  moving = _moving_transposes(text)
  assert len(moving) == (0 if Tq == 1 else 2), moving


def test_kernel_path_gradient_is_a_value_error(monkeypatch):
  # An inference call: its kernels have no derivative, and say so.
  from jax_fa3 import _native
  configs = frozenset({("bfloat16", 64)})
  monkeypatch.setattr(_native, "available", lambda: True)
  monkeypatch.setattr(_native, "sm90_gpu_present", lambda: True)
  monkeypatch.setattr(_native, "compiled_configs", lambda: configs)
  q, kc, vc, kn, vn, lens, _ = _setup(13, 1, 1, 2, 2, 64, 128, None, jnp.bfloat16)
  for kw in (dict(), dict(k_new=kn, v_new=vn)):
    f = lambda q: jnp.sum(jnp.asarray(jax.tree.leaves(  # noqa: E731
        jax_fa3.attention_with_kvcache(q, kc, vc, lens, **kw))[0], jnp.float32))
    with pytest.raises(ValueError, match="not differentiable"):
      jax.grad(f)(q)

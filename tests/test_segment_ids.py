"""Segment ids (packed sequences) on the reference path, against jax.nn with
the equivalent dense boolean mask (float32, XLA:CPU)."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import _validate as V, fp8, reference as R, pair_rule

from fa3_testing import (close, close_trees, out_and_grads, packed_ids,
                          partitioner, rand, row_spans_bruteforce)

pytestmark = pytest.mark.usefixtures("cpu_backend")


def dense_mask(q_ids, kv_ids, causal=False, window=None, ql=None, kl=None):
  """bool [B, T, S]: equal ids, top-left causal / window, lengths."""
  B, T = q_ids.shape
  S = kv_ids.shape[1]
  i = np.arange(T)[:, None]
  j = np.arange(S)[None, :]
  m = q_ids[:, :, None] == kv_ids[:, None, :]
  if causal:
    m = m & (j <= i)
  if window is not None:
    m = m & (j >= i - window[0]) & (j <= i + window[1])
  if ql is not None:
    m = m & (i[None] < np.asarray(ql)[:, None, None])
  if kl is not None:
    m = m & (j[None] < np.asarray(kl)[:, None, None])
  return m


def check(q, k, v, w, q_ids, kv_ids, mask, **kw):
  """jax_fa3.attention with segment ids vs jax.nn with ``mask``: outputs and
  q/k/v gradients.  Rows that see no key must be 0 here (jax.nn gives
  mean(V)), so jax.nn's are zeroed and get no cotangent."""
  rows = jnp.asarray(mask.any(-1))[:, :, None, None]  # [B,T,1,1]
  mask4 = jnp.asarray(mask)[:, None]

  @jax.jit
  def run(q, k, v, w, q_ids, kv_ids):
    f = lambda q, k, v: jax_fa3.attention(
        q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **kw)
    with jax.default_matmul_precision("highest"):
      g = lambda q, k, v: jnp.where(rows, jax.nn.dot_product_attention(
          q, k, v, mask=mask4, implementation="xla"), 0.0)
      out, vjp = jax.vjp(f, q, k, v)
      ref, ref_vjp = jax.vjp(g, q, k, v)
      return out, ref, vjp(w * rows), ref_vjp(w * rows)

  out, ref, grads, ref_grads = run(q, k, v, w, q_ids, kv_ids)
  close(out, ref)
  np.testing.assert_array_equal(np.asarray(out)[~mask.any(-1)], 0.0)
  for a, b in zip(grads, ref_grads):
    assert np.isfinite(np.asarray(a)).all()
    close(a, b, rtol=1e-4, atol=1e-5)
  return out, grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_docs", [1, 2, 7, 31])
def test_packed_documents(n_docs, causal):
  rng = np.random.default_rng(n_docs)
  L = 67  # odd
  q, k, v, w = rand(n_docs, B=2, T=L, S=L, N=2, K=2, H=8)
  ids = packed_ids(rng, 2, L, n_docs)
  check(q, k, v, w, ids, ids, dense_mask(ids, ids, causal), is_causal=causal)


def test_default_kv_ids_when_t_equals_s():
  rng = np.random.default_rng(1)
  q, k, v, _ = rand(1, B=2, T=33, S=33, N=2, K=2, H=8)
  ids = jnp.asarray(packed_ids(rng, 2, 33, 5))
  a, b = jax.jit(lambda q, k, v, ids: (
      jax_fa3.attention(q, k, v, q_segment_ids=ids, is_causal=True),
      jax_fa3.attention(q, k, v, q_segment_ids=ids, kv_segment_ids=ids,
                        is_causal=True)))(q, k, v, ids)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("causal,window", [(False, (5, 3)), (True, (4, 4))])
def test_window(causal, window):
  rng = np.random.default_rng(2)
  q, k, v, w = rand(2, B=2, T=41, S=41, N=2, K=2, H=8)
  ids = packed_ids(rng, 2, 41, 7)
  wr = min(window[1], 0) if causal else window[1]
  check(q, k, v, w, ids, ids, dense_mask(ids, ids, window=(window[0], wr)),
        is_causal=causal, local_window_size=window)


def test_gqa_causal():
  rng = np.random.default_rng(3)
  q, k, v, w = rand(3, B=2, T=45, S=45, N=6, K=2, H=8)
  ids = packed_ids(rng, 2, 45, 7)
  check(q, k, v, w, ids, ids, dense_mask(ids, ids, True), is_causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_t_ne_s_explicit_kv_ids(causal):
  # Keys hold the same documents as the queries plus later ones; top-left
  # causal leaves some query rows without a key (they must be 0).
  rng = np.random.default_rng(4)
  q, k, v, w = rand(4, B=2, T=29, S=45, N=4, K=2, H=8)
  kv_ids = packed_ids(rng, 2, 45, 6)
  q_ids = np.sort(rng.integers(0, 6, (2, 29)), axis=1).astype(np.int32)
  check(q, k, v, w, q_ids, kv_ids, dense_mask(q_ids, kv_ids, causal),
        is_causal=causal)


def test_seq_lengths_combined():
  rng = np.random.default_rng(5)
  q, k, v, w = rand(5, B=2, T=39, S=39, N=2, K=2, H=8)
  ids = packed_ids(rng, 2, 39, 7)
  ql = np.array([39, 23], np.int32)
  kl = np.array([30, 39], np.int32)
  check(q, k, v, w, ids, ids, dense_mask(ids, ids, True, ql=ql, kl=kl),
        is_causal=True, query_seq_lengths=jnp.asarray(ql),
        key_value_seq_lengths=jnp.asarray(kl))


def test_negative_and_repeated_ids():
  # Negative ids are ids like any other; equal ids match even where they are
  # not contiguous (the mask is id equality, not document position).
  q, k, v, w = rand(6, B=2, T=31, S=31, N=2, K=2, H=8)
  ids = np.stack([np.where(np.arange(31) % 3 == 0, -5, -1),
                  np.where(np.arange(31) < 10, -2147483648, 7)]).astype(np.int32)
  check(q, k, v, w, ids, ids, dense_mask(ids, ids))


def test_query_segment_without_keys():
  q, k, v, w = rand(7, B=2, T=16, S=20, N=2, K=2, H=8)
  q_ids = np.array([[0] * 8 + [9] * 8, [1] * 16], np.int32)  # 9: no key
  kv_ids = np.array([[0] * 20, [1] * 10 + [2] * 10], np.int32)
  mask = dense_mask(q_ids, kv_ids)
  assert not mask.any(-1).all()
  out, grads = check(q, k, v, w, q_ids, kv_ids, mask)
  np.testing.assert_array_equal(np.asarray(out)[0, 8:], 0.0)
  # Even with a cotangent on the empty rows, no NaN.
  dq = jax.jit(jax.grad(lambda q: jax_fa3.attention(
      q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids).sum()))(q)
  assert np.isfinite(np.asarray(dq)).all()
  np.testing.assert_array_equal(np.asarray(dq)[0, 8:], 0.0)


@pytest.mark.parametrize("block_k", [3, 8])
def test_reference_blockwise(block_k):
  # Segment boundaries inside and across key blocks; softcap; padded last
  # block (S % block_k != 0); against the reference's own dense-mask path.
  rng = np.random.default_rng(8)
  q, k, v, w = rand(8, B=2, T=27, S=35, N=4, K=2, H=8)
  q_ids = np.sort(rng.integers(0, 5, (2, 27)), axis=1).astype(np.int32)
  kv_ids = packed_ids(rng, 2, 35, 5)
  mask = jnp.asarray(dense_mask(q_ids, kv_ids))[:, None]
  kw = dict(scale=0.3, softcap=2.0, window_left=-1, window_right=0)

  def f(q, k, v):
    return R.reference_attention(q, k, v, None, None, None, None, 0.3, 2.0,
                                 -1, 0, block_k,
                                 segment_ids=(jnp.asarray(q_ids),
                                              jnp.asarray(kv_ids)))[0]

  def g(q, k, v):
    return R.reference_attention(q, k, v, None, None, None, mask, 0.3, 2.0,
                                 -1, 0, 512)[0]
  @jax.jit
  def run(q, k, v, w):
    out, vjp = jax.vjp(f, q, k, v)
    ref, ref_vjp = jax.vjp(g, q, k, v)
    out2, _ = R.attention_fwd(q, k, v, None, None, block_k=block_k,
                              q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                              **kw)
    return out, ref, out2, vjp(w), ref_vjp(w)

  out, ref, out2, grads, ref_grads = run(q, k, v, w)
  close(out, ref)
  close(out2, ref)
  for a, b in zip(grads, ref_grads):
    close(a, b, rtol=1e-4, atol=1e-5)


def test_softcap_and_deterministic():
  rng = np.random.default_rng(9)
  q, k, v, _ = rand(9, B=2, T=37, S=37, N=4, K=2, H=8)
  ids = jnp.asarray(packed_ids(rng, 2, 37, 7))
  mask = jnp.asarray(dense_mask(np.asarray(ids), np.asarray(ids), True))
  a, b, c = jax.jit(lambda q, k, v: (
      jax_fa3.attention(q, k, v, q_segment_ids=ids, softcap=3.0,
                        is_causal=True),
      R.attention_fwd(q, k, v, None, None, scale=1 / np.sqrt(8), softcap=3.0,
                      window_right=0, mask=mask[:, None])[0],
      jax_fa3.attention(q, k, v, q_segment_ids=ids, softcap=3.0,
                        is_causal=True, deterministic=True)))(q, k, v)
  close(a, b)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_fp8_forward_matches_emulation_with_dense_mask():
  rng = np.random.default_rng(10)
  q, k, v, _ = rand(10, B=2, T=40, S=40, N=2, K=1, H=16, dtype=jnp.bfloat16)
  ids = packed_ids(rng, 2, 40, 7)
  mask = jnp.asarray(dense_mask(ids, ids))

  @jax.jit
  def run(q, k, v):
    f8 = lambda q: jax_fa3.attention(q, k, v, q_segment_ids=ids,
                                     is_causal=True, precision="fp8")
    f16 = lambda q: jax_fa3.attention(q, k, v, q_segment_ids=ids,
                                      is_causal=True)
    q8, k8, v8, qs, ks, vs = fp8.quantize_qkv(q, k, v)
    ref, _ = fp8.emulate_fp8_attention(
        q8, k8, v8, qs, ks, vs, scale=0.25, window_right=0, mask=mask,
        out_dtype=jnp.bfloat16)
    # The straight-through gradient is the 16-bit one with the same ids.
    loss = lambda f: lambda q: f(q).astype(jnp.float32).sum()
    return (f8(q), ref, jax.grad(loss(f8))(q), jax.grad(loss(f16))(q))

  out, ref, gf, g16 = run(q, k, v)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(ref, np.float32))
  np.testing.assert_array_equal(np.asarray(gf, np.float32),
                                np.asarray(g16, np.float32))


def test_integer_dtypes_accepted():
  ids = np.array([[0] * 5 + [1] * 7, [3] * 12])
  for dt in (np.int32, np.int64, np.int8, np.uint16):
    q_ids, kv_ids = V.check_segment_ids(ids.astype(dt), None, 2, 12, 12)
    assert q_ids.dtype == kv_ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(q_ids), ids)


def test_wide_ids_must_fit_int32():
  # A 64-bit id past int32 would merge with another once cast: refused;
  # 64-bit ids that fit give the int32 answer.
  q, k, v, _ = rand(16, B=1, T=4, S=4, N=2, K=2, H=8)
  wide = np.array([[0, 0, 2**32, 2**32]], np.int64)
  with pytest.raises(ValueError, match="outside int32's range"):
    jax_fa3.attention(q, k, v, q_segment_ids=wide)
  with pytest.raises(ValueError, match="outside int32's range"):
    jax_fa3.attention(q, k, v, q_segment_ids=np.zeros((1, 4), np.int32),
                      kv_segment_ids=wide.astype(np.uint64))
  fit = np.array([[-2**31, -2**31, 2**31 - 1, 2**31 - 1]], np.int64)
  close(jax_fa3.attention(q, k, v, q_segment_ids=fit),
        jax_fa3.attention(q, k, v, q_segment_ids=fit.astype(np.int32)),
        rtol=0, atol=0)


@pytest.mark.parametrize("qi,ki,T,S,match", [
    (np.zeros((2, 12), np.float32), None, 12, 12, "integer"),
    (np.zeros((2, 12), bool), None, 12, 12, "integer"),
    (np.zeros((2, 11), np.int32), None, 12, 12, r"shape \[B, T\]"),
    (np.zeros((12,), np.int32), None, 12, 12, r"shape \[B, T\]"),
    (np.zeros((3, 12), np.int32), None, 12, 12, "batch size 3"),
    (np.zeros((2, 12), np.int32), None, 12, 20, "kv_segment_ids must be given"),
    (np.zeros((2, 12), np.int32), np.zeros((2, 12), np.int32), 12, 20,
     r"shape \[B, S\]"),
    (np.zeros((2, 12), np.int32), np.zeros((1, 20), np.int32), 12, 20,
     "batch size 1"),
    (None, np.zeros((2, 12), np.int32), 12, 12, "needs q_segment_ids"),
])
def test_validation(qi, ki, T, S, match):
  q, k, v, _ = rand(12, B=2, T=T, S=S, N=2, K=2, H=8)
  with pytest.raises(ValueError, match=match):
    jax_fa3.attention(q, k, v, q_segment_ids=qi, kv_segment_ids=ki)


@pytest.mark.parametrize("precision", [None, "fp8"])
def test_kernels_get_ids_and_spans(monkeypatch, precision):
  # As if the kernels could run: segment ids go to them (no reference
  # fallback), with the spans computed once in core.attention.
  from jax_fa3 import api, core
  monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
  monkeypatch.setattr(fp8, "fp8_kernel_blocker", lambda *a: None)
  seen = []

  def spy(q, k, v, q_lens, kv_lens, bias, mask, pairs, sinks, cfg):
    seen.append((cfg, pairs))
    a = (q,)
    return jnp.zeros(a[0].shape, a[0].dtype), None
  monkeypatch.setattr(core, "_attention_jit", spy)
  q, k, v, _ = rand(14, B=1, T=16, S=16, N=2, K=2, H=16, dtype=jnp.bfloat16)
  ids = jnp.zeros((1, 16), jnp.int32)
  jax_fa3.attention(q, k, v, q_segment_ids=ids, precision=precision,
                    implementation="fa3")
  (cfg, seg), = seen
  assert cfg.kernel and (cfg.fp8 is None or cfg.fp8.kernel)
  q_ids, kv_ids, q_spans, kv_spans = seg
  np.testing.assert_array_equal(q_ids, kv_ids)  # kv ids default to q's
  assert q_spans.shape == kv_spans.shape == (1, 1, 4)


def _spans_bruteforce(a, b):
  """NumPy spans of ``a``'s granules in ``b`` (jax_fa3.pair_rule doc)."""
  return row_spans_bruteforce(np.asarray(a)[:, None] == np.asarray(b)[None, :])


@pytest.mark.parametrize("kind", ["packed", "random", "cross", "one"])
def test_spans(kind):
  rng = np.random.default_rng(len(kind))
  if kind == "packed":
    a = b = packed_ids(rng, 1, 101, 9)[0]
  elif kind == "random":  # ids recur: no full spans for them
    a = b = rng.integers(-3, 3, 75).astype(np.int32)
  elif kind == "cross":  # some query ids have no key
    a = np.sort(rng.integers(0, 6, 50)).astype(np.int32)
    b = np.sort(rng.integers(2, 9, 83)).astype(np.int32)
  else:
    a = b = np.zeros(1, np.int32)
  q_ids, kv_ids, q_spans, kv_spans = pair_rule.from_segment_ids(
      jnp.asarray(a)[None], jnp.asarray(b)[None])
  np.testing.assert_array_equal(q_spans[0], _spans_bruteforce(a, b))
  np.testing.assert_array_equal(kv_spans[0], _spans_bruteforce(b, a))


@pytest.mark.parametrize("side", ["query", "key"])
def test_spans_of_one_side(side):
  # The side asked for is exact; the other narrows nothing: every position
  # may be seen (its spans cover the whole other side), none surely is.
  rng = np.random.default_rng(5)
  a = np.sort(rng.integers(0, 6, 50)).astype(np.int32)  # queries
  b = np.sort(rng.integers(2, 9, 83)).astype(np.int32)  # keys
  _, _, q_spans, kv_spans = pair_rule.from_segment_ids(
      jnp.asarray(a)[None], jnp.asarray(b)[None], sides=(side,))
  rows, cols = (a, b) if side == "query" else (b, a)
  asked, other = (q_spans, kv_spans) if side == "query" else (kv_spans, q_spans)
  np.testing.assert_array_equal(asked[0], _spans_bruteforce(rows, cols))
  other = np.asarray(other[0])
  assert other.shape == (-(-len(cols) // 16), 4)
  assert np.all((other[:, 0] <= 0) & (other[:, 1] >= len(rows)))
  assert np.all(other[:, 2] >= other[:, 3])  # no full span


def test_spans_with_hash_collisions():
  # Ids far apart share hash buckets: the spans may grow (never shrink) and
  # a full span may vanish (never cover a key some row does not see).
  rng = np.random.default_rng(7)
  runs = rng.integers(1, 9, 12)
  n = int(runs.sum())
  # 12 ids in 3 residue classes mod n (the bucket count for a keys side of n).
  ids = rng.integers(0, 3, 12) + n * rng.choice(
      np.arange(-1000, 1000), 12, replace=False)
  a = np.repeat(ids, runs).astype(np.int32)
  b = a[rng.permutation(n)][: n - 5]
  for x, y in ((a, a), (a, b), (b, a)):
    want = _spans_bruteforce(x, y)
    _, _, got, _ = pair_rule.from_segment_ids(jnp.asarray(x)[None],
                                              jnp.asarray(y)[None])
    got = np.asarray(got[0])
    seen = want[:, 0] < want[:, 1]
    assert np.all(~seen | ((got[:, 0] <= want[:, 0]) & (got[:, 1] >= want[:, 1])))
    full = got[:, 2] < got[:, 3]
    assert np.all(~full | ((got[:, 2] >= want[:, 2]) & (got[:, 3] <= want[:, 3])))
  assert len(set(np.remainder(a, n).tolist())) < len(set(a.tolist()))


@pytest.mark.parametrize("causal", [False, True])
def test_primitive_path_on_cpu(monkeypatch, causal):
  # The kernels' path (core -> sharding -> primitives with the segment
  # operands) lowers to the reference on XLA:CPU: it must equal the
  # reference path, forward and gradients, also under vmap.
  from jax_fa3 import api
  rng = np.random.default_rng(3)
  q, k, v, w = rand(3, B=2, T=40, S=40, N=4, K=2, H=16, dtype=jnp.bfloat16)
  ids = jnp.asarray(packed_ids(rng, 2, 40, 5))

  def run(impl):
    att = lambda q, k, v, ids: jax_fa3.attention(  # noqa: E731
        q, k, v, is_causal=causal, q_segment_ids=ids, implementation=impl)

    def f(q, k, v, ids):
      out, vjp = jax.vjp(lambda q, k, v: att(q, k, v, ids), q, k, v)
      return out, vjp(w.astype(out.dtype))
    return jax.jit(f)(q, k, v, ids), jax.jit(jax.vmap(att))(
        q[:, None], k[:, None], v[:, None], ids[:, None])

  want, want_v = run("reference")
  monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
  hlo = jax.jit(lambda q, k, v, ids: jax_fa3.attention(
      q, k, v, q_segment_ids=ids, implementation="fa3")).lower(
          q, k, v, ids).as_text()
  assert "scatter" in hlo  # the spans pre-pass ran
  got, got_v = run("fa3")
  close_trees((got, got_v), (want, want_v), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("part", ["shardy", "gspmd"])
def test_ids_sharded_in_small_sequence_shards(monkeypatch, part):
  # Ids sharded along the sequence in shards shorter than a span granule
  # (8 of 32 positions per device): the pre-pass computes spans whole per
  # batch shard (Shardy would otherwise hand the kernels granules split in
  # pieces); a sequence-sharded call rings, each step with its pieces' spans.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_fa3 import api
  cpus = jax.devices("cpu")
  if len(cpus) < 4:
    pytest.skip("needs 4 CPU devices")
  with partitioner(part):
    monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
    mesh = Mesh(np.array(cpus[:4]), ("x",))
    q, k, v, w = rand(17, B=2, T=32, S=32, N=4, K=2, H=8, dtype=jnp.bfloat16)
    ids = jnp.asarray(packed_ids(np.random.default_rng(17), 2, 32, 4))
    f = out_and_grads(lambda q, k, v, ids: jax_fa3.attention(
        q, k, v, q_segment_ids=ids, is_causal=True), w)
    want, want_g = f(q, k, v, ids)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    for qs in (P(), P(None, "x")):
      got, got_g = f(*(put(x, qs) for x in (q, k, v)), put(ids, P(None, "x")))
      close(np.asarray(got, np.float32), np.asarray(want, np.float32),
            rtol=1e-2, atol=1e-2)
      close_trees(got_g, want_g, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("layout", ["batch_gqa_heads", "batch_sequence"])
@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_sharded_with_gradients(monkeypatch, path, layout):
  # Under jit over a mesh, forward and gradients equal the unsharded call:
  # the ids shard with their rows. Batch x heads (GQA: each shard keeps whole
  # query-head groups): the kernels' partition keeps q, k and v where they
  # are (no all-gather in the compiled program). Batch x sequence: the
  # kernels ring over the sequence (K/V and the key side's ids rotate); only
  # the int32 ids are gathered, for the spans pre-pass.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_fa3 import api
  cpus = jax.devices("cpu")
  if len(cpus) < 4:
    pytest.skip("needs 4 CPU devices")
  mesh = Mesh(np.array(cpus[:4]).reshape(2, 2), ("d", "t"))
  rng = np.random.default_rng(16)
  dtype = jnp.float32
  if path == "kernel":  # bf16 through the primitives (reference lowering)
    monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
    dtype = jnp.bfloat16
  q, k, v, w = rand(16, B=2, T=40, S=40, N=4, K=2, H=8, dtype=dtype)
  ids = jnp.asarray(packed_ids(rng, 2, 40, 5))

  f = out_and_grads(lambda q, k, v, ids: jax_fa3.attention(
      q, k, v, q_segment_ids=ids, is_causal=True), w)
  want, want_g = f(q, k, v, ids)
  spec = P("d", None, "t") if layout == "batch_gqa_heads" else P("d", "t")
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  args = (*(put(x, spec) for x in (q, k, v)), put(ids, P(*spec[:2])))
  got, got_g = f(*args)
  tol, grad_tol = (1e-5, 1e-5) if dtype == jnp.float32 else (1e-2, 2e-2)
  close(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol,
        atol=tol)
  close_trees(got_g, want_g, rtol=grad_tol, atol=grad_tol)
  if path == "kernel":
    hlo = f.lower(*args).compile().as_text()
    gathers = [line for line in hlo.splitlines() if "all-gather(" in line]
    if layout == "batch_gqa_heads":
      assert not gathers
    else:
      assert "collective-permute" in hlo
      assert gathers and all(" s32[" in g for g in gathers), gathers

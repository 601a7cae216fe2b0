"""Sharding: custom_partitioning rules, ring attention, a sharded Flax step.

Runs on 8 virtual CPU devices (conftest sets the XLA flag before JAX starts),
where the kernel primitives lower to the reference, so every layout is checked
against the unsharded computation anywhere.  The ``gpu`` tests at the end run
the ring on the FFI kernels of one GPU (the ring axis emulated with
``vmap(axis_name=...)``).
"""
import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fa3_testing import close, packed_ids, partitioner  # noqa: F401
from host_reference import assert_fa3_tolerance
import jax_fa3
from jax_fa3 import _native, core, primitives, ring, sharding

CPUS = jax.devices("cpu")
pytestmark = pytest.mark.skipif(
    len(CPUS) < 8, reason="needs 8 CPU devices "
    "(XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts)")

B, T, N, H = 2, 32, 4, 8
TOL = dict(rtol=2e-5, atol=2e-5)


def _kernel_attention(q, k, v, q_lens, kv_lens, scale, softcap, wl, wr,
                      sinks=None, bias=None):
  """The kernel path of the core (on CPU its primitives lower to the
  reference), partitioned under a sharded jit."""
  cfg = core.Config(scale, softcap, wl, wr, kernel=True)
  return core.attention(q, k, v, q_lens, kv_lens, bias, None, cfg,
                        sinks=sinks)


def _mesh(shape, names):
  return Mesh(np.array(CPUS[:int(np.prod(shape))]).reshape(shape), names)


def _inputs(seed, K=2, S=T, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.float32).astype(dtype)
  w = jax.random.normal(ks[3], (B, T, N, H), jnp.float32)
  q_lens = jnp.array([T, 19], jnp.int32)
  kv_lens = jnp.array([S - 5, S], jnp.int32)
  return q, k, v, w, q_lens, kv_lens


def _check_lse(a, b):
  a, b = np.asarray(a), np.asarray(b)
  np.testing.assert_array_equal(np.isinf(a), np.isinf(b))
  fin = np.isfinite(b)
  np.testing.assert_allclose(a[fin], b[fin], **TOL)


# ------------------------------------------------- custom_partitioning rules
M3 = ("d", "t", "s")  # a 2 x 2 x 2 mesh
LAYOUTS = [
    # (id, q spec, k/v spec, K, S, causal, window_left, softcap)
    ("batch", P("d"), P("d"), 2, T, True, -1, 0.0),
    ("heads_gqa", P(None, None, "t"), P(None, None, "t"), 2, T, True, -1, 0.0),
    ("heads_4way_k2", P(None, None, ("t", "s")), P(), 2, T, False, -1, 0.0),
    ("heads_mqa", P(None, None, "t"), P(), 1, T, True, -1, 0.0),
    ("seq_ring_causal", P(None, "s"), P(None, "s"), 2, T, True, -1, 0.0),
    ("seq_ring_kv_repl", P(None, "s"), P(), 2, T, False, -1, 3.0),
    ("seq_ring_t_ne_s", P(None, "s"), P(None, "s"), 2, 48, False, -1, 0.0),
    ("batch_seq_heads", P("d", "s", "t"), P("d", "s", "t"), 2, T, True, -1,
     0.0),
    ("kv_heads_vs_q_seq", P(None, "s"), P(None, None, "t"), 2, T, True, -1,
     0.0),
    ("seq_two_axes_ring", P(None, ("t", "s")), P(None, ("t", "s")), 2, T, True,
     -1, 0.0),
    ("seq_two_axes_unordered", P(None, ("s", "t")), P(None, ("s", "t")), 2, T,
     False, -1, 0.0),
    ("seq_window", P(None, "s"), P(None, "s"), 2, T, True, 5, 0.0),
    ("head_dim", P(None, None, None, "t"), P(None, None, None, "t"), 2, T,
     False, -1, 0.0),
]


def _run_layout(qs, kvs, K, S, causal, wl, softcap, seed=0, sinks=False,
                hv=None, bias=None):
  mesh = _mesh((2, 2, 2), M3)
  q, k, v, w, ql, kl = _inputs(seed, K=K, S=S)
  if hv is not None:  # a value head dim unlike q's (v, out: their own factor)
    v, w = v[..., :hv], w[..., :hv]
  wr = 0 if causal else -1
  snk = jnp.linspace(-1.0, 2.0, N, dtype=jnp.float32) if sinks else None
  # Differentiated inputs: q, k, v (and the sinks or the bias when given).
  extra = (snk,) if sinks else ()
  if bias is not None:  # a bias shape with T and S filled in
    shape = tuple(T if d == "T" else S if d == "S" else d for d in bias)
    extra = (jax.random.normal(jax.random.key(seed + 7), shape),)
  args = (q, k, v) + extra
  argnums = tuple(range(len(args)))

  def fwd(impl):
    def f(q, k, v, *s):
      kw = {"bias" if bias is not None else "sinks": s[0]} if s else {}
      return impl(q, k, v, ql, kl, 0.35, softcap, wl, wr, **kw)
    return f

  def loss(impl):
    return lambda *a: jnp.sum(fwd(impl)(*a)[0] * w)

  with jax.default_device(CPUS[0]):
    ref_o, ref_l = jax.jit(fwd(_kernel_attention))(*args)
    ref_g = jax.jit(jax.grad(loss(_kernel_attention), argnums=argnums))(*args)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  qq, kk, vv = put(q, qs), put(k, kvs), put(v, kvs)
  sharded = (qq, kk, vv) + tuple(put(x, P()) for x in extra)
  o, l = jax.jit(fwd(_kernel_attention))(*sharded)
  g = jax.jit(jax.grad(loss(_kernel_attention), argnums=argnums))(*sharded)
  np.testing.assert_allclose(np.asarray(o), np.asarray(ref_o), **TOL)
  _check_lse(l, ref_l)
  for a, b in zip(g, ref_g):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
  return jax.jit(fwd(_kernel_attention)).lower(*sharded).as_text()


@pytest.mark.parametrize("case", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_partitioned_equals_unsharded(case):
  _run_layout(*case[1:])


_SINK_LAYOUTS = [c for c in LAYOUTS if c[0] in (
    "batch", "heads_gqa", "heads_mqa", "seq_ring_causal", "batch_seq_heads")]


@pytest.mark.parametrize("case", _SINK_LAYOUTS, ids=[c[0] for c in _SINK_LAYOUTS])
def test_partitioned_sinks_equal_unsharded(case):
  # The sinks follow the query heads; on a sequence ring they join once.
  _run_layout(*case[1:], sinks=True)


_BIAS_LAYOUTS = [c for c in LAYOUTS if c[0] in (
    "batch", "heads_gqa", "heads_mqa", "seq_ring_causal", "batch_seq_heads")]


@pytest.mark.parametrize("bias", [(1, N, "T", "S"), (B, 1, "T", "S"),
                                  (B, N, "T", "S")],
                         ids=["heads", "batch", "full"])
@pytest.mark.parametrize("case", _BIAS_LAYOUTS, ids=[c[0] for c in _BIAS_LAYOUTS])
def test_partitioned_bias_equals_unsharded(case, bias):
  # A bias follows the batch and heads it has (a sequence is gathered); its
  # gradient is summed over the dims it broadcasts over, across shards too.
  _run_layout(*case[1:], bias=bias)


@pytest.mark.parametrize("bias_spec", [P("d", "t", "s"), P("d", "t", None, "s")],
                         ids=["bias_t", "bias_s"])
def test_sequence_sharded_bias_leaves_q_out_and_grads_alone(bias_spec):
  # A bias sharded along a sequence while q, k, v are not: the partition
  # gathers the bias alone (its sequence is replicated there); Shardy must
  # not carry that sharding onto out, lse and the gradients (the backward
  # then gathered out, dout and lse).
  import re
  mesh = _mesh((2, 2, 2), M3)
  q, k, v, w, ql, kl = _inputs(9, K=N)
  bias = jax.random.normal(jax.random.key(10), (B, N, T, T))
  f = lambda q, k, v, b: _kernel_attention(q, k, v, ql, kl, 0.35, 0.0, -1, 0,
                                           bias=b)
  grad = jax.grad(lambda *a: jnp.sum(f(*a)[0] * w), argnums=(0, 1, 2, 3))
  with jax.default_device(CPUS[0]):
    want = jax.jit(grad)(q, k, v, bias)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  qs = P("d", None, "t")
  args = (put(q, qs), put(k, qs), put(v, qs), put(bias, bias_spec))
  compiled = jax.jit(grad).lower(*args).compile()
  got = compiled(*args)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
  for g in got[:3]:
    assert g.sharding.spec == NamedSharding(mesh, qs).spec, g.sharding
  gathered = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(",
                        compiled.as_text())
  assert gathered == ["1,2,32,32"], gathered  # the bias's shard, no more


_VALUE_LAYOUTS = [c for c in LAYOUTS if c[0] in (
    "batch", "heads_gqa", "heads_mqa", "seq_ring_causal", "seq_ring_t_ne_s")]


@pytest.mark.parametrize("case", _VALUE_LAYOUTS, ids=[c[0] for c in _VALUE_LAYOUTS])
def test_partitioned_value_head_dim_equals_unsharded(case):
  # Outputs and gradients (dv on Hv), on the sequence ring too.
  _run_layout(*case[1:], hv=H // 2)


@pytest.mark.parametrize("case", [LAYOUTS[0], LAYOUTS[4], LAYOUTS[7]],
                         ids=["batch", "seq_ring_causal", "batch_seq_heads"])
def test_partitioned_equals_unsharded_gspmd(case):
  with partitioner("gspmd"):
    _run_layout(*case[1:], seed=1)


def test_plan_serves_batch_heads_and_ring_locally():
  """The plan keeps what the kernel can serve (no gather of q's shards)."""
  mesh = _mesh((2, 2, 2), M3)
  mk = lambda spec, K=2, wl=-1, wr=0: sharding.Plan(
      mesh, NamedSharding(mesh, spec), (B, T, N, H), (B, T, K, H), wl, wr)
  p = mk(P("d", "s", "t"))
  assert (p.b, p.t, p.n, p.p) == (("d",), ("s",), ("t",), 2)
  assert p.q.spec == P("d", "s", "t", None)
  assert p.lse.spec == P("d", "t", "s")
  assert mk(P(None, None, "t"), K=1).n == ()       # MQA: heads replicated
  assert mk(P(None, "s"), wl=5).t == ()            # window: no ring
  assert mk(P(None, ("t", "s"))).t == ("t", "s")   # mesh order: ring
  assert mk(P(None, ("s", "t"))).t == ()           # other order: replicated


def test_vmap_through_partitioned_call():
  q, k, v, w, ql, kl = _inputs(3)
  qb, kb, vb = (jnp.stack([x, x[::-1]]) for x in (q, k, v))
  f = lambda impl: (lambda q, k, v: impl(q, k, v, ql, kl, 0.3, 0.0, -1, 0)[0])
  with jax.default_device(CPUS[0]):
    fn = f(_kernel_attention)
    a = jax.vmap(fn)(qb, kb, vb)
    b = jnp.stack([fn(qb[i], kb[i], vb[i]) for i in range(2)])
    grad = jax.grad(lambda q: fn(q, k, v).sum())
    ga = jax.vmap(grad)(qb)
    gb = jnp.stack([grad(qb[i]) for i in range(2)])
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)
  np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), **TOL)


# ------------------------------------------------------------ shard_map use
def test_attention_per_shard_in_shard_map():
  """jax_fa3.attention (and the partitioned call) work per shard."""
  mesh = _mesh((4,), ("x",))
  q, k, v, w, ql, kl = _inputs(4)
  q, k, v = (jnp.concatenate([x, x[::-1]]) for x in (q, k, v))  # batch 4
  spec = P("x")

  def per_shard(q, k, v):
    a = jax_fa3.attention(q, k, v, is_causal=True)
    b, _ = _kernel_attention(q, k, v, jnp.full((1,), T, jnp.int32),
                                  jnp.full((1,), T, jnp.int32),
                                  1 / np.sqrt(H), 0.0, -1, 0)
    return a, b

  sm = jax.shard_map(per_shard, mesh=mesh, in_specs=(spec,) * 3,
                     out_specs=(spec, spec))  # check_vma=True (default)
  a, b = jax.jit(sm)(q, k, v)
  g = jax.jit(jax.grad(lambda q: sum(jnp.sum(o) for o in sm(q, k, v))))(q)
  with jax.default_device(CPUS[0]):
    ref = jax_fa3.attention(q, k, v, is_causal=True)
    g_ref = 2 * jax.grad(
        lambda q: jnp.sum(jax_fa3.attention(q, k, v, is_causal=True)))(q)
  np.testing.assert_allclose(np.asarray(a), np.asarray(ref), **TOL)
  np.testing.assert_allclose(np.asarray(b), np.asarray(ref), **TOL)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), **TOL)


@pytest.mark.parametrize("fn", ["attention", "ring"])
def test_gradient_of_an_eager_shard_map(fn):
  """jax.grad of a shard_map that is not jitted (JAX runs its body eagerly,
  where a custom_vjp with symbolic zeros is not supported) equals the jitted
  one."""
  mesh = _mesh((2,), ("x",))
  q, k, v, w, ql, kl = _inputs(6)
  if fn == "ring":
    spec = P(None, "x")
    f = lambda q, k, v: jax_fa3.ring_attention(q, k, v, axis_name="x",
                                               is_causal=True)
  else:
    spec = P("x")
    f = lambda q, k, v: jax_fa3.attention(q, k, v, is_causal=True)
  sm = jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
  grad = jax.grad(lambda q, k, v: jnp.sum(sm(q, k, v) * w), argnums=(0, 1, 2))
  for a, b in zip(grad(q, k, v), jax.jit(grad)(q, k, v)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_ring_second_order_on_the_kernels_is_a_value_error(monkeypatch):
  from jax_fa3 import api
  monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
  mesh = _mesh((2,), ("sp",))
  q = _inputs(8, dtype=jnp.bfloat16)[0]
  sm = jax.shard_map(
      lambda q: jax_fa3.ring_attention(q, q, q, axis_name="sp", is_causal=True,
                                       implementation="fa3"),
      mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"))
  f = lambda q: jnp.sum(sm(q).astype(jnp.float32))
  assert jax.jit(jax.grad(f))(q).shape == q.shape  # first order: the kernels
  with pytest.raises(ValueError, match="implementation='reference'"):
    jax.jit(jax.grad(lambda q: jnp.sum(jax.grad(f)(q).astype(jnp.float32)
                                       ** 2)))(q)


def test_gqa_heads_over_an_axis_wider_than_the_kv_heads():
  # q's 4 heads over one 4-device axis, 2 kv heads: k cannot take part of
  # that axis (the rule keeps q's heads apart from k's; the plan replicates).
  mesh = _mesh((4,), ("x",))
  q, k, v, w, ql, kl = _inputs(6, K=2)
  f = lambda q, k, v: _kernel_attention(q, k, v, ql, kl, 0.35, 0.0, -1, 0)[0]
  grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2))
  with jax.default_device(CPUS[0]):
    ref = (jax.jit(f)(q, k, v),) + jax.jit(grad)(q, k, v)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  args = (put(q, P(None, None, "x")), put(k, P()), put(v, P()))
  got = (jax.jit(f)(*args),) + jax.jit(grad)(*args)
  for a, b in zip(got, ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("bias_spec", ["replicated", "heads"])
def test_bias_gradient_in_shard_map(kernel, bias_spec):
  # Heads split by shard_map: a replicated bias's gradient sums every
  # shard's heads; a head-sharded one stays per shard, typed as such.
  mesh = _mesh((4,), ("x",))
  q, k, v, w, ql, kl = _inputs(7, K=N)
  shape = (1, 1, T, T) if bias_spec == "replicated" else (B, N, T, T)
  bias = jax.random.normal(jax.random.key(8), shape)
  cfg = core.Config(0.35, 0.0, -1, -1, kernel=kernel)
  attn = lambda q, k, v, b: core.attention(q, k, v, ql, kl, b, None, cfg)[0]
  heads = P(None, None, "x")
  sm = jax.shard_map(attn, mesh=mesh, out_specs=heads, in_specs=(heads,) * 3 + (
      P() if bias_spec == "replicated" else P(None, "x"),))
  grad = lambda f: jax.grad(lambda q, k, v, b: jnp.sum(f(q, k, v, b) * w),
                            argnums=(0, 3))
  with jax.default_device(CPUS[0]):
    ref = jax.jit(grad(attn))(q, k, v, bias)
  got = jax.jit(grad(sm))(q, k, v, bias)
  for a, b in zip(got, ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


# ------------------------------------------------------------ ring attention
def _ring_vs_full(layout, causal, n_dev=4, K=2, S=T, dtype=jnp.float32,
                  lens=True, seed=5, docs=None):
  """Outputs and gradients of jax_fa3.attention on the whole sequence and of
  ring_attention over ``n_dev`` devices; ``docs``: that many packed
  documents per row (segment ids, the key side's own packing when S != T)."""
  mesh = _mesh((n_dev,), ("sp",))
  q, k, v, w, ql, kl = _inputs(seed, K=K, S=S, dtype=dtype)
  if not lens:
    ql = kl = None
  zz = layout == "zigzag"
  kw = dict(is_causal=causal, query_seq_lengths=ql, key_value_seq_lengths=kl)
  ids = ()
  if docs is not None:
    rng = np.random.default_rng(seed)
    q_ids = packed_ids(rng, B, T, docs)
    ids = (jnp.asarray(q_ids), jnp.asarray(
        q_ids if S == T else packed_ids(rng, B, S, docs)))

  def full(q, k, v, *ids):
    seg = dict(zip(("q_segment_ids", "kv_segment_ids"), ids))
    return jax_fa3.attention(q, k, v, **kw, **seg)

  def ringed(q, k, v, *ids):
    if zz:
      q, k, v = (ring.to_zigzag(x, n_dev) for x in (q, k, v))
      ids = tuple(ring.to_zigzag(x, n_dev) for x in ids)
    spec = P(None, "sp")
    f = jax.shard_map(
        lambda q, k, v, *ids: jax_fa3.ring_attention(
            q, k, v, axis_name="sp", layout=layout, **kw,
            **dict(zip(("q_segment_ids", "kv_segment_ids"), ids))),
        mesh=mesh, in_specs=(spec,) * (3 + len(ids)), out_specs=spec)
    o = f(q, k, v, *ids)
    return ring.from_zigzag(o, n_dev) if zz else o

  loss = lambda f: (lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w))
  with jax.default_device(CPUS[0]):
    a = jax.jit(full)(q, k, v, *ids)
    ga = jax.jit(jax.grad(loss(full), argnums=(0, 1, 2)))(q, k, v, *ids)
  b = jax.jit(ringed)(q, k, v, *ids)
  gb = jax.jit(jax.grad(loss(ringed), argnums=(0, 1, 2)))(q, k, v, *ids)
  return (a,) + tuple(ga), (b,) + tuple(gb)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_equals_full(layout, causal):
  want, got = _ring_vs_full(layout, causal)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_ring_attention_t_ne_s_mqa():
  want, got = _ring_vs_full("contiguous", False, n_dev=2, K=1, S=48)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_ring_attention_bf16_zigzag_8dev():
  want, got = _ring_vs_full("zigzag", True, n_dev=8, dtype=jnp.bfloat16,
                            lens=False)
  for a, b in zip(got, want):  # per-step bf16 partials: bf16-level agreement
    np.testing.assert_allclose(np.asarray(a, np.float32),
                               np.asarray(b, np.float32), rtol=2e-2,
                               atol=2e-2)


@pytest.mark.parametrize("path", ["reference", "kernel"])
@pytest.mark.parametrize("layout,causal,K,S", [
    ("contiguous", False, 2, T), ("contiguous", True, 2, T),
    ("zigzag", True, 2, T), ("zigzag", False, 1, T),
    ("contiguous", False, 1, 48)])
def test_ring_attention_segment_ids(monkeypatch, path, layout, causal, K, S):
  # Packed rows (7 documents, one of length 1) over a 4-device ring: every
  # step sees the ids of exactly its rows and keys (the key side's travel
  # with K/V), so the ring equals the unsharded call, forward and gradients.
  # "kernel": the primitives' path (each step's spans pre-pass included),
  # which XLA:CPU lowers to the reference.
  if path == "kernel":
    monkeypatch.setattr(jax_fa3.api.V, "kernel_blocker", lambda *a: None)
  want, got = _ring_vs_full(layout, causal, K=K, S=S, docs=7, seed=11)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def test_ring_attention_segment_ids_errors():
  q = jnp.zeros((1, 8, 2, 8))
  mesh = _mesh((2,), ("sp",))
  spec = P(None, "sp")

  def run(ids, kv_ids=None, k=q):
    f = lambda q, k, v: jax_fa3.ring_attention(
        q, k, v, axis_name="sp", q_segment_ids=ids, kv_segment_ids=kv_ids)
    return jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                         check_vma=False)(q, k, k)
  with pytest.raises(ValueError, match=r"q_segment_ids must have shape"):
    run(jnp.zeros((1, 8), jnp.int32))  # the global length, not the shard's
  with pytest.raises(ValueError, match="kv_segment_ids must be given"):
    run(jnp.zeros((1, 4), jnp.int32), k=jnp.zeros((1, 16, 2, 8)))
  with pytest.raises(ValueError, match="integer"):
    run(jnp.zeros((1, 4), jnp.float32))


def test_zigzag_helpers():
  x = jnp.arange(16)[None, :, None]
  z = ring.to_zigzag(x, 4)
  # device r holds chunks r and 2P-1-r (chunk size 2)
  np.testing.assert_array_equal(np.asarray(z[0, :4, 0]), [0, 1, 14, 15])
  np.testing.assert_array_equal(np.asarray(z[0, 4:8, 0]), [2, 3, 12, 13])
  np.testing.assert_array_equal(np.asarray(ring.from_zigzag(z, 4)),
                                np.asarray(x))
  with pytest.raises(ValueError, match="multiple of 2"):
    ring.to_zigzag(jnp.zeros((1, 10)), 4)
  for n in (0, -1, 2.0, True):
    with pytest.raises(ValueError, match="num_shards"):
      ring.to_zigzag(x, n)
  with pytest.raises(ValueError, match="axis"):
    ring.from_zigzag(x, 4, axis=3)
  np.testing.assert_array_equal(  # a negative axis counts from the end
      np.asarray(ring.to_zigzag(x, 4, axis=-2)), np.asarray(z))


def test_ring_attention_errors():
  q = jnp.zeros((1, 8, 2, 8))
  k = jnp.zeros((1, 4, 2, 8))
  mesh = _mesh((2,), ("sp",))
  sm = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P(None, "sp"),) * 3,
                               out_specs=P(None, "sp"), check_vma=False)
  with pytest.raises(ValueError, match="layout"):
    sm(lambda q, k, v: jax_fa3.ring_attention(q, k, v, axis_name="sp",
                                              layout="striped"))(q, q, q)
  with pytest.raises(ValueError, match="equal query and key"):
    sm(lambda q, k, v: jax_fa3.ring_attention(q, k, v, axis_name="sp",
                                              is_causal=True))(q, k, k)
  with pytest.raises(ValueError, match="even local"):
    q6 = jnp.zeros((1, 6, 2, 8))
    sm(lambda q, k, v: jax_fa3.ring_attention(q, k, v, axis_name="sp",
                                              layout="zigzag"))(q6, q6, q6)
  with pytest.raises(ValueError, match="inside shard_map"):
    jax_fa3.ring_attention(q, q, q, axis_name="sp")
  with pytest.raises(ValueError, match="axis_name must be"):
    sm(lambda q, k, v: jax_fa3.ring_attention(q, k, v, axis_name=["sp"]))(
        q, q, q)
  with pytest.raises(ValueError, match="axis_name must be"):  # not a 1-ring
    sm(lambda q, k, v: jax_fa3.ring_attention(q, k, v, axis_name=()))(q, q, q)
  with pytest.raises(ValueError, match="return_lse must be a bool"):
    sm(lambda q, k, v: jax_fa3.ring_attention(q, k, v, axis_name="sp",
                                              return_lse="no"))(q, q, q)


# --------------------------------------------------------------------- FP8
@pytest.fixture
def fp8_kernels(monkeypatch):
  """_native reporting bf16 d64 kernels (16-bit and FP8) and an sm_90 GPU,
  so precision="fp8" takes the kernel path (the partitioned primitives);
  on CPU devices those lower to the reference and the FP8 emulation."""
  cfg = frozenset({("bfloat16", 64)})
  monkeypatch.setattr(_native, "_jax_fa3", _native._jax_fa3 or object())
  for name in ("_CONFIGS", "_BWD_CONFIGS", "_FP8_CONFIGS"):
    monkeypatch.setattr(_native, name, cfg)
  monkeypatch.setattr(_native, "_SM90", True)


FP8_SPECS = [("batch", P("d")), ("heads", P(None, None, ("t", "s"))),
             ("batch_heads", P("d", None, "t"))]


def _fp8_inputs():
  q, k, v, *_ = _inputs(7, K=4, S=256, dtype=jnp.bfloat16)
  q = jnp.concatenate([q] * 8, axis=1)  # T = 256: two query scale blocks
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, 64 - H)))
  return pad(q), pad(k), pad(v)


def _fp8_attention(q, k, v):
  return jax_fa3.attention(q, k, v, precision="fp8", is_causal=True)


@pytest.mark.parametrize("case", FP8_SPECS, ids=[c[0] for c in FP8_SPECS])
def test_fp8_kernel_path_keeps_batch_and_head_sharding(fp8_kernels, case):
  mesh = _mesh((2, 2, 2), M3)
  q, k, v = _fp8_inputs()
  with jax.default_device(CPUS[0]):
    want = jax.jit(_fp8_attention)(q, k, v)
  xs = [jax.device_put(x, NamedSharding(mesh, case[1])) for x in (q, k, v)]
  # For CUDA: both FP8 kernels sit behind their partitioning rule.
  cuda = jax.jit(_fp8_attention).trace(*xs).lower(
      lowering_platforms=("cuda",)).as_text()
  assert cuda.count("@CustomSPMDPartitioning") == 2, cuda
  assert "jax_fa3_fp8" not in cuda  # no bare (unpartitioned) kernel call
  # On CPU (the same partitioning, emulated kernels): no gather of Q/K/V.
  compiled = jax.jit(_fp8_attention).lower(*xs).compile()
  hlo = compiled.as_text()
  assert "all-gather" not in hlo, [l for l in hlo.splitlines()
                                   if "all-gather" in l][:4]
  got = compiled(*xs)
  assert got.sharding.spec == NamedSharding(mesh, case[1]).spec
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want, np.float32))


def test_fp8_kernel_path_sequence_sharded_is_gathered(fp8_kernels):
  mesh = _mesh((2, 2, 2), M3)
  q, k, v = _fp8_inputs()
  with jax.default_device(CPUS[0]):
    want = jax.jit(_fp8_attention)(q, k, v)
    g_want = jax.jit(jax.grad(lambda q: jnp.sum(
        _fp8_attention(q, k, v).astype(jnp.float32))))(q)
  xs = [jax.device_put(x, NamedSharding(mesh, P("d", "s"))) for x in (q, k, v)]
  got = jax.jit(_fp8_attention)(*xs)
  g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
      _fp8_attention(q, k, v).astype(jnp.float32))))(*xs)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want, np.float32))
  np.testing.assert_allclose(np.asarray(g, np.float32),
                             np.asarray(g_want, np.float32), rtol=2e-2,
                             atol=2e-2)


@pytest.mark.parametrize("case", FP8_SPECS, ids=[c[0] for c in FP8_SPECS])
def test_fp8_reference_sharded_equals_unsharded(case):
  mesh = _mesh((2, 2, 2), M3)
  q, k, v = _fp8_inputs()
  f = lambda q, k, v: jax_fa3.attention(q, k, v, precision="fp8",
                                        implementation="reference")
  with jax.default_device(CPUS[0]):
    want = jax.jit(f)(q, k, v)
  xs = [jax.device_put(x, NamedSharding(mesh, case[1])) for x in (q, k, v)]
  got = jax.jit(f)(*xs)
  np.testing.assert_allclose(np.asarray(got, np.float32),
                             np.asarray(want, np.float32), rtol=1e-2,
                             atol=1e-2)


# ------------------------------------------------------ Flax training step
flax = pytest.importorskip("flax")


@pytest.mark.parametrize("attention", ["fa3", "xla"])
def test_sharded_flax_train_step_matches_single_device(attention):
  # xla: the demo's baseline under a context axis (sequence gathered in
  # shard_map, natural order) must train exactly like one device too.
  from jax_fa3 import demo
  args = demo.parse_args(["--steps", "2", "--seq-len", "32", "--batch", "4",
                      "--layers", "1", "--period", "8"], on_gpu=False)

  def run(data, tensor, context, devices):
    args.data, args.tensor, args.context = data, tensor, context
    mesh = Mesh(np.array(devices).reshape(data, tensor, context),
                ("data", "tensor", "context"))
    _, init_fn, step_fn, data_sh = demo.make_train_step(args, mesh,
                                                        attention)
    n_ctx = context if attention == "fa3" else 1  # as demo.train
    losses = []
    state = None
    for i in range(2):
      x, y, pos, w = (jax.device_put(a, data_sh)
                      for a in demo.make_batch(args, None, i, n_ctx))
      if state is None:
        state = init_fn(jax.random.key(0), x, pos)
      state, loss = step_fn(state, x, y, pos, w)
      losses.append(float(loss))
    return losses

  single = run(1, 1, 1, CPUS[:1])
  sharded = run(2, 2, 2, CPUS[:8])  # data x tensor x context (ring, zigzag)
  np.testing.assert_allclose(sharded, single, rtol=2e-5)
  assert single[1] < single[0] + 1.0  # trained, finite


# --------------------------------------------------------- one GPU (kernels)
def _vmapped_ring(q, k, v, n_dev, layout, causal, ids=None):
  """The ring on one device: the shards are a vmapped named axis; ``ids``:
  segment ids [B, T] of q and k/v, or None."""
  Bq = q.shape[0]
  zz = layout == "zigzag"
  split = lambda x: jnp.moveaxis(
      (ring.to_zigzag(x, n_dev) if zz else x).reshape(
          (Bq, n_dev, x.shape[1] // n_dev) + x.shape[2:]), 1, 0)
  o = jax.vmap(lambda a, b, c, *i: jax_fa3.ring_attention(
      a, b, c, axis_name="sp", is_causal=causal, layout=layout,
      q_segment_ids=i[0] if i else None),
      axis_name="sp")(split(q), split(k), split(v),
                      *(() if ids is None else (split(ids),)))
  o = jnp.moveaxis(o, 0, 1).reshape(q.shape)
  return ring.from_zigzag(o, n_dev) if zz else o


@pytest.mark.gpu
@pytest.mark.parametrize("layout,causal,docs", [
    ("contiguous", False, None), ("zigzag", True, None),
    ("zigzag", True, 7), ("contiguous", False, 31)])
def test_gpu_ring_kernels_vs_fp32(layout, causal, docs):
  """Ring on the FFI kernels (bf16, d128, GQA; ``docs`` packed documents per
  row as segment ids): error <= 2x (fwd) / 3x (bwd) of XLA attention in
  bf16 (with the ids' dense mask), both against an fp32 reference."""
  gpu = jax.devices("gpu")[0]
  ks = jax.random.split(jax.random.key(0), 4)
  shp_q, shp_k = (2, 2048, 8, 128), (2, 2048, 2, 128)
  ids = None if docs is None else jnp.asarray(packed_ids(3, 2, 2048, docs))
  mask = None if ids is None else (ids[:, :, None] == ids[:, None, :])[:, None]
  with jax.default_device(gpu):
    q = jax.random.normal(ks[0], shp_q).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], shp_k).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], shp_k).astype(jnp.bfloat16)
    w = jax.random.normal(ks[3], shp_q)
    f32 = lambda *a: tuple(x.astype(jnp.float32) for x in a)

    def xla(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, mask=mask,
                                          is_causal=causal,
                                          implementation="xla")

    ours = lambda q, k, v: _vmapped_ring(q, k, v, 4, layout, causal, ids)
    loss = lambda f: (lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w))
    run = lambda f, *a: (jax.jit(f)(*a),) + tuple(
        jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(*a))
    with jax.default_matmul_precision("highest"):
      ref = run(xla, *f32(q, k, v))
    base = run(xla, q, k, v)
    got = run(ours, q, k, v)
  assert_fa3_tolerance(got, base, ref, names=("out", "dq", "dk", "dv"))


@pytest.mark.gpu
def test_gpu_partitioned_call_single_device():
  gpu = jax.devices("gpu")[0]
  with jax.default_device(gpu):
    q, k, v, w, ql, kl = _inputs(6, dtype=jnp.bfloat16)
    q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, 64 - H)))
               for x in (q, k, v))
    f = lambda impl: jax.jit(lambda *a: impl(*a, ql, kl, 0.3, 0.0, -1, 0))
    a = f(_kernel_attention)(q, k, v)
    b = jax.jit(lambda *a: primitives.fa3_fwd(
        *a, ql, kl, scale=0.3, window_right=0))(q, k, v)
  np.testing.assert_array_equal(np.asarray(a[0], np.float32),
                                np.asarray(b[0], np.float32))

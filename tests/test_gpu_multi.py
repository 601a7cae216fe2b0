"""Multi-GPU truth for the sharding layer.

Every local GPU (any count >= 2; meshes are derived from the count) runs the
FA3 kernels sharded over batch, heads and sequence -- the partitioned call
under ``jit`` (``jax_fa3.attention`` -> the partitioned kernel calls of ``sharding``, ring
attention inside the partition for a sharded sequence) and
``jax_fa3.ring_attention`` in ``shard_map`` (contiguous and zig-zag) -- in
bf16 with GQA, causal and not.  Forward output and (dq, dk, dv) must

* satisfy the FA3 tolerance rule against an fp32 reference (at most 2x / 3x
  the error of XLA attention in bf16, + 1e-3; ``host_reference``), and
* be as close to the single-GPU kernel result (``jax_fa3.attention`` on GPU
  0) as that rule allows,

and the compiled program must show that the layout was served as intended
(a ring is a collective-permute; batch/head shards need no all-gather).  A
sharded Flax train step (``demo.make_train_step`` over a data x context mesh)
must give the single-GPU losses and gradients within bf16 noise.  Packed
sequences (segment ids) over batch or head shards and around the ring,
attention sinks over batch or head shards, and
``precision="fp8"`` (no gather of q, k, v), must give GPU 0's results.  KV-cache
decode (``attention_with_kvcache``, batch- or head-sharded, contiguous or
paged) must give GPU 0's output and caches without gathering the cache.

Cost: every case is one compiled forward+backward program, and the
references (fp32, XLA bf16, single-GPU kernel) are shared between cases with
the same inputs.
"""
import functools
import math
import os

# NCCL reads these when its first communicator is created (the first
# collective, after import): NVLink multicast (NVLS) stays off; these tests
# do not need it and not every multi-GPU host supports it.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from fa3_testing import kernel_configs, packed_ids  # noqa: E402
from host_reference import (assert_fa3_tolerance, fa3_bound,  # noqa: E402
                            max_abs_diff)
import jax_fa3  # noqa: E402
from jax_fa3 import ring  # noqa: E402


def _gpus():
  try:
    return jax.devices("gpu")  # real GPUs; conftest's flag only fakes CPUs
  except RuntimeError:
    return []


DEVS = _gpus()
IMPL = "fa3"  # the kernels or an error, never a silent reference fallback
N_HEADS, KV_HEADS = 8, 2  # GQA
T_BASE = 4096
NAMES = ("out", "dq", "dk", "dv")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(len(DEVS) < 2, reason="needs >= 2 GPUs"),
]


def _need_kernel(head_dim):
  if IMPL == "fa3" and ("bfloat16", head_dim) not in kernel_configs("fwd"):
    pytest.skip(f"bf16 d{head_dim} not compiled into the kernels")


def _mesh(shape, names):
  return Mesh(np.array(DEVS[:math.prod(shape)]).reshape(shape), names)


# ------------------------------------------------------------- inputs/refs
def _batch():
  return len(DEVS)  # every batch-sharded layout divides it


def _seq(t):
  """Rounds a sequence length up to a multiple of 2 x devices (ring and
  zig-zag shards must be equal and even)."""
  m = 2 * len(DEVS)
  return -(-t // m) * m


def _inputs(B, T, S, H, lens, seed):
  ks = jax.random.split(jax.random.key(seed), 4)
  bf = jnp.bfloat16
  with jax.default_device(DEVS[0]):
    q = jax.random.normal(ks[0], (B, T, N_HEADS, H)).astype(bf)
    k = jax.random.normal(ks[1], (B, S, KV_HEADS, H)).astype(bf)
    v = jax.random.normal(ks[2], (B, S, KV_HEADS, H)).astype(bf)
    # A bf16-exact cotangent: the fp32 reference and the bf16 runs then
    # differentiate against the very same values.
    w = jax.random.normal(ks[3], (B, T, N_HEADS, H)).astype(bf).astype(
        jnp.float32)
    ql = kl = None
    if lens:  # every batch row a different valid prefix (padding)
      b = np.arange(B)
      ql = jnp.asarray(T - b * T // (2 * B), jnp.int32)
      kl = jnp.asarray(S - (B - 1 - b) * S // (3 * B), jnp.int32)
  return q, k, v, w, ql, kl


def _fwd_bwd(attn):
  """(q, k, v, w, q_lens, kv_lens) -> (out, dq, dk, dv), ``w`` the output
  cotangent: forward and backward in one program (one compile per case)."""
  def f(q, k, v, w, ql, kl):
    out, pull = jax.vjp(lambda q, k, v: attn(q, k, v, ql, kl), q, k, v)
    return (out,) + tuple(pull(w.astype(out.dtype)))
  return f


def _xla(causal):
  return lambda q, k, v, ql, kl: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, query_seq_lengths=ql,
      key_value_seq_lengths=kl, implementation="xla")


def _fa3(causal):
  return lambda q, k, v, ql, kl: jax_fa3.attention(
      q, k, v, is_causal=causal, query_seq_lengths=ql,
      key_value_seq_lengths=kl, implementation=IMPL)


def _host(xs):
  return tuple(np.asarray(x, np.float32) for x in xs)


@functools.lru_cache(maxsize=None)
def _truth(B, T, S, H, causal, lens, seed=0):
  """Inputs on GPU 0 and, as host float32 arrays: the fp32 reference, XLA in
  bf16 (the tolerance baseline) and the single-GPU kernel result."""
  inp = _inputs(B, T, S, H, lens, seed)
  q, k, v, w, ql, kl = inp
  f32 = lambda x: x.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    ref = jax.jit(_fwd_bwd(_xla(causal)))(f32(q), f32(k), f32(v), w, ql, kl)
  base = jax.jit(_fwd_bwd(_xla(causal)))(*inp)
  single = jax.jit(_fwd_bwd(_fa3(causal)))(*inp)
  return inp, _host(ref), _host(base), _host(single)


# ------------------------------------------------------------------ layouts
def _ring_attn(mesh, layout, causal):
  """Natural-order global arrays -> ring attention in shard_map over "sp"
  (zig-zag: permuted in and out inside the program); ``ids``: segment ids
  [B, T] of q and k/v, sharded like them."""
  n = mesh.size
  spec = P(None, "sp")
  zz = layout == "zigzag"

  def attn(q, k, v, ql, kl, ids=None):
    if zz:
      q, k, v = (ring.to_zigzag(x, n) for x in (q, k, v))
      ids = None if ids is None else ring.to_zigzag(ids, n)
    kw = dict(axis_name="sp", is_causal=causal, layout=layout,
              implementation=IMPL)
    if ids is not None:
      local = lambda q, k, v, ids: jax_fa3.ring_attention(
          q, k, v, q_segment_ids=ids, **kw)
      o = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4,
                        out_specs=spec)(q, k, v, ids)
    elif ql is None:
      local = lambda q, k, v: jax_fa3.ring_attention(q, k, v, **kw)
      o = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3,
                        out_specs=spec)(q, k, v)
    else:  # global lengths, replicated on the ring
      local = lambda q, k, v, ql, kl: jax_fa3.ring_attention(
          q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl, **kw)
      o = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3 + (P(), P()),
                        out_specs=spec)(q, k, v, ql, kl)
    return ring.from_zigzag(o, n) if zz else o
  return attn


def _layout(name, causal):
  """(mesh, q/k/v PartitionSpec, attention fn, collective the program must
  contain or None, collectives it must not contain)."""
  n = len(DEVS)
  if name == "batch":
    return _mesh((n,), ("d",)), P("d"), _fa3(causal), None, ("all-gather",)
  if name == "heads":
    t = math.gcd(n, KV_HEADS)  # a head shard must hold whole GQA groups
    if t < 2:
      pytest.skip(f"{n} devices and {KV_HEADS} kv heads: no head split")
    return (_mesh((n // t, t), ("d", "t")), P("d", None, "t"), _fa3(causal),
            None, ("all-gather",))
  if name == "seq":  # ring inside the partitioned call
    return (_mesh((n,), ("s",)), P(None, "s"), _fa3(causal),
            "collective-permute", ("all-gather",))
  if name == "batch_seq":
    return (_mesh((2, n // 2), ("d", "s")), P("d", "s"), _fa3(causal),
            "collective-permute", ("all-gather",))
  if name.startswith("ring_"):
    mesh = _mesh((n,), ("sp",))
    return (mesh, P(None, "sp"), _ring_attn(mesh, name[5:], causal),
            "collective-permute", ())
  raise ValueError(name)


# (id, layout, head_dim, causal, T, S, lens, min GPUs).  T/S of ring layouts
# are rounded to multiples of 2 x GPUs; the heads case is deliberately odd
# and T != S (batch/head sharding takes any length).
CASES = [
    ("batch-causal", "batch", 128, True, T_BASE, T_BASE, False, 2),
    ("heads-noncausal", "heads", 128, False, T_BASE, T_BASE, False, 2),
    ("heads-odd-lens-causal", "heads", 128, True, 1999, 3001, True, 2),
    ("seq-partitioned-causal-lens", "seq", 128, True, T_BASE, T_BASE, True,
     2),
    ("seq-partitioned-d64", "seq", 64, False, 2048, 2048, False, 2),
    ("ring-contiguous-noncausal", "ring_contiguous", 128, False, T_BASE,
     T_BASE, False, 2),
    ("ring-zigzag-causal", "ring_zigzag", 128, True, T_BASE, T_BASE, False,
     2),
    ("batch-seq-causal", "batch_seq", 128, True, T_BASE, T_BASE, False, 4),
]


def _run_case(layout, head_dim, causal, T, S, lens, min_devs):
  if len(DEVS) < min_devs:
    pytest.skip(f"needs >= {min_devs} GPUs")
  _need_kernel(head_dim)
  if layout in ("seq", "batch_seq") or layout.startswith("ring_"):
    T, S = _seq(T), _seq(S)
  inp, ref, base, single = _truth(_batch(), T, S, head_dim, causal, lens)
  mesh, spec, attn, want, banned = _layout(layout, causal)

  def put(x, s):
    return None if x is None else jax.device_put(x, NamedSharding(mesh, s))

  q, k, v, w, ql, kl = inp
  args = (put(q, spec), put(k, spec), put(v, spec), put(w, spec),
          put(ql, P()), put(kl, P()))
  compiled = jax.jit(_fwd_bwd(attn)).lower(*args).compile()
  got = _host(compiled(*args))
  _assert_sharded(layout, got, base, ref, single, compiled.as_text(), want,
                  banned)
  return got


def _assert_sharded(label, got, base, ref, single, hlo, want, banned):
  """(out, dq, dk, dv) of a sharded run: the FA3 rule against fp32 (``base``:
  XLA in bf16), as close to the single-GPU result as that rule allows, and
  the compiled program holds ``want`` (or None) and none of ``banned``."""
  assert_fa3_tolerance(got, base, ref, NAMES)
  for i, (g, s) in enumerate(zip(got, single)):
    bound = fa3_bound(i, max_abs_diff(base[i], ref[i]))
    err = max_abs_diff(g, s)
    assert err <= bound, (f"{label} {NAMES[i]}: max|sharded - single GPU| = "
                          f"{err:.3e} > {bound:.3e}")
  if want is not None:
    assert want in hlo, f"{label}: no {want} in the compiled program"
  for op in banned:
    assert op not in hlo, f"{label}: unexpected {op} (layout not served)"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sharded_matches_single_gpu_and_fp32(case):
  _run_case(*case[1:])


# ------------------------------------------- packed sequences and sinks
# (id, feature, layout): the ids shard with the batch rows, the sinks with the
# query heads; a batch or head shard gathers nothing, a sequence shard rings.
NEW_ARG_CASES = [
    ("segment-ids-batch", "segment_ids", "batch"),
    ("segment-ids-heads", "segment_ids", "heads"),
    ("segment-ids-seq", "segment_ids", "seq"),  # the partitioned call rings
    ("sinks-batch", "sinks", "batch"),
    ("sinks-heads", "sinks", "heads"),
]


@pytest.mark.parametrize("case", NEW_ARG_CASES, ids=[c[0] for c in NEW_ARG_CASES])
def test_sharded_segment_ids_and_sinks_match_single_gpu(case):
  from test_segment_ids import dense_mask
  from test_sinks import sink_reference
  label, feature, layout = case
  _need_kernel(128)
  B, T, H = _batch(), 2048, 128
  q, k, v, w, _, _ = _inputs(B, T, T, H, False, seed=5)
  host_ids = packed_ids(np.random.default_rng(5), B, T, 6)
  with jax.default_device(DEVS[0]):
    ids = jnp.asarray(host_ids)
    mask = jnp.asarray(dense_mask(host_ids, host_ids, causal=True)[:, None])
    sinks = jnp.linspace(-1.0, 2.0, N_HEADS, dtype=jnp.float32)
  sinks_on = feature == "sinks"

  def fwd_bwd(attn):
    # out and the gradients of q, k, v (and the sinks): one program.
    def f(q, k, v, w, ids, sinks):
      if sinks_on:
        out, pull = jax.vjp(lambda q, k, v, s: attn(q, k, v, ids, s), q, k, v, sinks)
      else:
        out, pull = jax.vjp(lambda q, k, v: attn(q, k, v, ids, sinks), q, k, v)
      return (out,) + tuple(pull(w.astype(out.dtype)))
    return f

  def fa3(q, k, v, ids, sinks):
    kw = dict(sinks=sinks) if sinks_on else dict(q_segment_ids=ids)
    return jax_fa3.attention(q, k, v, is_causal=True, implementation=IMPL, **kw)

  def xla(q, k, v, ids, sinks, same_dtype=False):
    # jax.nn on XLA with the dense mask of equal ids, or a sink column.
    if sinks_on:
      return sink_reference(q, k, v, sinks, causal=True, same_dtype=same_dtype)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")

  f32 = lambda x: x.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    ref = _host(jax.jit(fwd_bwd(xla))(f32(q), f32(k), f32(v), w, ids, sinks))
  same = functools.partial(xla, same_dtype=True)
  base = _host(jax.jit(fwd_bwd(same))(q, k, v, w, ids, sinks))
  single = _host(jax.jit(fwd_bwd(fa3))(q, k, v, w, ids, sinks))

  mesh, spec, _, want, banned = _layout(layout, True)
  heads_axis = spec[2] if len(spec) > 2 else None
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
  args = (put(q, spec), put(k, spec), put(v, spec), put(w, spec),
          put(ids, P(spec[0])), put(sinks, P(heads_axis)))
  compiled = jax.jit(fwd_bwd(fa3)).lower(*args).compile()
  got = _host(compiled(*args))
  # out, dq, dk, dv as in _run_case; dsinks (a sum over every row) against
  # GPU 0 relative to its size.
  _assert_sharded(label, got[:4], base[:4], ref[:4], single[:4],
                  compiled.as_text(), want, banned)
  if sinks_on:
    scale = float(np.max(np.abs(single[4])))
    assert max_abs_diff(got[4], single[4]) <= 1e-2 * scale + 1e-3, "dsinks"


@pytest.mark.parametrize("layout,causal", [("zigzag", True),
                                           ("contiguous", False)])
def test_ring_segment_ids_match_single_gpu(layout, causal):
  # Packed rows around the ring: each GPU holds its shard of the ids; the
  # key side's travel with K/V.
  from test_segment_ids import dense_mask
  if len(DEVS) < 2:
    pytest.skip("needs >= 2 GPUs")
  _need_kernel(128)
  B, T = _batch(), _seq(T_BASE)
  q, k, v, w, _, _ = _inputs(B, T, T, 128, False, seed=6)
  host_ids = packed_ids(6, B, T, 7)
  with jax.default_device(DEVS[0]):
    ids = jnp.asarray(host_ids)
    mask = jnp.asarray(dense_mask(host_ids, host_ids, causal=causal)[:, None])

  def fwd_bwd(attn):
    def f(q, k, v, w, ids):
      out, pull = jax.vjp(lambda q, k, v: attn(q, k, v, ids), q, k, v)
      return (out,) + tuple(pull(w.astype(out.dtype)))
    return f

  def fa3(q, k, v, ids):
    return jax_fa3.attention(q, k, v, is_causal=causal, q_segment_ids=ids,
                             implementation=IMPL)

  def xla(q, k, v, ids):
    return jax.nn.dot_product_attention(q, k, v, mask=mask,
                                        implementation="xla")

  mesh, spec = _mesh((len(DEVS),), ("sp",)), P(None, "sp")
  ring_attn = _ring_attn(mesh, layout, causal)

  def ringed(q, k, v, ids):
    return ring_attn(q, k, v, None, None, ids)

  f32 = lambda x: x.astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    ref = _host(jax.jit(fwd_bwd(xla))(f32(q), f32(k), f32(v), w, ids))
  base = _host(jax.jit(fwd_bwd(xla))(q, k, v, w, ids))
  single = _host(jax.jit(fwd_bwd(fa3))(q, k, v, w, ids))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
  args = tuple(put(x) for x in (q, k, v, w, ids))
  compiled = jax.jit(fwd_bwd(ringed)).lower(*args).compile()
  _assert_sharded(f"ring-{layout}-segment-ids", _host(compiled(*args)), base,
                  ref, single, compiled.as_text(), "collective-permute", ())


# ------------------------------------------------------------------- FP8
@pytest.mark.parametrize("layout", ["batch", "heads"])
def test_sharded_fp8_matches_single_gpu(layout):
  # precision="fp8" keeps batch and head shards: no all-gather of q, k or v
  # (the quantize pre-pass and the FP8 kernel run per shard), and each
  # shard's blocks quantize as on one GPU.
  if ("bfloat16", 128) not in kernel_configs("fp8"):
    pytest.skip("bf16 d128 FP8 not compiled into the kernels")
  B, T, H = _batch(), 2048, 128
  q, k, v, _, _, _ = _inputs(B, T, T, H, False, seed=6)
  f = jax.jit(lambda q, k, v: jax_fa3.attention(
      q, k, v, is_causal=True, precision="fp8", implementation=IMPL))
  single = np.asarray(f(q, k, v), np.float32)
  mesh, spec, _, want, banned = _layout(layout, True)
  xs = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
  compiled = f.lower(*xs).compile()
  got = np.asarray(compiled(*xs), np.float32)
  hlo = compiled.as_text()
  for op in banned:
    assert op not in hlo, f"fp8 {layout}: unexpected {op}"
  # The same quantized blocks and kernels per shard, and no sum across CTAs
  # in the forward: bit for bit.
  np.testing.assert_array_equal(got, single)


# ------------------------------------------------------ Flax training step
# Small model, one layer: the point is the sharded program, not the size.
LM_ARGS = ["--steps", "3", "--seq-len", "2048", "--layers", "1", "--heads",
           "8", "--kv-heads", "2", "--head-dim", "128", "--vocab", "256",
           "--period", "64", "--dtype", "bfloat16"]


def test_sharded_flax_train_step_matches_single_gpu():
  pytest.importorskip("flax")
  optax = pytest.importorskip("optax")
  from jax_fa3 import demo
  _need_kernel(128)
  n = len(DEVS)
  if n % 2:
    pytest.skip("the context axis needs an even GPU count")
  data, context = n // 2, 2
  args = demo.parse_args(LM_ARGS + ["--batch", str(2 * data)], on_gpu=True)

  def run(data, context, devices):
    args.data, args.tensor, args.context = data, 1, context
    mesh = Mesh(np.array(devices).reshape(data, 1, context),
                ("data", "tensor", "context"))
    model, init_fn, step_fn, data_sh = demo.make_train_step(args, mesh, "fa3")
    batches = [tuple(jax.device_put(a, data_sh)
                     for a in demo.make_batch(args, None, i, context))
               for i in range(args.steps)]
    x, _, pos, _ = batches[0]
    state = init_fn(jax.random.key(0), x, pos)

    # The initial gradients check attention's backward through the model
    # directly (Adam's first steps are nearly sign(g): losses alone would
    # hide a wrong gradient); same loss as demo.make_train_step.
    def loss_fn(params, x, y, pos, w):
      logits = model.apply({"params": params}, x, pos)
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
      return jnp.sum(ce * w) / jnp.sum(w)

    grads = jax.jit(jax.grad(loss_fn))(state[0], *batches[0])
    grads = jax.tree.map(lambda g: np.asarray(g, np.float32), grads)
    losses = []
    for b in batches:  # step_fn donates the state: after the gradients
      state, loss = step_fn(state, *b)
      losses.append(float(loss))
    return losses, grads

  single, g1 = run(1, 1, DEVS[:1])
  sharded, gs = run(data, context, DEVS[:n])  # ring attention, zig-zag
  assert all(math.isfinite(x) for x in single + sharded)
  np.testing.assert_allclose(sharded, single, rtol=1e-2)
  leaves = jax.tree_util.tree_leaves_with_path(g1)
  other = jax.tree.leaves(gs)
  assert len(leaves) == len(other)
  worst = max(
      (float(np.linalg.norm(b - a) / max(np.linalg.norm(a), 1e-30)),
       jax.tree_util.keystr(p)) for (p, a), b in zip(leaves, other))
  assert worst[0] < 5e-2, f"gradient rel. error {worst[0]:.3e} at {worst[1]}"


# ---------------------------------------------------------------- KV caches
@pytest.mark.parametrize("layout", ["batch", "heads"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_sharded_matches_single_gpu(layout, paged):
  # Decode with an append through attention_with_kvcache over all GPUs:
  # batch or kv heads sharded, the cache (a paged pool: whole per batch
  # shard) never gathered; equal to GPU 0's result and updated caches.
  from test_gpu_kvcache import _setup
  _need_kernel(128)
  n = len(DEVS)
  B, K = (2 * n, 2) if layout == "batch" else (2, n)
  N, H, cap, page = 4 * K, 128, 2048, 256 if paged else None
  with jax.default_device(DEVS[0]):
    q, kc, vc, kn, vn, lens, table = _setup(7, jnp.bfloat16, B, 1, N, K, H, cap, page)
  args = (q, kc, vc, lens, kn, vn, table)

  def call(q, kc, vc, lens, kn, vn, table):
    return jax_fa3.attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=vn,
                                          page_table=table, num_splits=3)

  want = [np.asarray(x, np.float32) for x in jax.jit(call)(*args)]
  mesh = _mesh((n,), ("x",))
  ns = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
  if layout == "batch":
    rows, per_row = ns("x", None, None, None), ns("x")
    cache = ns() if paged else rows
    tab = ns("x", None)
  else:
    rows, per_row = ns(None, None, "x", None), ns()
    cache, tab = rows, ns()
  shardings = (rows, cache, cache, per_row, rows, rows, tab if paged else None)
  xs = [x if s is None else jax.device_put(x, s) for x, s in zip(args, shardings)]
  f = jax.jit(call)
  hlo = f.lower(*xs).compile().as_text()
  gathers = [l for l in hlo.splitlines() if "all-gather(" in l and "bf16[" in l]
  assert not gathers, gathers[:3]
  got = [np.asarray(x, np.float32) for x in f(*xs)]
  assert max_abs_diff(got[0], want[0]) <= 2e-3, layout
  for g, w in zip(got[1:], want[1:]):  # the caches: exact, NaN pages included
    np.testing.assert_array_equal(g, w)

"""Boolean masks on the kernel path, checked on every host: the mask's spans
pre-pass (jax_fa3.pair_rule.from_mask) against a brute force, and the
kernels' primitive path (which lowers to the reference on XLA:CPU) against
the reference path, forward and gradients, under vmap and over a mesh."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import pair_rule

from fa3_testing import (close, close_trees, out_and_grads, partitioner,
                          rand, row_spans_bruteforce)

pytestmark = pytest.mark.usefixtures("cpu_backend")


def _masks(rng, B, N, T, S):
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  causal = np.broadcast_to(j <= i, (1, 1, T, S))
  pad = np.arange(S)[None, None, None, :] < rng.integers(1, S + 1, (B, 1, 1, 1))
  rand_ = rng.random((B, N, T, S)) < 0.3
  rand_[:, :, 3] = False  # a row that sees nothing
  return {"causal": causal, "padding": np.broadcast_to(pad, (B, 1, T, S)),
          "causal_padding": causal & pad, "random_per_head": rand_}


def test_mask_broadcast_over_rows_and_columns():
  # A key-padding mask [B, 1, 1, S] (Flax make_attention_mask's shape for one
  # query row) gives the operands of its explicit [B, 1, T, S] broadcast.
  rng = np.random.default_rng(3)
  B, K, T, S = 2, 2, 37, 53
  pad = np.arange(S)[None, None, None, :] < rng.integers(1, S + 1, (B, 1, 1, 1))
  got = pair_rule.from_mask(jnp.asarray(pad), K, T, S)
  want = pair_rule.from_mask(jnp.asarray(np.broadcast_to(pad, (B, 1, T, S))), K, T, S)
  for g, w in zip(got, want):
    assert g.shape == w.shape
    np.testing.assert_array_equal(g, w)
  col = np.ones((1, 1, T, 1), bool)  # broadcast over keys
  a = pair_rule.from_mask(jnp.asarray(col), K, T, S)[0]
  assert a.shape == (1, 1, T, 4, -(-S // 128) + 1)
  np.testing.assert_array_equal(pair_rule._unpack_bits(a, S), np.ones((1, 1, T, S), bool))


@pytest.mark.parametrize("kind", ["causal", "padding", "causal_padding",
                                  "random_per_head"])
def test_mask_spans_and_packing(kind):
  rng = np.random.default_rng(len(kind))
  B, N, K, T, S = 2, 4, 2, 37, 53
  m = _masks(rng, B, N, T, S)[kind]
  a, b, q_spans, kv_spans = pair_rule.from_mask(jnp.asarray(m), K, T, S)
  mb, mn = m.shape[:2]
  assert a.dtype == b.dtype == jnp.int32
  # Bits in the accumulator order, one spare 128-column chunk; they round-trip.
  assert a.shape == (mb, mn, T, 4, -(-S // 128) + 1)
  assert b.shape == (mb, mn, S, 4, -(-T // 128) + 1)
  np.testing.assert_array_equal(pair_rule._unpack_bits(a, S), m)
  np.testing.assert_array_equal(pair_rule._unpack_bits(b, T),
                                np.swapaxes(m, -1, -2))
  # Column 8 j + 2 t + e of chunk c: bit 2 j + e of word [t, c].
  words = np.asarray(a).view(np.uint32)
  x, h, i = 0, 0, 5
  for col in range(S):
    c, j, t, e = col // 128, (col % 128) // 8, (col % 8) // 2, col % 2
    assert bool((words[x, h, i, t, c] >> (2 * j + e)) & 1) == m[x, h, i, col]
  mk = K if mn > 1 else 1
  assert q_spans.shape == (mb, mn, -(-T // 16), 4)
  assert kv_spans.shape == (mb, mk, -(-S // 16), 4)
  for x in range(mb):
    for h in range(mn):
      np.testing.assert_array_equal(q_spans[x, h], row_spans_bruteforce(m[x, h]))
    for kh in range(mk):
      # A kv head's key spans cover its query heads: the union of their
      # visible rows, the intersection of their full ranges.
      heads = range(kh * (mn // mk), (kh + 1) * (mn // mk))
      per = [row_spans_bruteforce(m[x, h].T) for h in heads]
      want = np.stack([np.min([p[:, 0] for p in per], 0),
                       np.max([p[:, 1] for p in per], 0),
                       np.max([p[:, 2] for p in per], 0),
                       np.min([p[:, 3] for p in per], 0)], -1)
      np.testing.assert_array_equal(kv_spans[x, kh], want)


@pytest.mark.parametrize("kind", ["causal", "causal_padding", "random_per_head"])
def test_primitive_path_equals_reference(monkeypatch, kind):
  # As if the kernels could run: dot_product_attention with a mask goes to
  # the primitives (the pair-rule operands), which lower to the reference on
  # XLA:CPU; forward, gradients and vmap must equal the reference path.
  from jax_fa3 import api
  rng = np.random.default_rng(5)
  B, N, K, T, S = 2, 4, 2, 37, 53
  mask = jnp.asarray(_masks(rng, B, N, T, S)[kind])
  q, k, v, w = rand(5, B=B, T=T, S=S, N=N, K=K, H=16, dtype=jnp.bfloat16)

  def run(impl):
    att = lambda q, k, v, m: jax_fa3.dot_product_attention(  # noqa: E731
        q, k, v, mask=m, implementation=impl)

    def f(q, k, v, m):
      out, vjp = jax.vjp(lambda q, k, v: att(q, k, v, m), q, k, v)
      return out, vjp(w.astype(out.dtype))
    mb = mask if mask.shape[0] == B else jnp.broadcast_to(mask, (B,) + mask.shape[1:])
    return jax.jit(f)(q, k, v, mask), jax.jit(jax.vmap(att))(
        q[:, None], k[:, None], v[:, None], mb[:, None])

  want, want_v = run("reference")
  monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
  jaxpr = str(jax.make_jaxpr(lambda q, k, v, m: jax_fa3.dot_product_attention(
      q, k, v, mask=m, implementation="fa3"))(q, k, v, mask))
  assert "fa3_fwd" in jaxpr or "custom_partitioning" in jaxpr or "custom_vmap" in jaxpr
  got, got_v = run("fa3")
  close_trees((got, got_v), (want, want_v), rtol=2e-2, atol=2e-2)


def test_bias_and_mask_are_taken_by_the_kernels(monkeypatch):
  from jax_fa3 import api
  monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
  q, k, v, _ = rand(6, B=1, T=16, S=16, N=2, K=2, H=16, dtype=jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (1, 2, 16, 16))
  m = jnp.tril(jnp.ones((16, 16), bool))
  # implementation="fa3" takes a bias and a mask, alone or together (off the
  # GPU its primitives compute the reference).
  for kw in (dict(bias=b), dict(mask=m), dict(bias=b, mask=m)):
    got = jax_fa3.dot_product_attention(q, k, v, implementation="fa3", **kw)
    want = jax_fa3.dot_product_attention(q, k, v, implementation="reference",
                                         **kw)
    close_trees(got, want, rtol=2e-2, atol=2e-2)
  # A bias that does not broadcast still names itself before anything runs.
  with pytest.raises(ValueError, match="bias of shape"):
    jax_fa3.dot_product_attention(q, k, v, bias=jnp.zeros((1, 3, 16, 16)),
                                  implementation="fa3")


@pytest.mark.parametrize("qkv_seq", [False, True], ids=["qkv_whole", "qkv_seq"])
@pytest.mark.parametrize("axis", [2, 3], ids=["rows", "columns"])
def test_sharded_along_the_sequence(monkeypatch, axis, qkv_seq):
  # A mask sharded along T or S (4 ways: 4 rows or 6 columns per device, less
  # than a span granule): its bits and spans are computed whole per batch
  # shard; results and gradients equal the unsharded call.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_fa3 import api
  cpus = jax.devices("cpu")
  if len(cpus) < 4:
    pytest.skip("needs 4 CPU devices")
  monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
  mesh = Mesh(np.array(cpus[:4]), ("x",))
  rng = np.random.default_rng(10)
  B, N, K, T, S = 2, 4, 2, 16, 24
  m = jnp.asarray(_masks(rng, B, N, T, S)["random_per_head"])
  q, k, v, w = rand(10, B=B, T=T, S=S, N=N, K=K, H=8, dtype=jnp.bfloat16)
  f = out_and_grads(lambda q, k, v, m: jax_fa3.dot_product_attention(
      q, k, v, mask=m, implementation="fa3"), w)
  want, want_g = f(q, k, v, m)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
  qs = P(None, "x") if qkv_seq else P()
  got, got_g = f(*(put(x, qs) for x in (q, k, v)),
                 put(m, P(*(None,) * axis, "x")))
  close(np.asarray(got, np.float32), np.asarray(want, np.float32),
        rtol=1e-2, atol=1e-2)
  close_trees(got_g, want_g, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("spec", [("d", None), (None, "m"), ("d", "m")])
def test_sharded_batch_and_heads(monkeypatch, spec):
  # Over a mesh the mask operands follow the batch and head axes they have
  # (a broadcast dim stays replicated); results and gradients equal the
  # unsharded call.
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_fa3 import api
  cpus = jax.devices("cpu")
  if len(cpus) < 4:
    pytest.skip("needs 4 CPU devices")
  monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
  mesh = Mesh(np.array(cpus[:4]).reshape(2, 2), ("d", "m"))
  rng = np.random.default_rng(9)
  B, N, K, T, S = 2, 4, 2, 32, 48
  masks = _masks(rng, B, N, T, S)
  q, k, v, w = rand(9, B=B, T=T, S=S, N=N, K=K, H=8, dtype=jnp.bfloat16)

  f = out_and_grads(lambda q, k, v, m: jax_fa3.dot_product_attention(
      q, k, v, mask=m, implementation="fa3"), w)
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
  for m in (masks["causal_padding"], masks["random_per_head"]):
    m = jnp.asarray(m)
    want, want_g = f(q, k, v, m)
    qs = P(spec[0], None, spec[1], None)
    ms = P(spec[0] if m.shape[0] > 1 else None, spec[1] if m.shape[1] > 1 else None)
    got, got_g = f(*(put(x, qs) for x in (q, k, v)), put(m, ms))
    close(np.asarray(got, np.float32), np.asarray(want, np.float32),
          rtol=1e-2, atol=1e-2)
    close_trees(got_g, want_g, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("part", ["shardy", "gspmd"])
@pytest.mark.parametrize("N,K,mesh_shape", [(4, 2, (2, 2)), (8, 4, (1, 4)),
                                            (8, 8, (2, 4))])
def test_head_sharded_mask_is_not_gathered(monkeypatch, part, N, K,
                                           mesh_shape):
  # A per-head mask sharded like q's heads (tensor parallelism): its bits and
  # spans are computed per head shard (whole GQA groups), so the compiled call
  # moves nothing between devices; results and gradients equal the unsharded
  # call.
  import re
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax_fa3 import api
  cpus = jax.devices("cpu")
  if len(cpus) < int(np.prod(mesh_shape)):
    pytest.skip(f"needs {int(np.prod(mesh_shape))} CPU devices")
  with partitioner(part):
    monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
    mesh = Mesh(np.array(cpus[:int(np.prod(mesh_shape))]).reshape(mesh_shape),
                ("d", "m"))
    B, T, S = 2, 32, 48
    m = jnp.asarray(_masks(np.random.default_rng(12), B, N, T, S)["random_per_head"])
    q, k, v, w = rand(12, B=B, T=T, S=S, N=N, K=K, H=8, dtype=jnp.bfloat16)
    f = out_and_grads(lambda q, k, v, m: jax_fa3.dot_product_attention(
        q, k, v, mask=m, implementation="fa3"), w)
    want, want_g = f(q, k, v, m)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    args = [put(x, P("d", None, "m")) for x in (q, k, v)] + [put(m, P("d", "m"))]
    hlo = f.lower(*args).compile().as_text()
    moved = [line for line in hlo.splitlines() if re.search(
        r"(all-gather|all-reduce|all-to-all|collective-permute)\(", line)]
    assert not moved, moved[:3]
    got, got_g = f(*args)
    close(np.asarray(got, np.float32), np.asarray(want, np.float32),
          rtol=1e-2, atol=1e-2)
    close_trees(got_g, want_g, rtol=2e-2, atol=2e-2)


def test_key_constant_bias_with_minus_infinity_on_the_kernel_path(monkeypatch):
  # The kernel path drops a bias constant along the keys from the softmax
  # (it only shifts the lse); -inf there hides the row's keys: 0 and lse
  # +inf, as the reference gives.  Finite shifts keep the lse's gradient.
  from jax_fa3 import api
  q, k, v, _ = rand(7, B=1, T=4, S=5, N=2, K=2, H=16, dtype=jnp.bfloat16)
  bias = jnp.zeros((1, 2, 4, 1), jnp.bfloat16).at[0, 0, 1, 0].set(-jnp.inf)
  run = lambda impl: jax_fa3.dot_product_attention(
      q, k, v, bias=bias, return_residual=True, implementation=impl)
  want = run("reference")
  monkeypatch.setattr(api.V, "kernel_blocker", lambda *a: None)
  got = run("fa3")
  assert float(want[1][0, 1, 0]) == float(got[1][0, 1, 0]) == np.inf
  assert not np.asarray(got[0][0, 1, 0], np.float32).any()
  close_trees(got, want, rtol=2e-2, atol=2e-2)

"""flax_attention_fn inside flax.linen / flax.nnx attention modules."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

import jax_fa3
from fa3_testing import close, nn_attention

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

B, L, F, HEADS = 2, 11, 16, 2

# XLA:CPU on every host, so float32 tolerances hold (no TF32 on a GPU).
pytestmark = pytest.mark.usefixtures("cpu_backend")


def _x(seed, shape=(B, L, F)):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_linen_matches_default(causal):
  x = _x(0)
  kw = dict(num_heads=HEADS, qkv_features=F, deterministic=True)
  ref = nn.MultiHeadDotProductAttention(**kw)
  ours = nn.MultiHeadDotProductAttention(
      **kw, attention_fn=jax_fa3.flax_attention_fn)
  params = ref.init(jax.random.key(1), x)
  mask = nn.make_causal_mask(jnp.ones((B, L))) if causal else None
  with jax.default_matmul_precision("highest"):
    a = jax.jit(lambda p, x: ours.apply(p, x, mask=mask))(params, x)
    b = jax.jit(lambda p, x: ref.apply(p, x, mask=mask))(params, x)
  assert a.shape == (B, L, F)
  close(a, b)
  if causal:  # the mask matters: first position ignores later tokens
    x2 = x.at[:, -1].add(5.0)
    a2 = ours.apply(params, x2, mask=mask)
    close(a2[:, 0], a[:, 0])
    assert float(jnp.max(jnp.abs(a2[:, -1] - a[:, -1]))) > 1e-3


def test_linen_extra_batch_dims_and_grad():
  x = _x(2, (2, 3, L, F))
  kw = dict(num_heads=HEADS, qkv_features=F, deterministic=True)
  ref = nn.MultiHeadDotProductAttention(**kw)
  ours = nn.MultiHeadDotProductAttention(
      **kw, attention_fn=jax_fa3.flax_attention_fn)
  params = ref.init(jax.random.key(3), x)
  mask = nn.make_causal_mask(jnp.ones((2, 3, L)))

  def loss(m, p):
    return jnp.sum(m.apply(p, x, mask=mask) ** 2)

  with jax.default_matmul_precision("highest"):
    la, ga = jax.jit(jax.value_and_grad(lambda p: loss(ours, p)))(params)
    lb, gb = jax.jit(jax.value_and_grad(lambda p: loss(ref, p)))(params)
  close(la, lb, rtol=1e-5, atol=1e-4)
  for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["none", "mask", "is_causal"])
def test_nnx_matches_default(mode):
  x = _x(4)
  kw = dict(num_heads=HEADS, in_features=F, qkv_features=F, decode=False)
  ref = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  ours = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0),
                                attention_fn=jax_fa3.flax_attention_fn)
  call = {}
  if mode == "mask":
    call["mask"] = nnx.make_causal_mask(jnp.ones((B, L)))
  elif mode == "is_causal":
    call["is_causal"] = True
  with jax.default_matmul_precision("highest"):
    a, b = ours(x, **call), ref(x, **call)
  assert a.shape == (B, L, F)
  close(a, b)
  if mode != "none":
    unmasked = ours(x)
    assert float(jnp.max(jnp.abs(unmasked - a))) > 1e-3


def test_nnx_gqa():
  x = _x(5)
  kw = dict(num_heads=4, num_kv_heads=2, in_features=F, qkv_features=F,
            decode=False)
  ref = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(1))
  ours = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(1),
                                attention_fn=jax_fa3.flax_attention_fn)
  with jax.default_matmul_precision("highest"):
    close(ours(x, is_causal=True), ref(x, is_causal=True))


def test_dropout_raises():
  x = _x(6)
  m = nnx.MultiHeadAttention(num_heads=HEADS, in_features=F, decode=False,
                             dropout_rate=0.5, rngs=nnx.Rngs(0),
                             attention_fn=jax_fa3.flax_attention_fn)
  with pytest.raises(ValueError, match="dropout"):
    m(x, deterministic=False)
  m(x, deterministic=True)  # fine without dropout
  q, k, v = (_x(s, (1, 4, 2, 8)) for s in (8, 9, 10))
  with pytest.raises(ValueError, match="dropout"):
    jax_fa3.flax_attention_fn(q, k, v, dropout_rate=0.1,
                              dropout_rng=jax.random.key(0))
  # deterministic=True: no dropout, plain attention
  out = jax_fa3.flax_attention_fn(q, k, v, dropout_rate=0.1,
                                  deterministic=True)
  with jax.default_matmul_precision("highest"):
    close(out, nn_attention(q, k, v))
  with pytest.raises(ValueError, match="static"):  # traced: undecidable
    jax.jit(lambda d: jax_fa3.flax_attention_fn(
        q, k, v, dropout_rate=0.1, deterministic=d))(False)


def test_dtype_cast_and_no_batch_dims():
  q = jax.random.normal(jax.random.key(7), (5, 2, 8))  # [L, heads, depth]
  out = jax_fa3.flax_attention_fn(q, q, q, dtype=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  ref = nn.dot_product_attention(q, q, q)
  close(out, ref, rtol=3e-2, atol=3e-2)


class _LatentAttention(nn.Module):
  """A DeepSeek-shaped attention block: queries and keys of head dim 192,
  values of 128, causal, no GQA; attention in bfloat16 (on an H100/H200 it
  runs the 192/128 kernels)."""
  heads: int = 2

  @nn.compact
  def __call__(self, x, attend=None):
    attend = attend or jax_fa3.attention
    B, T, _ = x.shape
    bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
    q = nn.Dense(self.heads * 192)(x).reshape(B, T, self.heads, 192)
    k = nn.Dense(self.heads * 192)(x).reshape(B, T, self.heads, 192)
    v = nn.Dense(self.heads * 128)(x).reshape(B, T, self.heads, 128)
    o = attend(bf(q), bf(k), bf(v), is_causal=True).astype(jnp.float32)
    return nn.Dense(x.shape[-1])(o.reshape(B, T, self.heads * 128))


def _dense_causal(q, k, v, is_causal):
  q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
  s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
  return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1), v)


def test_latent_attention_block_trains():
  # The loss of a regression onto a causal target falls under plain SGD, and
  # the gradients match the same block on a dense float32 softmax (up to
  # bfloat16 rounding).
  x = jax.random.normal(jax.random.key(0), (2, 40, 16))
  y = jnp.cumsum(x, axis=1) / jnp.arange(1, 41)[None, :, None]  # causal means
  model = _LatentAttention()
  params = model.init(jax.random.key(1), x)
  loss = lambda p, f=None: jnp.mean((model.apply(p, x, f) - y) ** 2)  # noqa: E731
  grad = jax.jit(jax.grad(loss))
  step = jax.jit(lambda p: jax.tree.map(lambda a, g: a - 0.05 * g, p, grad(p)))
  got = grad(params)
  want = jax.jit(jax.grad(lambda p: loss(p, _dense_causal)))(params)
  # Against the largest gradient: the query/key biases' nearly cancel (a
  # softmax ignores a shift of a row), leaving bfloat16 noise alone there.
  scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert float(jnp.max(jnp.abs(g - w))) <= 2e-2 * scale
  first = float(loss(params))
  for _ in range(40):
    params = step(params)
  assert float(loss(params)) < 0.5 * first

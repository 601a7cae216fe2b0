"""The blockwise reference (jax_fa3.reference) against jax.nn / dense formulas."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jax_fa3 import reference as R

from fa3_testing import close as _close, rand

# XLA:CPU on every host, so float32 tolerances hold (no TF32 on a GPU).
pytestmark = pytest.mark.usefixtures("cpu_backend")


def _rand(seed, B=2, T=37, S=53, N=6, K=2, H=16, dtype=jnp.float32):
  return rand(seed, B=B, T=T, S=S, N=N, K=K, H=H, dtype=dtype)


def _nn(q, k, v, **kw):
  with jax.default_matmul_precision("highest"):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)


@pytest.mark.parametrize("block_k,causal,window,wl,wr", [
    (8, False, None, -1, -1), (512, True, None, -1, 0), (5, False, (3, 2), 3, 2),
    (16, True, (5, 4), 5, 0)])
def test_fwd_bwd_vs_jax_nn(block_k, causal, window, wl, wr):
  q, k, v, w = _rand(0, T=29, S=37, N=4, K=2, H=8)
  ql = jnp.array([29, 20], jnp.int32)
  kl = jnp.array([37, 30], jnp.int32)
  scale = 0.3

  @jax.jit
  def run(q, k, v, w):
    out, lse = R.attention_fwd(q, k, v, ql, kl, scale=scale, window_left=wl,
                               window_right=wr, block_k=block_k)
    nn = lambda q, k, v: _nn(
        q, k, v, scale=scale, is_causal=causal, local_window_size=window,
        query_seq_lengths=ql, key_value_seq_lengths=kl, return_residual=True)
    (ref, ref_lse), vjp = jax.vjp(nn, q, k, v)
    gref = vjp((w, jnp.zeros_like(ref_lse)))
    g = R.attention_bwd(q, k, v, out, lse, w, ql, kl, scale=scale,
                        window_left=wl, window_right=wr, block_k=block_k)
    return out, lse, ref, ref_lse, g, gref

  out, lse, ref, ref_lse, g, gref = run(q, k, v, w)
  assert out.shape == q.shape and lse.shape == (2, 4, 29)
  assert lse.dtype == jnp.float32
  _close(out, ref)
  # lse on valid rows equals jax.nn's residual ([B,T,N]); padded rows: +inf.
  lse_btn = jnp.transpose(lse, (0, 2, 1))
  _close(lse_btn[0], ref_lse[0])
  _close(lse_btn[1, :20], ref_lse[1, :20])
  assert bool(jnp.all(jnp.isinf(lse_btn[1, 20:])))
  # Backward: explicit attention_bwd vs autodiff of jax.nn.
  for a, b in zip(g, gref):
    _close(a, b, rtol=1e-4, atol=2e-5)


def _dense_softcap(q, k, v, scale, cap, causal):
  B, T, N, H = q.shape
  K = k.shape[2]
  kr = jnp.repeat(k, N // K, axis=2)
  vr = jnp.repeat(v, N // K, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", q, kr, precision="highest") * scale
  s = cap * jnp.tanh(s / cap)
  if causal:
    s = jnp.where(jnp.tril(jnp.ones((T, k.shape[1]), bool)), s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1)
  return jnp.einsum("bnts,bsnh->btnh", p, vr, precision="highest")


@pytest.mark.parametrize("causal", [False, True])
def test_softcap_vs_dense(causal):
  q, k, v, w = _rand(1, T=13, S=19, N=4, K=2, H=8)
  scale, cap = 0.5, 2.0
  wr = 0 if causal else -1
  f = lambda q, k, v: R.reference_attention(
      q, k, v, None, None, None, None, scale, cap, -1, wr, 8)[0]
  g = lambda q, k, v: _dense_softcap(q, k, v, scale, cap, causal)

  @jax.jit
  def run(q, k, v, w):
    nocap = R.attention_fwd(q, k, v, None, None, scale=scale,
                            window_right=wr)[0]
    ga = jax.grad(lambda *a: jnp.sum(f(*a) * w), (0, 1, 2))(q, k, v)
    gb = jax.grad(lambda *a: jnp.sum(g(*a) * w), (0, 1, 2))(q, k, v)
    return f(q, k, v), g(q, k, v), nocap, ga, gb

  o, d, nocap, ga, gb = run(q, k, v, w)
  _close(o, d)
  # softcap actually changes the result (cap is small relative to scores)
  assert float(jnp.max(jnp.abs(nocap - d))) > 1e-2
  for a, b in zip(ga, gb):
    _close(a, b, rtol=1e-4, atol=2e-5)


def test_fully_masked_row_is_zero_and_lse_inf():
  q, k, v, w = _rand(2, B=1, T=8, S=8, N=2, K=2, H=8)
  kl = jnp.array([3], jnp.int32)
  # window (0, 0): row i sees only key i; rows 3.. see nothing (kv_len 3).
  out, lse = jax.jit(lambda q, k, v: R.attention_fwd(
      q, k, v, None, kl, scale=1.0, window_left=0, window_right=0,
      block_k=4))(q, k, v)
  assert bool(jnp.all(out[0, 3:] == 0))
  assert bool(jnp.all(jnp.isinf(lse[0, :, 3:])))
  # Rows 0..2 see exactly their own key: output = v[i].
  _close(out[0, :3], v[0, :3])
  f = lambda q, k, v: jnp.sum(R.reference_attention(
      q, k, v, None, kl, None, None, 1.0, 0.0, 0, 0, 4)[0] * w)
  grads = jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
  for gr in grads:
    assert bool(jnp.all(jnp.isfinite(gr)))
  dq = grads[0]
  assert bool(jnp.all(dq[0, 3:] == 0))


def test_gqa_does_not_repeat_and_matches_repeated_heads():
  q, k, v, _ = _rand(3, T=9, S=11, N=6, K=2)
  f = jax.jit(lambda q, k, v: R.attention_fwd(
      q, k, v, None, None, scale=0.25, block_k=4)[0])
  out = f(q, k, v)
  out_mha = f(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2))
  _close(out, out_mha)
  # Head n uses kv head n // 3: changing kv head 1 only moves heads 3..5.
  out2 = f(q, k, v.at[:, :, 1].add(1.0))
  _close(out2[:, :, :3], out[:, :, :3])
  assert float(jnp.min(jnp.abs(out2[:, :, 3:] - out[:, :, 3:]))) > 0.5


def test_long_sequence_never_materializes_full_scores():
  B, T, S, N, H = 1, 64, 4096, 1, 8
  q = jnp.ones((B, T, N, H), jnp.float32)
  k = jnp.ones((B, S, N, H), jnp.float32)
  f = jax.jit(lambda q, k, v: R.attention_fwd(
      q, k, v, None, None, scale=1.0, block_k=256))
  hlo = f.lower(q, k, k).compile().as_text()
  # a T x S (64 x 4096) f32 scores buffer must not appear
  assert "f32[1,1,1,64,4096]" not in hlo and "64,4096]" not in hlo
  out, _ = f(q, k, k)
  _close(out, jnp.ones_like(out))

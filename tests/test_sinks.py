"""Attention sinks and a value head dim unlike the query/key one, on the
reference path, against jax.nn-style float32 references (XLA:CPU): for
sinks, the scores with one extra column per head holding the sink's logit
(its value 0), for ``Hv != H`` a dense softmax."""
import numpy as np
import pytest
import jax
import jax.numpy as jnp

import jax_fa3

from fa3_testing import close

pytestmark = pytest.mark.usefixtures("cpu_backend")

HI = jax.lax.Precision.HIGHEST


def sink_reference(q, k, v, sinks, *, scale=None, causal=False, window=None,
                   q_lens=None, kv_lens=None, softcap=None, mask=None,
                   same_dtype=False, return_lse=False):
  """float32 attention with a sink column; rows that see no key give 0
  with or without a sink (the sink's value is 0).  ``same_dtype``: what
  jax.nn's XLA path does in q's dtype instead (products of q.dtype inputs
  with float32 accumulation, probabilities rounded to q.dtype)."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  scale = 1.0 / np.sqrt(H) if scale is None else scale
  dt = q.dtype if same_dtype else jnp.float32
  qf, kf, vf = (x.astype(dt) for x in (q, k, v))
  kf = jnp.repeat(kf, G, axis=2)
  vf = jnp.repeat(vf, G, axis=2)
  s = jnp.einsum("btnh,bsnh->bnts", qf, kf, precision=HI,
                 preferred_element_type=jnp.float32) * scale
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  i = jnp.arange(T)[:, None]
  j = jnp.arange(S)[None, :]
  ok = jnp.ones((B, 1, T, S), bool)
  if causal:
    ok = ok & (j <= i)
  if window is not None:
    ok = ok & (j >= i - window[0]) & (j <= i + window[1])
  if q_lens is not None:
    ok = ok & (i[None, None] < q_lens[:, None, None, None])
  if kv_lens is not None:
    ok = ok & (j[None, None] < kv_lens[:, None, None, None])
  if mask is not None:
    ok = ok & mask
  s = jnp.where(ok, s, -jnp.inf)
  if sinks is not None:
    col = jnp.broadcast_to(sinks[None, :, None, None].astype(jnp.float32),
                           (B, N, T, 1))
    s = jnp.concatenate([s, col], axis=-1)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  e = jnp.exp(s - m)
  den = jnp.sum(e, axis=-1, keepdims=True)
  p = jnp.where(den > 0, e / jnp.where(den > 0, den, 1.0), 0.0)[..., :S]
  out = jnp.einsum("bnts,bsnh->btnh", p.astype(dt), vf, precision=HI,
                   preferred_element_type=jnp.float32)
  rows = ok.any(-1)  # [B, 1|N, T]
  out = jnp.where(jnp.swapaxes(rows, 1, 2)[..., None], out, 0.0).astype(dt)
  return (out, (m + jnp.log(den))[..., 0]) if return_lse else out


def inputs(seed, B=2, T=37, S=53, N=4, K=2, H=16, Hv=None):
  ks = jax.random.split(jax.random.key(seed), 5)
  Hv = H if Hv is None else Hv
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32)
  v = jax.random.normal(ks[2], (B, S, K, Hv), jnp.float32)
  w = jax.random.normal(ks[3], (B, T, N, Hv), jnp.float32)
  sinks = 2.0 * jax.random.normal(ks[4], (N,), jnp.float32)
  return q, k, v, w, sinks


def check(q, k, v, w, sinks, ref_kw=None, **kw):
  """Output and gradients (q, k, v, sinks) against :func:`sink_reference`."""
  ref_kw = kw if ref_kw is None else ref_kw

  @jax.jit
  def run(q, k, v, sinks):
    f = lambda q, k, v, s: jax_fa3.attention(q, k, v, sinks=s, **kw)
    g = lambda q, k, v, s: sink_reference(q, k, v, s, **ref_kw)
    out, pull = jax.vjp(f, q, k, v, sinks)
    ref, ref_pull = jax.vjp(g, q, k, v, sinks)
    return out, ref, pull(w), ref_pull(w)

  out, ref, grads, ref_grads = run(q, k, v, sinks)
  close(out, ref)
  for name, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
    if sinks is None and name == "dsinks":
      continue
    assert np.isfinite(np.asarray(a)).all(), name
    close(a, b, rtol=1e-4, atol=2e-5)
  return out, grads


@pytest.mark.parametrize("causal", [False, True])
def test_sinks_match_the_sink_column(causal):
  check(*inputs(0), is_causal=causal, ref_kw=dict(causal=causal))


def test_sinks_change_the_output_and_get_a_gradient():
  # A sink far below every score is no sink; a large one takes most of the
  # probability away from the keys.
  q, k, v, w, _ = inputs(1)
  N = q.shape[2]
  base = jax_fa3.attention(q, k, v)
  low = jax_fa3.attention(q, k, v, sinks=jnp.full((N,), -1e4))
  high = jax_fa3.attention(q, k, v, sinks=jnp.full((N,), 30.0))
  close(low, base)
  assert float(jnp.max(jnp.abs(high))) < 1e-6 * float(jnp.max(jnp.abs(base)))
  g = jax.grad(lambda s: jnp.sum(w * jax_fa3.attention(q, k, v, sinks=s)))(
      jnp.zeros((N,)))
  assert g.shape == (N,) and bool(jnp.all(g != 0))


@pytest.mark.parametrize("case", ["gqa_lengths", "window_softcap", "mqa_odd"])
def test_sinks_compose(case):
  if case == "gqa_lengths":
    q, k, v, w, s = inputs(2, B=3, T=41, S=29, N=6, K=2)
    ql = jnp.array([41, 17, 0], jnp.int32)
    kl = jnp.array([29, 0, 5], jnp.int32)  # a row with no key at all
    kw = dict(query_seq_lengths=ql, key_value_seq_lengths=kl, is_causal=True)
    ref = dict(q_lens=ql, kv_lens=kl, causal=True)
  elif case == "window_softcap":
    q, k, v, w, s = inputs(3, T=53, S=53)
    kw = dict(local_window_size=(5, 2), softcap=3.0)
    ref = dict(window=(5, 2), softcap=3.0)
  else:
    q, k, v, w, s = inputs(4, T=1, S=77, N=5, K=1)
    kw = ref = {}
  out, _ = check(q, k, v, w, s, ref_kw=ref, **kw)
  if case == "gqa_lengths":  # padded query rows and rows without a key: 0
    assert np.all(np.asarray(out)[1, 17:] == 0) and np.all(np.asarray(out)[1] == 0)


def test_sinks_with_segment_ids():
  q, k, v, w, s = inputs(5, T=40, S=40)
  ids = jnp.asarray(np.repeat([0, 1, 2, 3], [1, 12, 20, 7])[None].repeat(2, 0),
                    jnp.int32)
  mask = (ids[:, :, None] == ids[:, None, :])[:, None]
  check(q, k, v, w, s, ref_kw=dict(causal=True, mask=mask), is_causal=True,
        q_segment_ids=ids)


def test_sinks_deterministic_and_fp8_emulation():
  q, k, v, w, s = inputs(6)
  check(q, k, v, w, s, ref_kw={}, deterministic=True)
  # FP8 (here its emulation): the sink folds into the quantized attention.
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  out = jax_fa3.attention(qb, kb, vb, sinks=s, precision="fp8")
  ref = sink_reference(qb, kb, vb, s)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
  assert err < 0.1 * float(jnp.max(jnp.abs(ref))), err


def test_sinks_validation():
  q, k, v, _, s = inputs(7)
  with pytest.raises(ValueError, match="sinks must have shape"):
    jax_fa3.attention(q, k, v, sinks=s[:2])
  with pytest.raises(ValueError, match="sinks must have shape"):
    jax_fa3.attention(q, k, v, sinks=s[None])
  for dtype in (jnp.int32, jnp.float8_e4m3fn):
    with pytest.raises(ValueError, match="float32"):
      jax_fa3.attention(q, k, v, sinks=jnp.zeros((4,), dtype))
  # 16-bit sinks are widened, as documented: same result as float32 ones.
  s16 = s.astype(jnp.bfloat16)
  np.testing.assert_array_equal(
      jax_fa3.attention(q, k, v, sinks=s16),
      jax_fa3.attention(q, k, v, sinks=s16.astype(jnp.float32)))


@pytest.mark.parametrize("hv", [8, 24])
@pytest.mark.parametrize("causal", [False, True])
def test_value_head_dim(hv, causal):
  # v [B, S, K, Hv] with Hv != H: output [B, T, N, Hv]; the default scale
  # is 1/sqrt(H) of the query/key head dim.
  q, k, v, w, s = inputs(8, H=16, Hv=hv, N=4, K=2)
  out, _ = check(q, k, v, w, None, ref_kw=dict(causal=causal),
                 is_causal=causal)
  assert out.shape == q.shape[:3] + (hv,)
  check(q, k, v, w, s, ref_kw=dict(causal=causal), is_causal=causal)


def test_value_head_dim_validation():
  q, k, v, _, _ = inputs(9, H=16, Hv=8)
  with pytest.raises(ValueError, match="not supported by implementation='fa3'"):
    jax_fa3.attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                      v.astype(jnp.bfloat16), implementation="fa3")
  with pytest.raises(ValueError, match="fp8"):
    jax_fa3.attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                      v.astype(jnp.bfloat16), precision="fp8")
  with pytest.raises(ValueError, match="same shape"):
    jax_fa3.attention(q, k, v[:, :-1])
  with pytest.raises(ValueError, match="same shape"):
    jax_fa3.dot_product_attention(q, k, v)  # jax.nn's rule: Hv == H


def _ring(causal, return_lse=False):
  """ring_attention with sinks over a 4-device sequence axis (skips with
  fewer devices): f(q, k, v, sinks)."""
  from jax.sharding import Mesh, PartitionSpec as P
  devs = np.array(jax.devices()[:4])
  if len(devs) < 4:
    pytest.skip("needs 4 devices")
  mesh = Mesh(devs, ("sp",))

  def local(q, k, v, s):
    return jax_fa3.ring_attention(q, k, v, axis_name="sp", is_causal=causal,
                                  sinks=s, return_lse=return_lse)
  out = (P(None, "sp"), P(None, None, "sp")) if return_lse else P(None, "sp")
  return jax.shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),),
                       out_specs=out)


def test_ring_attention_with_sinks():
  # The sink joins once, after the ring's merge of the shards.
  f = _ring(causal=True)
  q, k, v, w, s = inputs(10, B=1, T=64, S=64, N=4, K=2)
  close(jax.jit(f)(q, k, v, s), sink_reference(q, k, v, s, causal=True))
  g = jax.jit(jax.grad(lambda s: jnp.sum(w * f(q, k, v, s))))(s)
  want = jax.grad(lambda s: jnp.sum(w * sink_reference(q, k, v, s,
                                                       causal=True)))(s)
  close(g, want, rtol=1e-4, atol=2e-5)


def test_sink_of_minus_infinity_is_no_sink():
  # Rows that see no key stay 0 with finite gradients (exp(-inf - -inf)
  # would be NaN); the other rows are those without a sink.
  q, k, v, w, _ = inputs(11, B=2, T=9, S=7)
  sinks = jnp.array([-jnp.inf, 0.5, -jnp.inf, -1.0])
  lens = jnp.array([5, 9], jnp.int32), jnp.array([0, 7], jnp.int32)
  kw = dict(query_seq_lengths=lens[0], key_value_seq_lengths=lens[1])
  out, grads = check(q, k, v, w, sinks, dict(q_lens=lens[0], kv_lens=lens[1]),
                     **kw)
  plain = jax_fa3.attention(q, k, v, **kw)
  heads = np.array([0, 2])
  close(out[:, :, heads], plain[:, :, heads])
  assert np.asarray(grads[3])[heads].tolist() == [0.0, 0.0]


def test_ring_attention_lse_gradient():
  # return_lse's log-sum-exp is differentiable (through the ring's backward).
  q, k, v, w, s = inputs(12, B=1, T=64, S=64, N=4, K=2)
  u = jax.random.normal(jax.random.key(13), (1, 4, 64))
  for causal in (False, True):
    f = _ring(causal, return_lse=True)
    loss = lambda q, k, v, s: jnp.sum(w * f(q, k, v, s)[0]) + jnp.sum(
        u * f(q, k, v, s)[1])
    want_loss = lambda q, k, v, s: (
        lambda o, l: jnp.sum(w * o) + jnp.sum(u * l))(
            *sink_reference(q, k, v, s, causal=causal, return_lse=True))
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, s)
    want = jax.grad(want_loss, argnums=(0, 1, 2, 3))(q, k, v, s)
    for a, b in zip(got, want):
      close(a, b, rtol=1e-4, atol=2e-5)

"""The kernel primitives on CPU (where they lower to the reference): abstract
eval, jit, vmap (batching rules), grad (the core's custom_vjp), CUDA lowering."""
import re

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jax_fa3 import core, primitives as P, reference as R, pair_rule
from fa3_testing import close, nn_attention, rand

B, T, S, N, K, H = 2, 9, 13, 4, 2, 8
ATTRS = dict(scale=0.3, softcap=0.0, window_left=-1, window_right=0)
# float32 through the primitives is the reference lowering: XLA:CPU on every host.
pytestmark = pytest.mark.usefixtures("cpu_backend")


def _lens(b=B, t=T, s=S):
  return jnp.full((b,), t, jnp.int32), jnp.full((b,), s, jnp.int32)


def _attn(q, k, v, ql, kl, **over):
  cfg = core.Config(**dict(ATTRS, **over), kernel=True)
  return core.attention(q, k, v, ql, kl, None, None, cfg)


def test_abstract_eval_shapes():
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((B, S, K, H), jnp.bfloat16)
  ln = jax.ShapeDtypeStruct((B,), jnp.int32)
  out, lse = jax.eval_shape(lambda *a: P.fa3_fwd(*a, **ATTRS), q, k, k, ln, ln)
  assert (out.shape, out.dtype) == ((B, T, N, H), jnp.bfloat16)
  assert (lse.shape, lse.dtype) == ((B, N, T), jnp.float32)
  o = jax.ShapeDtypeStruct((B, N, T), jnp.float32)
  dq, dk, dv = jax.eval_shape(lambda *a: P.fa3_bwd(*a, **ATTRS),
                              q, k, k, q, o, q, ln, ln)
  assert (dq.shape, dq.dtype) == ((B, T, N, H), jnp.bfloat16)
  assert dk.shape == dv.shape == (B, S, K, H) and dk.dtype == jnp.bfloat16
  res = jax.eval_shape(_attn, q, k, k, ln, ln)
  assert res[0].shape == (B, T, N, H) and res[1].shape == (B, N, T)


def test_fwd_eager_and_jit_match_reference():
  q, k, v, _ = rand(0, B=B, T=T, S=S, N=N, K=K, H=H, dtype=jnp.bfloat16)
  ql, kl = jnp.array([9, 4], jnp.int32), jnp.array([13, 6], jnp.int32)
  out, lse = P.fa3_fwd(q, k, v, ql, kl, **ATTRS)  # eager (impl)
  jout, jlse = jax.jit(lambda *a: P.fa3_fwd(*a, **ATTRS))(q, k, v, ql, kl)
  rout, rlse = jax.jit(lambda *a: R.attention_fwd(*a, **ATTRS))(
      q, k, v, ql, kl)
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  for o in (out, jout):
    close(o, rout)
  for l in (lse, jlse):
    np.testing.assert_array_equal(np.isinf(l), np.isinf(rlse))
    close(np.where(np.isinf(l), 0, l), np.where(np.isinf(rlse), 0, rlse))
  assert np.all(np.asarray(out, np.float32)[1, 4:] == 0)  # padded rows


def test_grad_matches_jax_nn_and_uses_bwd_primitive():
  q, k, v, w = rand(1, B=B, T=T, S=S, N=N, K=K, H=H)
  ql, kl = _lens()
  f = lambda q, k, v: jnp.sum(_attn(q, k, v, ql, kl)[0] * w)
  g = lambda q, k, v: jnp.sum(nn_attention(q, k, v, scale=0.3,
                                           is_causal=True) * w)
  jaxpr = str(jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(q, k, v))
  assert "fa3_fwd" in jaxpr and "fa3_bwd" in jaxpr
  with jax.default_matmul_precision("highest"):
    ga = jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
    gb = jax.jit(jax.grad(g, (0, 1, 2)))(q, k, v)
  for a, b in zip(ga, gb):
    close(a, b, rtol=1e-4, atol=2e-5)
  # int seq-length inputs get zero (float0) cotangents
  gl = jax.grad(lambda q, ql: jnp.sum(_attn(q, k, v, ql, kl)[0]),
                (0, 1), allow_int=True)(q, ql)
  assert gl[1].dtype == jax.dtypes.float0


def test_vmap_leading_axis():
  V = 3
  q, k, v, w = rand(2, B=B, T=T, S=S, N=N, K=K, H=H, dtype=jnp.bfloat16)
  qs = jnp.stack([q, 2 * q, -q])
  kls = jnp.array([[13, 13], [5, 13], [13, 1]], jnp.int32)
  ql, _ = _lens()
  f = jax.jit(jax.vmap(lambda q, kl: _attn(q, k, v, ql, kl)[0]))
  out = f(qs, kls)
  assert out.shape == (V, B, T, N, H)
  for i in range(V):
    close(out[i], _attn(qs[i], k, v, ql, kls[i])[0])
  jaxpr = str(jax.make_jaxpr(jax.vmap(lambda q, kl: _attn(
      q, k, v, ql, kl)[0]))(qs, kls))
  assert "fa3_fwd" in jaxpr  # batching rule keeps the primitive


def test_vmap_non_leading_axis_and_grad():
  V = 2
  q, k, v, w = rand(3, B=B, T=T, S=S, N=N, K=K, H=H)
  ks = jnp.stack([k, k * 0.5], axis=2)  # [B, S, V, K, H]
  ql, kl = _lens()

  def loss(q, k):
    return jnp.sum(_attn(q, k, v, ql, kl)[0] * w)

  f = jax.jit(jax.vmap(jax.value_and_grad(loss, (0, 1)),
                       in_axes=(None, 2), out_axes=0))
  vals, (dq, dk) = f(q, ks)
  assert dq.shape == (V, B, T, N, H) and dk.shape == (V, B, S, K, H)
  for i in range(V):
    ki = ks[:, :, i]
    val_i, (dq_i, dk_i) = jax.jit(jax.value_and_grad(loss, (0, 1)))(q, ki)
    close(vals[i], val_i, rtol=1e-5, atol=1e-4)
    close(dq[i], dq_i)
    close(dk[i], dk_i)
  assert "fa3_bwd" in str(jax.make_jaxpr(jax.vmap(
      jax.grad(loss, (0, 1)), in_axes=(None, 2)))(q, ks))


def _cuda_hlo(fn, *args):
  return jax.jit(fn).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()


def test_cuda_lowering_is_ffi_custom_call():
  q, k, v, _ = rand(4, B=B, T=T, S=S, N=N, K=K, H=H, dtype=jnp.bfloat16)
  ql, kl = _lens()
  try:
    hlo = _cuda_hlo(lambda *a: _attn(*a, window_left=5), q, k, v, ql, kl)
  except Exception as e:  # pragma: no cover - jax without cross-lowering
    pytest.skip(f"cross-platform lowering unavailable: {e}")
  calls = [l for l in hlo.splitlines() if "custom_call @jax_fa3_fwd" in l]
  assert len(calls) == 1, hlo
  c = calls[0]
  assert "scale = 3.000000e-01 : f32" in c and "softcap = 0.000000e+00 : f32" in c
  assert "window_left = 5 : i32" in c and "window_right = 0 : i32" in c
  # operands q, k, v, q_lens, kv_lens, then the segment operands, the bias
  # and the sinks (empty without them); results out (bf16) and lse (f32 B,N,T)
  assert re.search(r"\(tensor<2x9x4x8xbf16>, tensor<2x13x2x8xbf16>, "
                   r"tensor<2x13x2x8xbf16>, tensor<2xi32>, tensor<2xi32>, "
                   r"tensor<2x0xi32>, tensor<2x0xi32>, tensor<2x0x4xi32>, "
                   r"tensor<2x0x4xi32>, tensor<2x0xbf16>, tensor<0xf32>\) -> "
                   r"\(tensor<2x9x4x8xbf16>, tensor<2x4x9xf32>\)", c), c
  # with segment ids: ids [B,T] / [B,S] and spans per 16 positions
  pairs = pair_rule.from_segment_ids(jnp.zeros((B, T), jnp.int32),
                           jnp.zeros((B, S), jnp.int32))
  shlo = _cuda_hlo(lambda q, k, v, ql, kl, *sg: P.fa3_fwd(
      q, k, v, ql, kl, sg, scale=0.3), q, k, v, ql, kl, *pairs)
  assert re.search(r"tensor<2xi32>, tensor<2x9xi32>, tensor<2x13xi32>, "
                   r"tensor<2x1x4xi32>, tensor<2x1x4xi32>, tensor<2x0xbf16>, "
                   r"tensor<0xf32>\) -> ",
                   shlo), shlo
  # sinks [N] reach the kernel (no fold after it)
  sinks = jnp.linspace(-1.0, 1.0, N, dtype=jnp.float32)
  khlo = _cuda_hlo(lambda q, k, v, ql, kl, s: core.attention(
      q, k, v, ql, kl, None, None, core.Config(**ATTRS, kernel=True),
      sinks=s), q, k, v, ql, kl, sinks)
  calls = [l for l in khlo.splitlines() if "custom_call @jax_fa3_fwd" in l]
  assert len(calls) == 1 and "tensor<4xf32>) -> " in calls[0], khlo
  # backward: the kernel where one was compiled for (dtype, head dim), else
  # the reference (tests/test_backward_dispatch.py covers both sides)
  ghlo = _cuda_hlo(jax.grad(lambda q: jnp.sum(
      _attn(q, k, v, ql, kl)[0].astype(jnp.float32))), q)
  assert "jax_fa3_fwd" in ghlo
  assert ("jax_fa3_bwd" in ghlo) == P.bwd_kernel_available(q.dtype, H)

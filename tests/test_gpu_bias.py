"""GPU truth tests of an additive bias on the kernels
(``jax_fa3.dot_product_attention(bias=...)`` and ``flax_attention_fn``),
forward and backward, the bias gradient included.

The FA3 rule against jax.nn: the kernel's error against jax.nn's XLA
attention in float32 is at most 2x (gradients 3x) the error of the same XLA
attention in the inputs' dtype, plus a small atol; the lowered HLO holds the
FFI calls (no reference fallback).
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fa3
from jax_fa3 import primitives
from fa3_testing import cid, kernel_configs, to_device
from host_reference import (FWD_FACTOR, GRAD_FACTOR, assert_fa3_rule,
                            make_inputs, np_dtype, roundoff, seed_of)

pytestmark = pytest.mark.gpu

ATOL = {"bfloat16": 2e-3, "float16": 1e-3}
BWD_CONFIGS = kernel_configs("bwd")
PRIMARY = [c for c in BWD_CONFIGS if c == ("bfloat16", 128)] or BWD_CONFIGS[:1]


def _bias(kind, rng, shape, N, T, S):
  """ALiBi (per head slope times distance) or random values of ``shape``."""
  if kind == "alibi":
    slopes = 2.0 ** (-8.0 * (np.arange(1, N + 1) / N))
    dist = -np.abs(np.arange(T)[:, None] - np.arange(S)[None, :])
    full = slopes[:, None, None] * dist[None]
    return np.broadcast_to(full[None], (1, N, T, S))[tuple(
        slice(None) if d > 1 else slice(0, 1) for d in shape)].reshape(shape)
  return rng.standard_normal(shape) * 2.0


def _attn(impl, causal, q_lens=None, kv_lens=None):
  def f(q, k, v, bias, mask):
    if impl == "fa3":
      return jax_fa3.dot_product_attention(
          q, k, v, bias=bias, mask=mask, is_causal=causal,
          query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
          implementation="fa3")
    return jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=mask, is_causal=causal,
        query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
        implementation="xla")
  return f


def _run(f, q, k, v, bias, mask, do):
  out, pull = jax.vjp(lambda q, k, v, b: f(q, k, v, b, mask), q, k, v, bias)
  return (out,) + pull(do)


def _check(cfg, bias_shape, *, B=2, N=4, K=2, T=333, S=333, causal=False,
           kind="random", mask_kind=None, lens=False):
  dtype_name, hd = cfg
  dtype = np_dtype(dtype_name)
  rng = np.random.default_rng(seed_of("bias", bias_shape, T, S, causal, kind))
  q, k, v, do = make_inputs(seed_of("bias", cfg, bias_shape, T, S, causal),
                            B, T, S, N, K, hd, dtype_name, with_dout=True)
  bias = _bias(kind, rng, bias_shape, N, T, S).astype(dtype)
  mask = None
  if mask_kind == "random":  # every row keeps its diagonal key
    m = rng.random((B, 1, T, S)) < 0.5
    m[..., np.arange(min(T, S)), np.arange(min(T, S))] = True
    mask = jnp.asarray(m)
  q_lens = kv_lens = None
  if lens:
    q_lens = jnp.asarray(rng.integers(T // 2, T + 1, B), jnp.int32)
    kv_lens = jnp.asarray(rng.integers(S // 2, S + 1, B), jnp.int32)
    # jax.nn leaves padded query rows unspecified (jax_fa3 zeroes them): no
    # cotangent there, so they add to no gradient in either.
    valid = np.arange(T)[None, :] < np.asarray(q_lens)[:, None]  # [B, T]
    do = do * valid[:, :, None, None].astype(do.dtype)
  args = to_device(q, k, v, bias, do)
  qd, kd, vd, bd, dod = args

  fa3 = jax.jit(lambda *a: _run(_attn("fa3", causal, q_lens, kv_lens), *a))
  hlo = fa3.lower(qd, kd, vd, bd, mask, dod).as_text()
  assert primitives.FWD_TARGET in hlo and primitives.BWD_TARGET in hlo
  got = fa3(qd, kd, vd, bd, mask, dod)
  xla = jax.jit(lambda *a: _run(_attn("xla", causal, q_lens, kv_lens), *a))
  same = xla(qd, kd, vd, bd, mask, dod)
  f32 = [x.astype(jnp.float32) for x in args]
  with jax.default_matmul_precision("highest"):
    ref = xla(*f32[:4], mask, f32[4])
  names = ("out", "dq", "dk", "dv", "dbias")
  for i, name in enumerate(names):
    g = np.asarray(got[i]).astype(np.float32)
    r = np.asarray(ref[i]).astype(np.float32)
    assert g.shape == r.shape, (name, g.shape, r.shape)
    assert np.all(np.isfinite(g)), f"{name}: NaN/Inf"
    s = np.asarray(same[i]).astype(np.float32)
    if lens and name == "out":
      g, r, s = (x * valid[:, :, None, None] for x in (g, r, s))
    atol = ATOL[dtype_name] + (0 if i == 0 else 2 * roundoff(r, dtype))
    assert_fa3_rule(name, g, r, s, atol, FWD_FACTOR if i == 0 else GRAD_FACTOR)


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
@pytest.mark.parametrize("shape", [(1, 4, 333, 333), (2, 1, 333, 333),
                                   (1, 1, 1, 333), (2, 1, 333, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_every_broadcast_shape(cfg, shape):
  _check(cfg, shape)


@pytest.mark.parametrize("cfg", BWD_CONFIGS, ids=cid)
def test_every_head_dim_alibi_causal(cfg):
  _check(cfg, (1, 4, 517, 517), T=517, S=517, causal=True, kind="alibi")


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
def test_gqa_cross_lengths_and_mask(cfg):
  _check(cfg, (2, 8, 257, 129), B=2, N=8, K=1, T=257, S=129)
  _check(cfg, (1, 4, 300, 901), T=300, S=901, causal=True)  # odd S: padded rows
  _check(cfg, (2, 4, 200, 300), T=200, S=300, mask_kind="random")


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
def test_seq_lengths(cfg):
  _check(cfg, (2, 4, 384, 384), T=384, S=384, lens=True)


def test_bias_without_gradient_writes_none():
  # A bias that is not differentiated: the backward call has an empty bias
  # gradient (the kernel writes none).
  cfg = PRIMARY[0]
  q, k, v = (jnp.asarray(x) for x in make_inputs(0, 1, 256, 256, 4, 4, cfg[1],
                                                 cfg[0]))
  bias = jnp.zeros((1, 4, 256, 256), q.dtype)
  loss = lambda q, k, v, b: jnp.sum(jax_fa3.dot_product_attention(  # noqa: E731
      q, k, v, bias=b, implementation="fa3").astype(jnp.float32))
  only_q = jax.jit(jax.grad(loss)).lower(q, k, v, bias).as_text()
  with_b = jax.jit(jax.grad(loss, argnums=3)).lower(q, k, v, bias).as_text()
  bwd = lambda h: [l for l in h.splitlines()  # noqa: E731
                   if f"custom_call @{primitives.BWD_TARGET}" in l]
  assert len(bwd(only_q)) == 1 and "tensor<1x0xbf16>" in bwd(only_q)[0].split("->")[1]
  assert len(bwd(with_b)) == 1 and "tensor<1x4x256x256xbf16>" in bwd(with_b)[0].split("->")[1]
  g = jax.jit(jax.grad(loss, argnums=(0, 3)))(q, k, v, bias)
  assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in g)


def test_flax_bias_and_mask_run_the_kernel():
  # A Flax attention call with a padding mask and an ALiBi bias runs the
  # kernels forward and backward (no reference fallback).
  nn = pytest.importorskip("flax.linen")
  cfg = PRIMARY[0]
  B, T, N, H = 2, 512, 4, cfg[1]
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(x) for x in make_inputs(4, B, T, T, N, N, H, cfg[0]))
  bias = jnp.asarray(_bias("alibi", rng, (1, N, T, T), N, T, T), q.dtype)
  mask = nn.make_attention_mask(jnp.ones((B, T)), jnp.arange(T)[None] < 400)

  def loss(fn, q, k, v, b):
    return jnp.sum(fn(q, k, v, bias=b, mask=mask).astype(jnp.float32) ** 2)
  grad = jax.jit(jax.grad(lambda *a: loss(jax_fa3.flax_attention_fn, *a),
                          argnums=(0, 3)))
  hlo = grad.lower(q, k, v, bias).as_text()
  assert primitives.FWD_TARGET in hlo and primitives.BWD_TARGET in hlo
  got = grad(q, k, v, bias)
  f32 = [x.astype(jnp.float32) for x in (q, k, v, bias)]
  with jax.default_matmul_precision("highest"):
    want = jax.grad(lambda *a: loss(nn.dot_product_attention, *a),
                    argnums=(0, 3))(*f32)
  for g, w in zip(got, want):
    g = np.asarray(g.astype(jnp.float32))
    w = np.asarray(w)
    assert np.all(np.isfinite(g))
    assert np.max(np.abs(g - w)) <= 3e-2 * np.max(np.abs(w)), np.max(np.abs(g - w))

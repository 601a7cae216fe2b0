"""GPU truth tests of boolean masks on the kernels
(``jax_fa3.dot_product_attention(mask=...)`` and ``flax_attention_fn``).

The rules of tests/test_gpu_forward.py and test_gpu_backward.py: the
kernel's error against a float64 host reference is at most 2x (gradients 3x)
the same-dtype XLA emulation's error plus a small atol; rows that see no key
are exactly 0, everything finite; the lowered HLO holds the FFI calls.
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
                            attention_grad_refs, attention_refs, make_inputs,
                            np_dtype, roundoff, seed_of)

pytestmark = pytest.mark.gpu

ATOL = {"bfloat16": 2e-3, "float16": 1e-3}
BWD_CONFIGS = kernel_configs("bwd")
PRIMARY = [c for c in BWD_CONFIGS if c == ("bfloat16", 128)] or BWD_CONFIGS[:1]


def _mask(kind, rng, B, N, T, S):
  i, j = np.arange(T)[:, None], np.arange(S)[None, :]
  if kind == "causal":                       # nn.make_causal_mask
    return np.broadcast_to(j <= i, (1, 1, T, S))
  if kind == "padding":                      # key padding per batch row
    lens = rng.integers(1, S + 1, B)
    return (j[None] < lens[:, None, None])[:, None]
  if kind == "causal_padding":
    return _mask("causal", rng, B, N, T, S) & _mask("padding", rng, B, N, T, S)
  if kind == "random":                       # non-contiguous rows, per head
    m = rng.random((B, N, T, S)) < 0.4
    m[:, :, 7] = False                       # a row that sees nothing
    return m
  if kind == "blocks":                       # whole blocks on and off
    blk = rng.random((1, N, -(-T // 128), -(-S // 128))) < 0.5
    return np.repeat(np.repeat(blk, 128, 2), 128, 3)[:, :, :T, :S]
  raise ValueError(kind)


def _check(cfg, kind, *, B=2, N=4, K=2, T=777, S=777, causal=False, grads=True):
  dtype_name, hd = cfg
  dtype = np_dtype(dtype_name)
  rng = np.random.default_rng(seed_of("mask", kind, T, S))
  mask = _mask(kind, rng, B, N, T, S)
  q, k, v, do = make_inputs(seed_of("mask", cfg, kind, T, S, causal), B, T, S,
                            N, K, hd, dtype_name, with_dout=True)

  def f(q, k, v, do, m):
    att = lambda a, b, c: jax_fa3.dot_product_attention(  # noqa: E731
        a, b, c, mask=m, is_causal=causal, implementation="fa3")
    out, pull = jax.vjp(att, q, k, v)
    return out, (pull(do) if grads else ())
  args = to_device(q, k, v, do) + (jnp.asarray(mask),)
  fn = jax.jit(f)
  hlo = fn.lower(*args).as_text()
  assert primitives.FWD_TARGET in hlo and (not grads or primitives.BWD_TARGET in hlo)
  out, g = fn(*args)
  refs = attention_refs(q, k, v, causal=causal, mask=mask)
  out = np.asarray(out).astype(np.float32)
  assert np.all(np.isfinite(out))
  # Rows without a key, per head.
  full = np.broadcast_to(mask, (B, N, T, S))
  if causal:
    full = full & (np.arange(S)[None, :] <= np.arange(T)[:, None])
  dead = ~full.any(-1)                       # [B, N, T]
  assert np.all(np.swapaxes(out, 1, 2)[dead] == 0)
  assert_fa3_rule("out", out, refs.ref64, refs.same, ATOL[dtype_name], FWD_FACTOR)
  if not grads:
    return
  g64, gsame = attention_grad_refs(q, k, v, do, causal=causal, mask=mask)
  for name, gr, gs, gr64 in zip(("dq", "dk", "dv"), g, gsame, g64):
    gr = np.asarray(gr).astype(np.float32)
    assert np.all(np.isfinite(gr)), f"{name}: NaN/Inf"
    atol = ATOL[dtype_name] + 2 * roundoff(gr64, dtype)
    assert_fa3_rule(name, gr, gr64, gs, atol, GRAD_FACTOR)


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
@pytest.mark.parametrize("kind", ["causal", "padding", "causal_padding",
                                  "random", "blocks"])
def test_masks(cfg, kind):
  _check(cfg, kind)


@pytest.mark.parametrize("cfg", BWD_CONFIGS, ids=cid)
def test_every_head_dim(cfg):
  _check(cfg, "causal_padding", T=517, S=517)
  _check(cfg, "random", T=300, S=333)


@pytest.mark.parametrize("cfg", PRIMARY, ids=cid)
def test_with_is_causal_and_cross_lengths(cfg):
  _check(cfg, "padding", T=300, S=900, causal=True)
  _check(cfg, "random", B=1, N=8, K=1, T=257, S=129)


def test_flax_causal_mask_runs_the_kernel():
  # A Flax layer with nn.make_causal_mask hands the mask to the kernels.
  flax_nn = pytest.importorskip("flax.linen")
  cfg = PRIMARY[0]
  B, T, N, H = 2, 1024, 4, cfg[1]
  layer = flax_nn.MultiHeadDotProductAttention(
      num_heads=N, qkv_features=N * H, attention_fn=jax_fa3.flax_attention_fn,
      dtype=jnp.bfloat16, param_dtype=jnp.float32)
  x = jax.random.normal(jax.random.key(0), (B, T, N * H), jnp.bfloat16)
  mask = flax_nn.make_causal_mask(jnp.ones((B, T)))
  params = layer.init(jax.random.key(1), x, mask=mask)
  f = jax.jit(lambda p, x, m: layer.apply(p, x, mask=m))
  assert primitives.FWD_TARGET in f.lower(params, x, mask).as_text()
  ref_layer = flax_nn.MultiHeadDotProductAttention(
      num_heads=N, qkv_features=N * H, dtype=jnp.float32, param_dtype=jnp.float32)
  with jax.default_matmul_precision("highest"):
    want = ref_layer.apply(params, x.astype(jnp.float32), mask=mask)
  got = f(params, x, mask)
  err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)))
  assert err <= 3e-2 * float(jnp.max(jnp.abs(want))), err  # bf16 projections

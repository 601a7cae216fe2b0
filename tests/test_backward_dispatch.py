"""CPU tests of the Python side of the backward kernel: the
``deterministic`` keyword and the per-configuration choice between the
``jax_fa3_bwd`` custom call and the reference backward, checked on the CUDA
lowering (exported for platform "cuda" without a GPU)."""
import fa3_testing as U  # noqa: F401

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa3
from jax_fa3 import _native, core, primitives as P

_CHECKS = [jax.export.DisabledSafetyCheck.custom_call(t)
           for t in (P.FWD_TARGET, P.BWD_TARGET)]


def _cuda_grad_module(dtype, hd, T=100, deterministic=False, hdv=None):
  q = jnp.ones((2, T, 4, hd), dtype)
  kv = jnp.ones((2, 80, 2, hd), dtype)
  v = jnp.ones((2, 80, 2, hd if hdv is None else hdv), dtype)
  lens = jnp.array([T, T - 3], jnp.int32)
  kl = jnp.array([80, 7], jnp.int32)

  def loss(q, k, v):
    cfg = core.Config(0.125, 0.0, -1, 0, deterministic, kernel=True)
    out, _ = core.attention(q, k, v, lens, kl, None, None, cfg)
    return out.astype(jnp.float32).sum()
  g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return jax.export.export(g, platforms=["cuda"], disabled_checks=_CHECKS)(
      q, kv, v).mlir_module()


def _bwd_calls(text):
  return [l for l in text.splitlines() if "@jax_fa3_bwd" in l]


@pytest.mark.parametrize("det", [False, True])
def test_cuda_lowering_uses_kernel_when_compiled(monkeypatch, det):
  monkeypatch.setattr(_native, "_BWD_CONFIGS",
                      frozenset({("bfloat16", 128)}))
  text = _cuda_grad_module(jnp.bfloat16, 128, deterministic=det)
  calls = _bwd_calls(text)
  assert len(calls) == 1, calls
  assert f"deterministic = {int(det)} : i32" in calls[0]
  # Scratch outputs (t_pad = 128 rows): dq_accum, delta, lse_log2, semaphores.
  for ty in ("tensor<2x4x128x128xf32>", "tensor<2x4x128xf32>",
             "tensor<2x4x2xi32>"):
    assert ty in calls[0], ty


def test_cuda_lowering_falls_back_per_config(monkeypatch):
  # Kernel compiled for bf16 d128 only: fp16 d128 and bf16 d256 use the
  # reference backward (and still differentiate).
  monkeypatch.setattr(_native, "_BWD_CONFIGS",
                      frozenset({("bfloat16", 128)}))
  assert not _bwd_calls(_cuda_grad_module(jnp.float16, 128))
  assert not _bwd_calls(_cuda_grad_module(jnp.bfloat16, 256, T=40))
  monkeypatch.setattr(_native, "_BWD_CONFIGS", frozenset())
  assert not _bwd_calls(_cuda_grad_module(jnp.bfloat16, 128))


def test_bwd_kernel_available_per_value_head_dim(monkeypatch):
  monkeypatch.setattr(_native, "_BWD_CONFIGS", frozenset({("bfloat16", 192)}))
  monkeypatch.setattr(_native, "_BWD_VALUE_CONFIGS",
                      frozenset({("float16", 192, 128)}))
  assert P.bwd_kernel_available(jnp.bfloat16, 192)
  assert P.bwd_kernel_available(jnp.bfloat16, 192, 192)
  assert not P.bwd_kernel_available(jnp.bfloat16, 192, 128)
  assert P.bwd_kernel_available(np.float16, 192, 128)
  assert not P.bwd_kernel_available(np.float16, 192)
  assert not P.bwd_kernel_available(np.float16, 128, 64)


def test_cuda_lowering_value_head_dim(monkeypatch):
  # V head dim 128 under Q/K's 192: the kernel only where the pair's backward
  # was built (a dv == d kernel for 192 does not serve it).
  monkeypatch.setattr(_native, "_BWD_CONFIGS", frozenset({("bfloat16", 192)}))
  monkeypatch.setattr(_native, "_BWD_VALUE_CONFIGS", frozenset())
  assert not _bwd_calls(_cuda_grad_module(jnp.bfloat16, 192, hdv=128))
  monkeypatch.setattr(_native, "_BWD_VALUE_CONFIGS",
                      frozenset({("bfloat16", 192, 128)}))
  calls = _bwd_calls(_cuda_grad_module(jnp.bfloat16, 192, hdv=128))
  assert len(calls) == 1, calls
  # v, out, dout and dv on Hv; dq, dk and the dQ accumulator on H; no bias
  # gradient (an empty result); the split scratch as the handler sizes it
  # (from H).
  split = P.bwd_split_scratch_floats(2, 80, 2, 192)
  assert ("(tensor<2x100x4x192xbf16>, tensor<2x80x2x192xbf16>, "
          "tensor<2x80x2x128xbf16>, tensor<2x100x4x128xbf16>, "
          "tensor<2x4x100xf32>, tensor<2x100x4x128xbf16>, ") in calls[0]
  assert ("-> (tensor<2x100x4x192xbf16>, tensor<2x80x2x192xbf16>, "
          "tensor<2x80x2x128xbf16>, tensor<2x0xbf16>, tensor<2x4x128x192xf32>, "
          "tensor<2x4x128xf32>, tensor<2x4x128xf32>, tensor<2x4x2xi32>, "
          f"tensor<{split}xf32>)") in calls[0], calls[0]


@pytest.mark.parametrize("bad", [1, "yes", None, np.int32(1)])
def test_deterministic_must_be_bool(bad):
  x = jnp.ones((1, 8, 2, 16), jnp.float32)
  with pytest.raises(ValueError, match="deterministic"):
    jax_fa3.attention(x, x, x, deterministic=bad)


def test_deterministic_reference_grads_equal():
  q, k, v, _ = U.rand(3, B=1, T=19, S=23, N=2, K=1, H=8)

  def grads(det):
    f = lambda q, k, v: jax_fa3.attention(  # noqa: E731
        q, k, v, is_causal=True, deterministic=det).sum()
    return jax.grad(f, argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(grads(False), grads(True)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

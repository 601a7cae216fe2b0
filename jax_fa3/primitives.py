"""JAX primitives ``fa3_fwd`` / ``fa3_bwd`` and the differentiable wrapper.

On CUDA the forward lowers to the XLA FFI custom call ``jax_fa3_fwd`` (see the
FFI contract in ``cc/``) and the backward to ``jax_fa3_bwd`` for every
(dtype, head dim) in ``_native.compiled_bwd_configs()``; a configuration
without a backward kernel (head dims 96/192/256 for now) lowers the backward to
the reference, explicitly.  On every other platform both lower to the pure-JAX
blockwise reference (:mod:`jax_fa3.reference`), so the primitives are usable
-- and tested -- on CPU.

Static parameters (``scale``, ``softcap``, ``window_left``, ``window_right``)
are Python ``float``/``int`` primitive params; they are converted to
``np.float32``/``np.int32`` FFI attributes at lowering time.
"""
from __future__ import annotations

import functools
from functools import partial

import numpy as np
import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

try:
  from jax.core import ShapedArray
except ImportError:  # pragma: no cover - future jax
  from jax._src.core import ShapedArray  # type: ignore

from jax_fa3 import _native, reference

__all__ = ["fa3_fwd_p", "fa3_bwd_p", "fa3_fwd", "fa3_bwd", "fa3_attention"]

# The CUDA backward kernel ("jax_fa3_bwd") is used for the configurations in
# _native.compiled_bwd_configs(); False forces the reference backward.
_BWD_KERNEL = True

FWD_TARGET = "jax_fa3_fwd"
BWD_TARGET = "jax_fa3_bwd"

fa3_fwd_p = Primitive("fa3_fwd")
fa3_fwd_p.multiple_results = True
fa3_bwd_p = Primitive("fa3_bwd")
fa3_bwd_p.multiple_results = True


def _attrs(scale, softcap, window_left, window_right):
  return dict(scale=float(scale), softcap=float(softcap),
              window_left=int(window_left), window_right=int(window_right))


def fa3_fwd(q, k, v, q_lens, kv_lens, *, scale, softcap=0.0, window_left=-1,
            window_right=-1):
  """Binds ``fa3_fwd``: returns ``(out [B,T,N,H] q.dtype, lse f32 [B,N,T])``."""
  out, lse = fa3_fwd_p.bind(q, k, v, q_lens, kv_lens,
                            **_attrs(scale, softcap, window_left, window_right))
  return out, lse


def fa3_bwd(q, k, v, out, lse, dout, q_lens, kv_lens, *, scale, softcap=0.0,
            window_left=-1, window_right=-1, deterministic=False):
  """Binds ``fa3_bwd``: returns ``(dq, dk, dv)``.

  ``deterministic=True`` makes the kernel's dQ reduction run in a fixed order
  (bit-identical gradients run to run); the reference is deterministic anyway.
  """
  dq, dk, dv = fa3_bwd_p.bind(
      q, k, v, out, lse, dout, q_lens, kv_lens,
      **_attrs(scale, softcap, window_left, window_right),
      deterministic=bool(deterministic))
  return dq, dk, dv


# ---------------------------------------------------------------- impl / eval
def _fwd_impl(q, k, v, q_lens, kv_lens, **attrs):
  return reference.attention_fwd(q, k, v, q_lens, kv_lens, **attrs)


def _bwd_impl(q, k, v, out, lse, dout, q_lens, kv_lens, deterministic=False,
              **attrs):
  del deterministic  # the reference's order is fixed
  return reference.attention_bwd(q, k, v, out, lse, dout, q_lens, kv_lens,
                                 **attrs)


def _fwd_abstract(q, k, v, q_lens, kv_lens, **_):
  B, T, N, _h = q.shape
  return (ShapedArray(q.shape, q.dtype),
          ShapedArray((B, N, T), jnp.float32))


def _bwd_abstract(q, k, v, out, lse, dout, q_lens, kv_lens, **_):
  return (ShapedArray(q.shape, q.dtype), ShapedArray(k.shape, k.dtype),
          ShapedArray(v.shape, v.dtype))


@functools.lru_cache(maxsize=None)
def _jitted_bind(prim, params):
  return jax.jit(lambda *args: prim.bind(*args, **dict(params)))


def _eager_impl(prim):
  # Eager application = jit of the single primitive (uses the lowerings below).
  def impl(*args, **params):
    return _jitted_bind(prim, tuple(sorted(params.items())))(*args)
  return impl


fa3_fwd_p.def_impl(_eager_impl(fa3_fwd_p))
fa3_bwd_p.def_impl(_eager_impl(fa3_bwd_p))
fa3_fwd_p.def_abstract_eval(_fwd_abstract)
fa3_bwd_p.def_abstract_eval(_bwd_abstract)


# ------------------------------------------------------------------ lowering
def _ffi_rule(target):
  rule = jax.ffi.ffi_lowering(target)

  def lowering(ctx, *args, scale, softcap, window_left, window_right):
    return rule(ctx, *args, scale=np.float32(scale),
                softcap=np.float32(softcap),
                window_left=np.int32(window_left),
                window_right=np.int32(window_right))
  return lowering


# Default (every platform): the pure-JAX reference.
mlir.register_lowering(fa3_fwd_p, mlir.lower_fun(_fwd_impl,
                                                 multiple_results=True))
mlir.register_lowering(fa3_bwd_p, mlir.lower_fun(_bwd_impl,
                                                 multiple_results=True))
BWD_ROW_PAD = 128    # kBwdRowPad in cc/bwd/params.h
BWD_SEM_BLOCK = 64   # kBwdBlockM in cc/bwd/params.h
BWD_MAX_SPLIT = 160  # kBwdMaxSplitUnits in cc/bwd/params.h


def bwd_split_scratch_floats(B, S, K, H) -> int:
  """Size of the split key blocks' scratch (bwd_split_scratch_floats in
  cc/bwd/params.h): counters, then dK/dV sums of up to 128 keys per slot."""
  slots = min(B * K * -(-S // 64), BWD_MAX_SPLIT)
  return BWD_MAX_SPLIT + slots * 2 * 128 * H


def bwd_kernel_available(dtype, head_dim) -> bool:
  """True iff ``jax_fa3_bwd`` was compiled for (dtype, head_dim)."""
  return _BWD_KERNEL and (np.dtype(dtype).name,
                          int(head_dim)) in _native.compiled_bwd_configs()


def _bwd_kernel_call(q, k, v, out, lse, dout, q_lens, kv_lens, *, scale,
                     softcap, window_left, window_right, deterministic):
  """The backward custom call; its fp32/int32 scratch comes from XLA as extra
  outputs (dQ accumulator, delta, base-2 LSE, semaphores, split key blocks'
  sums) and is dropped."""
  B, T, N, H = q.shape
  t_pad = -(-T // BWD_ROW_PAD) * BWD_ROW_PAD
  f32 = jnp.float32
  shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct((B, N, t_pad, H), f32),
            jax.ShapeDtypeStruct((B, N, t_pad), f32),
            jax.ShapeDtypeStruct((B, N, t_pad), f32),
            jax.ShapeDtypeStruct((B, N, t_pad // BWD_SEM_BLOCK), jnp.int32),
            jax.ShapeDtypeStruct(
                (bwd_split_scratch_floats(B, k.shape[1], k.shape[2], H),), f32))
  res = jax.ffi.ffi_call(BWD_TARGET, shapes)(
      q, k, v, out, lse, dout, q_lens, kv_lens, scale=np.float32(scale),
      softcap=np.float32(softcap), window_left=np.int32(window_left),
      window_right=np.int32(window_right),
      deterministic=np.int32(bool(deterministic)))
  return res[:3]


_bwd_kernel_lowering = mlir.lower_fun(_bwd_kernel_call, multiple_results=True)
_bwd_reference_lowering = mlir.lower_fun(_bwd_impl, multiple_results=True)


def _bwd_cuda_lowering(ctx, *args, **params):
  # Per configuration: a (dtype, head dim) without a compiled backward kernel
  # differentiates through the reference (documented in the README table).
  q_aval = ctx.avals_in[0]
  if bwd_kernel_available(q_aval.dtype, q_aval.shape[-1]):
    return _bwd_kernel_lowering(ctx, *args, **params)
  return _bwd_reference_lowering(ctx, *args, **params)


# CUDA: the FFI custom calls.
mlir.register_lowering(fa3_fwd_p, _ffi_rule(FWD_TARGET), platform="cuda")
mlir.register_lowering(fa3_bwd_p, _bwd_cuda_lowering, platform="cuda")


# ------------------------------------------------------------------ batching
def _fold(x, bd, size):
  """Moves the vmapped axis to the front and folds it into the batch dim."""
  if bd is None:
    x = jnp.broadcast_to(x, (size,) + x.shape)
  else:
    x = jnp.moveaxis(x, bd, 0)
  return x.reshape((size * x.shape[1],) + x.shape[2:])


def _unfold(x, size):
  return x.reshape((size, x.shape[0] // size) + x.shape[1:])


def _batch_rule(prim):
  def rule(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = [_fold(a, d, size) for a, d in zip(args, dims)]
    outs = prim.bind(*folded, **params)
    return [_unfold(o, size) for o in outs], [0] * len(outs)
  return rule


batching.primitive_batchers[fa3_fwd_p] = _batch_rule(fa3_fwd_p)
batching.primitive_batchers[fa3_bwd_p] = _batch_rule(fa3_bwd_p)


# ---------------------------------------------------------------- custom_vjp
@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def fa3_attention(q, k, v, q_lens, kv_lens, scale, softcap, window_left,
                  window_right, deterministic=False):
  """Differentiable kernel attention returning ``(out, lse)``.

  ``q_lens``/``kv_lens`` must be ``int32[B]`` arrays (not None).  The ``lse``
  output is treated as non-differentiable (its cotangent is ignored).
  ``deterministic`` only affects the backward (fixed dQ reduction order).
  """
  return fa3_fwd(q, k, v, q_lens, kv_lens, scale=scale, softcap=softcap,
                 window_left=window_left, window_right=window_right)


def _vjp_fwd(q, k, v, q_lens, kv_lens, scale, softcap, window_left,
             window_right, deterministic=False):
  out, lse = fa3_fwd(q, k, v, q_lens, kv_lens, scale=scale, softcap=softcap,
                     window_left=window_left, window_right=window_right)
  return (out, lse), (q, k, v, out, lse, q_lens, kv_lens)


def _vjp_bwd(scale, softcap, window_left, window_right, deterministic, res,
             cts):
  q, k, v, out, lse, q_lens, kv_lens = res
  dout, _ = cts
  dq, dk, dv = fa3_bwd(q, k, v, out, lse, dout.astype(out.dtype), q_lens,
                       kv_lens, scale=scale, softcap=softcap,
                       window_left=window_left, window_right=window_right,
                       deterministic=deterministic)
  return dq, dk, dv, None, None


fa3_attention.defvjp(_vjp_fwd, _vjp_bwd)

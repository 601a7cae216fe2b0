"""The inner primitives, one per kernel family: their shapes, lowering and
batching rule.

* ``fa3_fwd_p``: FlashAttention forward -> FFI ``jax_fa3_fwd``.
* ``fa3_bwd_p``: its backward -> FFI ``jax_fa3_bwd`` where a backward kernel
  was compiled for (dtype, head dim, V head dim), otherwise the reference
  backward.
* ``fp8_quantize_p``: the FP8 pre-pass (Hadamard rotation, block scales,
  e4m3 cast) -> FFI ``jax_fa3_fp8_quantize``.
* ``fp8_fwd_p``: FP8 attention forward -> FFI ``jax_fa3_fp8_fwd``.
* ``kvcache_fwd_p``: the forward kernels on a KV cache (packed GQA rows,
  bottom-right positions, paged caches, split-KV parts) -> FFI
  ``jax_fa3_kvcache_fwd`` (:mod:`jax_fa3.kvcache` merges the parts).
* ``kvcache_append_p``: new keys and values written into a KV cache in place
  -> FFI ``jax_fa3_kvcache_append`` (results alias the caches).

On CUDA they lower to the FFI custom calls (the contract is in ``cc/ffi``).
On every other platform they lower to pure JAX (:mod:`jax_fa3.reference`;
the FP8 pair to the emulation that :mod:`jax_fa3.fp8` registers), so the
whole primitive path runs, and is tested, on CPU.  The attention primitives
take the four pair-rule operands of :mod:`jax_fa3.pair_rule` (segment ids or
a mask) after the lengths, then an additive bias ``[B|1, N|1, T, S]`` in q's
dtype (empty arrays when there are none); the backward returns the bias
gradient per batch row and head, ``[B, N, T, S]`` in ``dbias_dtype`` (q's
dtype or float32) where that is not None.  Static parameters are Python
numbers in the primitive params and become ``np.float32`` / ``np.int32`` FFI
attributes at lowering time.

Users do not bind these directly: :mod:`jax_fa3.sharding` wraps each one with
its partitioning rule, and :mod:`jax_fa3.core` holds the ``custom_vjp``.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_fa3 import _native, reference, pair_rule

__all__ = ["fa3_fwd_p", "fa3_bwd_p", "fp8_quantize_p", "fp8_fwd_p",
           "kvcache_fwd_p", "fa3_fwd", "fa3_bwd", "no_sinks", "no_bias",
           "has_bias", "fp8_quantize",
           "fp8_fwd", "kvcache_fwd", "fold_vmap",
           "bwd_kernel_available", "FWD_TARGET", "BWD_TARGET",
           "FP8_QUANT_TARGET", "FP8_FWD_TARGET", "KVCACHE_TARGET"]

FWD_TARGET = "jax_fa3_fwd"
BWD_TARGET = "jax_fa3_bwd"
FP8_QUANT_TARGET = "jax_fa3_fp8_quantize"
FP8_FWD_TARGET = "jax_fa3_fp8_fwd"
KVCACHE_TARGET = "jax_fa3_kvcache_fwd"
KVCACHE_APPEND_TARGET = "jax_fa3_kvcache_append"

_F32 = jnp.float32
_E4M3 = jnp.float8_e4m3fn
_sds = jax.ShapeDtypeStruct


def _primitive(name):
  p = Primitive(name)
  p.multiple_results = True
  p.def_impl(partial(dispatch.apply_primitive, p))  # eager = jit of one op
  return p


fa3_fwd_p = _primitive("fa3_fwd")
fa3_bwd_p = _primitive("fa3_bwd")
fp8_quantize_p = _primitive("fp8_quantize")
fp8_fwd_p = _primitive("fp8_fwd")
kvcache_fwd_p = _primitive("kvcache_fwd")
kvcache_append_p = _primitive("kvcache_append")


# ------------------------------------------------------------------ binders
def _segs(pairs, batch):
  return pair_rule.absent(batch) if pairs is None else tuple(pairs)


def no_sinks():
  """The sinks operand of a call without sinks (an empty array)."""
  return jnp.zeros((0,), _F32)


def no_bias(q):
  """The bias operand of a call without a bias (an empty array)."""
  return jnp.zeros((q.shape[0], 0), q.dtype)


def _bias(bias, q):
  return no_bias(q) if bias is None else bias


def has_bias(bias) -> bool:
  """Whether a bias operand (array or shape) carries a bias."""
  return len(bias.shape) == 4


def fa3_fwd(q, k, v, q_lens, kv_lens, pairs=None, *, scale, softcap=0.0,
            window_left=-1, window_right=-1, sinks=None, bias=None):
  """``(out [B,T,N,H] q.dtype, lse f32 [B,N,T])``; ``pairs``: the segment
  operands (:func:`jax_fa3.pair_rule.from_segment_ids`) or None; ``sinks``:
  float32 ``[N]`` joining every row's softmax (:func:`reference.fold_sinks`)
  or None; ``bias``: ``[B|1, N|1, T, S]`` in q's dtype, or None."""
  return tuple(fa3_fwd_p.bind(
      q, k, v, q_lens, kv_lens, *_segs(pairs, q.shape[0]), _bias(bias, q),
      no_sinks() if sinks is None else sinks, scale=float(scale),
      softcap=float(softcap),
      window_left=int(window_left), window_right=int(window_right)))


def fa3_bwd(q, k, v, out, lse, dout, q_lens, kv_lens, pairs=None, *, scale,
            softcap=0.0, window_left=-1, window_right=-1, deterministic=False,
            bias=None, dbias_dtype=None):
  """``(dq, dk, dv)``, and with a ``bias`` operand (an array, possibly
  :func:`no_bias`) a fourth result: the bias gradient ``[B, N, T, S]`` (per
  batch row and head; the caller sums over broadcast dims) in
  ``dbias_dtype``, or ``[B, 0]`` where that is None.  ``deterministic`` fixes the kernel's dQ
  summation order (bit-identical gradients run to run)."""
  res = tuple(fa3_bwd_p.bind(
      q, k, v, out, lse, dout, q_lens, kv_lens, *_segs(pairs, q.shape[0]),
      _bias(bias, q), scale=float(scale),
      softcap=float(softcap), window_left=int(window_left),
      window_right=int(window_right), deterministic=bool(deterministic),
      dbias_dtype=(None if dbias_dtype is None or bias is None
                   or not has_bias(bias) else np.dtype(dbias_dtype))))
  return res if bias is not None else res[:3]


def fp8_quantize(q, k, v, signs, fixed, *, block_q, block_kv, hadamard,
                 v_transposed):
  """``(q8, k8, v8, q_scale, k_scale, v_scale)``; ``fixed`` is empty (block
  scales) or the three tensor-wide scales; ``v_transposed``: v8 in the V^T
  layout of :mod:`jax_fa3.fp8`."""
  return tuple(fp8_quantize_p.bind(
      q, k, v, signs, fixed, block_q=int(block_q), block_kv=int(block_kv),
      hadamard=bool(hadamard), v_transposed=bool(v_transposed)))


def fp8_fwd(q8, k8, v8, q_scale, k_scale, v_scale, q_lens, kv_lens, pairs=None,
            *, scale, window_left, window_right, out_dtype, v_transposed):
  """``(out [B,T,N,H] out_dtype, lse f32 [B,N,T])``."""
  return tuple(fp8_fwd_p.bind(
      q8, k8, v8, q_scale, k_scale, v_scale, q_lens, kv_lens,
      *_segs(pairs, q8.shape[0]),
      scale=float(scale), window_left=int(window_left),
      window_right=int(window_right), out_dtype=np.dtype(out_dtype),
      v_transposed=bool(v_transposed)))


def kvcache_fwd(q, k_cache, v_cache, kv_lens, page_table, *,
                scale, softcap=0.0, window_left=-1, window_right=-1, q_pack=1,
                num_splits=1, heads_major=False, new_rows=0):
  """``(out [B, num_splits, T, N, H], lse f32 [B, num_splits, N, T])``: the
  split-KV parts of attention on a cache (:func:`reference.kvcache_fwd`),
  every query row valid and aligned bottom-right to ``kv_lens`` (clamped to
  the capacity inside, so a caller's cache lengths pass as they are and a
  decode step compiles to this call alone; ``new_rows`` appended ahead of
  the call add to the clamped lengths, capped at the capacity);
  ``page_table`` int32 ``[B, pages]``, or ``[B, 0]`` for a contiguous
  cache.  ``heads_major``: q is ``[B, N, T, H]`` and out ``[B, num_splits,
  N, T, H]``."""
  return tuple(kvcache_fwd_p.bind(
      q, k_cache, v_cache, kv_lens, page_table,
      scale=float(scale), softcap=float(softcap),
      window_left=int(window_left), window_right=int(window_right),
      q_pack=int(q_pack), num_splits=int(num_splits),
      heads_major=bool(heads_major), new_rows=int(new_rows)))


def kvcache_append(k_new, v_new, k_cache, v_cache, seqlens, page_table):
  """``(k_cache, v_cache)`` with ``k_new, v_new [B, Tq, K, H]`` written at
  positions ``clip(seqlens, 0, capacity) + i`` (:func:`reference.kvcache_append`);
  on the kernels the results alias the caches (donated caches update in
  place)."""
  return tuple(kvcache_append_p.bind(k_new, v_new, k_cache, v_cache, seqlens,
                                     page_table))


# ------------------------------------------------------------ abstract eval
def _blocks(n, rows):
  return -(-n // rows)


def vt_shape(b, s, kh, h, block_kv):
  """V^T as the pre-pass writes it: ``[B, K, H, S padded to block_kv]``."""
  return (b, kh, h, _blocks(s, block_kv) * block_kv)


def _fwd_shapes(q, k, v, q_lens, kv_lens, *_segs, **_):
  b, t, n, _h = q.shape
  return (_sds((b, t, n, v.shape[-1]), q.dtype), _sds((b, n, t), _F32))


def _dbias_shape(q, bias, dbias_dtype):
  """[B, N, T, S] (S: the bias's) in ``dbias_dtype``, or [B, 0] where that
  is None (no bias gradient asked for)."""
  B, T, N, _ = q.shape
  if dbias_dtype is None:
    return _sds((B, 0), bias.dtype)
  return _sds((B, N, T, bias.shape[-1]), dbias_dtype)


def _grad_shapes(q, k, v):
  return (_sds(q.shape, q.dtype), _sds(k.shape, k.dtype),
          _sds(v.shape, v.dtype))


def _bwd_shapes(q, k, v, *operands, dbias_dtype, **_):
  """dq, dk, dv and the bias gradient (the last operand is the bias)."""
  return _grad_shapes(q, k, v) + (_dbias_shape(q, operands[-1], dbias_dtype),)


def _quantize_shapes(q, k, v, signs, fixed, *, block_q, block_kv, hadamard,
                     v_transposed):
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  v_shape = vt_shape(b, s, kh, h, block_kv) if v_transposed else v.shape
  kv_scales = _sds((b, kh, _blocks(s, block_kv)), _F32)
  return (_sds(q.shape, _E4M3), _sds(k.shape, _E4M3), _sds(v_shape, _E4M3),
          _sds((b, n, _blocks(t, block_q)), _F32), kv_scales, kv_scales)


def _fp8_fwd_shapes(q8, k8, v8, qs, ks, vs, q_lens, kv_lens, *_segs, out_dtype,
                    **_):
  b, t, n, _h = q8.shape
  return (_sds(q8.shape, out_dtype), _sds((b, n, t), _F32))


def _kvcache_shapes(q, *_, num_splits, heads_major, **__):
  # out keeps q's layout per part; lse is [B, Z, N, T] either way.
  b, d1, d2, h = q.shape
  heads, rows = (d1, d2) if heads_major else (d2, d1)
  return (_sds((b, num_splits, d1, d2, h), q.dtype),
          _sds((b, num_splits, heads, rows), _F32))


def _append_shapes(k_new, v_new, k_cache, v_cache, *_):
  return (_sds(k_cache.shape, k_cache.dtype), _sds(v_cache.shape, v_cache.dtype))


def _abstract(shapes_fn):
  def rule(*avals, **params):
    return [jax.core.ShapedArray(s.shape, s.dtype)
            for s in shapes_fn(*avals, **params)]
  return rule


fa3_fwd_p.def_abstract_eval(_abstract(_fwd_shapes))
fa3_bwd_p.def_abstract_eval(_abstract(_bwd_shapes))
fp8_quantize_p.def_abstract_eval(_abstract(_quantize_shapes))
fp8_fwd_p.def_abstract_eval(_abstract(_fp8_fwd_shapes))
kvcache_fwd_p.def_abstract_eval(_abstract(_kvcache_shapes))
kvcache_append_p.def_abstract_eval(_abstract(_append_shapes))


# ------------------------------------------------------------------ lowering
def _ffi(target, shapes_fn, attrs_fn):
  """CUDA lowering: the FFI call."""
  def call(*args, **params):
    shapes = shapes_fn(*args, **params)
    return jax.ffi.ffi_call(target, shapes)(*args, **attrs_fn(**params))
  return mlir.lower_fun(call, multiple_results=True)


def _window_attrs(scale, window_left, window_right):
  return dict(scale=np.float32(scale), window_left=np.int32(window_left),
              window_right=np.int32(window_right))


def _fwd_attrs(scale, softcap, window_left, window_right):
  return dict(_window_attrs(scale, window_left, window_right),
              softcap=np.float32(softcap))


BWD_ROW_PAD = 128    # kBwdRowPad in cc/bwd/params.h
BWD_SEM_BLOCK = 64   # kBwdBlockM in cc/bwd/params.h
BWD_MAX_SPLIT = 160  # kBwdMaxSplitUnits in cc/bwd/params.h


def bwd_split_scratch_floats(B, S, K, H) -> int:
  """Size of the split key blocks' scratch (bwd_split_scratch_floats in
  cc/bwd/params.h): counters, then dK/dV sums of up to 128 keys per slot."""
  slots = min(B * K * -(-S // 64), BWD_MAX_SPLIT)
  return BWD_MAX_SPLIT + slots * 2 * 128 * H


def _bwd_kernel_shapes(q, k, v, out, lse, dout, q_lens, kv_lens, *segs_bias,
                       dbias_dtype, **_):
  """dq, dk, dv (dv [B,S,K,Hv] from v, the rest q/k's head dim H), the bias
  gradient, then the fp32/int32 scratch: dQ accumulator, delta, base-2 LSE,
  semaphores, split key blocks' sums."""
  B, T, N, H = q.shape
  t_pad = -(-T // BWD_ROW_PAD) * BWD_ROW_PAD
  return _bwd_shapes(q, k, v, *segs_bias, dbias_dtype=dbias_dtype) + (
      _sds((B, N, t_pad, H), _F32), _sds((B, N, t_pad), _F32),
      _sds((B, N, t_pad), _F32),
      _sds((B, N, t_pad // BWD_SEM_BLOCK), jnp.int32),
      _sds((bwd_split_scratch_floats(B, k.shape[1], k.shape[2], H),), _F32))


def _bwd_kernel_attrs(deterministic, dbias_dtype, **attrs):
  del dbias_dtype  # the dbias result's type carries it
  return dict(_fwd_attrs(**attrs), deterministic=np.int32(deterministic))


def _quantize_attrs(block_q, block_kv, hadamard, v_transposed):
  return dict(block_q=np.int32(block_q), block_kv=np.int32(block_kv),
              hadamard=np.int32(hadamard),
              v_transposed=np.int32(v_transposed))


def _fp8_fwd_attrs(scale, window_left, window_right, out_dtype,
                   v_transposed):
  del out_dtype  # the result type carries it
  return dict(_window_attrs(scale, window_left, window_right),
              v_transposed=np.int32(v_transposed))


def _kvcache_attrs(q_pack, num_splits, heads_major, new_rows, **attrs):
  return dict(_fwd_attrs(**attrs), q_pack=np.int32(q_pack),
              num_splits=np.int32(num_splits),
              heads_major=np.int32(heads_major), new_rows=np.int32(new_rows))


def bwd_kernel_available(dtype, head_dim, value_head_dim=None) -> bool:
  """True iff ``jax_fa3_bwd`` was compiled for (dtype, head_dim) with a V
  head dim of ``value_head_dim`` (default: ``head_dim``)."""
  name, h = np.dtype(dtype).name, int(head_dim)
  hv = h if value_head_dim is None else int(value_head_dim)
  if hv == h:
    return (name, h) in _native.compiled_bwd_configs()
  return (name, h, hv) in _native.compiled_bwd_value_configs()


def _rule_kwargs(pairs, q, k):
  return pair_rule.reference_kwargs(pairs, q.shape[1], k.shape[1])


def _reference_fwd(q, k, v, q_lens, kv_lens, *pairs_bias_sinks, **attrs):
  *pairs, bias, sinks = pairs_bias_sinks
  kw = _rule_kwargs(pairs, q, k)
  if has_bias(bias):
    kw["bias"] = bias
  res = reference.attention_fwd(q, k, v, q_lens, kv_lens, **kw, **attrs)
  return reference.fold_sinks(*res, sinks)


def _reference_bwd(q, k, v, out, lse, dout, q_lens, kv_lens, *pairs_bias,
                   deterministic, dbias_dtype, **attrs):
  del deterministic  # the reference's summation order is fixed
  *pairs, bias = pairs_bias
  kw = _rule_kwargs(pairs, q, k)
  if dbias_dtype is None:  # no bias, or no gradient asked for it
    if has_bias(bias):
      kw["bias"] = bias
    none = jnp.zeros(_dbias_shape(q, bias, None).shape, bias.dtype)
    return reference.attention_bwd(q, k, v, out, lse, dout, q_lens, kv_lens,
                                   **kw, **attrs) + (none,)
  B, T, N, _ = q.shape
  # Per batch row and head, as the kernel writes it.
  full = jnp.broadcast_to(bias, (B, N, T, k.shape[1]))
  dq, dk, dv, dbias = reference.attention_bwd_with_dbias(
      q, k, v, out, lse, dout, q_lens, kv_lens, bias=full, **kw, **attrs)
  return dq, dk, dv, dbias.astype(dbias_dtype)


def _pad_bias(bias):
  """The kernels read the bias in column pairs: S rounded up to even."""
  if not has_bias(bias) or bias.shape[-1] % 2 == 0:
    return bias
  return jnp.pad(bias, [(0, 0)] * 3 + [(0, 1)])


def _fwd_kernel_call(*args, **params):
  *head, bias, sinks = args
  args = (*head, _pad_bias(bias), sinks)
  return jax.ffi.ffi_call(FWD_TARGET, _fwd_shapes(*args))(
      *args, **_fwd_attrs(**params))


def _bwd_kernel_call(*args, **params):
  """The FFI results less the scratch, the bias gradient cut to S."""
  *head, bias = args
  args = (*head, _pad_bias(bias))
  res = jax.ffi.ffi_call(BWD_TARGET, _bwd_kernel_shapes(*args, **params))(
      *args, **_bwd_kernel_attrs(**params))
  dq, dk, dv, dbias = res[:4]
  if params["dbias_dtype"] is not None:
    dbias = dbias[..., :bias.shape[-1]]
  return dq, dk, dv, dbias


_bwd_kernel = mlir.lower_fun(_bwd_kernel_call, multiple_results=True)
_bwd_reference = mlir.lower_fun(_reference_bwd, multiple_results=True)


def _bwd_cuda(ctx, *args, **params):
  # A (dtype, head dim, V head dim) without a compiled backward kernel
  # differentiates through the reference (the README's table lists which).
  q, v = ctx.avals_in[0], ctx.avals_in[2]
  if bwd_kernel_available(q.dtype, q.shape[-1], v.shape[-1]):
    return _bwd_kernel(ctx, *args, **params)
  return _bwd_reference(ctx, *args, **params)


_kvcache_kernel = _ffi(KVCACHE_TARGET, _kvcache_shapes, _kvcache_attrs)
_kvcache_reference = mlir.lower_fun(reference.kvcache_fwd,
                                    multiple_results=True)


def _kvcache_cuda(ctx, *args, **params):
  q = ctx.avals_in[0]
  if (np.dtype(q.dtype).name, q.shape[-1]) in _native.compiled_configs():
    return _kvcache_kernel(ctx, *args, **params)
  return _kvcache_reference(ctx, *args, **params)


mlir.register_lowering(kvcache_fwd_p, _kvcache_reference)
mlir.register_lowering(kvcache_fwd_p, _kvcache_cuda, platform="cuda")


def _append_kernel_call(k_new, v_new, k_cache, v_cache, seqlens, page_table):
  return jax.ffi.ffi_call(
      KVCACHE_APPEND_TARGET, _append_shapes(k_new, v_new, k_cache, v_cache),
      input_output_aliases={2: 0, 3: 1})(k_new, v_new, k_cache, v_cache,
                                          seqlens, page_table)


_append_kernel = mlir.lower_fun(_append_kernel_call, multiple_results=True)
_append_reference = mlir.lower_fun(reference.kvcache_append,
                                   multiple_results=True)


def _append_cuda(ctx, *args):
  # The copy is dtype-blind: any compiled library serves a cache whose rows
  # are whole 16-byte chunks.
  c = ctx.avals_in[2]
  if _native.compiled_configs() and (c.shape[-1] * np.dtype(c.dtype).itemsize) % 16 == 0:
    return _append_kernel(ctx, *args)
  return _append_reference(ctx, *args)


mlir.register_lowering(kvcache_append_p, _append_reference)
mlir.register_lowering(kvcache_append_p, _append_cuda, platform="cuda")
mlir.register_lowering(fa3_fwd_p, mlir.lower_fun(_reference_fwd,
                                                 multiple_results=True))
mlir.register_lowering(fa3_bwd_p, _bwd_reference)
mlir.register_lowering(fa3_fwd_p, mlir.lower_fun(_fwd_kernel_call,
                                                 multiple_results=True),
                       platform="cuda")
mlir.register_lowering(fa3_bwd_p, _bwd_cuda, platform="cuda")
mlir.register_lowering(
    fp8_quantize_p, _ffi(FP8_QUANT_TARGET, _quantize_shapes, _quantize_attrs),
    platform="cuda")
mlir.register_lowering(
    fp8_fwd_p, _ffi(FP8_FWD_TARGET, _fp8_fwd_shapes, _fp8_fwd_attrs),
    platform="cuda")


# ------------------------------------------------------------------ batching
def fold_vmap(fn, axis_size, args, batched, n_per_batch=None):
  """vmap of a kernel call whose operands all lead with the batch dim: the
  vmapped axis (at 0, or absent) folds into the batch dim, one call serves
  every element.  Operands after the first ``n_per_batch`` are shared by the
  whole batch (Hadamard signs, fixed scales); when one of those is batched
  the elements run one after another instead."""
  n = len(args) if n_per_batch is None else n_per_batch
  bcast = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
           for a, b in zip(args, batched)]
  # An operand that broadcasts over the batch (a bias or mask [1, ...])
  # takes the batch first: folded, its 1 would not match the new batch.
  batch = bcast[0].shape[1]
  bcast = [jnp.broadcast_to(a, a.shape[:1] + (batch,) + a.shape[2:])
           if i < n and a.ndim > 1 and a.shape[1] == 1 < batch else a
           for i, a in enumerate(bcast)]
  if any(batched[n:]):
    return lax.map(lambda xs: tuple(fn(*xs)), tuple(bcast))
  folded = [a.reshape((axis_size * a.shape[1],) + a.shape[2:])
            for a in bcast[:n]] + list(args[n:])
  return tuple(o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:])
               for o in fn(*folded))


def _batch_rule(prim, n_per_batch=None):
  def rule(args, dims, **params):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [a if d is None else jnp.moveaxis(a, d, 0)
            for a, d in zip(args, dims)]
    outs = fold_vmap(lambda *xs: prim.bind(*xs, **params), size, args,
                     [d is not None for d in dims], n_per_batch)
    return list(outs), [0] * len(outs)
  return rule


batching.primitive_batchers[fa3_fwd_p] = _batch_rule(fa3_fwd_p, 10)  # sinks shared
batching.primitive_batchers[fa3_bwd_p] = _batch_rule(fa3_bwd_p)
batching.primitive_batchers[fp8_quantize_p] = _batch_rule(fp8_quantize_p, 3)
batching.primitive_batchers[fp8_fwd_p] = _batch_rule(fp8_fwd_p)

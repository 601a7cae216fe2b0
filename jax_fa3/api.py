"""Public API: :func:`attention`, :func:`dot_product_attention`,
:func:`flax_attention_fn`.

Semantics (all entry points): query row ``i`` of batch ``b`` attends key ``j``
iff ``i < q_len[b]``, ``j < kv_len[b]``, the (top-left aligned) causal / local
window constraints hold, and (reference path only) ``mask`` is True.  Scores
are ``scale * q.k``, soft-capped as ``c * tanh(s / c)`` when ``softcap=c``.

Difference from ``jax.nn.dot_product_attention``: a query row that is *not*
padded but sees no key at all (e.g. a window or mask that excludes every key)
outputs 0 here (its log-sum-exp residual is ``+inf``), whereas jax.nn outputs
the mean of V.  Padded query rows (``i >= q_len[b]``) output 0 in both.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa3 import _native, _validate as V, reference
from jax_fa3 import primitives, sharding
from jax_fa3 import fp8

__all__ = ["attention", "dot_product_attention", "flax_attention_fn"]

_BLOCK_K = 512
_OWN_IMPLS = (None, "fa3", "reference")


def _fold_window(window, is_causal):
  wl, wr = (-1, -1) if window is None else window
  if is_causal:
    wr = 0 if wr < 0 else min(wr, 0)
  return wl, wr


def _core(q, k, v, *, bias, mask, q_lens, kv_lens, scale, softcap, wl, wr,
          implementation, deterministic=False):
  """Validated 4-D inputs -> (out [B,T,N,H], lse f32 [B,N,T])."""
  B, T, N, H = q.shape
  S = k.shape[1]
  blocker = V.kernel_blocker(q.dtype, H, _native)
  if implementation == "fa3":
    if bias is not None or mask is not None:
      raise ValueError("bias/mask are not supported by implementation='fa3'; "
                       "use implementation=None or 'reference'")
    if blocker is not None:
      raise ValueError(f"implementation='fa3' is not possible: {blocker}")
  use_kernel = (implementation == "fa3" or (
      implementation is None and blocker is None and bias is None
      and mask is None))
  if use_kernel:
    if q_lens is None:
      q_lens = jnp.full((B,), T, jnp.int32)
    if kv_lens is None:
      kv_lens = jnp.full((B,), S, jnp.int32)
    return sharding.fa3_attention(q, k, v, q_lens, kv_lens, scale, softcap,
                                    wl, wr, deterministic)
  return reference.reference_attention(q, k, v, q_lens, kv_lens, bias, mask,
                                       scale, softcap, wl, wr, _BLOCK_K)


def attention(query, key, value, *, scale=None, is_causal=False,
              local_window_size=None, query_seq_lengths=None,
              key_value_seq_lengths=None, softcap=None, precision=None,
              implementation=None, deterministic=False, fp8_block_scales=True,
              fp8_hadamard=True, fp8_seed=0):
  """FlashAttention-3 attention with the layout of ``jax.nn.dot_product_attention``.

  Args:
    query: ``[B, T, N, H]``; key, value: ``[B, S, K, H]`` with ``N % K == 0``
      (GQA / MQA).  bfloat16/float16 for the kernel; float32 uses the reference.
    scale: logit scale, default ``1/sqrt(H)``.
    is_causal: top-left aligned causal mask (query ``i`` sees keys ``<= i``).
    local_window_size: ``w`` (= ``(w, w)``) or ``(left, right)``: query ``i``
      sees keys ``i - left <= j <= i + right`` (jax.nn semantics).
    query_seq_lengths, key_value_seq_lengths: optional ``int32[B]``.
    softcap: optional positive float ``c``: ``s = c * tanh(s / c)``.
    precision: None, or ``"fp8"``: bf16/fp16 inputs are quantized to e4m3
      inside (see :mod:`jax_fa3.fp8`: the FP8 kernel on an H100/H200, else a
      pure-JAX emulation; ``JAX_FA3_FP8_KERNEL=0`` forces the emulation); the result has
      the input dtype; gradients are straight-through (the 16-bit backward at
      the original inputs).  Options, for ablation: ``fp8_block_scales``
      (False: one scale per tensor), ``fp8_hadamard`` (random-sign Hadamard
      rotation of Q and K), ``fp8_seed`` (the signs).
    implementation: None (kernel when supported, otherwise the reference),
      ``"fa3"`` (kernel or ValueError) or ``"reference"``.
    deterministic: if True, the backward kernel sums dQ over key blocks in a
      fixed order, so gradients are bit-identical run to run (slower: key
      blocks wait for their turn per query block; about 0.67-0.78x the
      backward's speed at d128 on an H200).  The forward is always
      deterministic, and so is the reference backward.

  Returns:
    Array with ``query``'s shape and dtype.  Rows with no visible key are 0
    (jax.nn returns mean(V) for non-padded fully-masked rows).
  """
  q, k, v = V.check_qkv(query, key, value)
  B, T, N, H = q.shape
  q_lens = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", B)
  kv_lens = V.check_seq_lengths(key_value_seq_lengths,
                                "key_value_seq_lengths", B)
  window = V.check_window(local_window_size)
  softcap = V.check_softcap(softcap)
  scale = V.check_scale(scale, H)
  is_causal = V.check_is_causal(is_causal)
  deterministic = V.check_deterministic(deterministic)
  V.check_precision(precision)
  V.check_implementation(implementation, _OWN_IMPLS)
  wl, wr = _fold_window(window, is_causal)
  if precision == "fp8":
    opts = fp8.check_fp8_options(fp8_block_scales, fp8_hadamard, fp8_seed)
    def bf16_core(q, k, v):
      return _core(q, k, v, bias=None, mask=None, q_lens=q_lens,
                   kv_lens=kv_lens, scale=scale, softcap=softcap, wl=wl, wr=wr,
                   implementation=implementation,
                   deterministic=deterministic)[0]
    return fp8.fp8_attention(
        q, k, v, q_lens, kv_lens, scale=scale, softcap=softcap, wl=wl, wr=wr,
        block_scales=opts[0], hadamard=opts[1], seed=opts[2],
        implementation=implementation, bf16_core=bf16_core)
  out, _ = _core(q, k, v, bias=None, mask=None, q_lens=q_lens,
                 kv_lens=kv_lens, scale=scale, softcap=softcap, wl=wl, wr=wr,
                 implementation=implementation, deterministic=deterministic)
  return out


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale=None, is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False):
  """Drop-in replacement for ``jax.nn.dot_product_attention`` (same signature).

  ``implementation``: None (jax_fa3: kernel when supported, else the
  reference), ``"fa3"``, ``"reference"``, or ``"xla"``/``"cudnn"`` (delegated
  to ``jax.nn.dot_product_attention``).  ``bias``/``mask`` (broadcastable to
  ``[B, N, T, S]``) use the blockwise reference.  ``return_residual=True``
  returns ``(out, lse)`` with ``lse`` shaped ``[B, T, N]`` (``[T, N]`` for 3-D
  inputs) in ``key.dtype`` and without gradient, like jax.nn.  Rows with no
  visible key give 0 and an lse of ``+inf`` (jax.nn: mean(V) and a large
  negative lse).
  """
  if implementation in ("xla", "cudnn"):
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation=implementation,
        return_residual=return_residual)
  V.check_implementation(implementation, _OWN_IMPLS + ("xla", "cudnn"))
  q, k, v = (V.as_array(query, "query"), V.as_array(key, "key"),
             V.as_array(value, "value"))
  if not (q.ndim == k.ndim == v.ndim and q.ndim in (3, 4)):
    raise ValueError("query/key/value must all be rank 4 [B, T|S, N|K, H] or "
                     f"all rank 3 [T|S, N|K, H], got ranks {q.ndim}, "
                     f"{k.ndim}, {v.ndim}")
  squeeze = q.ndim == 3
  if squeeze:
    q, k, v = q[None], k[None], v[None]
  q, k, v = V.check_qkv(q, k, v)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  bias4 = V.check_bias_mask(bias, "bias", B, N, T, S, K)
  mask4 = V.check_bias_mask(mask, "mask", B, N, T, S, K)
  q_lens = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", B)
  kv_lens = V.check_seq_lengths(key_value_seq_lengths,
                                "key_value_seq_lengths", B)
  window = V.check_window(local_window_size)
  scale = V.check_scale(scale, H)
  is_causal = V.check_is_causal(is_causal)
  wl, wr = _fold_window(window, is_causal)
  out, lse = _core(q, k, v, bias=bias4, mask=mask4, q_lens=q_lens,
                   kv_lens=kv_lens, scale=scale, softcap=0.0, wl=wl, wr=wr,
                   implementation=implementation)
  if squeeze:
    out, lse = out[0], lse[0]
  if not return_residual:
    return out
  res = jax.lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(k.dtype))
  return out, res


def _flatten_bm(t, name, batch_dims, Bf):
  """flax bias/mask [batch..., heads, q, k] (broadcastable) -> 4-D [Bf|1,...]."""
  if t is None:
    return None
  t = jnp.asarray(t)
  nb = len(batch_dims)
  if t.ndim > nb + 3:
    raise ValueError(f"{name} must be broadcastable to [batch..., heads, "
                     f"q_length, kv_length], got shape {t.shape}")
  t = t.reshape((1,) * (nb + 3 - t.ndim) + t.shape)
  lead = t.shape[:nb]
  if all(d == 1 for d in lead):
    return t.reshape((1,) + t.shape[nb:])
  t = jnp.broadcast_to(t, tuple(batch_dims) + t.shape[nb:])
  return t.reshape((Bf,) + t.shape[nb:])


def flax_attention_fn(query, key, value, bias=None, mask=None,
                      broadcast_dropout=True, dropout_rng=None,
                      dropout_rate=0.0, deterministic=False, dtype=None,
                      precision=None, module=None,
                      force_fp32_for_softmax=False,
                      qk_attn_weights_einsum=None,
                      attn_weights_value_einsum=None, is_causal=False):
  """``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention`` and
  ``flax.nnx.MultiHeadAttention``.

  Inputs are ``[batch..., length, heads, features]`` (any number of leading
  batch dims, including none).  ``mask`` (True = attend) and ``bias`` follow
  flax semantics and use the reference path; ``is_causal`` (nnx) is folded
  into the kernel's window.  ``dtype`` casts q/k/v (otherwise they are promoted
  to a common dtype); ``precision`` is ignored (the softmax is always fp32).
  Dropout is not supported (``dropout_rate > 0`` with ``deterministic=False``
  raises ValueError) and neither is sowing attention weights (``module``) or
  custom einsums.  Fully masked rows give 0 (flax: mean of V).
  """
  del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
  if dropout_rate and dropout_rate > 0.0 and not deterministic:
    raise ValueError(
        f"jax_fa3.flax_attention_fn does not support attention dropout "
        f"(dropout_rate={dropout_rate}, deterministic=False); set "
        "dropout_rate=0 or deterministic=True")
  if module is not None:
    raise ValueError("jax_fa3.flax_attention_fn cannot sow attention weights "
                     "(sow_weights=True / module=...): they are never "
                     "materialized")
  if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
    raise ValueError("jax_fa3.flax_attention_fn does not support custom "
                     "qk_attn_weights_einsum/attn_weights_value_einsum")
  q, k, v = (V.as_array(query, "query"), V.as_array(key, "key"),
             V.as_array(value, "value"))
  if dtype is not None:
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
  else:
    dt = jnp.result_type(q, k, v)
    q, k, v = q.astype(dt), k.astype(dt), v.astype(dt)
  if q.ndim < 3 or not (q.ndim == k.ndim == v.ndim):
    raise ValueError("query/key/value must have the same rank >= 3 "
                     "([batch..., length, heads, features]), got shapes "
                     f"{q.shape}, {k.shape}, {v.shape}")
  batch_dims = q.shape[:-3]
  if k.shape[:-3] != batch_dims or v.shape[:-3] != batch_dims:
    raise ValueError("query/key/value batch dims must match, got "
                     f"{q.shape}, {k.shape}, {v.shape}")
  if mask is not None:
    mask = jnp.asarray(mask).astype(bool)  # flax masks may be 0/1 floats
  Bf = int(np.prod(batch_dims)) if batch_dims else 1
  q4 = q.reshape((Bf,) + q.shape[-3:])
  k4 = k.reshape((Bf,) + k.shape[-3:])
  v4 = v.reshape((Bf,) + v.shape[-3:])
  q4, k4, v4 = V.check_qkv(q4, k4, v4)
  B, T, N, H = q4.shape
  S, K = k4.shape[1], k4.shape[2]
  bias4 = V.check_bias_mask(_flatten_bm(bias, "bias", batch_dims, Bf), "bias",
                            B, N, T, S, K)
  mask4 = V.check_bias_mask(_flatten_bm(mask, "mask", batch_dims, Bf), "mask",
                            B, N, T, S, K)
  wl, wr = _fold_window(None, V.check_is_causal(is_causal))
  out, _ = _core(q4, k4, v4, bias=bias4, mask=mask4, q_lens=None,
                 kv_lens=None, scale=1.0 / float(np.sqrt(H)), softcap=0.0,
                 wl=wl, wr=wr, implementation=None)
  return out.reshape(q.shape)

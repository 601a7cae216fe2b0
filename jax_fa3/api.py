"""Public API: :func:`attention`, :func:`dot_product_attention`,
:func:`flax_attention_fn`, :func:`attention_fp8`, :func:`ring_attention`.

Semantics (all entry points): query row ``i`` of batch ``b`` attends key ``j``
iff ``i < q_len[b]``, ``j < kv_len[b]``, the (top-left aligned) causal / local
window constraints hold, the segment ids are equal (``q_segment_ids[b, i] ==
kv_segment_ids[b, j]``) and ``mask`` (where given) is True.  Scores
are ``scale * q.k``, soft-capped as ``c * tanh(s / c)`` when ``softcap=c``.

Difference from ``jax.nn.dot_product_attention``: a query row that is *not*
padded but sees no key at all (e.g. a window, mask or segment id that excludes
every key) outputs 0 here (its log-sum-exp residual is ``+inf``), whereas
jax.nn outputs the mean of V.  Padded query rows (``i >= q_len[b]``) output 0 in both.

Every entry point validates its arguments here, then runs
:func:`jax_fa3.core.attention` (kernels or reference, one ``custom_vjp``);
:func:`attention_fp8` runs :func:`jax_fa3.fp8.attention_quantized` (no VJP).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_fa3 import _native, _validate as V, core, fp8, ring

__all__ = ["attention", "dot_product_attention", "flax_attention_fn",
           "attention_fp8", "ring_attention"]

_OWN_IMPLS = (None, "fa3", "reference")
_BLOCK_K = core.BLOCK_K  # the reference's key block


def _fold_window(window, is_causal):
  wl, wr = (-1, -1) if window is None else window
  if is_causal:
    wr = 0 if wr < 0 else min(wr, 0)
  return wl, wr


def _check_mask_args(query_seq_lengths, key_value_seq_lengths,
                     local_window_size, is_causal, scale, batch, head_dim):
  """The arguments every entry point shares -> (q_lens, kv_lens, scale, wl,
  wr)."""
  q_lens = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", batch)
  kv_lens = V.check_seq_lengths(key_value_seq_lengths,
                                "key_value_seq_lengths", batch)
  window = V.check_window(local_window_size)
  scale = V.check_scale(scale, head_dim)
  wl, wr = _fold_window(window, V.check_is_causal(is_causal))
  return q_lens, kv_lens, scale, wl, wr


def _not_on_kernel(q, v):
  """The argument(s) the kernels cannot take (None if none): a value head
  dim unlike q's without a compiled tile for the pair (192/128 and 128/64
  are built)."""
  if v.shape[-1] != q.shape[-1] and (np.dtype(q.dtype).name, q.shape[-1], v.shape[-1]) \
      not in _native.compiled_value_configs():
    return (f"a value head_dim ({v.shape[-1]}) different from the query/key "
            f"head_dim ({q.shape[-1]}) is")
  return None


def _use_kernel(q, implementation, unsupported=None):
  """Whether the 16-bit kernel runs for ``implementation``; raises for "fa3"
  where it cannot (``unsupported``: the arguments it cannot take)."""
  blocker = V.kernel_blocker(q.dtype, q.shape[-1], _native)
  if implementation == "fa3":
    if unsupported is not None:
      raise ValueError(f"{unsupported} not supported by implementation='fa3'"
                       "; use implementation=None or 'reference'")
    if blocker is not None:
      raise ValueError(f"implementation='fa3' is not possible: {blocker}")
  return (implementation == "fa3" or (
      implementation is None and blocker is None and unsupported is None))


def _core(q, k, v, *, bias, mask, q_lens, kv_lens, scale, softcap, wl, wr,
          implementation, deterministic=False, segment_ids=None, sinks=None):
  """Validated 4-D inputs -> (out [B,T,N,Hv], lse f32 [B,N,T])."""
  unsupported = _not_on_kernel(q, v)
  cfg = core.Config(scale=scale, softcap=softcap, window_left=wl,
                    window_right=wr, deterministic=deterministic,
                    kernel=_use_kernel(q, implementation, unsupported),
                    block_k=_BLOCK_K)
  return core.attention(q, k, v, q_lens, kv_lens, bias, mask, cfg,
                        segment_ids=segment_ids, sinks=sinks)


def _fp8_config(q, softcap, implementation, wl, wr, scale, deterministic,
                opts):
  """The precision="fp8" configuration (validated 16-bit inputs)."""
  block_scales, hadamard, seed = opts
  if softcap:
    raise ValueError("softcap is not supported with precision='fp8'")
  if np.dtype(q.dtype) not in V.KERNEL_DTYPES:
    raise ValueError(f"precision='fp8' needs bfloat16 or float16 inputs, got "
                     f"{q.dtype}")
  fp8.check_head_dim(q.shape[-1], hadamard)
  blocker = fp8.fp8_kernel_blocker(q.dtype, q.shape[-1])
  if implementation == "fa3" and blocker is not None:
    raise ValueError(f"implementation='fa3' is not possible: {blocker}")
  # The 16-bit kernel serves the straight-through gradient; for
  # implementation="fa3" a missing one is an error only when differentiating.
  blocker16 = V.kernel_blocker(q.dtype, q.shape[-1], _native)
  return core.Config(
      scale=scale, softcap=0.0, window_left=wl, window_right=wr,
      deterministic=deterministic,
      kernel=implementation != "reference" and blocker16 is None,
      kernel_error=blocker16 if implementation == "fa3" else None,
      fp8=core.FP8Config(block_scales, hadamard, seed,
                         kernel=implementation != "reference"
                         and blocker is None),
      block_k=_BLOCK_K)


def attention(query, key, value, *, scale=None, is_causal=False,
              local_window_size=None, query_seq_lengths=None,
              key_value_seq_lengths=None, softcap=None, precision=None,
              implementation=None, deterministic=False, fp8_block_scales=True,
              fp8_hadamard=True, fp8_seed=0, q_segment_ids=None,
              kv_segment_ids=None, sinks=None):
  """FlashAttention-3 attention with the layout of ``jax.nn.dot_product_attention``.

  Args:
    query: ``[B, T, N, H]``; key: ``[B, S, K, H]`` with ``N % K == 0``
      (GQA / MQA); value: ``[B, S, K, Hv]``.  bfloat16/float16 for the
      kernel; float32 uses the reference.  ``Hv != H``: forward and
      backward run on the kernels for (192, 128) (latent attention) and
      (128, 64); other pairs on the reference.
    scale: logit scale, default ``1/sqrt(H)``.
    is_causal: top-left aligned causal mask (query ``i`` sees keys ``<= i``).
    local_window_size: ``w`` (= ``(w, w)``) or ``(left, right)``: query ``i``
      sees keys ``i - left <= j <= i + right`` (jax.nn semantics).
    query_seq_lengths, key_value_seq_lengths: optional ``int32[B]``.
    softcap: optional positive float ``c``: ``s = c * tanh(s / c)``.
    precision: None, or ``"fp8"``: bf16/fp16 inputs are quantized to e4m3
      inside (see :mod:`jax_fa3.fp8`: the FP8 kernel on an H100/H200, else a
      pure-JAX emulation); the result has the input dtype; gradients are
      straight-through (the 16-bit backward at the original inputs).
      Options, for ablation: ``fp8_block_scales`` (False: one scale per
      tensor), ``fp8_hadamard`` (random-sign Hadamard rotation of Q and K),
      ``fp8_seed`` (the signs).
    implementation: None (kernel when supported, otherwise the reference),
      ``"fa3"`` (kernel or ValueError) or ``"reference"`` (pure JAX; with
      ``precision="fp8"`` the emulation).
    deterministic: if True, the backward kernel sums dQ over key blocks in a
      fixed order, so gradients are bit-identical run to run (slower: key
      blocks wait for their turn per query block).  The forward is always
      deterministic, and so is the reference backward.
    q_segment_ids, kv_segment_ids: optional integer ``[B, T]`` and ``[B, S]``
      (cast to int32; wider ids must hold int32 values) for packed
      sequences: query ``i`` sees key ``j`` only where the ids are equal
      (any values, negative included).
      ``kv_segment_ids`` defaults to ``q_segment_ids`` when ``T == S``.
      Composes with every mask above; causal / window positions are the
      row's global positions (top-left aligned), not per-segment ones.
    sinks: optional float32 ``[N]``: attention sinks, one learnable logit
      per query head for a virtual key with value 0 that joins every row's
      softmax (``softmax([s_row, sink])``, the sink's share dropped), so
      rows may attend to "nothing".  Differentiable (``dsink[n] =
      -sum(P_sink * rowsum(dout * out))`` over batch and rows).

  Returns:
    Array ``[B, T, N, Hv]`` with ``query``'s dtype.  Rows with no visible key
    are 0 (jax.nn returns mean(V) for non-padded fully-masked rows).
  """
  q, k, v = V.check_qkv(query, key, value, value_head_dim=True)
  B, T, N, H = q.shape
  q_lens, kv_lens, scale, wl, wr = _check_mask_args(
      query_seq_lengths, key_value_seq_lengths, local_window_size, is_causal,
      scale, B, H)
  softcap = V.check_softcap(softcap)
  deterministic = V.check_deterministic(deterministic)
  V.check_precision(precision)
  V.check_implementation(implementation, _OWN_IMPLS)
  seg = V.check_segment_ids(q_segment_ids, kv_segment_ids, B, T, k.shape[1])
  sinks = V.check_sinks(sinks, N)
  if precision == "fp8":
    if v.shape[-1] != H:
      raise ValueError(f"precision='fp8' needs equal query/key and value "
                       f"head_dims, got {H} and {v.shape[-1]}")
    opts = fp8.check_fp8_options(fp8_block_scales, fp8_hadamard, fp8_seed)
    cfg = _fp8_config(q, softcap, implementation, wl, wr, scale,
                      deterministic, opts)
    return core.attention(q, k, v, q_lens, kv_lens, None, None, cfg,
                          segment_ids=seg, sinks=sinks)[0]
  out, _ = _core(q, k, v, bias=None, mask=None, q_lens=q_lens,
                 kv_lens=kv_lens, scale=scale, softcap=softcap, wl=wl, wr=wr,
                 implementation=implementation, deterministic=deterministic,
                 segment_ids=seg, sinks=sinks)
  return out


def attention_fp8(query, key, value, q_scale, k_scale, v_scale, *,
                  scale=None, is_causal=False, local_window_size=None,
                  query_seq_lengths=None, key_value_seq_lengths=None,
                  out_dtype=jnp.bfloat16, implementation=None):
  """Attention on already quantized e4m3 inputs (e.g. an FP8 KV cache).

  ``query [B, T, N, H]``, ``key/value [B, S, K, H]`` float8_e4m3fn; scales
  in the layout of :mod:`jax_fa3.fp8` (:func:`jax_fa3.quantize_fp8` makes
  them).  If Q and K were rotated, they must share the signs (``QK^T`` is
  then unchanged).  Returns ``out_dtype`` (bfloat16 or float16).
  ``implementation``: None (the FP8 kernel where it can run, else the
  emulation), ``"fa3"`` (kernel or ValueError) or ``"reference"`` (the
  emulation).  Not differentiable.
  """
  q8, k8, v8, qs, ks, vs = fp8.check_fp8_operands(query, key, value, q_scale,
                                                  k_scale, v_scale)
  b, t, n, h = q8.shape
  try:
    out_dtype = np.dtype(out_dtype)
  except TypeError as e:
    raise ValueError(f"out_dtype must be bfloat16 or float16, got "
                     f"{out_dtype!r}") from e
  if out_dtype not in V.KERNEL_DTYPES:
    raise ValueError(f"out_dtype must be bfloat16 or float16, got {out_dtype}")
  q_lens, kv_lens, scale, wl, wr = _check_mask_args(
      query_seq_lengths, key_value_seq_lengths, local_window_size, is_causal,
      scale, b, h)
  V.check_implementation(implementation, _OWN_IMPLS)
  attend = core.no_derivative(
      lambda *a: fp8.attention_quantized(*a, scale, wl, wr, out_dtype,
                                         implementation)[0],
      "attention_fp8 is not differentiable (attention(precision='fp8') has a "
      "straight-through gradient)")
  return attend(q8, k8, v8, qs, ks, vs, q_lens, kv_lens)


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale=None, is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False):
  """Drop-in replacement for ``jax.nn.dot_product_attention`` (same signature).

  ``implementation``: None (jax_fa3: kernel when supported, else the
  reference), ``"fa3"``, ``"reference"``, or ``"xla"``/``"cudnn"`` (delegated
  to ``jax.nn.dot_product_attention``).  ``mask`` (bool, broadcastable to
  ``[B, N, T, S]``) runs on the kernels, which skip the blocks it hides
  entirely; so does ``bias`` (broadcastable to ``[B, N, T, S]``, added to the
  scores in the inputs' dtype, as jax.nn does), forward and backward, its
  gradient included where it is differentiated.
  ``return_residual=True``
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
  V.check_bool(return_residual, "return_residual")
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
  q_lens, kv_lens, scale, wl, wr = _check_mask_args(
      query_seq_lengths, key_value_seq_lengths, local_window_size, is_causal,
      scale, B, H)
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
  flax semantics; both run on the kernels (as in
  :func:`dot_product_attention`); ``is_causal`` (nnx) is folded
  into the kernel's window.  ``dtype`` casts q/k/v (otherwise they are promoted
  to a common dtype); ``precision`` is ignored (the softmax is always fp32).
  Dropout is not supported (``dropout_rate > 0`` with ``deterministic=False``
  raises ValueError) and neither is sowing attention weights (``module``) or
  custom einsums.  Fully masked rows give 0 (flax: mean of V).
  """
  del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
  try:
    dropout = bool(dropout_rate and dropout_rate > 0.0 and not deterministic)
  except jax.errors.ConcretizationTypeError as e:
    raise ValueError("jax_fa3.flax_attention_fn needs static (Python) "
                     "dropout_rate and deterministic, got traced values") from e
  if dropout:
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


def ring_attention(query, key, value, *, axis_name, is_causal=False,
                   layout="contiguous", scale=None, softcap=None,
                   query_seq_lengths=None, key_value_seq_lengths=None,
                   implementation=None, return_lse=False, sinks=None,
                   q_segment_ids=None, kv_segment_ids=None):
  """Ring attention for use inside ``shard_map`` (sequence split over ``axis_name``).

  Run the ``shard_map`` under ``jax.jit``: differentiating an eager
  ``shard_map`` around it is not supported by JAX (its custom VJP keeps
  symbolic zeros).

  Args:
    query: local shard ``[B, T/P, N, H]``; key, value: ``[B, S/P, K, H]``
      (GQA as in :func:`jax_fa3.attention`).  All devices on the ring must
      hold equal-length shards.
    axis_name: the mesh axis (or tuple of axes) the sequence is split over.
    is_causal: top-left causal over the GLOBAL positions (needs T == S).
    layout: ``"contiguous"`` (device r holds the r-th slice) or ``"zigzag"``
      (device r holds chunks r and 2P-1-r; build it with :func:`to_zigzag`).
      Zigzag balances causal work; for non-causal both are equally fast.
    scale, softcap: as in :func:`jax_fa3.attention`.
    query_seq_lengths, key_value_seq_lengths: optional GLOBAL ``int32[B]``
      lengths (identical on every device of the ring).
    implementation: None (kernel when supported, else the reference), "fa3"
      or "reference".
    return_lse: also return the global log-sum-exp ``f32 [B, N, T/P]``
      (``+inf`` for rows that see no key; differentiable).
    sinks: as in :func:`jax_fa3.attention` (replicated on the ring): the
      sink joins each row's softmax once, after the ring's merge (a row
      that sees no key then has the sink as its lse).
    q_segment_ids, kv_segment_ids: packed sequences, as in
      :func:`jax_fa3.attention`, but the LOCAL shards ``int32 [B, T/P]`` and
      ``[B, S/P]`` in the layout of query and of key/value (zigzag: permute
      them with :func:`to_zigzag` too); ``kv_segment_ids`` defaults to
      ``q_segment_ids`` when the shards are equally long.  The key side
      travels around the ring with K/V.

  Local windows are not supported (there is no window argument).
  """
  q, k, v = V.check_qkv(query, key, value)
  B, T, N, H = q.shape
  S = k.shape[1]
  if layout not in ring.LAYOUTS:
    raise ValueError(f"layout must be one of {ring.LAYOUTS}, got {layout!r}")
  if not (isinstance(axis_name, str) or (isinstance(axis_name, tuple) and
                                         axis_name and
                                         all(isinstance(a, str) for a in axis_name))):
    # An empty tuple would be a ring of one device: each shard attending
    # only to its own keys, silently.
    raise ValueError(f"axis_name must be a mesh axis name or a non-empty "
                     f"tuple of them, got {axis_name!r}")
  is_causal = V.check_is_causal(is_causal)
  return_lse = V.check_bool(return_lse, "return_lse")
  if is_causal and T != S:
    raise ValueError("causal ring attention needs equal query and key/value "
                     f"shard lengths, got {T} and {S}")
  V.check_implementation(implementation, (None, "fa3", "reference"))
  q_lens = V.check_seq_lengths(query_seq_lengths, "query_seq_lengths", B)
  kv_lens = V.check_seq_lengths(key_value_seq_lengths,
                                "key_value_seq_lengths", B)
  segment_ids = V.check_segment_ids(q_segment_ids, kv_segment_ids, B, T, S)
  try:
    n_dev = ring.axis_size(axis_name)
  except (NameError, KeyError, ValueError) as e:
    raise ValueError(f"ring_attention must run inside shard_map/pmap with "
                     f"axis {axis_name!r} bound: {e}") from e
  if layout == "zigzag" and (T % 2 or S % 2):
    raise ValueError("zigzag layout needs even local sequence lengths, got "
                     f"{T} (q) and {S} (kv)")
  T_glob, S_glob = T * n_dev, S * n_dev
  q_lens = (jnp.full((B,), T_glob, jnp.int32) if q_lens is None
            else jnp.minimum(q_lens, T_glob))
  kv_lens = (jnp.full((B,), S_glob, jnp.int32) if kv_lens is None
             else jnp.minimum(kv_lens, S_glob))
  cfg = core.Config(
      scale=V.check_scale(scale, H), softcap=V.check_softcap(softcap),
      window_left=-1, window_right=-1,
      kernel=_use_kernel(q, implementation),
      ring=core.RingConfig(axis_name, n_dev, layout, is_causal),
      block_k=_BLOCK_K)
  out, lse = core.attention(q, k, v, q_lens, kv_lens, None, None, cfg,
                            segment_ids=segment_ids,
                            sinks=V.check_sinks(sinks, N))
  return (out, lse) if return_lse else out

"""Attention against a KV cache (decode, speculative verification, chunked
prefill): :func:`attention_with_kvcache`.

Semantics (the contract the kernels will keep):

* The cache is contiguous ``[B, S_max, K, H]`` or paged
  ``[num_pages, page_size, K, H]`` with ``page_table`` int32
  ``[B, max_pages_per_seq]``: position ``p`` of row ``b`` lives in page
  ``page_table[b, p // page_size]`` at slot ``p % page_size``.  Capacity per
  row: ``S_max``, or ``max_pages_per_seq * page_size``.
* ``cache_seqlens[b]``: valid positions before the call.  With ``k_new`` /
  ``v_new`` ``[B, Tq, K, H]`` their rows are written at positions
  ``cache_seqlens[b] + i`` and attended to; row ``b`` then has
  ``L[b] = cache_seqlens[b] + Tq`` keys, else ``L[b] = cache_seqlens[b]``.
* Causal alignment is **bottom-right** (as FlashAttention's KV-cache entry
  point): query ``i`` sits at absolute position ``L[b] - Tq + i``, so the
  last query is aligned with the last key (with ``k_new``: position
  ``cache_seqlens[b] + i``).  ``jax_fa3.attention`` is top-left aligned
  instead (query ``i`` at position ``i``).  ``local_window_size=(left,
  right)`` is relative to the same diagonal.  A query that sees no key
  (e.g. position < 0 when ``L[b] < Tq``) outputs 0.
* Out-of-range values at run time never read or write outside the cache:
  ``cache_seqlens`` is clamped to ``[0, capacity]``; page ids are clamped
  to ``[0, num_pages - 1]`` where keys are read; new rows past the capacity
  or bound for a page id outside the pool (-1 for an unallocated page) are
  dropped, so no other row's page is overwritten.

The kernel path (bfloat16 / float16, head dims 64, 96, 128, 192, 256;
pages of a multiple of the kernels' key block, :data:`KEY_BLOCK`: 128
positions up to head dim 128, 80 above) runs the FlashAttention-3 forward
kernels on the cache in place: a kv head's ``G = N / K`` query heads are
stacked as ``Tq * G`` rows of one tile (GQA packing: one K/V read serves the
group), the page table is resolved per key block, and with few tiles per SM
the keys are split into ``num_splits`` parts (split-KV) whose partial
results merge by their log-sum-exp.  ``k_new`` / ``v_new`` are written by a
copy kernel whose results alias the caches (donated under ``jit``: no copy of
a cache), and the attention kernel adds the new rows to the clamped lengths.
Other dtypes and page sizes take the pure-JAX path, which gathers the row's
pages into a dense ``[B, capacity, K, H]`` view (fine for tests and moderate
caches, not production decode).
Groups of a size that is not a power of two are not packed (each query head
is its own tile row; the kernel maps it to its kv head).
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from jax_fa3 import _validate as V
from jax_fa3 import core, reference, sharding

__all__ = ["attention_with_kvcache", "KEY_BLOCK"]

_NO_GRAD = ("attention_with_kvcache is not differentiable on the kernels (an "
            "inference call); float32 inputs run its differentiable reference")
_append_kernel = core.no_derivative(sharding.kvcache_append, _NO_GRAD)


# Key block of the forward kernels per head dim (FwdTileConfig in
# cc/fwd/traits.h): a page must hold whole blocks.
KEY_BLOCK = {64: 128, 96: 128, 128: 128, 192: 80, 256: 80}
_ROWS = 128  # query rows per tile


def _kernel_path(q, paged, page_size):
  return (np.dtype(q.dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
          and q.shape[-1] in KEY_BLOCK
          and (not paged or page_size % KEY_BLOCK[q.shape[-1]] == 0))


def _num_sms():
  try:
    return int(getattr(jax.devices()[0], "core_count", 0)) or 132
  except RuntimeError:
    return 132


def auto_splits(batch, heads, rows, capacity, head_dim, num_sms=None):
  """Split-KV parts for a call of ``batch * heads * ceil(rows / 128)``
  tiles: none when they fill 80 % of the SMs, else enough to fill them,
  each part keeping at least 4 key blocks."""
  sms = num_sms or _num_sms()
  tiles = batch * heads * -(-rows // _ROWS)
  if 5 * tiles >= 4 * sms:
    return 1
  blocks = -(-capacity // KEY_BLOCK.get(head_dim, 128))
  return max(1, min(sms // tiles, blocks // 4, 64))


def _merge_splits(out, lse):
  """``out [B, Z, T, N, H]`` parts normalized over their own keys, ``lse [B,
  Z, N, T]`` (+inf: a part without keys) -> ``[B, T, N, H]`` in out's dtype
  (merged in float32)."""
  if out.shape[1] == 1:
    return out[:, 0]
  l = jnp.where(lse == jnp.inf, -jnp.inf, lse)
  m = jnp.max(l, axis=1, keepdims=True)
  w = jnp.exp(l - jnp.where(jnp.isfinite(m), m, 0.0))
  total = jnp.sum(w, axis=1, keepdims=True)
  w = w / jnp.where(total > 0, total, 1.0)
  merged = jnp.einsum("bznt,bztnh->btnh", w, out.astype(jnp.float32))
  return merged.astype(out.dtype)


def _kernel_attention(q, k_cache, v_cache, lengths, table, capacity, *, scale,
                      causal, window, softcap, num_splits, new_rows):
  """The kernel path: a GQA group's query heads packed as rows of their kv
  head (sharding.kvcache_fwd), ``L = min(clip(lengths) + new_rows, capacity)``
  keys, positions ``L - Tq + i`` (bottom-right; the kernel clamps and derives
  them, so a decode step runs the custom call alone)."""
  B, Tq, N, H = q.shape
  K = k_cache.shape[2]
  G = N // K
  # A power-of-two group packs (the kernel shifts rows to positions); other
  # groups keep their heads, which the kernel maps to kv heads.
  pack = G if G & (G - 1) == 0 else 1
  rows, heads = Tq * pack, N // pack
  left = window[0] if window is not None else -1
  right = 0 if causal else (window[1] if window is not None else -1)
  ns = num_splits or auto_splits(B, heads, rows, capacity, H)
  fwd = core.no_derivative(lambda *a: sharding.kvcache_fwd(
      *a, scale=scale, softcap=softcap, window_left=left, window_right=right,
      q_pack=pack, num_splits=ns, new_rows=new_rows), _NO_GRAD)
  out, lse = fwd(q, k_cache, v_cache, lengths, table)
  return _merge_splits(out, lse)


def _check_cache(k_cache, v_cache, page_table, B, K, H):
  """-> (paged, capacity, page_size)."""
  k_cache = V.as_array(k_cache, "k_cache")
  v_cache = V.as_array(v_cache, "v_cache")
  if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
    raise ValueError("k_cache and v_cache must have one rank-4 shape, "
                     "[B, S_max, K, H] (contiguous) or [num_pages, page_size, "
                     f"K, H] (paged), got {k_cache.shape} and {v_cache.shape}")
  if k_cache.shape[2:] != (K, H):
    raise ValueError(f"k_cache/v_cache heads and head dim {k_cache.shape[2:]} "
                     f"do not match k_new / the query's (K, H) = {(K, H)}")
  if page_table is None:
    if k_cache.shape[0] != B:
      raise ValueError(f"a contiguous cache needs batch {B}, got k_cache of "
                       f"shape {k_cache.shape} (pass page_table for a paged one)")
    if k_cache.shape[1] == 0:
      raise ValueError(f"a contiguous cache needs a capacity S_max >= 1, got "
                       f"k_cache of shape {k_cache.shape}")
    return False, k_cache.shape[1], None
  pt = V.as_array(page_table, "page_table")
  if not jnp.issubdtype(pt.dtype, jnp.integer) or pt.ndim != 2 or pt.shape[0] != B:
    raise ValueError("page_table must be an integer array of shape "
                     f"[B, max_pages_per_seq] with B = {B}, got {pt.dtype} "
                     f"{pt.shape}")
  if pt.shape[1] < 1:
    raise ValueError("page_table must list at least one page per row "
                     f"(max_pages_per_seq >= 1), got shape {pt.shape}")
  page_size = k_cache.shape[1]
  if page_size < 1 or k_cache.shape[0] < 1:
    raise ValueError(f"a paged cache needs pages, got shape {k_cache.shape}")
  return True, pt.shape[1] * page_size, page_size


def _reference(q, k, v, lengths, *, scale, causal, window, softcap):
  """Dense attention of ``q [B, Tq, N, H]`` on ``k, v [B, C, K, H]`` with the
  module's bottom-right semantics; f32 softmax, output in q's dtype."""
  B, Tq, N, H = q.shape
  C, K = k.shape[1], k.shape[2]
  G = N // K
  qg = q.reshape(B, Tq, K, G, H).astype(jnp.float32)
  with jax.default_matmul_precision("highest"):
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32)) * scale
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  qpos = lengths[:, None] - Tq + jnp.arange(Tq, dtype=jnp.int32)[None]  # [B, Tq]
  j = jnp.arange(C, dtype=jnp.int32)[None, None]
  vis = j < lengths[:, None, None]
  if causal:
    vis = vis & (j <= qpos[..., None])
  if window is not None:
    vis = vis & (j >= qpos[..., None] - window[0])
    if not causal:
      vis = vis & (j <= qpos[..., None] + window[1])
  vis = vis[:, None, None]  # [B, 1, 1, Tq, C]
  s = jnp.where(vis, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(vis, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  den = jnp.sum(p, axis=-1, keepdims=True)
  with jax.default_matmul_precision("highest"):
    o = jnp.einsum("bkgts,bskh->btkgh", p / jnp.where(den > 0, den, 1.0),
                   v.astype(jnp.float32))
  return o.reshape(B, Tq, N, H).astype(q.dtype)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, k_new=None,
                           v_new=None, page_table=None, scale=None,
                           is_causal=True, local_window_size=None,
                           softcap=None, num_splits=None):
  """Attention of ``q [B, Tq, N, H]`` against a KV cache (module docstring).

  Args:
    q: queries, ``Tq`` = 1 (decode), a few (speculative verification) or a
      chunk (chunked prefill).
    k_cache, v_cache: ``[B, S_max, K, H]``, or ``[num_pages, page_size, K,
      H]`` with ``page_table``.
    cache_seqlens: int32 ``[B]``, valid cache positions before this call.
    k_new, v_new: optional ``[B, Tq, K, H]``, appended at ``cache_seqlens``
      and attended to.
    page_table: optional int32 ``[B, max_pages_per_seq]`` (a paged cache).
    scale: defaults to ``1 / sqrt(H)``.
    is_causal: bottom-right causal (default True).
    local_window_size: ``w`` or ``(left, right)`` around the diagonal.
    softcap: scores ``-> c * tanh(s / c)``.
    num_splits: None (chosen from the shape) or an int >= 1: how many parts
      of the cache length the kernel splits the work into; results are
      deterministic for a fixed value.  The dense pure-JAX path (other
      dtypes, page sizes) ignores it.

  Returns:
    ``out [B, Tq, N, H]``, or ``(out, k_cache, v_cache)`` with the caches
    updated when ``k_new`` / ``v_new`` are given (under ``jit`` donate the
    caches to update them in place).
  """
  q = V.as_array(q, "q")
  if q.ndim != 4:
    raise ValueError(f"q must be [B, Tq, N, H], got shape {q.shape}")
  V.check_dtype(q, "q")
  B, Tq, N, H = q.shape
  if (k_new is None) != (v_new is None):
    raise ValueError("k_new and v_new go together")
  kc = V.as_array(k_cache, "k_cache")
  K = kc.shape[2] if kc.ndim == 4 else -1
  if k_new is not None:
    k_new, v_new = V.as_array(k_new, "k_new"), V.as_array(v_new, "v_new")
    if k_new.shape != v_new.shape or k_new.shape[:2] != (B, Tq) or k_new.ndim != 4:
      raise ValueError(f"k_new and v_new must be [B, Tq, K, H] = [{B}, {Tq}, "
                       f"K, H], got {k_new.shape} and {v_new.shape}")
    K = k_new.shape[2]
    if k_new.shape[3] != H:
      raise ValueError(f"k_new head dim {k_new.shape[3]} != q's {H}")
  paged, capacity, page_size = _check_cache(k_cache, v_cache, page_table, B, K, H)
  if K < 1 or N % K:
    raise ValueError(f"the query heads N={N} must be a multiple of the cache's "
                     f"kv heads K={K}")
  vc = V.as_array(v_cache, "v_cache")
  given = [q, kc, vc] + ([] if k_new is None else [k_new, v_new])
  if len({np.dtype(x.dtype) for x in given}) > 1:
    raise ValueError("q, the caches and k_new/v_new must share one dtype, got "
                     + ", ".join(str(x.dtype) for x in given))
  sl = V.clamped_int32(cache_seqlens, "cache_seqlens")
  if not jnp.issubdtype(sl.dtype, jnp.integer) or sl.shape != (B,):
    raise ValueError(f"cache_seqlens must be an integer array of shape [{B}], "
                     f"got {sl.dtype} {sl.shape}")
  if k_new is not None and Tq > capacity:
    raise ValueError(f"{Tq} new rows do not fit a cache of capacity {capacity}")
  if num_splits is not None and not (V.is_int(num_splits) and num_splits >= 1):
    raise ValueError(f"num_splits must be None or an int >= 1, got {num_splits!r}")
  scale = V.check_scale(scale, H)
  causal = V.check_is_causal(is_causal)
  window = V.check_window(local_window_size)
  softcap = V.check_softcap(softcap)

  sl = sl.astype(jnp.int32)
  # A contiguous cache travels with an empty [B, 0] table, as the kernels take it.
  # Wider page ids are clamped, not wrapped, so the pool clamp sees them.
  table = (V.clamped_int32(page_table, "page_table").astype(jnp.int32)
           if paged else jnp.zeros((B, 0), jnp.int32))
  k_cache, v_cache = kc, vc
  new_rows = 0
  # An empty query takes the reference (its empty output).
  kernel = q.size > 0 and _kernel_path(q, paged, page_size)
  if k_new is not None:
    # In place (the results alias the caches); rows land at clip(sl) + i.
    # The dense path's scatter is plain JAX: sharding propagates through it
    # as through the attention after it (which may split the kv heads over
    # part of a mesh axis, a sharding the partitioned kernel cannot take).
    append = _append_kernel if kernel else reference.kvcache_append
    k_cache, v_cache = append(k_new, v_new, k_cache, v_cache, sl, table)
    new_rows = Tq
  if kernel:
    out = _kernel_attention(q, k_cache, v_cache, sl, table, capacity,
                            scale=scale, causal=causal, window=window,
                            softcap=softcap, num_splits=num_splits,
                            new_rows=new_rows)
  else:
    k = reference.dense_cache(k_cache, table)
    v = reference.dense_cache(v_cache, table)
    lengths = jnp.minimum(jnp.clip(sl, 0, capacity) + new_rows, capacity)
    out = _reference(q, k, v, lengths, scale=scale, causal=causal,
                     window=window, softcap=softcap)
  if k_new is None:
    return out
  return out, k_cache, v_cache

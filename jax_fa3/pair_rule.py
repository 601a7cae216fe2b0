"""The kernels' pair rule on top of positions -- segment ids (packed
sequences) or a boolean mask -- and its spans pre-pass.

Segment ids: query ``i`` sees key ``j`` only where ``q_ids[i] == kv_ids[j]``.
A mask ``[B|1, N|1, T, S]``: only where it is True.  The kernels skip blocks by
*spans*: for every granule of :data:`GRANULE` positions of one side, int32
``(lo, hi, full_lo, full_hi)`` -- the other side's positions that some row of
the granule sees lie in ``[lo, hi)``, and every row of it sees all of
``[full_lo, full_hi)`` (empty where a row's visible positions are not one
contiguous run: those rows are tested element by element).  A block outside
``[lo, hi)`` is skipped, one inside ``[full_lo, full_hi)`` needs no element
test.  The layout is ``PairRuleParams`` in ``cc/fwd/params.h``.

The kernel operands are four arrays: :func:`from_segment_ids` (ids and spans),
:func:`from_mask` (the mask's bits in the kernels' order, its transpose,
and spans) or :func:`absent` (four empty arrays: no rule), so every call has
one signature; the rank of the first tells ids (2) from a mask (5).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["GRANULE", "from_segment_ids", "from_mask", "absent", "present",
           "query_side",
           "is_mask", "reference_kwargs", "dense_mask"]

GRANULE = 16  # kSegmentGranule in cc/fwd/params.h
_BIG = 1 << 30  # an empty span is [_BIG, -_BIG)


def _spans_from_rows(found, first, last, count):
  """Per row: (lo, hi, full_lo, full_hi) from its visible positions' first
  and last index and their count."""
  lo = jnp.where(found, first, _BIG)
  hi = jnp.where(found, last + 1, -_BIG)
  run = found & (last - first + 1 == count)
  return lo, hi, jnp.where(run, lo, _BIG), jnp.where(run, hi, -_BIG)


def _no_spans(shape):
  zeros = jnp.zeros(shape, jnp.int32)
  return _spans_from_rows(jnp.zeros(shape, bool), zeros, zeros, zeros)


def _row_spans(a, b):
  """For each position of ``a`` ([La] int32), the positions of ``b`` ([Lb])
  with the same id: ``(lo, hi, full_lo, full_hi)`` as in the module doc.

  No sort (a GPU sort of a long row costs more than the attention it
  narrows): ids are hashed into Lb buckets and each bucket keeps the range,
  count and smallest/largest id of its positions.  A bucket holding one id
  answers exactly; a shared one (distinct ids with equal hashes) gives its
  whole range as the span and no full span -- wider, never wrong."""
  n = b.shape[0]
  if n == 0:  # nothing to match (an empty other side)
    return _no_spans(a.shape)
  hb = jnp.remainder(b, n)
  pos = jnp.arange(n, dtype=jnp.int32)
  # One scatter-min gathers both ends of each bucket's positions and ids
  # (~x = -x - 1 turns a max into a min without overflow).
  ends = jnp.full((n, 4), jnp.iinfo(jnp.int32).max, jnp.int32).at[hb].min(
      jnp.stack([pos, ~pos, b, ~b], axis=-1))
  count = jnp.zeros((n,), jnp.int32).at[hb].add(1)
  ha = jnp.remainder(a, n)
  ends, count = ends[ha], count[ha]
  first, last, id_lo, id_hi = (ends[:, 0], ~ends[:, 1], ends[:, 2],
                               ~ends[:, 3])
  one_id = id_lo == id_hi  # an empty bucket has id_lo > id_hi
  shared = ~one_id & (count > 0)
  found = (one_id & (id_lo == a)) | shared
  lo, hi, full_lo, full_hi = _spans_from_rows(found, first, last, count)
  return (lo, hi, jnp.where(shared, _BIG, full_lo),
          jnp.where(shared, -_BIG, full_hi))


def _granules(spans, axis_len):
  """Per-row spans (4 arrays [..., L]) -> ``[..., ceil(L / GRANULE), 4]``."""
  lo, hi, full_lo, full_hi = spans
  g = -(-axis_len // GRANULE)
  pad = g * GRANULE - axis_len

  def reduce(x, fill, fn):
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=fill)
    return fn(x.reshape(x.shape[:-1] + (g, GRANULE)), axis=-1)
  # Padding rows are neutral: they widen no span and narrow no full span.
  return jnp.stack([reduce(lo, _BIG, jnp.min), reduce(hi, -_BIG, jnp.max),
                    reduce(full_lo, -_BIG, jnp.max),
                    reduce(full_hi, _BIG, jnp.min)], axis=-1).astype(jnp.int32)


def _granule_spans(a, b):
  """``[ceil(La / GRANULE), 4]`` spans of ``a``'s granules in ``b``."""
  return _granules(_row_spans(a, b), a.shape[0])


def _mask_row_spans(m):
  """Per row of a bool ``[..., L, M]``: spans over its last axis."""
  M = m.shape[-1]
  if M == 0:
    return _no_spans(m.shape[:-1])
  found = jnp.any(m, axis=-1)
  first = jnp.argmax(m, axis=-1).astype(jnp.int32)
  last = (M - 1 - jnp.argmax(m[..., ::-1], axis=-1)).astype(jnp.int32)
  count = jnp.sum(m, axis=-1, dtype=jnp.int32)
  return _spans_from_rows(found, first, last, count)


def _chunks(cols):
  return -(-cols // 128) + 1  # mask_chunks in cc/fwd/params.h


def _pack_bits(m):
  """bool ``[..., L]`` -> int32 ``[..., 4, chunks]``: column
  ``128 c + 8 j + 2 t + e`` at bit ``2 j + e`` of word ``[t, c]``, the order a
  WGMMA accumulator lane ``t`` holds its columns (``cc/fwd/params.h``)."""
  L = m.shape[-1]
  C = _chunks(L)
  x = jnp.pad(m, [(0, 0)] * (m.ndim - 1) + [(0, C * 128 - L)])
  x = x.reshape(m.shape[:-1] + (C, 16, 4, 2))          # c, j, t, e
  x = jnp.moveaxis(x, -2, -4)                           # t, c, j, e
  x = x.reshape(m.shape[:-1] + (4, C, 32)).astype(jnp.uint32)
  words = jnp.sum(x << jnp.arange(32, dtype=jnp.uint32), axis=-1,
                  dtype=jnp.uint32)
  return lax.bitcast_convert_type(words, jnp.int32)


def _unpack_bits(w, L):
  """Inverse of :func:`_pack_bits`: bool ``[..., L]``."""
  words = lax.bitcast_convert_type(w, jnp.uint32)       # [..., 4, C]
  bits = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
  C = w.shape[-1]
  x = bits.reshape(w.shape[:-2] + (4, C, 16, 2))        # t, c, j, e
  x = jnp.moveaxis(x, -4, -2)                           # c, j, t, e
  return x.reshape(w.shape[:-2] + (C * 128,))[..., :L] != 0


def from_mask(mask, kv_heads, T, S):
  """bool ``[B|1, N|1, T|1, S|1]`` -> the kernels' four operands: the mask and
  its transpose as bits (:func:`_pack_bits`), query spans ``[B|1, N|1, Gt,
  4]`` and key spans ``[B|1, K|1, Gs, 4]`` (a kv head's span covers its query
  heads)."""
  mask = jnp.asarray(mask, bool)
  # The bits and spans index every (row, column): broadcast T and S first.
  mask = jnp.broadcast_to(mask, mask.shape[:2] + (T, S))
  mb, mn = mask.shape[:2]
  q_spans = _granules(_mask_row_spans(mask), T)
  mask_t = jnp.swapaxes(mask, -1, -2)
  kv_spans = _granules(_mask_row_spans(mask_t), S)  # [mb, mn, Gs, 4]
  if mn > 1 and kv_heads < mn:
    g = kv_spans.reshape(mb, kv_heads, mn // kv_heads, -1, 4)
    kv_spans = jnp.stack([g[..., 0].min(2), g[..., 1].max(2), g[..., 2].max(2),
                          g[..., 3].min(2)], axis=-1)
  return _pack_bits(mask), _pack_bits(mask_t), q_spans, kv_spans


def _open_spans(batch, length):
  """``[batch, ceil(length / GRANULE), 4]`` spans that narrow nothing (any
  position may be seen, none surely is): correct for any ids, only slower."""
  row = jnp.array([0, _BIG, _BIG, -_BIG], jnp.int32)
  return jnp.broadcast_to(row, (batch, -(-length // GRANULE), 4))


def from_segment_ids(q_ids, kv_ids, sides=("query", "key")):
  """int32 ``[B, T]`` / ``[B, S]`` ids -> the kernels' four operands
  ``(q_ids, kv_ids, q_spans [B, Gt, 4], kv_spans [B, Gs, 4])``.

  ``sides``: the spans to compute; the other side's narrow nothing.  The
  forward kernels read only the query side's, the backward only the key
  side's: a call that feeds one of them alone computes its side."""
  same = q_ids is kv_ids  # self-attention over one packing: equal spans
  q_ids = q_ids.astype(jnp.int32)
  kv_ids = q_ids if same else kv_ids.astype(jnp.int32)
  B, T, S = q_ids.shape[0], q_ids.shape[1], kv_ids.shape[1]
  q_spans = (jax.vmap(_granule_spans)(q_ids, kv_ids) if "query" in sides
             else _open_spans(B, T))
  if same and "query" in sides:
    kv_spans = q_spans
  elif "key" in sides:
    kv_spans = jax.vmap(_granule_spans)(kv_ids, q_ids)
  else:
    kv_spans = _open_spans(B, S)
  return q_ids, kv_ids, q_spans, kv_spans


def absent(batch):
  """The four operands of a call without segment ids (empty arrays)."""
  ids = jnp.zeros((batch, 0), jnp.int32)
  spans = jnp.zeros((batch, 0, 4), jnp.int32)
  return ids, ids, spans, spans


def query_side(pairs):
  """The operands as a forward reads them: a mask's key side (its
  transposed bits and key spans, which only the backward reads) becomes
  zeros of its shape, so a program without the backward never computes it.
  Segment ids and None pass through."""
  if pairs is None or not is_mask(pairs):
    return pairs
  mask, mask_t, q_spans, kv_spans = pairs
  return (mask, jnp.zeros(mask_t.shape, mask_t.dtype), q_spans,
          jnp.zeros(kv_spans.shape, kv_spans.dtype))


def present(pairs) -> bool:
  """Whether the four operands (arrays or shapes) carry a rule."""
  return is_mask(pairs) or pairs[0].shape[1] > 0


def is_mask(pairs) -> bool:
  """Whether the four operands carry a mask (else ids, or nothing)."""
  return len(pairs[0].shape) == 5


def reference_kwargs(pairs, T, S):
  """The reference's keywords for the four operands: ``q_segment_ids`` /
  ``kv_segment_ids``, or ``mask`` (bool ``[B|1, N|1, T, S]``)."""
  if is_mask(pairs):
    return dict(mask=_unpack_bits(pairs[0], S))
  if present(pairs):
    return dict(q_segment_ids=pairs[0], kv_segment_ids=pairs[1])
  return {}


def dense_mask(q_ids, kv_ids):
  """bool ``[B, T, S]``: where the ids are equal."""
  return q_ids[:, :, None] == kv_ids[:, None, :]

"""Segment ids (packed sequences) for the kernels: the spans pre-pass.

Query ``i`` sees key ``j`` only where ``q_ids[i] == kv_ids[j]``.  The kernels
skip blocks by *spans*: for every granule of :data:`GRANULE` positions of one
side, int32 ``(lo, hi, full_lo, full_hi)`` -- the other side's positions that
some row of the granule sees lie in ``[lo, hi)``, and every row of it sees all
of ``[full_lo, full_hi)`` (empty where a row's id does not occupy one
contiguous run on the other side: those rows are compared id by id).  A
block outside ``[lo, hi)`` is skipped, one inside ``[full_lo, full_hi)``
needs no element mask.  The layout is ``SegmentParams`` in
``cc/fwd/params.h``.

The kernel operands are four arrays, :func:`operands` (ids and spans) or
:func:`absent` (four empty arrays: no segment ids), so every call has one
signature.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["GRANULE", "operands", "absent", "present", "ids_of", "dense_mask"]

GRANULE = 16  # kSegmentGranule in cc/fwd/params.h
_BIG = 1 << 30  # an empty span is [_BIG, -_BIG)


def _row_spans(a, b):
  """For each position of ``a`` ([La] int32), the positions of ``b`` ([Lb])
  with the same id: ``(lo, hi, full_lo, full_hi)`` as in the module doc."""
  order = jnp.argsort(b, stable=True)
  sb = b[order]
  first_i = jnp.searchsorted(sb, a, side="left")
  end_i = jnp.searchsorted(sb, a, side="right")
  count = end_i - first_i
  found = count > 0
  last_b = b.shape[0] - 1
  # Stable order: equal ids keep ascending positions, so the run's ends are
  # the first and last position with that id.
  first = order[jnp.clip(first_i, 0, last_b)]
  last = order[jnp.clip(end_i - 1, 0, last_b)]
  lo = jnp.where(found, first, _BIG)
  hi = jnp.where(found, last + 1, -_BIG)
  run = found & (last - first + 1 == count)
  return lo, hi, jnp.where(run, lo, _BIG), jnp.where(run, hi, -_BIG)


def _granule_spans(a, b):
  """``[ceil(La / GRANULE), 4]`` spans of ``a``'s granules in ``b``."""
  lo, hi, full_lo, full_hi = _row_spans(a, b)
  g = -(-a.shape[0] // GRANULE)
  pad = g * GRANULE - a.shape[0]

  def reduce(x, fill, fn):
    x = jnp.pad(x, (0, pad), constant_values=fill)
    return fn(x.reshape(g, GRANULE), axis=1)
  # Padding rows are neutral: they widen no span and narrow no full span.
  return jnp.stack([reduce(lo, _BIG, jnp.min), reduce(hi, -_BIG, jnp.max),
                    reduce(full_lo, -_BIG, jnp.max),
                    reduce(full_hi, _BIG, jnp.min)], axis=-1).astype(jnp.int32)


def operands(q_ids, kv_ids):
  """int32 ``[B, T]`` / ``[B, S]`` ids -> the kernels' four operands
  ``(q_ids, kv_ids, q_spans [B, Gt, 4], kv_spans [B, Gs, 4])``."""
  q_ids = q_ids.astype(jnp.int32)
  kv_ids = kv_ids.astype(jnp.int32)
  q_spans = jax.vmap(_granule_spans)(q_ids, kv_ids)
  kv_spans = jax.vmap(_granule_spans)(kv_ids, q_ids)
  return q_ids, kv_ids, q_spans, kv_spans


def absent(batch):
  """The four operands of a call without segment ids (empty arrays)."""
  ids = jnp.zeros((batch, 0), jnp.int32)
  spans = jnp.zeros((batch, 0, 4), jnp.int32)
  return ids, ids, spans, spans


def present(segs) -> bool:
  """Whether the four operands (arrays or shapes) carry segment ids."""
  return segs[0].shape[1] > 0


def ids_of(segs):
  """``(q_ids, kv_ids)``, or ``(None, None)`` for :func:`absent` operands."""
  return (segs[0], segs[1]) if present(segs) else (None, None)


def dense_mask(q_ids, kv_ids):
  """bool ``[B, T, S]``: where the ids are equal."""
  return q_ids[:, :, None] == kv_ids[:, None, :]

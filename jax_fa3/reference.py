"""Pure-JAX blockwise reference of the FlashAttention-3 kernels.

This is both the CPU / non-sm90 fallback and the numerical ground truth for the
CUDA kernels, so it implements *exactly* the kernel semantics:

* ``q [B,T,N,H]``, ``k [B,S,K,H]``, ``v [B,S,K,Hv]`` (``Hv`` may differ
  from ``H``) with ``N % K == 0``; query head ``n`` uses
  kv head ``n // (N // K)`` (grouped-query attention, done through a
  ``[B,T,K,G,H]`` view of ``q`` -- K/V are never repeated).
* Query row ``i`` of batch ``b`` attends key ``j`` iff ``i < q_lens[b]`` and
  ``j < kv_lens[b]`` and (``window_left < 0`` or ``j >= i - window_left``) and
  (``window_right < 0`` or ``j <= i + window_right``) (and
  ``mask[b, n, i, j]``) (and ``q_seg[b, i] == kv_seg[b, j]`` for segment
  ids of packed sequences).  Causal is ``window_right = 0`` (top-left
  aligned).
* Scores ``s = scale * q.k``; with ``softcap = c > 0``: ``s = c * tanh(s / c)``;
  then ``s += bias``; then masking.
* A row with no visible key outputs 0 and its log-sum-exp is ``+inf``.
  (``jax.nn.dot_product_attention`` returns the mean of V for a fully masked
  row that is not a padded query row; this library returns 0.)
* All math is float32; ``lse`` is float32 ``[B,N,T]``; the output has
  ``q.dtype``.

Keys are processed in chunks of ``block_k`` with an online softmax, so the
``T x S`` score matrix is never materialized (only ``T x block_k`` at a time).
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["attention_fwd", "attention_bwd", "attention_bwd_with_dbias",
           "kvcache_fwd", "kvcache_append", "cache_slots", "dense_cache",
           "reference_attention", "varying_like", "summed_like"]

_HIGHEST = lax.Precision.HIGHEST
_F32 = jnp.float32


def _einsum(spec, a, b):
  return jnp.einsum(spec, a, b, precision=_HIGHEST,
                    preferred_element_type=_F32)


def _full_lens(lens, b, n):
  if lens is None:
    return jnp.full((b,), n, jnp.int32)
  return jnp.asarray(lens).astype(jnp.int32)


def _grouped_bm(t, n_heads, n_kv, s_pad):
  """[Bb,Nb,Tb,Sb] bias/mask -> [Bb,Kb,Gb,Tb,Sb'] (S padded to s_pad if full)."""
  if t is None:
    return None
  t = jnp.asarray(t)
  if t.ndim < 4:
    t = t.reshape((1,) * (4 - t.ndim) + t.shape)
  bb, nb, tb, sb = t.shape
  if nb == 1:
    t = t.reshape(bb, 1, 1, tb, sb)
  else:
    t = t.reshape(bb, n_kv, n_heads // n_kv, tb, sb)
  if sb > 1 and s_pad > sb:
    pad_val = False if t.dtype == jnp.bool_ else 0
    t = jnp.pad(t, [(0, 0)] * 4 + [(0, s_pad - sb)], constant_values=pad_val)
  return t


def _vma(x):
  """The manual mesh axes ``x`` varies over (empty outside shard_map)."""
  aval = jax.typeof(x)
  v = getattr(aval, "vma", None)  # jax >= 0.11 spelling
  if v is None:  # jax 0.10: aval.manual_axis_type.varying
    v = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
  return frozenset(v or ())


def summed_like(x, ref):
  """``x`` summed over the manual mesh axes it varies over and ``ref`` does
  not: the cotangent of a value replicated inside ``shard_map`` (e.g. a
  per-head parameter shared by the sequence shards).  No-op elsewhere."""
  extra = tuple(sorted(_vma(x) - _vma(ref), key=str))
  return lax.psum(x, extra) if extra else x


def varying_like(tree, *refs):
  """Types ``tree`` as varying over the manual mesh axes of ``refs``.

  Inside ``shard_map`` (``check_vma=True``) a scan carry must have the same
  varying axes as the per-shard values it is combined with; fresh constants
  have none.  No-op outside ``shard_map``.
  """
  vma = set()
  for r in refs:
    if r is not None:
      vma |= _vma(r)
  if not vma or not hasattr(lax, "pcast"):
    return tree
  axes = tuple(sorted(vma, key=str))

  def cast(x):
    missing = tuple(a for a in axes if a not in _vma(x))
    return lax.pcast(x, missing, to="varying") if missing else x
  return jax.tree.map(cast, tree)


def _chunk(t, start, bk):
  if t is None or t.shape[-1] == 1:
    return t
  return lax.dynamic_slice_in_dim(t, start, bk, axis=t.ndim - 1)


class _Setup:
  """Shapes, padding and the per-chunk score/mask computation."""

  def __init__(self, q, k, v, q_lens, kv_lens, scale, softcap, window_left,
               window_right, bias, mask, block_k, q_seg=None, kv_seg=None):
    B, T, N, H = q.shape
    _, S, K, _ = k.shape
    self.Hv = v.shape[-1]  # may differ from H (value head dim)
    if N % K:
      raise ValueError(f"num query heads {N} not a multiple of kv heads {K}")
    self.B, self.T, self.N, self.H, self.S, self.K = B, T, N, H, S, K
    self.G = G = N // K
    self.bk = bk = max(1, min(int(block_k), S))
    self.n_chunks = -(-S // bk)
    s_pad = self.n_chunks * bk
    if s_pad > S:
      pad = [(0, 0), (0, s_pad - S), (0, 0), (0, 0)]
      k = jnp.pad(k, pad)
      v = jnp.pad(v, pad)
    self.qg = q.reshape(B, T, K, G, H)
    self.k, self.v = k, v
    self.q_lens = _full_lens(q_lens, B, T)
    # Keys past the real length S are padding.
    self.kv_lens = jnp.minimum(_full_lens(kv_lens, B, S), S)
    self.scale = float(scale)
    self.softcap = float(softcap) if softcap else 0.0
    self.wl, self.wr = int(window_left), int(window_right)
    self.bias = _grouped_bm(bias, N, K, s_pad)
    self.mask = _grouped_bm(mask, N, K, s_pad)
    # Segment ids stay [B,T] / [B,S]: the [T, bk] equality mask is built per
    # key chunk, never as a dense T x S array.  Padded keys are excluded by
    # kv_lens, so their pad id does not matter.
    if (q_seg is None) != (kv_seg is None):
      raise ValueError("q_segment_ids and kv_segment_ids go together")
    self.q_seg = None if q_seg is None else jnp.asarray(q_seg, jnp.int32)
    self.kv_seg = None
    if kv_seg is not None:
      self.kv_seg = jnp.pad(jnp.asarray(kv_seg, jnp.int32),
                            [(0, 0), (0, s_pad - S)])

  def chunk_kv(self, start):
    kc = lax.dynamic_slice_in_dim(self.k, start, self.bk, axis=1)
    vc = lax.dynamic_slice_in_dim(self.v, start, self.bk, axis=1)
    return kc, vc

  def valid(self, start):
    """Boolean visibility [B,1|K,1|G,T,bk] of the chunk starting at `start`."""
    i = jnp.arange(self.T, dtype=jnp.int32)[:, None]
    j = start + jnp.arange(self.bk, dtype=jnp.int32)[None, :]
    ok = (i[None] < self.q_lens[:, None, None]) & (
        j[None] < self.kv_lens[:, None, None])
    if self.wl >= 0:
      ok = ok & (j >= i - self.wl)[None]
    if self.wr >= 0:
      ok = ok & (j <= i + self.wr)[None]
    if self.q_seg is not None:
      kv_seg = lax.dynamic_slice_in_dim(self.kv_seg, start, self.bk, axis=1)
      ok = ok & (self.q_seg[:, :, None] == kv_seg[:, None, :])
    ok = ok[:, None, None]  # [B,1,1,T,bk]
    if self.mask is not None:
      ok = ok & _chunk(self.mask, start, self.bk)
    return ok

  def scores(self, kc, start):
    """Returns (s, tanh_term or None): scaled, soft-capped, biased scores."""
    s = _einsum("btkgh,bskh->bkgts", self.qg, kc) * np.float32(self.scale)
    t = None
    if self.softcap > 0:
      c = np.float32(self.softcap)
      t = jnp.tanh(s / c)
      s = c * t
    if self.bias is not None:
      s = s + _chunk(self.bias, start, self.bk).astype(_F32)
    return s, t


def fold_sinks(out, lse, sinks):
  """Folds the sinks into a finished softmax: with ``lse' = log(e^lse +
  e^sink)`` every probability, hence ``out``, scales by ``e^(lse - lse')``.
  A row that sees no key gets ``lse' = sink`` and stays 0.  The backward
  needs nothing else: with ``(out', lse')`` the usual ``P`` and
  ``delta = rowsum(dout * out')`` are those of the softmax with the sink
  (whose value is 0), and ``dsink = -sum(P_sink * delta)``.  ``sinks``
  None or empty (the kernels' operand without sinks): nothing to fold."""
  if sinks is None or sinks.shape[0] == 0:
    return out, lse
  s = sinks[None, :, None]
  keys = jnp.where(jnp.isinf(lse), -jnp.inf, lse)  # +inf: no key
  lse2 = jnp.logaddexp(keys, s)
  scale = jnp.exp(keys - lse2)                      # [B, N, T]
  out = (out * jnp.swapaxes(scale, 1, 2)[..., None]).astype(out.dtype)
  return out, lse2


def attention_fwd(q, k, v, q_lens, kv_lens, *, scale, softcap=0.0,
                  window_left=-1, window_right=-1, bias=None, mask=None,
                  block_k=512, q_segment_ids=None, kv_segment_ids=None):
  """Blockwise attention forward.

  Args:
    q: ``[B,T,N,H]``; k, v: ``[B,S,K,H]``.
    q_lens, kv_lens: ``int32[B]`` (or None for full length).
    scale, softcap, window_left, window_right: see the module docstring
      (``softcap`` 0 = off, window -1 = unbounded on that side).
    bias: optional float array broadcastable to ``[B,N,T,S]`` (each dim 1 or
      full), added to the (soft-capped) scores.
    mask: optional bool array broadcastable to ``[B,N,T,S]``; True = attend.
    block_k: key chunk size of the online softmax.
    q_segment_ids, kv_segment_ids: optional int32 ``[B,T]`` and ``[B,S]``
      (both or neither): query ``i`` sees key ``j`` only where they are equal.

  Returns:
    ``(out, lse)``: ``out`` with q's shape and dtype; ``lse`` float32
    ``[B,N,T]`` (``+inf`` on rows with no visible key, whose output is 0).
  """
  st = _Setup(q, k, v, q_lens, kv_lens, scale, softcap, window_left,
              window_right, bias, mask, block_k, q_segment_ids, kv_segment_ids)
  B, T, K, G, Hv = st.B, st.T, st.K, st.G, st.Hv

  def body(carry, c):
    m, l, acc = carry
    start = c * st.bk
    kc, vc = st.chunk_kv(start)
    s, _ = st.scores(kc, start)
    s = jnp.where(st.valid(start), s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = _einsum("bkgts,bskh->btkgh", p, vc)
    acc = acc * jnp.moveaxis(alpha, 3, 1)[..., None] + pv
    return (m_new, l, acc), None

  init = (jnp.full((B, K, G, T), -jnp.inf, _F32),
          jnp.zeros((B, K, G, T), _F32),
          jnp.zeros((B, T, K, G, Hv), _F32))
  init = varying_like(init, q, k, v, q_lens, kv_lens, bias, mask,
                      q_segment_ids, kv_segment_ids)
  (m, l, acc), _ = lax.scan(body, init, jnp.arange(st.n_chunks))
  has = l > 0
  l_safe = jnp.where(has, l, 1.0)
  lse = jnp.where(has, m + jnp.log(l_safe), jnp.inf)
  inv = jnp.where(has, 1.0 / l_safe, 0.0)
  out = acc * jnp.moveaxis(inv, 3, 1)[..., None]
  out = out.reshape(q.shape[:3] + (Hv,)).astype(q.dtype)
  return out, lse.reshape(B, st.N, T)


def cache_slots(page_table, page_size, num_pages, pos):
  """(first index, second index) of positions ``pos [B, L]`` in a cache:
  ``(b, pos)`` when ``page_table`` is ``[B, 0]`` (contiguous), else (page,
  slot), page ids clamped to the pool."""
  if not page_table.shape[1]:
    b = jnp.broadcast_to(jnp.arange(pos.shape[0])[:, None], pos.shape)
    return b, pos
  return jnp.clip(page_ids(page_table, page_size, pos), 0, num_pages - 1), \
      pos % page_size


def page_ids(page_table, page_size, pos):
  """The page-table entries (unclamped) holding positions ``pos [B, L]``."""
  col = jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)
  return jnp.take_along_axis(page_table, col, axis=1)


def dense_cache(cache, page_table):
  """The ``[B, capacity, K, H]`` view of a cache: itself when ``page_table``
  is ``[B, 0]`` (contiguous), else its rows' pages gathered."""
  if not page_table.shape[1]:
    return cache
  B, ps = page_table.shape[0], cache.shape[1]
  cap = page_table.shape[1] * ps
  pos = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32)[None], (B, cap))
  return cache[cache_slots(page_table, ps, cache.shape[0], pos)]


def kvcache_append(k_new, v_new, k_cache, v_cache, seqlens, page_table):
  """The append kernel (``primitives.kvcache_append``) in pure JAX: row ``i``
  of ``k_new, v_new [B, Tq, K, H]`` lands at position ``clip(seqlens, 0, C)
  + i`` of its batch row (capacity ``C``: ``S`` of a contiguous ``[B, S, K,
  H]`` cache, ``pages * page_size`` of a paged one); rows past ``C``, or
  bound for a page id outside the pool (-1: unallocated), are dropped."""
  paged = page_table.shape[1] > 0
  ps = k_cache.shape[1]
  cap = page_table.shape[1] * ps if paged else ps
  Tq = k_new.shape[1]
  pos = (jnp.clip(seqlens, 0, cap)[:, None]
         + jnp.arange(Tq, dtype=jnp.int32)[None])
  i0, i1 = cache_slots(page_table, ps, k_cache.shape[0], pos)
  keep = pos < cap
  if paged:  # a bad page id must not overwrite another row's page
    page = page_ids(page_table, ps, pos)
    keep &= (page >= 0) & (page < k_cache.shape[0])
  # Dropped rows get an index past the end, which mode="drop" ignores.
  i0 = jnp.where(keep, i0, k_cache.shape[0])
  return (k_cache.at[i0, i1].set(k_new.astype(k_cache.dtype), mode="drop"),
          v_cache.at[i0, i1].set(v_new.astype(v_cache.dtype), mode="drop"))


def kvcache_fwd(q, k, v, kv_lens, page_table, *, scale,
                softcap, window_left, window_right, q_pack, num_splits,
                heads_major=False, new_rows=0):
  """The KV-cache kernel call (``primitives.kvcache_fwd``) in pure JAX.

  ``q [B,T,N,H]``, every row valid: row ``i`` of batch ``b`` sits at
  position ``L[b] - T // q_pack + i // q_pack`` for the window rule
  (bottom-right, ``L`` = ``kv_lens`` clamped to ``[0, S]``, plus
  ``new_rows`` capped at ``S``); ``k, v`` a
  contiguous ``[B,S,K,H]`` cache, or pages ``[P, page_size, K, H]`` that
  ``page_table [B, pages]`` maps (``[B, 0]``: contiguous; page ids clamped
  to the pool).  Returns ``(out [B, Z, T, N, H], lse [B, Z, N, T])`` for
  ``Z = num_splits`` parts of the keys, each normalized over its own keys
  (a part with none: 0 and ``+inf``); here part ``z`` holds positions
  ``[z c, (z + 1) c)``, ``c = ceil(S / Z)`` (the kernel splits by key
  blocks: any partition merges to the same result).  ``heads_major``: q
  ``[B, N, T, H]`` and out ``[B, Z, N, T, H]``."""
  if heads_major:
    out, lse = kvcache_fwd(
        q.transpose(0, 2, 1, 3), k, v, kv_lens, page_table,
        scale=scale, softcap=softcap, window_left=window_left,
        window_right=window_right, q_pack=q_pack, num_splits=num_splits,
        new_rows=new_rows)
    return out.transpose(0, 1, 3, 2, 4), lse
  B, T, N, H = q.shape
  k, v = dense_cache(k, page_table), dense_cache(v, page_table)
  S, K = k.shape[1], k.shape[2]
  G = N // K
  qg = q.reshape(B, T, K, G, H).astype(_F32)
  s = _einsum("btkgh,bskh->bkgts", qg, k.astype(_F32)) * scale
  if softcap:
    s = softcap * jnp.tanh(s / softcap)
  row = jnp.arange(T, dtype=jnp.int32)
  kv_len = jnp.minimum(jnp.clip(kv_lens, 0, S) + new_rows, S)
  qpos = (kv_len - T // q_pack)[:, None] + row[None] // q_pack    # [B, T]
  j = jnp.arange(S, dtype=jnp.int32)
  vis = jnp.broadcast_to(j[None, None] < kv_len[:, None, None], (B, T, S))
  if window_right >= 0:
    vis = vis & (j <= qpos[..., None] + window_right)
  if window_left >= 0:
    vis = vis & (j >= qpos[..., None] - window_left)
  chunk = -(-S // num_splits)
  part = j // chunk == jnp.arange(num_splits)[:, None]            # [Z, S]
  vis = vis[:, None, None, None] & part[None, :, None, None, None]  # [B,Z,1,1,T,S]
  s = jnp.where(vis, s[:, None], -jnp.inf)
  m = jnp.max(s, axis=-1)
  p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
  den = jnp.sum(p, axis=-1)                                       # [B,Z,K,G,T]
  has = den > 0
  p = p / jnp.where(has, den, 1.0)[..., None]
  out = _einsum("bzkgts,bskh->bztkgh", p, v.astype(_F32))
  lse = jnp.where(has, m + jnp.log(jnp.where(has, den, 1.0)), jnp.inf)
  return (out.reshape(B, num_splits, T, N, v.shape[-1]).astype(q.dtype),
          lse.reshape(B, num_splits, N, T))


def attention_bwd_with_dbias(q, k, v, out, lse, dout, q_lens, kv_lens, *,
                             scale, softcap=0.0, window_left=-1,
                             window_right=-1, bias=None, mask=None,
                             block_k=512, q_segment_ids=None,
                             kv_segment_ids=None):
  """Like :func:`attention_bwd` but returns ``(dq, dk, dv, dbias)``.

  ``dbias`` has the (4-D) shape and dtype of ``bias`` (None without bias).
  """
  st = _Setup(q, k, v, q_lens, kv_lens, scale, softcap, window_left,
              window_right, bias, mask, block_k, q_segment_ids, kv_segment_ids)
  B, T, N, K, G, H, S = st.B, st.T, st.N, st.K, st.G, st.H, st.S
  dout_g = dout.reshape(B, T, K, G, st.Hv)
  lse_g = lse.reshape(B, K, G, T).astype(_F32)
  delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1)  # [B,T,N]
  delta = jnp.transpose(delta, (0, 2, 1)).reshape(B, K, G, T)

  bshape = None if st.bias is None else st.bias.shape  # [Bb,Kb,Gb,Tb,Sb']
  bias_full_s = bshape is not None and bshape[-1] > 1

  def reduce_to_bias(ds):
    axes = tuple(a for a in range(4) if bshape[a] == 1 and ds.shape[a] != 1)
    return jnp.sum(ds, axis=axes, keepdims=True) if axes else ds

  def body(carry, c):
    dq, db_acc = carry
    start = c * st.bk
    kc, vc = st.chunk_kv(start)
    s, t = st.scores(kc, start)
    valid = st.valid(start)
    p = jnp.where(valid, jnp.exp(s - lse_g[..., None]), 0.0)
    dv_c = _einsum("bkgts,btkgh->bskh", p, dout_g)
    dp = _einsum("btkgh,bskh->bkgts", dout_g, vc)
    ds = p * (dp - delta[..., None])
    ys_db = None
    if bshape is not None:
      dsb = reduce_to_bias(ds)
      if bias_full_s:
        ys_db = dsb
      else:
        db_acc = db_acc + jnp.sum(dsb, axis=-1, keepdims=True)
    if t is not None:
      ds = ds * (1.0 - t * t)
    ds = ds * np.float32(st.scale)
    dq = dq + _einsum("bkgts,bskh->btkgh", ds, kc)
    dk_c = _einsum("bkgts,btkgh->bskh", ds, st.qg)
    return (dq, db_acc), (dk_c, dv_c, ys_db)

  db0 = (jnp.zeros(bshape[:4] + (1,), _F32)
         if bshape is not None and not bias_full_s else jnp.zeros((), _F32))
  init = varying_like((jnp.zeros((B, T, K, G, H), _F32), db0), q, k, v,
                       out, lse, dout, q_lens, kv_lens, bias, mask,
                       q_segment_ids, kv_segment_ids)
  (dq, db_acc), (dk, dv, db_chunks) = lax.scan(body, init,
                                               jnp.arange(st.n_chunks))

  def unchunk(x):  # [n,B,bk,K,h] -> [B,S,K,h]
    x = jnp.moveaxis(x, 0, 1).reshape(B, st.n_chunks * st.bk, K, x.shape[-1])
    return x[:, :S]

  dq = dq.reshape(q.shape).astype(q.dtype)
  dk = unchunk(dk).astype(k.dtype)
  dv = unchunk(dv).astype(v.dtype)
  dbias = None
  if bshape is not None:
    if bias_full_s:  # [n,Bb,Kb,Gb,Tb,bk] -> [Bb,Kb,Gb,Tb,S]
      db = jnp.moveaxis(db_chunks, 0, 4)
      db = db.reshape(db.shape[:4] + (st.n_chunks * st.bk,))[..., :S]
    else:
      db = db_acc
    b4 = jnp.asarray(bias)
    b4 = b4.reshape((1,) * (4 - b4.ndim) + b4.shape)
    dbias = db.reshape(b4.shape).astype(b4.dtype)
  return dq, dk, dv, dbias


def attention_bwd(q, k, v, out, lse, dout, q_lens, kv_lens, *, scale,
                  softcap=0.0, window_left=-1, window_right=-1, bias=None,
                  mask=None, block_k=512, q_segment_ids=None,
                  kv_segment_ids=None):
  """Blockwise attention backward (recomputes P from ``lse``).

  ``delta = rowsum(dout * out)`` (float32), ``dS = P * (dP - delta)``; dk/dv
  are summed over each GQA group.  Returns ``(dq, dk, dv)`` with the shapes
  and dtypes of ``q, k, v``.
  """
  dq, dk, dv, _ = attention_bwd_with_dbias(
      q, k, v, out, lse, dout, q_lens, kv_lens, scale=scale, softcap=softcap,
      window_left=window_left, window_right=window_right, bias=bias,
      mask=mask, block_k=block_k, q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids)
  return dq, dk, dv


def reference_attention(q, k, v, q_lens, kv_lens, bias, mask, scale, softcap,
                        window_left, window_right, block_k, segment_ids=None):
  """Differentiable reference returning ``(out, lse)``: the reference path of
  :func:`jax_fa3.core.attention` (its ``custom_vjp`` gives the blockwise
  :func:`attention_bwd_with_dbias`, memory O(T*block_k), rather than
  autodiff through the scan; ``bias`` and ``lse`` get gradients)."""
  from jax_fa3 import core  # core builds on this module
  cfg = core.Config(scale, softcap, window_left, window_right,
                    block_k=block_k)
  return core.attention(q, k, v, q_lens, kv_lens, bias, mask, cfg,
                        segment_ids=segment_ids)

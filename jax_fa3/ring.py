"""Ring attention (context parallelism) over a mesh axis, for ``shard_map``.

The sequence axis of q, k and v is split over ``axis_name`` (``P`` devices).
Each device keeps its query shard; K/V shards travel around the ring with
``lax.ppermute`` (device ``r`` sends to ``r + 1``), so at step ``s`` device
``r`` holds the K/V shard of device ``r - s``.  The next rotation is issued
before the local attention of the current step so that XLA can overlap the
transfer with the kernel.  Per-step partial outputs are merged exactly through
their log-sum-exp (the local forward returns ``lse = +inf`` for a row that
sees no key; such a partial contributes nothing).

Layouts (``layout=``):

* ``"contiguous"``: device ``r`` holds global positions ``[r*c, (r+1)*c)``.
  Causal attention then does ``r + 1`` blocks of work on device ``r`` -- correct
  but unbalanced.
* ``"zigzag"``: the sequence is cut into ``2P`` chunks of ``c`` and device ``r``
  holds chunks ``r`` and ``2P-1-r`` (see :func:`to_zigzag` /
  :func:`from_zigzag`).  Every causal step is then the same amount of work:
  step 0 is the local causal diagonal (top-left causal on the concatenated
  local ``2c`` rows is exactly right), and every later step is either "all my
  rows vs the first half of the visiting K/V" or "my second half rows vs all of
  the visiting K/V".

Sequence lengths are global (``int32[B]``, replicated over ``axis_name``): in
both layouts the valid positions of any local piece form a prefix of it, so
they map onto the kernel's per-batch lengths.  Segment ids (packed
sequences) are local shards in the layout of q and of k/v: the key side's
travel with K/V, and each step hands the local call the ids of exactly the
rows and keys it attends (its pair-rule spans computed there, from the
pieces).

The backward rotates K/V together with the dK/dV accumulators (fp32),
calling the local backward per step with the GLOBAL ``out`` and ``lse``;
after ``P`` rotations each accumulator is home.  :func:`ring_fwd` /
:func:`ring_bwd` run inside ``shard_map`` (:func:`jax_fa3.ring_attention`,
through the core's ``custom_vjp``) and inside the sequence-sharded
partitioning rule of :mod:`jax_fa3.sharding`.
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from jax_fa3 import _validate as V, pair_rule, reference

__all__ = ["ring_fwd", "ring_bwd", "kernel_steps", "to_zigzag", "from_zigzag",
           "axis_size", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")
_F32 = jnp.float32


# ------------------------------------------------------------ layout helpers
def _zigzag_perm(n, p):
  if not V.is_int(p) or p < 1:
    raise ValueError(f"num_shards must be a positive int, got {p!r}")
  if n % (2 * p):
    raise ValueError(f"zigzag layout needs the sequence length ({n}) to be a "
                     f"multiple of 2 * axis size ({2 * p})")
  c = n // (2 * p)
  order = []
  for r in range(p):
    order += [r, 2 * p - 1 - r]
  return np.concatenate([np.arange(i * c, (i + 1) * c) for i in order])


def _seq_axis(x, axis):
  if not V.is_int(axis) or not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis must be an int in [-{x.ndim}, {x.ndim}), got "
                     f"{axis!r}")
  return axis


def to_zigzag(x, num_shards, axis=1):
  """Permutes a global sequence axis into the zig-zag layout.

  After this, splitting ``axis`` into ``num_shards`` contiguous shards gives
  device ``r`` the chunks ``r`` and ``2*num_shards-1-r``.
  """
  perm = _zigzag_perm(x.shape[_seq_axis(x, axis)], num_shards)
  return jnp.take(x, jnp.asarray(perm), axis=axis)


def from_zigzag(x, num_shards, axis=1):
  """Inverse of :func:`to_zigzag`."""
  perm = _zigzag_perm(x.shape[_seq_axis(x, axis)], num_shards)
  return jnp.take(x, jnp.asarray(np.argsort(perm)), axis=axis)


# ------------------------------------------------------------ local pieces
def _piece_len(lens, chunk, c):
  """Valid rows of chunk index ``chunk`` (traced) of size ``c``."""
  return jnp.clip(lens - chunk * c, 0, c).astype(jnp.int32)


class _Plan:
  """Static ring geometry plus the traced position of this device."""

  def __init__(self, axis_name, n_dev, layout, causal, t_local, s_local):
    self.axis, self.P, self.layout, self.causal = axis_name, n_dev, layout, causal
    self.idx = lax.axis_index(axis_name)
    zz = layout == "zigzag"
    if zz and (t_local % 2 or s_local % 2):
      raise ValueError("zigzag layout needs even local sequence lengths, got "
                       f"{t_local} (q) and {s_local} (kv)")
    self.cq = t_local // 2 if zz else t_local
    self.ck = s_local // 2 if zz else s_local

  def chunks(self, r):
    return (r, 2 * self.P - 1 - r) if self.layout == "zigzag" else (r,)

  def lens(self, lens, r, c, which=None):
    """Global lens -> valid prefix of device r's local piece (or one chunk)."""
    ch = self.chunks(r)
    if which is not None:
      ch = (ch[which],)
    return sum(_piece_len(lens, x, c) for x in ch)

  def src(self, s):
    return (self.idx - s) % self.P

  def rotate(self, x):
    perm = [(r, (r + 1) % self.P) for r in range(self.P)]
    return lax.ppermute(x, self.axis, perm)


def kernel_steps(fwd, bwd):
  """A ring's local ``(fwd, bwd)`` from kernel calls that take the pair-rule
  operands after the lengths: a step's segment ids become those operands,
  the spans its kernel reads computed from the step's pieces."""
  def ops(ids, side):
    return None if ids is None else pair_rule.from_segment_ids(*ids, sides=(side,))
  return (lambda *a, **kw: fwd(*a[:-1], ops(a[-1], "query"), **kw),
          lambda *a, **kw: bwd(*a[:-1], ops(a[-1], "key"), **kw))


def _steps(plan, s):
  """The case of step ``s``: ``(kind, None)`` when static, else
  ``("cond", (pred, kind_if_true, kind_if_false))``.

  Kinds: "full" (all rows vs all visiting keys), "diag" (causal diagonal),
  "kv_first" (all rows vs the first K/V half), "q_second" (second-half rows vs
  all keys), "skip" (nothing visible).
  """
  j = plan.src(s)
  i = plan.idx
  if not plan.causal:
    return ("full", None)
  if s == 0:
    return ("diag", None)
  if plan.layout == "contiguous":
    return ("cond", (j < i, "full", "skip"))
  return ("cond", (j < i, "kv_first", "q_second"))


def _ids(ids, q_rows=slice(None), kv_rows=slice(None)):
  """The segment ids of a step's rows and keys (None: no segment ids)."""
  return None if ids is None else (ids[0][:, q_rows], ids[1][:, kv_rows])


def _fwd_case(kind, plan, fwd, q, k, v, q_lens, kv_lens, ids, j, attrs):
  B, T, N, H = q.shape
  i, cq, ck = plan.idx, plan.cq, plan.ck
  full_q = plan.lens(q_lens, i, cq)
  full_k = plan.lens(kv_lens, j, ck)
  if kind == "skip":  # out has V's head dim
    return (jnp.zeros(q.shape[:3] + v.shape[-1:], q.dtype),
            jnp.full((B, N, T), jnp.inf, _F32))
  if kind in ("full", "diag"):
    wr = 0 if kind == "diag" else -1
    return fwd(q, k, v, full_q, full_k, ids, **attrs, window_left=-1,
               window_right=wr)
  if kind == "kv_first":
    return fwd(q, k[:, :ck], v[:, :ck], full_q,
               plan.lens(kv_lens, j, ck, which=0),
               _ids(ids, kv_rows=slice(None, ck)), **attrs, window_left=-1,
               window_right=-1)
  # q_second: rows of the later chunk see every visiting key.
  o, l = fwd(q[:, cq:], k, v, plan.lens(q_lens, i, cq, which=1), full_k,
             _ids(ids, q_rows=slice(cq, None)), **attrs, window_left=-1,
             window_right=-1)
  o = jnp.concatenate([jnp.zeros_like(o), o], axis=1)
  l = jnp.concatenate([jnp.full_like(l, jnp.inf), l], axis=2)
  return o, l


def _run_case(step, fn, refs):
  """Runs the step's case; ``refs`` type every result as varying over the
  same manual axes (shard_map's check_vma: cond branches and loop-carried
  accumulators must agree)."""
  tag, arg = step
  typed = lambda kind: reference.varying_like(fn(kind), *refs)
  if tag != "cond":
    return typed(tag)
  pred, a, b = arg
  return lax.cond(pred, lambda: typed(a), lambda: typed(b))


def _merge(o, l, o_s, l_s):
  """Exact log-sum-exp merge; ``l`` uses -inf for "no key yet"."""
  l_s = jnp.where(l_s == jnp.inf, -jnp.inf, l_s)
  l_new = jnp.logaddexp(l, l_s)
  safe = jnp.where(jnp.isfinite(l_new), l_new, 0.0)
  wa = jnp.swapaxes(jnp.exp(l - safe), 1, 2)[..., None]
  wb = jnp.swapaxes(jnp.exp(l_s - safe), 1, 2)[..., None]
  return o * wa + o_s.astype(_F32) * wb, l_new


def ring_fwd(q, k, v, q_lens, kv_lens, axis_name, n_dev, layout, causal,
              attrs, fns, segment_ids=None):
  """``fns``: the local ``(fwd, bwd)``, called as ``fwd(q, k, v, q_lens,
  kv_lens, ids, **attrs)`` with ``ids`` None or ``(q_ids, kv_ids)`` of the
  step's pieces; ``segment_ids``: None or the local ``(q_ids [B, T],
  kv_ids [B, S])``."""
  fwd = fns[0]
  plan = _Plan(axis_name, n_dev, layout, causal, q.shape[1], k.shape[1])
  B, T, N, H = q.shape
  refs = (q, k, v, q_lens, kv_lens, plan.idx)
  o, l = reference.varying_like(
      (jnp.zeros(q.shape[:3] + v.shape[-1:], _F32),
       jnp.full((B, N, T), -jnp.inf, _F32)), *refs)
  kv = (k, v) if segment_ids is None else (k, v, segment_ids[1])
  for s in range(n_dev):
    if s + 1 < n_dev:  # issue the next transfer before this step's kernel
      kv_next = tuple(plan.rotate(x) for x in kv)
    j = plan.src(s)
    ids = None if segment_ids is None else (segment_ids[0], kv[2])
    o_s, l_s = _run_case(
        _steps(plan, s),
        lambda kind: _fwd_case(kind, plan, fwd, q, kv[0], kv[1], q_lens,
                               kv_lens, ids, j, attrs), refs)
    o, l = _merge(o, l, o_s, l_s)
    if s + 1 < n_dev:
      kv = kv_next
  lse = jnp.where(jnp.isfinite(l), l, jnp.inf)
  return o.astype(q.dtype), lse


def _bwd_case(kind, plan, bwd, q, k, v, out, lse, dout, q_lens, kv_lens, ids,
              j, attrs):
  i, cq, ck = plan.idx, plan.cq, plan.ck
  full_q = plan.lens(q_lens, i, cq)
  full_k = plan.lens(kv_lens, j, ck)
  f32 = lambda *xs: tuple(x.astype(_F32) for x in xs)
  if kind == "skip":
    return (jnp.zeros(q.shape, _F32), jnp.zeros(k.shape, _F32),
            jnp.zeros(v.shape, _F32))
  if kind in ("full", "diag"):
    wr = 0 if kind == "diag" else -1
    return f32(*bwd(q, k, v, out, lse, dout, full_q, full_k, ids, **attrs,
                    window_left=-1, window_right=wr))
  if kind == "kv_first":
    dq, dk, dv = f32(*bwd(q, k[:, :ck], v[:, :ck], out, lse, dout, full_q,
                          plan.lens(kv_lens, j, ck, which=0),
                          _ids(ids, kv_rows=slice(None, ck)), **attrs,
                          window_left=-1, window_right=-1))
    pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)
    return dq, pad(dk), pad(dv)
  dq, dk, dv = f32(*bwd(q[:, cq:], k, v, out[:, cq:], lse[..., cq:],
                        dout[:, cq:], plan.lens(q_lens, i, cq, which=1),
                        full_k, _ids(ids, q_rows=slice(cq, None)), **attrs,
                        window_left=-1, window_right=-1))
  return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv


def ring_bwd(q, k, v, out, lse, dout, q_lens, kv_lens, axis_name, n_dev,
              layout, causal, attrs, fns, segment_ids=None):
  """``fns`` and ``segment_ids`` as in :func:`ring_fwd`; the local backward
  is called as ``bwd(q, k, v, out, lse, dout, q_lens, kv_lens, ids,
  **attrs)``."""
  bwd = fns[1]
  plan = _Plan(axis_name, n_dev, layout, causal, q.shape[1], k.shape[1])
  dout = dout.astype(out.dtype)
  refs = (q, k, v, out, lse, dout, q_lens, kv_lens, plan.idx)
  dq, dk, dv = reference.varying_like(
      (jnp.zeros(q.shape, _F32), jnp.zeros(k.shape, _F32),
       jnp.zeros(v.shape, _F32)), *refs)
  kv = (k, v) if segment_ids is None else (k, v, segment_ids[1])
  for s in range(n_dev):
    if s + 1 < n_dev:
      kv_next = tuple(plan.rotate(x) for x in kv)
    j = plan.src(s)
    ids = None if segment_ids is None else (segment_ids[0], kv[2])
    dq_s, dk_s, dv_s = _run_case(
        _steps(plan, s),
        lambda kind: _bwd_case(kind, plan, bwd, q, kv[0], kv[1], out, lse,
                               dout, q_lens, kv_lens, ids, j, attrs), refs)
    dq = dq + dq_s
    # The accumulators travel with the K/V block they belong to; after the
    # P-th rotation each one is back on its owner.
    dk, dv = plan.rotate(dk + dk_s), plan.rotate(dv + dv_s)
    if s + 1 < n_dev:
      kv = kv_next
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)



def axis_size(axis_name):
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  n = 1
  for a in names:
    n *= lax.axis_size(a)
  return int(n)

"""Partitioning rules: each primitive of :mod:`jax_fa3.primitives` wrapped
with ``jax.experimental.custom_partitioning`` (and ``custom_vmap``, which
custom_partitioning lacks) so that ``jit`` over a mesh runs the kernels on
local shards instead of gathering everything.

* Shardy (the default partitioner): an einsum-like ``sharding_rule`` with the
  factors ``b`` (batch), ``t``/``s`` (query / key sequence), ``k`` (key/value
  heads), ``g`` (GQA group: query heads are the compound factor ``(k g)``) and
  ``h`` (head_dim, must stay replicated).
* GSPMD: ``infer_sharding_from_operands``; both partitioners then call
  ``partition``, which decides what the local kernel can serve and returns
  exactly those argument shardings (XLA reshards anything else -- a mismatch
  between the returned shardings and what the local call assumes would
  silently corrupt results, so every decision is made in one place,
  :class:`Plan`).

What is served locally:

* batch: any mesh axes (every operand and result follows q's batch axes);
* heads: q's head axes when the key/value head count divides by their size
  (GQA: a shard holds whole groups, so head ``n`` still maps to kv head
  ``n // G`` locally); otherwise heads are replicated;
* sequence (16-bit attention only): when q's sequence axis is sharded (over
  one mesh axis, or several listed in mesh order) and the mask is
  position-free or causal (no local window), ring attention runs inside the
  partition (:mod:`jax_fa3.ring`, contiguous layout: K/V rotate with
  ``ppermute``; segment ids are sharded with their sequence, the key side's
  rotating with K/V, and each step computes the spans of its pieces);
  otherwise, and always for FP8 (its scales are per block of the whole
  sequence), with a mask (its bits and spans index the whole sequence) and
  with a bias, the sequence is replicated (gathered);
* a bias ``[B|1, N|1, T, S]`` follows the batch and heads it has; its
  gradient is per batch row and head, sharded like q;
* head_dim: always replicated;
* the pair-rule pre-pass (:func:`pairs_from_segment_ids`,
  :func:`pairs_from_mask`): per batch shard (and a mask's head shard, whole
  GQA groups), the sequence whole.
"""
from __future__ import annotations

import functools
import re
from functools import partial

import numpy as np
import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_fa3 import primitives, ring, pair_rule, reference

__all__ = ["Plan", "fa3_fwd", "fa3_bwd", "fp8_quantize", "fp8_fwd",
           "kvcache_fwd", "kvcache_append", "pairs_from_segment_ids",
           "pairs_from_mask"]

# Q = query heads, x/y/z = scale blocks and V^T's padded key axis (FP8);
# SEG: the four pair-rule operands (_pair_rule_factors); SNK: the sinks [N]
# follow the query heads, or their own factor o when absent ([0]); BIAS /
# DBIAS: the bias [B|1, N|1, T, S] (r, q where it broadcasts) and its
# gradient [B, N, T, S], or [B, 0] (factor o) when absent; v: the value head
# dim (V, O, dO), which may differ from Q/K's h.  The bias's sequences are
# their own factors x, y (replicated): a call with a bias never keeps a
# sequence sharded, and Shardy propagates through replicated factors too, so
# sharing q's t would carry a bias's sequence sharding onto q, out and lse
# (gathered back in the partition: out, dout and lse in the backward).
_FWD_RULE = "b t Q h, b s k h, b s k v, b, b, SEG, BIAS, SNK -> b t Q v, b Q t"
_BWD_RULE = ("b t Q h, b s k h, b s k v, b t Q v, b Q t, b t Q v, b, b, SEG, "
             "BIAS -> b t Q h, b s k h, b s k v, DBIAS")
_QUANT_RULE = ("b t Q h, b s k h, b s k h, h, f -> b t Q h, b s k h, V, "
               "b Q x, b k y, b k y")
_FP8_FWD_RULE = "b t Q h, b s k h, V, b Q x, b k y, b k y, b, b, SEG -> b t Q h, b Q t"
_V_LAYOUT = {False: "b s k h", True: "b k h z"}
# KV caches: q as the caller holds it (_kvcache_impl packs GQA groups); a
# contiguous cache follows the batch, a paged pool (c pages) is whole on
# every batch shard; z: split parts.
_KVCACHE_RULE = "b t Q h, C s k h, C s k h, b, b p -> b z t Q h, b z Q t"
_APPEND_RULE = "b t k h, b t k h, C s k h, C s k h, b, b p -> C s k h, C s k h"
_SEQ_FREE = ("h", "v", "i", "j", "u", "w", "c", "a", "m", "p", "d", "e", "l", "o",
             "x", "y")
_SEQ_REPLICATED = _SEQ_FREE + ("t", "s", "z", "f")


def _pair_rule_factors(ops, first):
  """Factors of the pair-rule operands ops[first:first + 4] (their own, so
  the empty arrays of a call without a rule fit): segment ids i, j and span
  granules u, w of c = 4 values; a mask's bits [B|1, N|1, T, p = 4, a] /
  [B|1, N|1, S, 4, m] with span heads N|1 / K|1 shares batch b and heads Q /
  k where it has them (d, e, l where it broadcasts)."""
  a = ops[first]
  if len(a.shape) == 2:
    return "b i, b j, b u c, b w c"
  B, N, K = ops[0].shape[0], ops[0].shape[2], ops[1].shape[2]
  mb, mn, mk = a.shape[0], a.shape[1], ops[first + 3].shape[1]
  bf = "b" if mb == B else "d"
  nf = "Q" if mn == N else "e"
  kf = "k" if mk == K else "l"
  return f"{bf} {nf} i p a, {bf} {nf} j p m, {bf} {nf} u c, {bf} {kf} w c"


def _bias_factors(ops, i):
  """Factors of the bias operand ops[i]: batch and heads where it has them."""
  a = ops[i]
  if not primitives.has_bias(a):
    return "b o"
  B, N = ops[0].shape[0], ops[0].shape[2]
  return ("b" if a.shape[0] == B else "r") + " " + (
      "Q" if a.shape[1] == N else "q") + " x y"


def _rule(template, operand_types, replicated, v_transposed=False,
          bias_grad=False, mesh=None):
  """Query heads Q = (k g): kv heads major, GQA group minor.  Shardy rejects
  size-1 parts of a compound factor, so MQA (K = 1) and plain MHA (G = 1)
  spell Q as one factor; so does GQA on a mesh with an axis that could shard
  the query heads but not the K kv heads (Shardy would give k a part of that
  axis, which custom_partitioning cannot take; the plan decides k/v)."""
  n, kh = operand_types[0].shape[2], operand_types[1].shape[2]
  if "SEG" in template:  # first: the operands before it count one comma each
    first = template.split("SEG")[0].count(",")
    template = template.replace("SEG", _pair_rule_factors(operand_types, first))
  if "BIAS" in template:
    first = template.split("BIAS")[0].count(",")
    template = template.replace("DBIAS", "b Q x y" if bias_grad else "b o")
    template = template.replace("BIAS", _bias_factors(operand_types, first))
  if "SNK" in template:
    template = template.replace(
        "SNK", "Q" if operand_types[-1].shape[0] else "o")
  template = template.replace("V", _V_LAYOUT[v_transposed])
  factors = list(dict.fromkeys(re.findall(r"[a-z]", template)))
  # Shardy wants them in the order the factors first appear.
  extra = dict(need_replication_factors=tuple(
      f for f in factors if f in replicated))
  q_heads, sizes = _query_heads(n, kh, mesh)
  return template.replace("Q", q_heads), dict(extra, **sizes)


def _query_heads(n, kh, mesh):
  """How a rule spells ``n`` query heads over ``kh`` kv heads (see
  :func:`_rule`) -> (factors, factor sizes)."""
  sizes = () if mesh is None else tuple(mesh.shape.values())
  if kh == 1 or any(z > 1 and n % z == 0 and kh % z for z in sizes):
    return "n", {}
  if n == kh:
    return "k", {}
  return "(k g)", dict(g=n // kh)


def _axes(entry):
  """PartitionSpec entry -> tuple of mesh axis names."""
  if entry is None:
    return ()
  if isinstance(entry, (tuple, list)):
    return tuple(entry)
  return (entry,)


def _entry(axes):
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else tuple(axes)


def _size(mesh, axes):
  n = 1
  for a in axes:
    n *= mesh.shape[a]
  return n


def _mesh_and_spec(mesh, sharding):
  """The mesh a partition runs on and ``sharding``'s spec on it.  No mesh
  known (shardings without axis names): every device the call runs on, all
  replicated."""
  if mesh.empty:
    return (Mesh(np.array(sharding._device_assignment), ("_fa3_all",)),
            PartitionSpec())
  return mesh, (sharding.spec if isinstance(sharding, NamedSharding)
                else PartitionSpec())


class Plan:
  """What the local kernel serves for a given q sharding (module doc).

  ``ring``: whether a sharded sequence may stay sharded (the 16-bit calls
  ring over it); for the others it is replicated."""

  def __init__(self, mesh, q_sharding, q_shape, kv_shape, window_left,
               window_right, ring=True):
    B, T, N, _ = q_shape
    S, K = kv_shape[1], kv_shape[2]
    self.batch, self.heads = B, N
    mesh, spec = _mesh_and_spec(mesh, q_sharding)
    self.mesh = mesh
    spec = tuple(spec) + (None,) * (4 - len(spec))
    used = set()

    def take(axes, ok):
      if not axes or not ok or used & set(axes):
        return ()
      used.update(axes)
      return axes

    b = _axes(spec[0])
    self.b = take(b, B % max(_size(mesh, b), 1) == 0)
    n = _axes(spec[2])
    self.n = take(n, K % max(_size(mesh, n), 1) == 0)
    t = _axes(spec[1])
    p = _size(mesh, t)
    # Several mesh axes ring only when listed in mesh order: for other
    # orders the ring's device order inside the partition did not match the
    # shard order (wrong answers), so those are resharded.
    in_mesh_order = list(t) == [a for a in mesh.axis_names if a in t]
    ring_ok = (ring and in_mesh_order and window_left < 0
               and window_right in (-1, 0) and p > 1
               and T % p == 0 and S % p == 0 and (window_right < 0 or T == S))
    self.t = take(t, ring_ok)
    self.p = _size(mesh, self.t)

  def ns(self, *entries):
    return NamedSharding(self.mesh, PartitionSpec(*entries))

  @property
  def q(self):
    return self.ns(_entry(self.b), _entry(self.t), _entry(self.n), None)

  kv = q  # same axes: K/V shards follow q's (sequence shards ring)

  @property
  def lse(self):
    return self.ns(_entry(self.b), _entry(self.n), _entry(self.t))

  @property
  def lens(self):
    return self.ns(_entry(self.b))

  def pairs(self, arg_shapes, first):
    """Shardings of the pair-rule operands arg_shapes[first:first + 4]:
    segment ids follow the batch and a ringed sequence (their spans, unused
    by a ring, stay whole); a mask the batch and heads it has."""
    a = arg_shapes[first]
    b = _entry(self.b)
    if len(a.shape) == 2:
      seq = _entry(self.t) if a.shape[1] else None  # absent: [B, 0]
      ids, spans = self.ns(b, seq), self.ns(b, None, None)
      return (ids, ids, spans, spans)
    B, N, K = arg_shapes[0].shape[0], arg_shapes[0].shape[2], arg_shapes[1].shape[2]
    mb = b if a.shape[0] == B else None
    mn = _entry(self.n) if a.shape[1] == N else None
    mk = _entry(self.n) if arg_shapes[first + 3].shape[1] == K else None
    bits = self.ns(mb, mn, None, None, None)
    return (bits, bits, self.ns(mb, mn, None, None), self.ns(mb, mk, None, None))

  def bias(self, shape):
    """A bias follows the batch and heads it has; an empty one the batch."""
    b = _entry(self.b)
    if not primitives.has_bias(shape):
      return self.ns(b, None)
    return self.ns(b if shape.shape[0] == self.batch else None,
                   _entry(self.n) if shape.shape[1] == self.heads else None,
                   None, None)

  def dbias(self, bias_grad):
    return (self.ns(_entry(self.b), _entry(self.n), None, None) if bias_grad
            else self.ns(_entry(self.b), None))

  def sinks(self, shape):
    """The sinks [N] follow the query heads; an empty one is replicated."""
    return self.ns(_entry(self.n)) if shape.shape[0] else self.ns()

  @property
  def heads_major(self):
    """``[B, heads, ...]`` operands: FP8 scales, V^T."""
    return self.ns(_entry(self.b), _entry(self.n))

  @property
  def replicated(self):
    return self.ns()

  @property
  def axis(self):
    return self.t[0] if len(self.t) == 1 else self.t


def _plan(arg_shapes, mesh, window_left=-1, window_right=-1, ring=True):
  return Plan(mesh, arg_shapes[0].sharding, arg_shapes[0].shape,
              arg_shapes[1].shape, window_left, window_right, ring)


def _may_ring(arg_shapes, first_seg):
  """A sharded sequence rings only without a mask or bias (the operand
  after the pair rule's four); segment ids ring with their pieces."""
  return not (pair_rule.is_mask(arg_shapes[first_seg:first_seg + 4])
              or primitives.has_bias(arg_shapes[first_seg + 4]))


def _ring_ids(pairs):
  """A ring's segment ids ``(q_ids, kv_ids)`` from the pair-rule operands
  (their spans, of the whole sequence, go unused), or None."""
  return tuple(pairs[:2]) if pair_rule.present(pairs) else None


# ------------------------------------------------------------ 16-bit calls
def _fwd_local(plan, scale, softcap, window_left, window_right):
  def lower(q, k, v, q_lens, kv_lens, *pairs_bias_sinks):
    *pairs, bias, sinks = pairs_bias_sinks
    if plan.p > 1:  # no mask or bias (_may_ring); the sinks join once, after the ring
      return reference.fold_sinks(*ring.ring_fwd(
          q, k, v, q_lens, kv_lens, plan.axis, plan.p, "contiguous",
          window_right == 0, dict(scale=scale, softcap=softcap),
          ring.kernel_steps(primitives.fa3_fwd, primitives.fa3_bwd),
          segment_ids=_ring_ids(pairs)), sinks)
    return primitives.fa3_fwd(q, k, v, q_lens, kv_lens, pairs, scale=scale,
                              softcap=softcap, window_left=window_left,
                              window_right=window_right, sinks=sinks,
                              bias=bias)
  return lower


def _bwd_local(plan, scale, softcap, window_left, window_right,
               deterministic, dbias_dtype):
  bwd = partial(primitives.fa3_bwd, deterministic=deterministic)

  def lower(q, k, v, out, lse, dout, q_lens, kv_lens, *pairs_bias):
    *pairs, bias = pairs_bias
    if plan.p > 1:  # no mask or bias (_may_ring)
      return ring.ring_bwd(q, k, v, out, lse, dout, q_lens, kv_lens,
                           plan.axis, plan.p, "contiguous", window_right == 0,
                           dict(scale=scale, softcap=softcap),
                           ring.kernel_steps(primitives.fa3_fwd, bwd),
                           segment_ids=_ring_ids(pairs)) + (bias,)  # bias: empty
    return bwd(q, k, v, out, lse, dout, q_lens, kv_lens, pairs, scale=scale,
               softcap=softcap, window_left=window_left,
               window_right=window_right, bias=bias, dbias_dtype=dbias_dtype)
  return lower


def _fwd_impl(q, k, v, q_lens, kv_lens, q_ids, kv_ids, q_spans, kv_spans,
              bias, sinks, scale, softcap, window_left, window_right):
  return primitives.fa3_fwd(q, k, v, q_lens, kv_lens,
                            (q_ids, kv_ids, q_spans, kv_spans), scale=scale,
                            softcap=softcap, window_left=window_left,
                            window_right=window_right, sinks=sinks, bias=bias)


def _fwd_partition(scale, softcap, window_left, window_right, mesh,
                   arg_shapes, result_shape):
  plan = _plan(arg_shapes, mesh, window_left, window_right,
               _may_ring(arg_shapes, 5))
  return (plan.mesh, _fwd_local(plan, scale, softcap, window_left,
                                window_right),
          (plan.q, plan.lse),
          (plan.q, plan.kv, plan.kv, plan.lens, plan.lens) + plan.pairs(arg_shapes, 5)
          + (plan.bias(arg_shapes[9]), plan.sinks(arg_shapes[10])))


def _bwd_impl(q, k, v, out, lse, dout, q_lens, kv_lens, q_ids, kv_ids,
              q_spans, kv_spans, bias, scale, softcap, window_left,
              window_right, deterministic, dbias_dtype):
  return primitives.fa3_bwd(q, k, v, out, lse, dout, q_lens, kv_lens,
                            (q_ids, kv_ids, q_spans, kv_spans), scale=scale, softcap=softcap,
                            window_left=window_left,
                            window_right=window_right,
                            deterministic=deterministic, bias=bias,
                            dbias_dtype=dbias_dtype)


def _bwd_partition(scale, softcap, window_left, window_right, deterministic,
                   dbias_dtype, mesh, arg_shapes, result_shape):
  plan = _plan(arg_shapes, mesh, window_left, window_right,
               _may_ring(arg_shapes, 8))
  return (plan.mesh, _bwd_local(plan, scale, softcap, window_left,
                                window_right, deterministic, dbias_dtype),
          (plan.q, plan.kv, plan.kv, plan.dbias(dbias_dtype is not None)),
          (plan.q, plan.kv, plan.kv, plan.q, plan.lse, plan.q, plan.lens,
           plan.lens) + plan.pairs(arg_shapes, 8) + (plan.bias(arg_shapes[12]),))


# --------------------------------------------------------------- FP8 calls
def _quant_impl(q, k, v, signs, fixed, block_q, block_kv, hadamard,
                v_transposed):
  return primitives.fp8_quantize(q, k, v, signs, fixed, block_q=block_q,
                                 block_kv=block_kv, hadamard=hadamard,
                                 v_transposed=v_transposed)


def _quant_shardings(plan, v_transposed):
  v8 = plan.heads_major if v_transposed else plan.kv
  return (plan.q, plan.kv, v8, plan.heads_major, plan.heads_major,
          plan.heads_major)


def _quant_partition(block_q, block_kv, hadamard, v_transposed, mesh,
                     arg_shapes, result_shape):
  plan = _plan(arg_shapes, mesh, ring=False)
  local = partial(_quant_impl, block_q=block_q, block_kv=block_kv,
                  hadamard=hadamard, v_transposed=v_transposed)
  return (plan.mesh, local, _quant_shardings(plan, v_transposed),
          (plan.q, plan.kv, plan.kv, plan.replicated, plan.replicated))


def _fp8_fwd_impl(q8, k8, v8, qs, ks, vs, q_lens, kv_lens, q_ids, kv_ids,
                  q_spans, kv_spans, scale, window_left, window_right,
                  out_dtype, v_transposed):
  return primitives.fp8_fwd(q8, k8, v8, qs, ks, vs, q_lens, kv_lens,
                            (q_ids, kv_ids, q_spans, kv_spans), scale=scale, window_left=window_left,
                            window_right=window_right, out_dtype=out_dtype,
                            v_transposed=v_transposed)


def _fp8_fwd_partition(scale, window_left, window_right, out_dtype,
                       v_transposed, mesh, arg_shapes, result_shape):
  plan = _plan(arg_shapes, mesh, ring=False)
  local = partial(_fp8_fwd_impl, scale=scale, window_left=window_left,
                  window_right=window_right, out_dtype=out_dtype,
                  v_transposed=v_transposed)
  v8 = plan.heads_major if v_transposed else plan.kv
  hm = plan.heads_major
  return (plan.mesh, local, (plan.q, plan.lse),
          (plan.q, plan.kv, v8, hm, hm, hm, plan.lens, plan.lens) + plan.pairs(arg_shapes, 8))


# ------------------------------------------------------------- KV caches
def _kvcache_impl(q, k_cache, v_cache, kv_lens, page_table,
                  scale, softcap, window_left, window_right, q_pack,
                  num_splits, new_rows):
  """``q [B, T, N, H]`` -> ``(out [B, Z, T, N, H], lse [B, Z, N, T])``.  With
  ``q_pack`` > 1 a kv head's group of query heads runs as its ``T * q_pack``
  rows, which the kernel reads heads-major (``[B, K, T * q_pack, H]``): for
  a decode step (T = 1) that is q as it lies, and out and lse come back in
  place too (the transposes below move only size-1 axes)."""
  kw = dict(scale=scale, softcap=softcap, window_left=window_left,
            window_right=window_right, q_pack=q_pack, num_splits=num_splits,
            new_rows=new_rows)
  if q_pack == 1:
    return primitives.kvcache_fwd(q, k_cache, v_cache, kv_lens, page_table,
                                  **kw)
  B, T, N, H = q.shape
  K, G = N // q_pack, q_pack
  qp = q.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
  out, lse = primitives.kvcache_fwd(qp, k_cache, v_cache, kv_lens,
                                    page_table, heads_major=True, **kw)
  Z = out.shape[1]
  out = out.reshape(B, Z, K, T, G, H).transpose(0, 1, 3, 2, 4, 5)
  lse = lse.reshape(B, Z, K, T, G).transpose(0, 1, 2, 4, 3)
  return out.reshape(B, Z, T, N, H), lse.reshape(B, Z, N, T)


def _kvcache_shardings(plan, paged):
  """Batch and heads (whole GQA groups); a paged pool splits over heads
  only (page ids index the whole pool)."""
  b, n = _entry(plan.b), _entry(plan.n)
  cache = plan.ns(None, None, n, None) if paged else plan.kv
  outs = (plan.ns(b, None, None, n, None), plan.ns(b, None, n, None))
  return outs, (plan.q, cache, cache, plan.lens, plan.ns(b, None))


def _kvcache_partition(scale, softcap, window_left, window_right, q_pack,
                       num_splits, new_rows, mesh, arg_shapes, result_shape):
  plan = _plan(arg_shapes, mesh, ring=False)
  outs, args = _kvcache_shardings(plan, arg_shapes[4].shape[1] > 0)
  local = partial(_kvcache_impl, scale=scale, softcap=softcap,
                  window_left=window_left, window_right=window_right,
                  q_pack=q_pack, num_splits=num_splits, new_rows=new_rows)
  return plan.mesh, local, outs, args


# The append: the new rows [B, Tq, K, H] play q's part in the plan (their
# heads are the cache's), so the caches shard as the attention call's. A
# paged pool is whole on every batch shard, so each shard writes every
# row's new keys (a few KB gathered) and the copies stay equal.
def _append_shardings(plan, paged):
  b, n = _entry(plan.b), _entry(plan.n)
  if paged:
    cache, new = plan.ns(None, None, n, None), plan.ns(None, None, n, None)
    return (cache, cache), (new, new, cache, cache, plan.ns(None),
                            plan.ns(None, None))
  return (plan.kv, plan.kv), (plan.q, plan.q, plan.kv, plan.kv, plan.lens,
                              plan.ns(b, None))


def _append_partition(mesh, arg_shapes, result_shape):
  plan = _plan(arg_shapes, mesh, ring=False)
  outs, args = _append_shardings(plan, arg_shapes[5].shape[1] > 0)
  return plan.mesh, primitives.kvcache_append, outs, args


def _append_rule(mesh, ops):
  paged = ops[5].shape[1] > 0
  rule = _APPEND_RULE.replace("C", "c" if paged else "b")
  return _rule(rule, ops, ("t", "h", "s", "p", "c") + (("b",) if paged else ()),
               mesh=mesh)


def _kvcache_rule(mesh, ops, *static):
  rule = _KVCACHE_RULE.replace("C", "c" if ops[4].shape[1] else "b")
  return _rule(rule, ops, ("t", "h", "s", "p", "z", "c"), mesh=mesh)


# ------------------------------------------------------------ pair-rule pre-pass
def _batch_and_heads(mesh, arg_shapes, group=None):
  """-> (mesh, x -> sharding): the batch axes of the first operand where
  they divide its batch; with ``group`` (a mask's query heads per kv head)
  also its head axes where they divide the kv heads (a shard holds whole
  groups); every other axis whole."""
  a = arg_shapes[0]
  mesh, spec = _mesh_and_spec(mesh, a.sharding)
  b = _axes(spec[0]) if len(spec) else ()
  b = _entry(b) if b and a.shape[0] % _size(mesh, b) == 0 else None
  h = _axes(spec[1]) if group and len(spec) > 1 and a.shape[1] > 1 else ()
  h = _entry(h) if h and (a.shape[1] // group) % _size(mesh, h) == 0 else None
  return mesh, lambda x: NamedSharding(
      mesh, PartitionSpec(*((b, h) + (None,) * len(x.shape))[:len(x.shape)]))


def _prepass(fn, rule, group=None):
  """``fn`` (a pair-rule pre-pass of operands that lead with the batch, four
  results) partitioned over the batch (and a mask's heads, see
  :func:`_batch_and_heads`).  Its bits and spans reshape the sequence axes:
  left to Shardy, a sequence-sharded mask or ids would reach the kernels'
  boundary sharded in pieces custom_partitioning cannot take."""
  cp = custom_partitioning(fn)

  def partition(mesh, arg_shapes, result_shape):
    mesh, ns = _batch_and_heads(mesh, arg_shapes, group)
    return (mesh, fn, tuple(ns(r) for r in result_shape),
            tuple(ns(a) for a in arg_shapes))

  def infer(mesh, arg_shapes, result_shape):
    ns = _batch_and_heads(mesh, arg_shapes, group)[1]
    return tuple(ns(r) for r in result_shape)

  def sharding_rule(mesh, operand_types, result_types):
    r, sizes = rule(mesh, operand_types) if callable(rule) else (rule, {})
    return r, dict(sizes, need_replication_factors=tuple(
        f for f in dict.fromkeys(re.findall(r"[a-z]", r))
        if f not in ("b", "n", "k", "g")))

  cp.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=sharding_rule)

  @custom_vmap
  def call(*args):
    return tuple(cp(*args))

  @call.def_vmap
  def _vmap(axis_size, in_batched, *args):
    outs = primitives.fold_vmap(call, axis_size, args, in_batched)
    return outs, (True,) * len(outs)
  return call


# (a lambda: custom_partitioning would take from_segment_ids' keyword
# default for an operand)
_ids_prepass = _prepass(lambda q, kv: pair_rule.from_segment_ids(q, kv),
                        "b i, b j -> b i, b j, b u c, b w c")
_self_ids_prepass = _prepass(lambda ids: pair_rule.from_segment_ids(ids, ids),
                             "b i -> b i, b i, b u c, b u c")


@functools.lru_cache(maxsize=None)
def _mask_prepass(group):
  """The mask pre-pass for ``group`` query heads per kv head.  A mask with
  heads keeps their sharding (the kv spans of a shard's whole groups are
  local); the heads are Q = (k g) as in :func:`_rule`."""
  def rule(mesh, ops):
    mn = ops[0].shape[1]
    q, sizes = _query_heads(mn, max(1, mn // group), mesh)
    return (f"b {q} t s -> b {q} t p a, b {q} s p m, b {q} u c, b k w c",
            sizes)
  return _prepass(lambda m: pair_rule.from_mask(
      m, max(1, m.shape[1] // group), *m.shape[2:]), rule, group)


def pairs_from_segment_ids(q_ids, kv_ids):
  """:func:`pair_rule.from_segment_ids`, partitioned over the batch."""
  if q_ids is kv_ids:
    return _self_ids_prepass(q_ids)
  return _ids_prepass(q_ids, kv_ids)


def pairs_from_mask(mask, kv_heads, T, S):
  """:func:`pair_rule.from_mask`, partitioned over the mask's batch and
  heads."""
  mask = jnp.asarray(mask, bool)
  mask = jnp.broadcast_to(mask, mask.shape[:2] + (T, S))
  return _mask_prepass(max(1, mask.shape[1] // int(kv_heads)))(mask)


# ------------------------------------------------------------ registration
def _partitioned(impl, n_static, partition, outs_of_plan, rule, plan_kw,
                 n_per_batch=None):
  """custom_partitioning(impl) with ``partition``, and the matching
  infer/rule callbacks; returns ``call(*arrays, *static)`` that also
  vmaps (by :func:`primitives.fold_vmap`)."""
  n_args = impl.__code__.co_argcount - n_static
  cp = custom_partitioning(impl, static_argnums=tuple(
      range(n_args, n_args + n_static)))

  def infer(*a):
    static, (mesh, arg_shapes, _) = a[:n_static], a[n_static:]
    return outs_of_plan(_plan(arg_shapes, mesh, **plan_kw(arg_shapes, *static)),
                        *static)

  def sharding_rule(*a):
    static, (mesh, operand_types, _) = a[:n_static], a[n_static:]
    return rule(mesh, operand_types, *static)

  cp.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=sharding_rule)

  @functools.lru_cache(maxsize=None)
  def batchable(static):
    @custom_vmap
    def call(*args):
      return tuple(cp(*args, *static))

    @call.def_vmap
    def _vmap(axis_size, in_batched, *args):
      outs = primitives.fold_vmap(call, axis_size, args, in_batched,
                                  n_per_batch)
      return outs, (True,) * len(outs)
    return call

  return lambda *args, static: batchable(tuple(static))(*args)


_fwd = _partitioned(
    _fwd_impl, 4, _fwd_partition,
    lambda plan, *s: (plan.q, plan.lse),
    lambda mesh, ops, *s: _rule(_FWD_RULE, ops, _SEQ_FREE, mesh=mesh),
    lambda shapes, scale, softcap, wl, wr: dict(
        window_left=wl, window_right=wr, ring=_may_ring(shapes, 5)),
    n_per_batch=10)
_bwd = _partitioned(
    _bwd_impl, 6, _bwd_partition,
    lambda plan, *s: (plan.q, plan.kv, plan.kv, plan.dbias(s[-1] is not None)),
    lambda mesh, ops, *s: _rule(_BWD_RULE, ops, _SEQ_FREE,
                                bias_grad=s[-1] is not None, mesh=mesh),
    lambda shapes, scale, softcap, wl, wr, det, bg: dict(
        window_left=wl, window_right=wr, ring=_may_ring(shapes, 8)))
_quant = _partitioned(
    _quant_impl, 4, _quant_partition,
    lambda plan, bq, bkv, had, vt: _quant_shardings(plan, vt),
    lambda mesh, ops, bq, bkv, had, vt: _rule(_QUANT_RULE, ops,
                                              _SEQ_REPLICATED, vt, mesh=mesh),
    lambda shapes, *s: dict(ring=False), n_per_batch=3)
_fp8 = _partitioned(
    _fp8_fwd_impl, 5, _fp8_fwd_partition,
    lambda plan, *s: (plan.q, plan.lse),
    lambda mesh, ops, scale, wl, wr, dt, vt: _rule(
        _FP8_FWD_RULE, ops, _SEQ_REPLICATED, vt, mesh=mesh),
    lambda shapes, *s: dict(ring=False))


# Under vmap the elements run one after another: a paged pool is not per
# batch row, so folding the vmapped axis into the batch would mix the
# elements' page ids.
_kvcache = _partitioned(
    _kvcache_impl, 7, _kvcache_partition,
    lambda plan, *s: _kvcache_shardings(plan, False)[0],
    _kvcache_rule, lambda shapes, *s: dict(ring=False), n_per_batch=0)
_append = _partitioned(
    primitives.kvcache_append, 0, _append_partition,
    lambda plan: _append_shardings(plan, False)[0],
    _append_rule, lambda shapes: dict(ring=False), n_per_batch=0)


def kvcache_fwd(q, k_cache, v_cache, kv_lens, page_table, *,
                scale, softcap, window_left, window_right, q_pack,
                num_splits, new_rows=0):
  """Partitioned :func:`primitives.kvcache_fwd` -> ``(out, lse)`` (batch and
  kv-head sharding)."""
  return _kvcache(q, k_cache, v_cache, kv_lens, page_table,
                  static=(float(scale), float(softcap), int(window_left),
                          int(window_right), int(q_pack), int(num_splits),
                          int(new_rows)))


def kvcache_append(k_new, v_new, k_cache, v_cache, seqlens, page_table):
  """Partitioned :func:`primitives.kvcache_append` -> ``(k_cache,
  v_cache)`` (batch and kv-head sharding)."""
  return _append(k_new, v_new, k_cache, v_cache, seqlens, page_table,
                 static=())


def fa3_fwd(q, k, v, q_lens, kv_lens, scale, softcap, window_left,
            window_right, pairs=None, sinks=None, bias=None):
  """Partitioned :func:`primitives.fa3_fwd` -> ``(out, lse)``; ``pairs``:
  :func:`pair_rule.from_segment_ids` or None; ``sinks``: float32 ``[N]`` or
  None; ``bias``: ``[B|1, N|1, T, S]`` in q's dtype, or None."""
  pairs = pair_rule.absent(q.shape[0]) if pairs is None else pairs
  sinks = primitives.no_sinks() if sinks is None else sinks
  bias = primitives.no_bias(q) if bias is None else bias
  return _fwd(q, k, v, q_lens, kv_lens, *pairs, bias, sinks, static=(
      float(scale), float(softcap), int(window_left), int(window_right)))


def fa3_bwd(q, k, v, out, lse, dout, q_lens, kv_lens, scale, softcap,
            window_left, window_right, deterministic=False, pairs=None,
            bias=None, dbias_dtype=None):
  """Partitioned :func:`primitives.fa3_bwd` -> ``(dq, dk, dv, dbias)``;
  ``dbias`` ``[B, N, T, S]`` in ``dbias_dtype`` where that is not None (and
  a bias), else None."""
  pairs = pair_rule.absent(q.shape[0]) if pairs is None else pairs
  dbias_dtype = (None if bias is None or dbias_dtype is None
                 else np.dtype(dbias_dtype))
  bias = primitives.no_bias(q) if bias is None else bias
  dq, dk, dv, dbias = _bwd(
      q, k, v, out, lse, dout, q_lens, kv_lens, *pairs, bias, static=(
          float(scale), float(softcap), int(window_left), int(window_right),
          bool(deterministic), dbias_dtype))
  return dq, dk, dv, None if dbias_dtype is None else dbias


def fp8_quantize(q, k, v, signs, fixed, *, block_q, block_kv, hadamard,
                 v_transposed):
  """Partitioned :func:`primitives.fp8_quantize`."""
  return _quant(q, k, v, signs, fixed, static=(
      int(block_q), int(block_kv), bool(hadamard), bool(v_transposed)))


def fp8_fwd(q8, k8, v8, q_scale, k_scale, v_scale, q_lens, kv_lens,
            pairs=None, *, scale, window_left, window_right, out_dtype,
            v_transposed):
  """Partitioned :func:`primitives.fp8_fwd` -> ``(out, lse)``."""
  pairs = pair_rule.absent(q8.shape[0]) if pairs is None else pairs
  return _fp8(q8, k8, v8, q_scale, k_scale, v_scale, q_lens, kv_lens, *pairs,
              static=(
      float(scale), int(window_left), int(window_right), np.dtype(out_dtype),
      bool(v_transposed)))

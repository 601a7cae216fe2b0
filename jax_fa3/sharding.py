"""Sharding rules for the kernel calls (``jax.experimental.custom_partitioning``).

``fa3_fwd`` / ``fa3_bwd`` below wrap :func:`primitives.fa3_fwd` /
:func:`primitives.fa3_bwd` (the calls the ``custom_vjp`` makes) so that ``jit``
over a mesh runs the kernel on local shards instead of gathering everything:

* Shardy (the default partitioner): an einsum-like ``sharding_rule`` with the
  factors ``b`` (batch), ``t``/``s`` (query / key sequence), ``k`` (key/value
  heads), ``g`` (GQA group: query heads are the compound factor ``(k g)``) and
  ``h`` (head_dim, must stay replicated).
* GSPMD: ``infer_sharding_from_operands``; both partitioners then call
  ``partition``, which decides what the local kernel can serve and returns
  exactly those argument shardings (XLA reshards anything else -- a mismatch
  between the returned shardings and what the local call assumes would
  silently corrupt results, so every decision is made in one place,
  :func:`_plan`).

What is served locally:

* batch: any mesh axes (q, k, v, lengths, out, lse all follow q's batch axes);
* heads: q's head axes when the key/value head count divides by their size
  (GQA: a shard holds whole groups, so head ``n`` still maps to kv head
  ``n // G`` locally); otherwise heads are replicated;
* sequence: when q's sequence axis is sharded (over one mesh axis, or several
  listed in mesh order) and the mask
  is position-free or causal (no local window), ring attention runs inside the
  partition
  (:mod:`jax_fa3.ring`, contiguous layout: K/V rotate with ``ppermute``);
  otherwise the sequence is replicated (K/V all-gathered);
* head_dim: always replicated.
"""
from __future__ import annotations

import functools
from functools import partial

import numpy as np
import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_fa3 import primitives, reference, ring

__all__ = ["fa3_fwd", "fa3_bwd", "fa3_attention"]

_FWD_RULE = "b t Q h, b s k h, b s k h, b, b -> b t Q h, b Q t"
_BWD_RULE = ("b t Q h, b s k h, b s k h, b t Q h, b Q t, b t Q h, b, b "
             "-> b t Q h, b s k h, b s k h")


def _rule(template, operand_types):
  """Query heads Q = (k g): kv heads major, GQA group minor.  Shardy rejects
  size-1 parts of a compound factor, so MQA (K = 1) and plain MHA (G = 1)
  spell Q as one factor."""
  n, kh = operand_types[0].shape[2], operand_types[1].shape[2]
  extra = dict(need_replication_factors=("h",))
  if kh == 1:
    return template.replace("Q", "n"), extra
  if n == kh:
    return template.replace("Q", "k"), extra
  return template.replace("Q", "(k g)"), dict(extra, g=n // kh)


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


class _Plan:
  """What the local kernel serves for a given q sharding (see module doc)."""

  def __init__(self, mesh, q_sharding, q_shape, kv_shape, window_left,
               window_right):
    B, T, N, _ = q_shape
    S, K = kv_shape[1], kv_shape[2]
    if mesh.empty:
      # No mesh known (shardings without axis names): replicate everything
      # over the devices the call runs on.
      mesh = Mesh(np.array(q_sharding._device_assignment), ("_fa3_all",))
    self.mesh = mesh
    spec = (q_sharding.spec if isinstance(q_sharding, NamedSharding)
            and not mesh.empty else PartitionSpec())
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
    # shard order in testing (wrong answers), so those are resharded.
    in_mesh_order = list(t) == [a for a in mesh.axis_names if a in t]
    ring_ok = (in_mesh_order and window_left < 0 and window_right in (-1, 0)
               and p > 1
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

  @property
  def axis(self):
    return self.t[0] if len(self.t) == 1 else self.t


def _attrs(scale, softcap, window_left, window_right):
  return dict(scale=scale, softcap=softcap, window_left=window_left,
              window_right=window_right)


_KERNELS = (primitives.fa3_fwd, primitives.fa3_bwd)


# ------------------------------------------------------------------ forward
def _fwd_impl(q, k, v, q_lens, kv_lens, scale, softcap, window_left,
              window_right):
  return primitives.fa3_fwd(q, k, v, q_lens, kv_lens,
                            **_attrs(scale, softcap, window_left,
                                     window_right))


_fwd_cp = custom_partitioning(_fwd_impl, static_argnums=(5, 6, 7, 8))


def _fwd_plan(window_left, window_right, mesh, arg_shapes):
  return _Plan(mesh, arg_shapes[0].sharding, arg_shapes[0].shape,
               arg_shapes[1].shape, window_left, window_right)


def _fwd_infer(scale, softcap, window_left, window_right, mesh, arg_shapes,
               result_shape):
  del scale, softcap, result_shape
  plan = _fwd_plan(window_left, window_right, mesh, arg_shapes)
  return (plan.q, plan.lse)


def _fwd_partition(scale, softcap, window_left, window_right, mesh,
                   arg_shapes, result_shape):
  del result_shape
  plan = _fwd_plan(window_left, window_right, mesh, arg_shapes)
  attrs = _attrs(scale, softcap, window_left, window_right)

  def lower(q, k, v, q_lens, kv_lens):
    if plan.p > 1:
      return ring._ring_fwd(q, k, v, q_lens, kv_lens, plan.axis, plan.p,
                            "contiguous", window_right == 0,
                            dict(scale=scale, softcap=softcap), _KERNELS)
    return primitives.fa3_fwd(q, k, v, q_lens, kv_lens, **attrs)

  args = (plan.q, plan.kv, plan.kv, plan.lens, plan.lens)
  return plan.mesh, lower, (plan.q, plan.lse), args


def _fwd_rule(scale, softcap, window_left, window_right, mesh, operand_types,
              result_types):
  del scale, softcap, window_left, window_right, mesh, result_types
  return _rule(_FWD_RULE, operand_types)


_fwd_cp.def_partition(partition=_fwd_partition,
                      infer_sharding_from_operands=_fwd_infer,
                      sharding_rule=_fwd_rule)


# ----------------------------------------------------------------- backward
def _bwd_impl(q, k, v, out, lse, dout, q_lens, kv_lens, scale, softcap,
              window_left, window_right, deterministic):
  return primitives.fa3_bwd(q, k, v, out, lse, dout, q_lens, kv_lens,
                            **_attrs(scale, softcap, window_left,
                                     window_right),
                            deterministic=deterministic)


_bwd_cp = custom_partitioning(_bwd_impl, static_argnums=(8, 9, 10, 11, 12))


def _bwd_infer(scale, softcap, window_left, window_right, deterministic, mesh,
               arg_shapes, result_shape):
  del scale, softcap, deterministic, result_shape
  plan = _fwd_plan(window_left, window_right, mesh, arg_shapes)
  return (plan.q, plan.kv, plan.kv)


def _bwd_partition(scale, softcap, window_left, window_right, deterministic,
                   mesh, arg_shapes, result_shape):
  del result_shape
  plan = _fwd_plan(window_left, window_right, mesh, arg_shapes)
  attrs = _attrs(scale, softcap, window_left, window_right)
  kernels = (primitives.fa3_fwd,
             partial(primitives.fa3_bwd, deterministic=deterministic))

  def lower(q, k, v, out, lse, dout, q_lens, kv_lens):
    if plan.p > 1:
      return ring._ring_bwd(q, k, v, out, lse, dout, q_lens, kv_lens,
                            plan.axis, plan.p, "contiguous",
                            window_right == 0,
                            dict(scale=scale, softcap=softcap), kernels)
    return primitives.fa3_bwd(q, k, v, out, lse, dout, q_lens, kv_lens,
                              **attrs, deterministic=deterministic)

  args = (plan.q, plan.kv, plan.kv, plan.q, plan.lse, plan.q, plan.lens,
          plan.lens)
  return plan.mesh, lower, (plan.q, plan.kv, plan.kv), args


def _bwd_rule(scale, softcap, window_left, window_right, deterministic, mesh,
              operand_types, result_types):
  del scale, softcap, window_left, window_right, deterministic, mesh
  del result_types
  return _rule(_BWD_RULE, operand_types)


_bwd_cp.def_partition(partition=_bwd_partition,
                      infer_sharding_from_operands=_bwd_infer,
                      sharding_rule=_bwd_rule)


# ------------------------------------------------------------------ vmap
# custom_partitioning has no batching rule; fold a vmapped axis into the
# batch dimension (as the primitives' own batching rule does) and call again.
@functools.lru_cache(maxsize=None)
def _batchable(cp_fn, static):
  @custom_vmap
  def call(*args):
    return tuple(cp_fn(*args, *static))

  @call.def_vmap
  def _rule(axis_size, in_batched, *args):
    folded = []
    for a, b in zip(args, in_batched):
      if not b:
        a = jnp.broadcast_to(a, (axis_size,) + a.shape)
      folded.append(a.reshape((axis_size * a.shape[1],) + a.shape[2:]))
    outs = call(*folded)
    return (tuple(o.reshape((axis_size, o.shape[0] // axis_size) + o.shape[1:])
                  for o in outs), (True,) * len(outs))
  return call


def fa3_fwd(q, k, v, q_lens, kv_lens, scale, softcap, window_left,
            window_right):
  """Partitioned ``primitives.fa3_fwd`` -> ``(out, lse)``."""
  static = (float(scale), float(softcap), int(window_left), int(window_right))
  return _batchable(_fwd_cp, static)(q, k, v, q_lens, kv_lens)


def fa3_bwd(q, k, v, out, lse, dout, q_lens, kv_lens, scale, softcap,
            window_left, window_right, deterministic=False):
  """Partitioned ``primitives.fa3_bwd`` -> ``(dq, dk, dv)``."""
  static = (float(scale), float(softcap), int(window_left), int(window_right),
            bool(deterministic))
  return _batchable(_bwd_cp, static)(q, k, v, out, lse, dout, q_lens, kv_lens)


# ---------------------------------------------------------------- custom_vjp
@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def fa3_attention(q, k, v, q_lens, kv_lens, scale, softcap, window_left,
                  window_right, deterministic=False):
  """Like :func:`primitives.fa3_attention`, through the partitioned calls."""
  return _typed(fa3_fwd(q, k, v, q_lens, kv_lens, scale, softcap,
                        window_left, window_right), q, k, v, q_lens, kv_lens)


def _typed(outs, *refs):
  # The primitives' abstract eval drops shard_map's varying-axes type; restore
  # it so check_vma=True (the shard_map default) accepts the results and the
  # custom_vjp's cotangent types.
  return reference._varying_like(outs, *refs)


def _vjp_fwd(q, k, v, q_lens, kv_lens, scale, softcap, window_left,
             window_right, deterministic=False):
  out, lse = _typed(fa3_fwd(q, k, v, q_lens, kv_lens, scale, softcap,
                            window_left, window_right), q, k, v, q_lens,
                    kv_lens)
  return (out, lse), (q, k, v, out, lse, q_lens, kv_lens)


def _vjp_bwd(scale, softcap, window_left, window_right, deterministic, res,
             cts):
  q, k, v, out, lse, q_lens, kv_lens = res
  dout, _ = cts
  dq, dk, dv = fa3_bwd(q, k, v, out, lse, dout.astype(out.dtype), q_lens,
                       kv_lens, scale, softcap, window_left, window_right,
                       deterministic)
  dq, dk, dv = (reference._varying_like(g, x)
                for g, x in ((dq, q), (dk, k), (dv, v)))
  return dq, dk, dv, None, None


fa3_attention.defvjp(_vjp_fwd, _vjp_bwd)

"""The attention core: the one ``custom_vjp`` every entry point goes through.

:class:`Config` (static, hashable) says what runs: the 16-bit kernels
(partitioned calls of :mod:`jax_fa3.sharding`) or the blockwise reference;
optionally FP8 for the forward, or a ring over a ``shard_map`` axis
(:mod:`jax_fa3.ring`).
The backward is always the 16-bit one: for FP8 it is straight-through,
evaluated at the unquantized inputs (the 16-bit forward is recomputed there
for its ``out`` / ``lse``).  The ``custom_vjp`` sees which inputs are
differentiated (symbolic zeros), so the kernels write a bias gradient only
where one is asked for.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from jax_fa3 import fp8, primitives, reference, ring, pair_rule, sharding

__all__ = ["Config", "FP8Config", "RingConfig", "attention", "BLOCK_K"]

BLOCK_K = 512  # key block of the reference's online softmax
NO_SINK = -1e30  # the sink logit that stands for -inf

@dataclasses.dataclass(frozen=True)
class FP8Config:
  block_scales: bool
  hadamard: bool
  seed: int
  kernel: bool  # the FP8 kernels (else the emulation)


@dataclasses.dataclass(frozen=True)
class RingConfig:
  """Ring attention inside ``shard_map``: the sequence is split over
  ``axis_name`` (``n_dev`` devices) in ``layout``."""
  axis_name: object
  n_dev: int
  layout: str
  causal: bool


@dataclasses.dataclass(frozen=True)
class Config:
  scale: float
  softcap: float
  window_left: int
  window_right: int
  deterministic: bool = False
  kernel: bool = False  # the 16-bit kernels (else the reference)
  # Why implementation='fa3' cannot have the 16-bit kernel: raised where it
  # is needed (FP8 needs it only for the gradient).
  kernel_error: str | None = None
  fp8: FP8Config | None = None
  ring: RingConfig | None = None
  block_k: int = BLOCK_K

  @property
  def attrs(self):
    return dict(scale=self.scale, softcap=self.softcap,
                window_left=self.window_left, window_right=self.window_right)


def attention(q, k, v, q_lens, kv_lens, bias, mask, cfg: Config, *,
              segment_ids=None, sinks=None):
  """Validated 4-D inputs -> ``(out [B,T,N,Hv], lse f32 [B,N,T])``.

  ``sinks``: None or float32 ``[N]``, each head's logit of a virtual key
  with value 0 that joins every row's softmax (:func:`reference.fold_sinks`).

  ``segment_ids``: None or ``(q_ids int32 [B,T], kv_ids int32 [B,S])``
  (packed sequences: query ``i`` sees key ``j`` only where the ids are
  equal).  The kernels get them, or a ``mask``, as the pair-rule operands
  of :mod:`jax_fa3.pair_rule` (with their spans), computed once here and
  kept for the backward; a ring hands each step the ids of its pieces.
  ``lse`` is differentiable too (higher-order derivatives need it); ``bias``
  gets a gradient, the lengths, ``mask`` and segment ids do not."""
  B, T = q.shape[:2]
  S = k.shape[1]
  if cfg.ring is None:
    cfg = _without_unreachable_bounds(cfg, T, S)
  if q_lens is None:
    q_lens = jnp.full((B,), T, jnp.int32)
  if kv_lens is None:
    kv_lens = jnp.full((B,), S, jnp.int32)
  if sinks is not None:
    # A sink of -inf is "no sink"; a finite stand-in keeps a row that sees no
    # key at 0 (exp(-inf - -inf) would be NaN) and changes no other row.
    sinks = jnp.maximum(sinks, NO_SINK)
  pairs = segment_ids
  if segment_ids is not None:
    if cfg.ring is None and (cfg.kernel or
                             (cfg.fp8 is not None and cfg.fp8.kernel)):
      pairs = sharding.pairs_from_segment_ids(*segment_ids)
  elif mask is not None and cfg.kernel and cfg.fp8 is None:
    if cfg.ring is not None:
      raise ValueError("masks are not supported by ring attention")
    pairs, mask = sharding.pairs_from_mask(mask, k.shape[2], T, S), None
  if (bias is not None and bias.shape[3] == 1 and sinks is None
      and cfg.kernel and cfg.fp8 is None and cfg.ring is None):
    # A bias constant along the keys shifts a row's scores alike: the
    # softmax drops it (its gradient is 0), only the log-sum-exp keeps it;
    # -inf hides the row's keys (a row that sees no key: 0 and lse +inf).
    out, lse = _attention_jit(q, k, v, q_lens, kv_lens, None, mask, pairs,
                              sinks, cfg)
    shift = jnp.broadcast_to(bias[..., 0], lse.shape).astype(lse.dtype)
    dead = jnp.isneginf(shift)
    out = jnp.where(jnp.swapaxes(dead, 1, 2)[..., None], 0, out).astype(out.dtype)
    return out, jnp.where(dead, jnp.inf, lse + shift)
  return _attention_jit(q, k, v, q_lens, kv_lens, bias, mask, pairs, sinks,
                        cfg)


def _without_unreachable_bounds(cfg, T, S):
  """A window side no row reaches is no bound: left >= T - 1 and right >=
  S - 1 change no mask (top-left positions), and as -1 the kernels pick their
  causal schedule and tiles for e.g. a (4096, 0) window on 2k rows."""
  return dataclasses.replace(
      cfg, window_left=-1 if cfg.window_left >= T - 1 else cfg.window_left,
      window_right=-1 if cfg.window_right >= S - 1 else cfg.window_right)


_NO_SECOND_ORDER = ("derivatives of second and higher order run on "
                    "implementation='reference' (the backward kernels have "
                    "no derivative)")


def _local_fns(cfg):
  """The (fwd, bwd) each ring step calls, with the segment ids of its
  pieces (None, or ``(q_ids, kv_ids)``) after the lengths."""
  if cfg.kernel:
    def bwd(*args, **attrs):
      return no_derivative(partial(primitives.fa3_bwd, **attrs,
                                   deterministic=cfg.deterministic),
                           _NO_SECOND_ORDER)(*args)
    return ring.kernel_steps(primitives.fa3_fwd, bwd)

  def with_ids(fn):  # the reference takes the ids as keywords
    return lambda *a, **attrs: fn(*a[:-1], **_seg_kwargs(a[-1]), **attrs)
  return with_ids(reference.attention_fwd), with_ids(reference.attention_bwd)


def _ring_args(cfg):
  r = cfg.ring
  return (r.axis_name, r.n_dev, r.layout, r.causal,
          dict(scale=cfg.scale, softcap=cfg.softcap), _local_fns(cfg))


def _seg_kwargs(pairs):
  """Reference keywords for ``pairs``: None, the segment ids pair, or the
  kernels' segment-id operands (mask operands only reach the kernels)."""
  q_ids, kv_ids = (None, None) if pairs is None else pairs[:2]
  return dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids)


def _forward16(q, k, v, q_lens, kv_lens, bias, mask, pairs, sinks, cfg):
  """``(out, lse)`` with the sinks in the softmax (the kernel adds them to
  the row sums; the ring and the reference fold them in afterwards)."""
  if cfg.kernel_error is not None:
    raise ValueError(f"implementation='fa3' is not possible: "
                     f"{cfg.kernel_error}")
  if cfg.ring is not None:
    return reference.fold_sinks(
        *ring.ring_fwd(q, k, v, q_lens, kv_lens, *_ring_args(cfg),
                       segment_ids=pairs), sinks)
  if cfg.kernel:
    # The primitives' abstract eval drops shard_map's varying-axes type;
    # restore it so check_vma=True accepts results and cotangent types.
    return reference.varying_like(sharding.fa3_fwd(
        q, k, v, q_lens, kv_lens, pairs=pair_rule.query_side(pairs),
        sinks=sinks, bias=_kernel_bias(bias, q, k), **cfg.attrs),
        q, k, v, q_lens, kv_lens)
  return reference.fold_sinks(*reference.attention_fwd(
      q, k, v, q_lens, kv_lens, bias=bias, mask=mask, block_k=cfg.block_k,
      **_seg_kwargs(pairs), **cfg.attrs), sinks)


def _forward_fp8(q, k, v, q_lens, kv_lens, pairs, cfg):
  f = cfg.fp8
  # The kernel path has the pre-pass write V^T (fp8 module docstring).
  q8, k8, v8, qs, ks, vs = fp8.quantize_qkv(
      q, k, v, block_scales=f.block_scales, hadamard=f.hadamard, seed=f.seed,
      use_kernel=f.kernel, v_transposed=f.kernel)
  return fp8.attention_quantized(
      q8, k8, v8, qs, ks, vs, q_lens, kv_lens, cfg.scale, cfg.window_left,
      cfg.window_right, q.dtype, "fa3" if f.kernel else "reference",
      v_transposed=f.kernel, pairs=pairs)


def _dsinks(out, lse, dout, sinks, dlse=None):
  """``dsink[n] = -sum over batch and rows of P_sink * (rowsum(dout * out)
  - dlse)`` (``out``/``lse`` with the sinks folded in)."""
  delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32),
                     out.astype(jnp.float32))
  if dlse is not None:
    delta = delta - dlse
  p_sink = jnp.exp(sinks[None, :, None] - lse)
  d = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)
  return reference.summed_like(d, sinks)


def _kernel_bias(bias, q, k):
  """The kernels' bias operand: ``[B|1, N|1, T, S]`` in q's dtype (as jax.nn
  adds it to the scores), or None."""
  if bias is None:
    return None
  T, S = q.shape[1], k.shape[1]
  return jnp.broadcast_to(bias, bias.shape[:2] + (T, S)).astype(q.dtype)


def _dbias_dtype(bias, q, k):
  """The kernels' bias gradient type: q's, or float32 where it is summed
  over broadcast dims next (the sum cancels: bf16 terms lost too much)."""
  B, T, N, _ = q.shape
  return q.dtype if bias.shape == (B, N, T, k.shape[1]) else jnp.float32


def _reduced_dbias(dbias, bias):
  """The kernels' per batch row and head gradient -> ``bias``'s shape."""
  axes = tuple(a for a in range(4) if bias.shape[a] == 1 and dbias.shape[a] > 1)
  if axes:
    dbias = jnp.sum(dbias.astype(jnp.float32), axis=axes, keepdims=True)
  return dbias.astype(bias.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attention(q, k, v, q_lens, kv_lens, bias, mask, pairs, sinks, cfg):
  if cfg.fp8 is not None:
    return reference.fold_sinks(
        *_forward_fp8(q, k, v, q_lens, kv_lens, pairs, cfg), sinks)
  return _forward16(q, k, v, q_lens, kv_lens, bias, mask, pairs, sinks, cfg)


# Called through a jit: shard_map run eagerly cannot differentiate a
# custom_vjp with symbolic zeros, a jit inside it can.
_attention_jit = jax.jit(_attention, static_argnums=(9,))


def _vjp_fwd(*args):
  # Symbolic zeros: the last residual is None unless the bias is
  # differentiated (a static marker: the residuals' tree structure).
  *primals, cfg = args
  bias = primals[5]
  bias_grad = bias is not None and bias.perturbed
  primals = custom_vjp_primal_tree_values(tuple(primals))
  out, lse = _attention(*primals, cfg)
  saved = (None, None) if cfg.fp8 is not None else (out, lse)
  marker = jnp.zeros((0,), jnp.float32) if bias_grad else None
  return (out, lse), tuple(primals) + saved + (marker,)


def no_derivative(fn, why):
  """``fn`` whose derivative raises ``ValueError(why)``: calls of kernels
  that have no derivative of their own (else JAX's error names only
  ``custom_partitioning``)."""
  @jax.custom_jvp
  def call(*args):
    return fn(*args)

  @call.defjvp
  def _jvp(primals, tangents):
    raise ValueError(why)
  return call


def _grads(cfg, q, k, v, out, lse, dout, q_lens, kv_lens, bias, mask, pairs,
           bias_grad):
  """``(dq, dk, dv, dbias)`` of one backward pass (dbias None unless
  ``bias_grad``), on the path ``cfg`` names."""
  if cfg.ring is not None:
    return (*ring.ring_bwd(q, k, v, out, lse, dout, q_lens, kv_lens,
                           *_ring_args(cfg), segment_ids=pairs), None)
  if cfg.kernel:
    kernels = partial(sharding.fa3_bwd, deterministic=cfg.deterministic,
                  dbias_dtype=_dbias_dtype(bias, q, k) if bias_grad else None,
                  **cfg.attrs)
    bwd = no_derivative(
        lambda *a: kernels(*a[:8], pairs=a[8], bias=a[9]), _NO_SECOND_ORDER)
    *grads, dbias = bwd(q, k, v, out, lse, dout.astype(out.dtype), q_lens,
                        kv_lens, pairs, _kernel_bias(bias, q, k))
    dq, dk, dv = (reference.varying_like(g, x)
                  for g, x in zip(grads, (q, k, v)))
    return dq, dk, dv, None if dbias is None else _reduced_dbias(dbias, bias)
  dq, dk, dv, dbias = reference.attention_bwd_with_dbias(
      q, k, v, out, lse, dout, q_lens, kv_lens, bias=bias, mask=mask,
      block_k=cfg.block_k, **_seg_kwargs(pairs), **cfg.attrs)
  return dq, dk, dv, dbias if bias_grad else None


def _lse_probe(out, lse, dlse):
  """``(v scale 0, out', dout')`` that make a backward pass return the
  gradient through ``lse`` alone: ``d lse_i / d s_ij = P_ij``, and a pass
  computes ``dS = P * (dout'.v' - rowsum(dout' * out'))``; with ``v' = 0``,
  ``out' = e_0`` and ``dout' = -dlse e_0`` that is ``P * dlse``.  (Only
  higher-order differentiation and ring attention's ``return_lse`` send a
  cotangent to ``lse``.)"""
  dlse = jnp.where(jnp.isfinite(lse), dlse.astype(jnp.float32), 0.0)
  e0 = (jnp.arange(out.shape[-1]) == 0).astype(out.dtype)
  out1 = jnp.broadcast_to(e0, out.shape)
  dout1 = (-jnp.swapaxes(dlse, 1, 2)[..., None] * e0).astype(out.dtype)
  return out1, dout1, dlse


def _vjp_bwd(cfg, res, cts):
  q, k, v, q_lens, kv_lens, bias, mask, pairs, sinks, out, lse, marker = res
  dout, dlse = cts
  if isinstance(dout, SymbolicZero):
    dout = jnp.zeros(dout.aval.shape, dout.aval.dtype)
  bias_grad = marker is not None
  if cfg.fp8 is not None:
    out, lse = _forward16(q, k, v, q_lens, kv_lens, bias, mask, pairs,
                          sinks, cfg)
  args = (q_lens, kv_lens, bias, mask, pairs, bias_grad)
  dq, dk, dv, dbias = _grads(cfg, q, k, v, out, lse, dout, *args)
  if isinstance(dlse, SymbolicZero):
    dlse = None
  else:
    out1, dout1, dlse = _lse_probe(out, lse, dlse)
    gq, gk, _, gb = _grads(cfg, q, k, jnp.zeros_like(v), out1, lse, dout1,
                           *args)
    dq, dk = (dq + gq).astype(q.dtype), (dk + gk).astype(k.dtype)
    if dbias is not None:
      dbias = (dbias + gb).astype(dbias.dtype)
  if dbias is not None:
    # Inside shard_map: typed like the shards that produced it, then summed
    # over the manual axes a replicated bias does not vary over.
    dbias = reference.summed_like(
        reference.varying_like(dbias, q, k, v, bias), bias)
  dseg = None if pairs is None else (None,) * len(pairs)
  dsinks = None if sinks is None else _dsinks(out, lse, dout, sinks, dlse)
  return dq, dk, dv, None, None, dbias, None, dseg, dsinks


_attention.defvjp(_vjp_fwd, _vjp_bwd, symbolic_zeros=True)

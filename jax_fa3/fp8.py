"""FP8 (e4m3) attention: block scales and Hadamard incoherent processing.

``attention(q, k, v, precision="fp8")`` quantizes bf16/fp16 Q, K, V inside
and returns the input dtype.  On an H100/H200 with the kernels built this is
the CUDA path: one fused quantize pre-pass kernel, then the FP8 forward
kernel (QGMMA with FP32 accumulation, FP32 softmax).  Elsewhere, or with
``implementation="reference"``, it is the pure-JAX emulation of the same
method defined here (quantize, e4m3 rounding of Q, K, V and P, FP32 scores
and softmax); it is also what the FP8 primitives lower to off CUDA.  Two
accuracy devices, both on by default and switchable for ablation:

* **block scales**: one FP32 scale (``amax / 448``) per block of rows the
  kernel consumes, so an outlier coarsens only its own block;
  ``fp8_block_scales=False`` uses one scale per tensor.
* **Hadamard rotation** of Q and K: ``x -> x diag(signs) H_d / sqrt(d)``
  with random signs from ``fp8_seed``.  The rotation is orthogonal and
  applied to both, so ``Q K^T`` is unchanged, but an outlier channel is spread
  over all ``d`` channels before quantization.  V is not rotated (its rotation
  would not cancel).

Scale layout (float32, row-major), one scale per kernel block:

* ``q_scale [B, N, ceil(T / 128)]``: 128 query rows of one head.
* ``k_scale, v_scale [B, K, ceil(S / block_n)]`` with ``block_n =
  kv_block_rows(head_dim)`` (128): rows of one key/value head.  V's scales
  are powers of two: the kernel folds their ratios into the e4m3
  probabilities (other V scales work but round P less well).

A dequantized value is ``e4m3 value * scale``.  :func:`quantize_fp8` produces
exactly this layout; :func:`jax_fa3.attention_fp8` consumes it (e.g. an FP8
KV cache).

V's layout.  FP8 WGMMA reads V only as V^T (key index contiguous).
``attention_fp8`` takes V as ``[B, S, K, H]`` and its kernel transposes every
V tile in shared memory.  ``precision="fp8"`` instead has the pre-pass, which
writes V anyway, write it as V^T ``[B, K, H, S padded to 128]`` (keys
permuted inside each 32-key slice to match the P registers, padding zero):
the same HBM traffic, and the kernel then loads V^T tiles with TMA and skips
the transpose.

Gradients: ``jax.grad`` through ``precision="fp8"`` is straight-through: the
backward is the ordinary (bf16/fp16) attention backward evaluated at the
original, unquantized inputs (:mod:`jax_fa3.core`).  The emulation's results
are close to, not bit-identical with, the kernel's.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import mlir

from jax_fa3 import _native, _validate as V, primitives, pair_rule, sharding

__all__ = ["quantize_fp8", "quantize_qkv", "attention_quantized",
           "emulate_fp8_attention", "hadamard_signs", "rotate",
           "kv_block_rows", "vt_key_order", "to_vt_layout", "Q_BLOCK_ROWS",
           "E4M3_MAX", "QUANT_TARGET", "FWD_TARGET", "compiled_fp8_configs",
           "fp8_kernel_blocker", "check_fp8_options", "check_fp8_operands"]

E4M3_MAX = 448.0
Q_BLOCK_ROWS = 128
# P is produced as 2**8 * exp(s - max) before its cast to e4m3 (uses the e4m3
# range; values below 2**-9 would flush to zero otherwise); cancels in PV/sum.
_P_SHIFT = 256.0
_F32 = jnp.float32
_E4M3 = jnp.float8_e4m3fn
_HIGHEST = lax.Precision.HIGHEST

QUANT_TARGET = primitives.FP8_QUANT_TARGET
FWD_TARGET = primitives.FP8_FWD_TARGET
compiled_fp8_configs = _native.compiled_fp8_configs


def kv_block_rows(head_dim: int) -> int:
  """Rows per K/V scale block of the FP8 kernel for this head dim."""
  del head_dim  # one block height for every head dim (cc/fp8/params.h)
  return 128


def _check_head_dim_pow2(h):
  if h < 1 or h & (h - 1):
    raise ValueError(f"the Hadamard rotation needs a power-of-two head_dim, "
                     f"got {h}")


def hadamard_signs(head_dim: int, seed: int = 0) -> jax.Array:
  """The random +-1 diagonal (float32 ``[head_dim]``) drawn from ``seed``."""
  return jax.random.rademacher(jax.random.PRNGKey(seed), (head_dim,),
                               dtype=_F32)


@functools.lru_cache(maxsize=None)
def _hadamard_np(d):
  i = np.arange(d)
  pop = np.vectorize(lambda x: bin(x).count("1"))(i[:, None] & i[None, :])
  return ((-1.0) ** pop / math.sqrt(d)).astype(np.float32)


def rotate(x, signs):
  """``x diag(signs) H / sqrt(d)`` along the last axis, in float32 (the
  Sylvester-ordered Hadamard matrix; orthogonal and symmetric)."""
  d = x.shape[-1]
  _check_head_dim_pow2(d)
  h = jnp.asarray(_hadamard_np(d))
  return jnp.matmul(x.astype(_F32) * signs.astype(_F32), h, precision=_HIGHEST)


def _block_amax(y, block_rows):
  """y [B, S, N, H] f32 -> amax [B, N, ceil(S / block_rows)]."""
  b, s, n, h = y.shape
  nb = -(-s // block_rows)
  y = jnp.pad(jnp.abs(y), ((0, 0), (0, nb * block_rows - s), (0, 0), (0, 0)))
  a = jnp.max(y.reshape(b, nb, block_rows, n, h), axis=(2, 4))
  return jnp.transpose(a, (0, 2, 1))


def _expand_scales(scales, block_rows, s):
  """[B, N, nb] -> [B, S, N, 1] (each block's scale on its rows)."""
  e = jnp.repeat(jnp.transpose(scales, (0, 2, 1)), block_rows, axis=1)[:, :s]
  return e[..., None]


def quantize_fp8(x, *, block_rows: int = Q_BLOCK_ROWS, hadamard: bool = False,
                 seed: int = 0, signs=None, per_tensor: bool = False,
                 pow2_scales: bool = False):
  """Quantizes ``x [B, S, N, H]`` to e4m3 with FP32 block scales.

  Returns ``(x_e4m3 [B, S, N, H] float8_e4m3fn, scales f32 [B, N,
  ceil(S / block_rows)])`` with ``x ~= x_e4m3 * scale`` (after the rotation
  when ``hadamard``).  For the FP8 kernel use ``block_rows = 128`` for Q and
  ``kv_block_rows(H)`` for K and V, the same ``signs`` (or ``seed``) for Q and
  K, and ``hadamard=False, pow2_scales=True`` for V.  ``per_tensor`` puts
  the tensor-wide scale in every entry.  ``pow2_scales`` rounds every scale up
  to a power of two (the kernel folds V's scale ratios into the e4m3
  probabilities, exact only for powers of two; e4m3's relative precision does
  not depend on the scale).  An all-zero block gets scale 1, or the smallest
  normal float with ``pow2_scales`` (below every real block's).  Pure JAX.
  """
  x = V.as_array(x, "x")
  if x.ndim != 4 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating [B, S, N, H] array, got "
                     f"{x.dtype} of shape {x.shape}")
  if not V.is_int(block_rows) or block_rows <= 0:
    raise ValueError(f"block_rows must be a positive int, got {block_rows!r}")
  for name, flag in (("hadamard", hadamard), ("per_tensor", per_tensor),
                     ("pow2_scales", pow2_scales)):
    V.check_bool(flag, name)
  _check_seed(seed, "seed")
  if signs is not None and not hadamard:
    raise ValueError("signs are the Hadamard rotation's: pass hadamard=True "
                     "with them")
  y = x.astype(_F32)
  if hadamard:
    if signs is None:
      signs = hadamard_signs(x.shape[-1], seed)
    signs = jnp.asarray(signs, _F32)
    if signs.shape != (x.shape[-1],):
      raise ValueError(f"signs must have shape [H]=({x.shape[-1]},), got "
                       f"{signs.shape}")
    try:
      concrete = np.asarray(signs)
    except jax.errors.TracerArrayConversionError:
      concrete = None  # traced signs: the caller's to get right
    if concrete is not None and not np.all(np.abs(concrete) == 1):
      raise ValueError("signs must be +1 or -1 (else the rotation is not "
                       "orthogonal and does not cancel in Q K^T)")
    y = rotate(y, signs)
  amax = _block_amax(y, block_rows)
  if per_tensor:
    amax = jnp.full_like(amax, jnp.max(amax))
  scales = _amax_scales(amax, pow2_scales)
  return _cast(y, scales, block_rows), scales


def _amax_scales(amax, pow2):
  # A tiny amax / 448 flushes to 0 (x / 0 below): the smallest normal is the
  # floor, as in the pre-pass kernel.
  scales = jnp.maximum(amax / E4M3_MAX, np.finfo(np.float32).tiny)
  if pow2:
    mant, expo = jnp.frexp(scales)  # scales = mant * 2^expo, mant in [0.5, 1)
    scales = jnp.ldexp(jnp.ones_like(scales),
                       jnp.where(mant == 0.5, expo - 1, expo))
  zero_scale = float(np.finfo(np.float32).tiny) if pow2 else 1.0
  return jnp.where(amax > 0, scales, zero_scale).astype(_F32)


def _cast(y, scales, block_rows):
  q = jnp.clip(y / _expand_scales(scales, block_rows, y.shape[1]),
               -E4M3_MAX, E4M3_MAX).astype(_E4M3)
  return _pin(q)


def _pin(x8):
  """Keeps an e4m3 value from being folded away: with excess precision
  allowed (the default), XLA:GPU may drop an f32 -> e4m3 -> f32 round trip
  inside one jit, which would make the GPU emulation more accurate than FP8."""
  return lax.optimization_barrier(x8)


def _dequantize(x8, scales, block_rows):
  return x8.astype(_F32) * _expand_scales(scales, block_rows, x8.shape[1])


def emulate_fp8_attention(q8, k8, v8, q_scale, k_scale, v_scale, *, scale,
                          q_lens=None, kv_lens=None, window_left=-1,
                          window_right=-1, out_dtype=jnp.bfloat16,
                          quantize_p=True, mask=None):
  """Pure-JAX emulation of the FP8 kernel on quantized inputs: dequantized
  operands, FP32 scores and softmax, P rounded to e4m3 as ``2**8 * exp(s -
  rowmax)`` (the kernel uses a lazily moved running max of its key blocks
  instead of the final one, and scales P by the power-of-two ratio of the V
  block's scale to the tile's largest), ``O = P V / sum(P)`` with the FP32 sum.  Dense ``T x S``
  scores: meant for tests and the accuracy table, not for long sequences.
  ``mask``: optional bool ``[B|1, T, S]`` (True = attend; e.g. segment ids).
  Returns ``(out [B, T, N, H] out_dtype, lse f32 [B, N, T])``."""
  b, t, n, h = q8.shape
  s, kh = k8.shape[1], k8.shape[2]
  bn = kv_block_rows(h)
  q = _dequantize(q8, q_scale, Q_BLOCK_ROWS).reshape(b, t, kh, n // kh, h)
  k = _dequantize(k8, k_scale, bn)
  v = _dequantize(v8, v_scale, bn)
  sc = jnp.einsum("btkgh,bskh->bkgts", q, k, precision=_HIGHEST) * scale
  i = jnp.arange(t)[:, None]
  j = jnp.arange(s)[None, :]
  ql = jnp.full((b,), t, jnp.int32) if q_lens is None else q_lens
  kl = jnp.full((b,), s, jnp.int32) if kv_lens is None else kv_lens
  vis = (i[None] < ql[:, None, None]) & (j[None] < kl[:, None, None])
  if window_left >= 0:
    vis &= (j >= i - window_left)[None]
  if window_right >= 0:
    vis &= (j <= i + window_right)[None]
  if mask is not None:
    vis &= mask
  vis = vis[:, None, None]
  sc = jnp.where(vis, sc, -jnp.inf)
  m = jnp.max(sc, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(sc - m) * _P_SHIFT
  denom = jnp.sum(p, axis=-1, keepdims=True)
  if quantize_p:
    p = _pin(p.astype(_E4M3)).astype(_F32)
  o = jnp.einsum("bkgts,bskh->btkgh", p, v, precision=_HIGHEST)
  dt = jnp.transpose(denom[..., 0], (0, 3, 1, 2))[..., None]  # [b,t,k,g,1]
  o = jnp.where(dt > 0, o / jnp.where(dt > 0, dt, 1.0), 0.0)
  lse = jnp.where(denom[..., 0] > 0,
                  m[..., 0] + jnp.log(jnp.where(denom[..., 0] > 0, denom[..., 0], 1.0))
                  - math.log(_P_SHIFT), jnp.inf)
  return (o.reshape(b, t, n, h).astype(out_dtype),
          lse.reshape(b, n, t))


# ------------------------------------------------------------- V^T layout
def vt_key_order(block_n: int = 128) -> np.ndarray:
  """Key held by each position of one V^T block (``vt_key_of`` in
  cc/fp8/params.h): within each 32-key slice, position ``16 h + 4 t + i``
  holds key ``16 h + 8 (i // 2) + 2 t + i % 2``."""
  p = np.arange(block_n)
  return ((p & ~31) + 16 * ((p & 31) // 16) + 8 * ((p % 4) // 2)
          + 2 * ((p % 16) // 4) + p % 2)


def _vt_keys(padded, block_n):
  p = np.arange(padded)
  return (p // block_n) * block_n + vt_key_order(block_n)[p % block_n]


def to_vt_layout(v8):
  """e4m3 V ``[B, S, K, H]`` -> the V^T layout ``[B, K, H, S_pad]`` the
  pre-pass writes for ``precision="fp8"`` (module docstring).  Pure JAX."""
  b, s, kh, h = v8.shape
  bn = kv_block_rows(h)
  sp = primitives.vt_shape(b, s, kh, h, bn)[-1]
  vp = jnp.pad(v8, ((0, 0), (0, sp - s), (0, 0), (0, 0)))
  return jnp.transpose(vp[:, _vt_keys(sp, bn)], (0, 2, 3, 1))


def _from_vt_layout(vt, s):
  """Inverse of :func:`to_vt_layout` (``s`` keys)."""
  bn = kv_block_rows(vt.shape[2])
  pos = np.argsort(_vt_keys(vt.shape[3], bn))
  return jnp.transpose(vt, (0, 3, 1, 2))[:, pos[:s]]


# ------------------------------------------- emulation of the FP8 kernels
def _quantize_emulation(q, k, v, signs, fixed, *, block_q, block_kv, hadamard,
                        v_transposed):
  """What the pre-pass kernel computes (``fixed``: empty, or the three
  tensor-wide scales of a second pass)."""
  ys = [x.astype(_F32) for x in (q, k, v)]
  if hadamard:
    ys[0], ys[1] = rotate(ys[0], signs), rotate(ys[1], signs)
  outs, scales = [], []
  for i, (y, rows) in enumerate(zip(ys, (block_q, block_kv, block_kv))):
    sc = _amax_scales(_block_amax(y, rows), pow2=i == 2)
    if fixed.shape[0]:
      sc = jnp.full_like(sc, fixed[i])
    outs.append(_cast(y, sc, rows))
    scales.append(sc)
  if v_transposed:
    outs[2] = to_vt_layout(outs[2])
  return (*outs, *scales)


def _fwd_emulation(q8, k8, v8, qs, ks, vs, q_lens, kv_lens, *pairs, scale,
                   window_left, window_right, out_dtype, v_transposed):
  if v_transposed:
    v8 = _from_vt_layout(v8, k8.shape[1])
  if pair_rule.is_mask(pairs):  # precision="fp8" takes no mask (api.py)
    raise ValueError("the FP8 kernels take segment ids, not masks")
  kw = pair_rule.reference_kwargs(pairs, q8.shape[1], k8.shape[1])
  mask = (pair_rule.dense_mask(kw["q_segment_ids"], kw["kv_segment_ids"])
          if kw else None)
  return emulate_fp8_attention(
      q8, k8, v8, qs, ks, vs, scale=scale, q_lens=q_lens, kv_lens=kv_lens,
      window_left=window_left, window_right=window_right, out_dtype=out_dtype,
      mask=mask)


# Off CUDA the FP8 primitives are this emulation (as the 16-bit ones are the
# reference), so their partitioning is testable on CPU.
mlir.register_lowering(primitives.fp8_quantize_p, mlir.lower_fun(
    _quantize_emulation, multiple_results=True))
mlir.register_lowering(primitives.fp8_fwd_p, mlir.lower_fun(
    _fwd_emulation, multiple_results=True))


# ---------------------------------------------------------------- kernels
def fp8_kernel_blocker(dtype, head_dim):
  """Why the FP8 kernel cannot run (None if it can)."""
  dtype = np.dtype(dtype)
  if dtype not in V.KERNEL_DTYPES:
    return f"precision='fp8' needs bfloat16 or float16 inputs, got {dtype}"
  if not _native.available():
    return "the jax_fa3 CUDA kernels were not built"
  if not _native.sm90_gpu_present():
    return "no sm_90 (H100/H200) GPU is visible to JAX"
  if (dtype.name, int(head_dim)) not in compiled_fp8_configs():
    return (f"no FP8 kernel for head_dim {head_dim} with output {dtype.name} "
            f"(compiled: {sorted(compiled_fp8_configs())})")
  return None


def quantize_qkv(q, k, v, *, block_scales=True, hadamard=True, seed=0,
                 use_kernel=False, v_transposed=False):
  """Q, K, V -> (q8, k8, v8, q_scale, k_scale, v_scale) in the kernel's
  block layout; Q and K share the rotation, V gets power-of-two scales only.
  ``use_kernel``: the pre-pass kernel (else the emulation); with it,
  ``v_transposed`` writes v8 in the V^T layout of the module docstring."""
  if v_transposed and not use_kernel:
    raise ValueError("v_transposed needs use_kernel=True (the pre-pass kernel)")
  h = q.shape[-1]
  if hadamard:
    _check_head_dim_pow2(h)
  signs = hadamard_signs(h, seed) if hadamard else jnp.ones((h,), _F32)
  if use_kernel:
    call = functools.partial(
        sharding.fp8_quantize, q, k, v, signs, block_q=Q_BLOCK_ROWS,
        block_kv=kv_block_rows(h), hadamard=hadamard,
        v_transposed=v_transposed)
    out = call(jnp.zeros((0,), _F32))
    if not block_scales:  # a second pass with the tensor-wide scales
      out = call(jnp.stack([jnp.max(out[3]), jnp.max(out[4]),
                            jnp.max(out[5])]))
    return out
  bn = kv_block_rows(h)
  kw = dict(per_tensor=not block_scales)
  rot = dict(hadamard=hadamard, signs=signs if hadamard else None)  # Q and K only
  q8, qs = quantize_fp8(q, block_rows=Q_BLOCK_ROWS, **rot, **kw)
  k8, ks = quantize_fp8(k, block_rows=bn, **rot, **kw)
  v8, vs = quantize_fp8(v, block_rows=bn, pow2_scales=True, **kw)
  return q8, k8, v8, qs, ks, vs


def check_fp8_operands(q8, k8, v8, q_scale, k_scale, v_scale):
  """Validates :func:`jax_fa3.attention_fp8`'s quantized operands."""
  arrs = [V.as_array(x, name) for x, name in
          ((q8, "query"), (k8, "key"), (v8, "value"))]
  if any(x.dtype != np.dtype(_E4M3) for x in arrs):
    raise ValueError("attention_fp8 needs float8_e4m3fn query/key/value, got "
                     f"{[str(x.dtype) for x in arrs]}")
  q8, k8, v8 = V.check_qkv(*arrs, dtypes=(np.dtype(_E4M3),))
  b, t, n, h = q8.shape
  s, kh = k8.shape[1], k8.shape[2]
  bn = kv_block_rows(h)
  want = {"q_scale": (q_scale, (b, n, -(-t // Q_BLOCK_ROWS))),
          "k_scale": (k_scale, (b, kh, -(-s // bn))),
          "v_scale": (v_scale, (b, kh, -(-s // bn)))}
  out = []
  for name, (x, shape) in want.items():
    x = V.as_array(x, name)
    if x.shape != shape or x.dtype != np.dtype(_F32):
      raise ValueError(f"{name} must be float32 of shape {shape} (one scale "
                       f"per kernel block), got {x.dtype} {x.shape}")
    out.append(x)
  return (q8, k8, v8, *out)


def attention_quantized(q8, k8, v8, qs, ks, vs, q_lens, kv_lens, scale, wl,
                        wr, out_dtype, implementation, v_transposed=False,
                        pairs=None):
  """Attention on validated e4m3 operands -> ``(out, lse)``: the FP8 kernel
  (partitioned) or, for ``implementation="reference"`` or where the kernel
  cannot run, the emulation.  ``v_transposed``: v8 is V^T from
  ``quantize_qkv(..., use_kernel=True, v_transposed=True)``; kernel only.
  ``pairs``: None or segment ids -- the pair ``(q int32 [B,T], kv int32
  [B,S])`` for the emulation, the kernels' operands
  (:func:`pair_rule.from_segment_ids`, ids first) for either."""
  b, t, n, h = q8.shape
  s = k8.shape[1]
  blocker = fp8_kernel_blocker(out_dtype, h)
  if v_transposed and (implementation == "reference" or blocker is not None):
    raise ValueError("a V^T operand needs the FP8 kernel: "
                     f"{blocker or 'implementation=reference'}")
  if implementation == "fa3" and blocker is not None:
    raise ValueError(f"implementation='fa3' is not possible: {blocker}")
  if implementation != "reference" and blocker is None:
    ql = jnp.full((b,), t, jnp.int32) if q_lens is None else q_lens
    kl = jnp.full((b,), s, jnp.int32) if kv_lens is None else kv_lens
    return sharding.fp8_fwd(q8, k8, v8, qs, ks, vs, ql, kl, pairs, scale=scale,
                            window_left=wl, window_right=wr,
                            out_dtype=out_dtype, v_transposed=v_transposed)
  mask = None if pairs is None else pair_rule.dense_mask(*pairs[:2])
  return emulate_fp8_attention(q8, k8, v8, qs, ks, vs, scale=scale,
                               q_lens=q_lens, kv_lens=kv_lens, window_left=wl,
                               window_right=wr, out_dtype=out_dtype, mask=mask)


def _check_seed(seed, name):
  """An int that ``jax.random.PRNGKey`` takes (64 bits; a wider one is
  its OverflowError)."""
  if not V.is_int(seed) or not -2**63 <= seed < 2**63:
    raise ValueError(f"{name} must be an int in [-2**63, 2**63), got {seed!r}")
  return int(seed)


def check_fp8_options(block_scales, hadamard, seed):
  block_scales = V.check_bool(block_scales, "fp8_block_scales")
  hadamard = V.check_bool(hadamard, "fp8_hadamard")
  return block_scales, hadamard, _check_seed(seed, "fp8_seed")


def check_head_dim(h, hadamard):
  """The Hadamard rotation needs a power-of-two head dim."""
  if hadamard:
    _check_head_dim_pow2(h)

"""Input validation for the public API (raises ValueError in Python, before
anything is traced into a kernel)."""
from __future__ import annotations

import math
import numbers

import numpy as np
import jax
import jax.numpy as jnp

KERNEL_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
# What the 16-bit API takes: the kernels' dtypes, and float32 (the reference).
INPUT_DTYPES = KERNEL_DTYPES + (np.dtype(jnp.float32),)
PRECISIONS = (None, "fp8")


def as_array(x, name):
  if x is None:
    raise ValueError(f"{name} must be an array, got None")
  try:
    return jnp.asarray(x)
  except TypeError as e:
    raise ValueError(f"{name} must be an array, got {type(x).__name__}") from e


def check_dtype(t, name, dtypes=INPUT_DTYPES):
  if t.dtype not in dtypes:
    raise ValueError(f"{name} must have dtype "
                     f"{' or '.join(str(d) for d in dtypes)}, got {t.dtype}")


def check_qkv(query, key, value, *, ndim=4, value_head_dim=False,
              dtypes=INPUT_DTYPES):
  """Checks q [B,T,N,H], k/v [B,S,K,H] (v [B,S,K,Hv] with any Hv if
  ``value_head_dim``) of one of ``dtypes``; returns the three arrays."""
  q, k, v = (as_array(query, "query"), as_array(key, "key"),
             as_array(value, "value"))
  for name, t in (("query", q), ("key", k), ("value", v)):
    if t.ndim != ndim:
      form = "[B, T, N, H]" if name == "query" else "[B, S, K, H]"
      raise ValueError(f"{name} must be a rank-{ndim} array of shape {form}, "
                       f"got shape {t.shape}")
    check_dtype(t, name, dtypes)
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError("query, key and value must have the same dtype, got "
                     f"{q.dtype}, {k.dtype}, {v.dtype}")
  if k.shape[:-1] != v.shape[:-1] or (not value_head_dim
                                       and k.shape != v.shape):
    form = "[B, S, K]" if value_head_dim else "[B, S, K, H]"
    raise ValueError(f"key and value must have the same shape {form}, "
                     f"got key {k.shape} and value {v.shape} (mismatched "
                     "k-v lengths, heads or head_dim)")
  if v.shape[-1] == 0:
    raise ValueError(f"value head_dim must be positive, got {v.shape}")
  if k.shape[1] == 0:
    raise ValueError(f"key/value sequence length S must be positive (a "
                     f"query needs a key to attend to), got {k.shape}")
  B, T, N, H = q.shape
  if k.shape[0] != B:
    raise ValueError(f"query and key/value batch sizes differ: {B} vs "
                     f"{k.shape[0]}")
  if k.shape[3] != H:
    raise ValueError(f"query and key/value head_dim differ: {H} vs "
                     f"{k.shape[3]}")
  K = k.shape[2]
  if K == 0 or N % K != 0:
    raise ValueError(f"number of query heads N={N} must be a multiple of the "
                     f"number of key/value heads K={K}")
  return q, k, v


def check_seq_lengths(lens, name, batch):
  """An integer array [B] -> int32 (NumPy's default int64 too, as jax.nn
  takes it; lengths past int32's range clamp, as lengths past T do)."""
  if lens is None:
    return None
  orig_dtype = np.dtype(lens.dtype if hasattr(lens, "dtype")
                        else np.asarray(lens).dtype)
  if orig_dtype.kind not in "iu":
    raise ValueError(f"{name} must be an integer (int32) array of shape "
                     f"[B]=({batch},), got dtype {orig_dtype}")
  lens = clamped_int32(lens, name).astype(jnp.int32)
  if lens.shape != (batch,):
    raise ValueError(f"{name} must have shape [B]=({batch},), got "
                     f"{lens.shape}")
  return lens


def is_int(x):
  return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(
      x, (bool, np.bool_))


def is_real(x):
  return isinstance(x, (numbers.Real, np.floating, np.integer)) and not \
      isinstance(x, (bool, np.bool_))


WINDOW_MAX = 2**30


def check_window(local_window_size):
  """None | int w | (left, right) -> None or (left, right) of python ints,
  each at most ``WINDOW_MAX`` (wider than any sequence: the same mask, and
  ``position + window`` stays in int32)."""
  if local_window_size is None:
    return None
  w = local_window_size
  if is_int(w) and w >= 0:
    return (min(int(w), WINDOW_MAX),) * 2
  if (isinstance(w, (tuple, list)) and len(w) == 2
      and all(is_int(x) and x >= 0 for x in w)):
    return min(int(w[0]), WINDOW_MAX), min(int(w[1]), WINDOW_MAX)
  raise ValueError("local_window_size must be None, a non-negative int w "
                   "(meaning (w, w)) or a pair (left, right) of non-negative "
                   f"ints, got {w!r}")


def _static_scalar(x, name):
  """A 0-d NumPy or concrete JAX array -> its Python value (else x as is);
  a traced one is refused: the kernels take these as compile-time values."""
  if isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0 and \
      jnp.issubdtype(x.dtype, np.number):
    try:
      return x.item()
    except jax.errors.ConcretizationTypeError as e:
      raise ValueError(f"{name} must be a static (Python) finite number, got "
                       "a traced value") from e
  return x


def _finite_f32(x):
  """A real number that stays finite as float32 (the kernels' and the
  reference's type for scale and softcap: 1e39 would become inf there)."""
  if not is_real(x) or not math.isfinite(float(x)):
    return False
  with np.errstate(over="ignore"):
    return bool(np.isfinite(np.float32(float(x))))


def check_softcap(softcap):
  if softcap is None:
    return 0.0
  softcap = _static_scalar(softcap, "softcap")
  if not _finite_f32(softcap) or float(softcap) <= 0:
    raise ValueError("softcap must be None or a positive number finite in "
                     f"float32, got {softcap!r}")
  return float(softcap)


def check_scale(scale, head_dim):
  if head_dim < 1:
    raise ValueError(f"query/key head_dim must be positive, got {head_dim}")
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  scale = _static_scalar(scale, "scale")
  if not _finite_f32(scale):
    raise ValueError("scale must be None or a number finite in float32, got "
                     f"{scale!r}")
  return float(scale)


def check_bool(x, name):
  if not isinstance(x, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool, got {x!r}")
  return bool(x)


def check_is_causal(is_causal):
  return check_bool(is_causal, "is_causal")


def check_deterministic(deterministic):
  return check_bool(deterministic, "deterministic")


def check_precision(precision):
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be None or 'fp8', got {precision!r}")
  return precision


def check_implementation(implementation, allowed):
  if implementation not in allowed:
    raise ValueError(f"implementation must be one of {allowed}, got "
                     f"{implementation!r}")
  return implementation


def check_bias_mask(t, name, B, N, T, S, K):
  """bias/mask broadcastable to [B,N,T,S] (each dim 1 or full); returns 4-D."""
  if t is None:
    return None
  t = as_array(t, name)
  if name == "mask" and t.dtype != np.dtype(bool):
    raise ValueError(f"mask must be a bool array (True = attend), got "
                     f"{t.dtype}")
  if name == "bias" and not jnp.issubdtype(t.dtype, jnp.floating):
    raise ValueError(f"bias must be a floating array, got {t.dtype}")
  if t.ndim > 4:
    raise ValueError(f"{name} must have rank <= 4 and be broadcastable to "
                     f"[B, N, T, S]=({B}, {N}, {T}, {S}), got {t.shape}")
  t4 = t.reshape((1,) * (4 - t.ndim) + t.shape)
  for have, want in zip(t4.shape, (B, N, T, S)):
    if have not in (1, want):
      raise ValueError(f"{name} of shape {t.shape} is not broadcastable to "
                       f"[B, N, T, S]=({B}, {N}, {T}, {S}) (each dim must be "
                       "1 or the full size)")
  return t4


def kernel_blocker(dtype, head_dim, native):
  """Why the fa3 kernel can't run this config (None if it can)."""
  dtype = np.dtype(dtype)
  if dtype not in KERNEL_DTYPES:
    return (f"query/key/value dtype {dtype} is not supported by the fa3 "
            "kernel (needs bfloat16 or float16)")
  if not native.available():
    return ("the jax_fa3 CUDA kernels were not built (no sm_90 GPU / kernels "
            "not built)")
  if not native.sm90_gpu_present():
    return "no sm_90 (H100/H200) GPU is visible to JAX (no sm_90 GPU)"
  configs = native.compiled_configs()
  if (dtype.name, int(head_dim)) not in configs:
    return (f"head_dim {head_dim} with dtype {dtype.name} was not compiled "
            f"into the kernels (compiled: {sorted(configs)})")
  return None


def _wide_ints(x, name):
  """The values of integers wider than int32 as NumPy (a cast to int32
  would wrap them), else None; traced wider integers are refused."""
  orig = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
  if orig.kind not in "iu" or np.can_cast(orig, np.int32):
    return None
  try:
    return np.asarray(x)
  except jax.errors.TracerArrayConversionError as e:
    raise ValueError(f"{name} must be int32 (or a narrower integer type), "
                     f"got a traced {orig} array") from e


_I32 = np.iinfo(np.int32)


def clamped_int32(x, name):
  """Integers -> int32 with values outside its range clamped."""
  vals = _wide_ints(x, name)
  if vals is not None:
    x = np.clip(vals, _I32.min, _I32.max).astype(np.int32)
  return as_array(x, name)


def _check_ids(ids, name, batch, length, form):
  # Wider ids would merge distinct segments when cut to int32: only concrete
  # values that fit pass.
  vals = _wide_ints(ids, name)
  if vals is not None and vals.size and (vals.min() < _I32.min or
                                         vals.max() > _I32.max):
    raise ValueError(f"{name} holds values outside int32's range (dtype "
                     f"{vals.dtype}); distinct ids would merge when cast")
  ids = as_array(ids, name)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer (int32) array of shape "
                     f"{form}, got dtype {ids.dtype}")
  if ids.ndim != 2 or ids.shape[1] != length:
    raise ValueError(f"{name} must have shape {form}=({batch}, {length}), "
                     f"got {ids.shape}")
  if ids.shape[0] != batch:
    raise ValueError(f"{name} batch size {ids.shape[0]} does not match the "
                     f"query/key/value batch size {batch}")
  return ids.astype(jnp.int32)


def check_sinks(sinks, num_heads):
  """None or a floating ``[N]`` array -> None or float32 ``[N]``."""
  if sinks is None:
    return None
  s = as_array(sinks, "sinks")
  check_dtype(s, "sinks")  # 16-bit sinks are widened to float32
  if s.shape != (num_heads,):
    raise ValueError(f"sinks must have shape [N]=({num_heads},) (one logit "
                     f"per query head), got {s.shape}")
  return s.astype(jnp.float32)


def check_segment_ids(q_segment_ids, kv_segment_ids, B, T, S):
  """Segment ids of packed sequences -> None or (q int32 [B,T], kv int32
  [B,S]); kv_segment_ids defaults to q_segment_ids when T == S."""
  if q_segment_ids is None:
    if kv_segment_ids is not None:
      raise ValueError("kv_segment_ids needs q_segment_ids (give both, or "
                       "q_segment_ids alone when T == S)")
    return None
  q_ids = _check_ids(q_segment_ids, "q_segment_ids", B, T, "[B, T]")
  if kv_segment_ids is None:
    if T != S:
      raise ValueError(f"kv_segment_ids must be given when the query and "
                       f"key/value lengths differ (T={T}, S={S}); it "
                       "defaults to q_segment_ids only when T == S")
    return q_ids, q_ids
  return q_ids, _check_ids(kv_segment_ids, "kv_segment_ids", B, S, "[B, S]")

"""Helpers shared by the test modules: random inputs, jax.nn as the CPU
reference, float32 comparisons, and which kernels this machine has.

The NumPy references the GPU tests judge kernels against are in
``host_reference.py``.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jax_fa3 import _native
from jax_fa3.pair_rule import GRANULE as _GRANULE

# float32 tolerance of the CPU tests (reference path vs jax.nn on XLA:CPU).
RTOL = ATOL = 1e-5


# ------------------------------------------------------------ partitioner
@contextlib.contextmanager
def partitioner(name):
  """Runs the block under the "shardy" or "gspmd" partitioner (skips the
  test where this jax lacks it), then restores the previous one."""
  old = getattr(jax.config, "jax_use_shardy_partitioner", None)
  try:
    jax.config.update("jax_use_shardy_partitioner", name == "shardy")
  except Exception:
    pytest.skip(f"this jax has no {name} partitioner")
  try:
    yield
  finally:
    jax.config.update("jax_use_shardy_partitioner", old)


# ------------------------------------------------------------------ inputs
def rand(seed, B=2, T=37, S=53, N=2, K=2, H=8, dtype=jnp.float32):
  """Normal(0, 1) ``q [B,T,N,H]``, ``k, v [B,S,K,H]`` in ``dtype`` and a
  float32 output cotangent ``w [B,T,N,H]`` (jax.random: on the default
  device)."""
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.float32).astype(dtype)
  w = jax.random.normal(ks[3], (B, T, N, H), jnp.float32)
  return q, k, v, w


def packed_ids(rng, B, L, n_docs, offset=0):
  """int32 [B, L]: n_docs contiguous documents of random lengths (>= 1) per
  row, one of them of length 1 when n_docs > 1; ``rng`` a seed or a
  ``np.random.Generator``."""
  rng = np.random.default_rng(rng)
  ids = np.zeros((B, L), np.int32)
  for b in range(B):
    cuts = {1} if n_docs > 1 else set()  # document 0 has length 1
    if n_docs > 2:
      cuts |= set(rng.choice(np.arange(2, L), n_docs - 2,
                             replace=False).tolist())
    for c in sorted(cuts):
      ids[b, c:] += 1
  return ids + offset


def to_device(*xs):
  """Host arrays -> jax arrays on the default device."""
  return tuple(jnp.asarray(x) for x in xs)


def seq_lens(x):
  """Per-batch lengths (list / array / None) -> ``int32[B]`` jax array or None."""
  return None if x is None else jnp.asarray(np.asarray(x, np.int32))


def np32(x):
  """Any array -> float32 NumPy array on the host."""
  return np.asarray(x).astype(np.float32)


# ------------------------------------------------------------ comparisons
def nn_attention(q, k, v, *a, **kw):
  """jax.nn.dot_product_attention, XLA implementation (never cuDNN)."""
  return jax.nn.dot_product_attention(q, k, v, *a, implementation="xla", **kw)


def row_spans_bruteforce(m):
  """NumPy spans per granule of the rows of a bool [L, M] (the layout of
  :mod:`jax_fa3.pair_rule`), by brute force."""
  G, big = _GRANULE, 1 << 30
  out = []
  for g in range(-(-m.shape[0] // G)):
    lo, hi, flo, fhi = big, -big, -big, big
    for i in range(g * G, min(m.shape[0], (g + 1) * G)):
      js = np.flatnonzero(m[i])
      if len(js):
        lo, hi = min(lo, js[0]), max(hi, js[-1] + 1)
      run = len(js) > 0 and js[-1] - js[0] + 1 == len(js)
      flo = max(flo, js[0] if run else big)
      fhi = min(fhi, js[-1] + 1 if run else -big)
    out.append((lo, hi, flo, fhi))
  return np.array(out, np.int32)


def close(a, b, rtol=RTOL, atol=ATOL):
  np.testing.assert_allclose(np.asarray(a, np.float32),
                             np.asarray(b, np.float32), rtol=rtol, atol=atol)


def close_trees(got, want, rtol=RTOL, atol=ATOL):
  """:func:`close` leaf by leaf over two pytrees of the same structure."""
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got) == len(want), (len(got), len(want))
  for a, b in zip(got, want):
    close(a, b, rtol=rtol, atol=atol)


def out_and_grads(attn, w):
  """jit of ``(q, k, v, *rest) -> (out, (dq, dk, dv))`` for
  ``out = attn(q, k, v, *rest)`` and the output cotangent ``w``."""
  def f(q, k, v, *rest):
    out, pull = jax.vjp(lambda q, k, v: attn(q, k, v, *rest), q, k, v)
    return out, pull(w.astype(out.dtype))
  return jax.jit(f)


# ------------------------------------------------------- compiled kernels
def sm90_kernels_present() -> bool:
  """The compiled kernels are loaded and JAX sees an sm_90 GPU: what a test
  marked ``gpu`` needs (conftest skips those tests otherwise)."""
  return _native.available() and _native.sm90_gpu_present()


# Stand-in where the kernels are not built: GPU tests still collect (with the
# head dim 128 ids) and conftest then skips them.
_UNBUILT_CONFIGS = frozenset({("bfloat16", 128), ("float16", 128)})


def kernel_configs(family="fwd"):
  """Sorted ``(dtype name, head dim)`` pairs with a compiled kernel, by head
  dim then dtype. ``family``: ``"fwd"`` (``_native.compiled_configs``),
  ``"bwd"`` (``_native.compiled_bwd_configs``, a subset) or ``"fp8"``
  (``fp8.compiled_fp8_configs``: output dtype, head dim)."""
  if not _native.available():
    configs = _UNBUILT_CONFIGS
  elif family == "fp8":
    from jax_fa3 import fp8
    configs = fp8.compiled_fp8_configs()
  else:
    configs = {"fwd": _native.compiled_configs,
               "bwd": _native.compiled_bwd_configs}[family]()
  return sorted(((str(d), int(h)) for d, h in configs),
                key=lambda c: (c[1], c[0]))


def cid(cfg) -> str:
  """Test id of a ``(dtype name, head dim)`` config, e.g. ``bf16-d128``."""
  dtype, hd = cfg
  return f"{'bf16' if dtype == 'bfloat16' else 'fp16'}-d{hd}"

"""Shared helpers for the CPU test-suite (jax_fa3 reference path)."""
import os

# The CPU suite is dominated by XLA:CPU compile time of many tiny programs;
# skip LLVM optimizations (no effect once a backend is initialized, e.g. when
# conftest already touched the GPU).
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

RTOL = ATOL = 1e-5


def rand(seed, B=2, T=37, S=53, N=2, K=2, H=8, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.float32).astype(dtype)
  w = jax.random.normal(ks[3], (B, T, N, H), jnp.float32)
  return q, k, v, w


def nn_attention(q, k, v, *a, **kw):
  """jax.nn.dot_product_attention, XLA implementation."""
  return jax.nn.dot_product_attention(q, k, v, *a, implementation="xla", **kw)


def close(a, b, rtol=RTOL, atol=ATOL):
  np.testing.assert_allclose(np.asarray(a, np.float32),
                             np.asarray(b, np.float32), rtol=rtol, atol=atol)


# ------------------------------------------------ FA3 tolerance rule (GPU)
# Kernel results are judged against an fp32 reference relative to what plain
# XLA attention in the same 16-bit dtype achieves: a kernel may be at most
# 2x (forward) / 3x (gradients) as far from fp32 as XLA is, plus 1e-3.
FA3_FACTORS = (2, 3)  # (first result = forward output, the rest = gradients)
FA3_ATOL = 1e-3


def max_abs_err(a, b):
  """max |a - b| in float32 on the host (works for arrays sharded over
  several devices, which jnp ops against a single-device array would not)."""
  return float(np.max(np.abs(np.asarray(a, np.float32) -
                             np.asarray(b, np.float32))))


def fa3_bound(i, base_err, atol=FA3_ATOL):
  """Allowed error of result ``i`` given XLA's error ``base_err``."""
  return (FA3_FACTORS[0] if i == 0 else FA3_FACTORS[1]) * base_err + atol


def assert_fa3_tolerance(got, base, ref, names=None, atol=FA3_ATOL):
  """The FA3 rule for results ``got`` = (out, grads...): each one's max error
  against ``ref`` (fp32) is within :func:`fa3_bound` of ``base``'s (XLA in
  bf16/fp16).  Returns ``[(err_got, err_base), ...]``."""
  got, base, ref = list(got), list(base), list(ref)
  assert len(got) == len(base) == len(ref)
  names = names or [f"result {i}" for i in range(len(got))]
  errs = []
  for i, (g, b, r) in enumerate(zip(got, base, ref)):
    eg, eb = max_abs_err(g, r), max_abs_err(b, r)
    errs.append((eg, eb))
    assert eg <= fa3_bound(i, eb, atol), (
        f"{names[i]}: max|got - fp32| = {eg:.3e} > bound "
        f"{fa3_bound(i, eb, atol):.3e} (xla bf16: {eb:.3e})")
  return errs

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


"""GPU truth tests of the backward kernel (``jax_fa3_bwd``).

Every test carries the ``gpu`` marker; ``tests/conftest.py`` skips them unless
the compiled kernels and an sm_90 GPU are present.

Accuracy rule (FlashAttention-3's, for gradients)::

    max|d - d_ref64| <= 3 * max|d_same - d_ref64| + atol     (d in dq, dk, dv)

``d_ref64`` is the float64 dense backward of the library semantics and
``d_same`` an emulation of JAX autodiff through ``jax.nn.dot_product_attention``
(xla path) in the input dtype, both from :func:`host_reference.attention_grad_refs`
(checked against jax.nn on CPU by ``tests/test_host_reference.py``), so only the
kernel's vjp is compiled here. ``atol = GRAD_ATOL + 2 * roundoff(d_ref64)``.

Head dims come from ``_native.compiled_bwd_configs()``: 128 gets the full
seqlen sweep, the other backward head dims a reduced one. Forward-only head
dims (no backward kernel) are checked to fall back to the reference backward.
"""
from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fa3
from fa3_testing import cid, kernel_configs, seq_lens, to_device
from host_reference import (GRAD_FACTOR, assert_fa3_rule, attention_grad_refs,
                            make_inputs, np_dtype, roundoff, seed_of)

pytestmark = pytest.mark.gpu

GRAD_ATOL = {"bfloat16": 2e-3, "float16": 1e-3}
BWD_CONFIGS = kernel_configs("bwd")
FWD_CONFIGS = kernel_configs("fwd")
FWD_ONLY = [c for c in FWD_CONFIGS if c not in BWD_CONFIGS]
_HDIMS = sorted({h for _, h in BWD_CONFIGS}) or [128]
PRIMARY_HD = 128 if 128 in _HDIMS else _HDIMS[0]
PRIMARY = [c for c in BWD_CONFIGS if c[1] == PRIMARY_HD]
OTHER = [c for c in BWD_CONFIGS if c[1] != PRIMARY_HD]
BF16_PRIMARY = [c for c in PRIMARY if c[0] == "bfloat16"] or PRIMARY[:1]
# Deterministic mode also on the staged-P/dS tile config (kBlockN = 64, d256).
BF16_DET = BF16_PRIMARY + [c for c in OTHER if c == ("bfloat16", 256)]

PAIRS = [(1, 1), (17, 33), (113, 203), (128, 128), (255, 257), (512, 512),
         (1024, 777), (2048, 2048)]
OTHER_PAIRS = [(17, 33), (113, 203), (255, 257), (1024, 777)]


def _bhk(t, s):
  if t * s >= (1 << 21):
    return 1, 2, 2
  return 2, 3, 3


_JIT: dict = {}
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1)


def _grad_fn(causal, window, softcap, deterministic=False, impl="fa3"):
  """Cached jitted vjp of jax_fa3.attention for one static config."""
  key = (causal, window, softcap, deterministic, impl)
  g = _JIT.get(key)
  if g is None:
    def g(q, k, v, do, ql, kl):
      f = lambda a, b, c: jax_fa3.attention(  # noqa: E731
          a, b, c, is_causal=causal, local_window_size=window,
          softcap=softcap, query_seq_lengths=ql, key_value_seq_lengths=kl,
          implementation=impl, deterministic=deterministic)
      _, pull = jax.vjp(f, q, k, v)
      return pull(do)
    g = _JIT[key] = jax.jit(g)
  return g


def _odd_lengths(b, t, s):
  rng = np.random.default_rng(t * 7919 + s)
  ql = np.maximum(1, rng.integers(0, t + 1, size=b)).astype(np.int32)
  kl = rng.integers(0, s + 1, size=b).astype(np.int32)
  ql[0], kl[0] = t, s  # one full-length row keeps the check non-trivial
  return ql, kl


def _check(cfg, t, s, *, b, n, k, causal=False, window=None, softcap=None,
           lens=False, deterministic=False):
  dtype_name, hd = cfg
  dtype = np_dtype(dtype_name)
  ql = kl = None
  if lens:
    ql, kl = _odd_lengths(b, t, s)
  q, kk, v, do = make_inputs(
      seed_of("bwd", cfg, t, s, n, k, causal, window, softcap, lens),
      b, t, s, n, k, hd, dtype_name, with_dout=True)
  fut = _POOL.submit(attention_grad_refs, q, kk, v, do, ql, kl, causal=causal,
                     window=window, softcap=softcap)
  g = _grad_fn(causal, window, softcap, deterministic)
  grads = g(*to_device(q, kk, v, do), seq_lens(ql), seq_lens(kl))
  grads64, grads_same = fut.result()
  for name, gr, gs, g64 in zip(("dq", "dk", "dv"), grads, grads_same,
                               grads64):
    assert gr.dtype == dtype, (name, gr.dtype)
    gr = np.asarray(gr).astype(np.float32)
    assert gr.shape == g64.shape
    assert np.all(np.isfinite(gr)), f"{name}: NaN/Inf"
    if np.any(g64 != 0):
      assert np.any(gr != 0), f"{name}: all zero"
    atol = GRAD_ATOL[dtype_name] + 2 * roundoff(g64, dtype)
    assert_fa3_rule(name, gr, g64, gs, atol, GRAD_FACTOR)


def _sweep():
  out = []
  for c in PRIMARY:
    for t, s in PAIRS:
      for causal in (False, True):
        out.append(pytest.param(c, t, s, causal,
                                id=f"{cid(c)}-{t}x{s}-c{int(causal)}"))
  for c in OTHER:
    for t, s in OTHER_PAIRS:
      for causal in (False, True):
        out.append(pytest.param(c, t, s, causal,
                                id=f"{cid(c)}-{t}x{s}-c{int(causal)}"))
  return out


@pytest.mark.parametrize("cfg,t,s,causal", _sweep())
def test_grad_seqlens(cfg, t, s, causal):
  b, n, k = _bhk(t, s)
  _check(cfg, t, s, b=b, n=n, k=k, causal=causal)


def _variant_params():
  out = []
  for c in BWD_CONFIGS:
    for t, s in ((113, 203), (384, 256)):
      for causal in (False, True):
        for kind in ("gqa62", "gqa61", "window", "softcap", "lens"):
          out.append(pytest.param(c, t, s, causal, kind,
                                  id=f"{cid(c)}-{t}x{s}-c{int(causal)}-{kind}"))
  return out


@pytest.mark.parametrize("cfg,t,s,causal,kind", _variant_params())
def test_grad_variants(cfg, t, s, causal, kind):
  kw = dict(b=2, n=3, k=3, causal=causal)
  if kind == "gqa62":
    kw.update(n=6, k=2)
  elif kind == "gqa61":
    kw.update(n=6, k=1)
  elif kind == "window":
    kw.update(window=(64, 31))
  elif kind == "softcap":
    kw.update(softcap=30.0)
  elif kind == "lens":
    kw.update(b=4, lens=True)
  _check(cfg, t, s, **kw)


@pytest.mark.parametrize("cfg", BF16_PRIMARY, ids=cid)
def test_grad_combined(cfg):
  _check(cfg, 1000, 1500, b=3, n=6, k=2, causal=True, window=(300, 0),
         softcap=20.0, lens=True)


@pytest.mark.parametrize("window", [(4096, 0), (2, 4096)], ids=["left_past", "right_past"])
@pytest.mark.parametrize("cfg", BF16_PRIMARY, ids=cid)
def test_grad_window_bound_past_the_rows(cfg, window):
  # A bound no row reaches reaches the kernels as none (causal / one-sided).
  _check(cfg, 640, 896, b=2, n=4, k=2, window=window)


@pytest.mark.parametrize("cfg", BF16_DET, ids=cid)
def test_grad_deterministic_matches(cfg):
  _check(cfg, 640, 896, b=2, n=4, k=2, causal=True, deterministic=True)


@pytest.mark.parametrize("cfg", BF16_DET, ids=cid)
def test_deterministic_bitwise(cfg):
  """200 backward calls in deterministic mode are bit-identical."""
  dtype_name, hd = cfg
  q, kk, v, do = make_inputs(seed_of("det", cfg), 2, 1000, 1024, 4, 2, hd,
                             dtype_name, with_dout=True)
  args = to_device(q, kk, v, do) + (None, None)
  g = _grad_fn(False, None, None, deterministic=True)
  first = [np.asarray(x).tobytes() for x in g(*args)]
  for i in range(199):
    again = [np.asarray(x).tobytes() for x in g(*args)]
    assert again == first, f"deterministic call {i + 2} differs from call 1"


@pytest.mark.parametrize("cfg", BF16_PRIMARY, ids=cid)
def test_grad_hlo_uses_kernel(cfg):
  """jax.grad of jax_fa3.attention runs our kernels only (no cuDNN, no
  reference backward)."""
  dtype = jnp.dtype(np_dtype(cfg[0]))
  x = jnp.ones((1, 256, 2, cfg[1]), dtype)
  f = jax.jit(jax.grad(lambda q, k, v: jax_fa3.attention(
      q, k, v, is_causal=True).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
  hlo = f.lower(x, x, x).compile().as_text()
  assert "jax_fa3_bwd" in hlo and "jax_fa3_fwd" in hlo
  assert "cudnn" not in hlo.lower()


@pytest.mark.parametrize("cfg", FWD_ONLY[:2], ids=cid)
def test_forward_only_head_dim_falls_back(cfg):
  """A head dim without a backward kernel differentiates through the
  reference backward (explicitly, never a missing-kernel error)."""
  dtype = jnp.dtype(np_dtype(cfg[0]))
  x = jnp.ones((1, 128, 2, cfg[1]), dtype)
  f = jax.jit(jax.grad(lambda q, k, v: jax_fa3.attention(q, k, v).astype(
      jnp.float32).sum(), argnums=(0, 1, 2)))
  hlo = f.lower(x, x, x).as_text()
  assert "jax_fa3_fwd" in hlo and "jax_fa3_bwd" not in hlo
  _check(cfg, 113, 203, b=2, n=3, k=3, causal=True)


@pytest.mark.parametrize("cfg", BF16_PRIMARY, ids=cid)
def test_batch_past_the_grid_limit_is_a_clean_error(cfg):
  """A batch the backward's grid cannot hold (here folded in by vmap) fails
  with the handler's error before anything runs; one row fewer works."""
  dtype = jnp.dtype(np_dtype(cfg[0]))
  grad = jax.grad(lambda q: jax_fa3.attention(q, q, q, implementation="fa3")
                  .astype(jnp.float32).sum())
  x = jnp.ones((65536, 1, 1, 1, cfg[1]), dtype) / 8
  with pytest.raises(Exception, match="65535"):
    jax.block_until_ready(jax.jit(jax.vmap(grad))(x))
  g = jax.jit(jax.vmap(grad))(x[1:])
  assert bool(jnp.isfinite(g.astype(jnp.float32)).all())

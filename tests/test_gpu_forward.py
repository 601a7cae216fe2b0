"""GPU truth tests of the FlashAttention-3 kernels (``implementation="fa3"``).

Every test here carries the ``gpu`` marker (module-level ``pytestmark``);
``tests/conftest.py`` skips them unless the compiled kernels and an sm_90 GPU
are present.

Accuracy rule (the one FlashAttention-3 itself uses)::

    max|out - ref32| <= 2 * max|out_xla - ref32| + atol

* ``ref32``: ``jax.nn.dot_product_attention(..., implementation="xla")`` on
  float32 up-casts of the *same* inputs, under
  ``jax.default_matmul_precision("highest")``.
* ``out_xla``: the same XLA call on the bf16/fp16 inputs (what a JAX user gets
  today: f32 logits/softmax, P rounded to the input dtype before P@V).
* ``atol``: ``FWD_ATOL`` = 1e-3 for fp16 and 2e-3 for bf16 (a tiny slack so a
  case where XLA happens to be exact, e.g. one visible key, does not demand
  bit-exactness from the kernel).

jax.nn has no softcap, so softcap cases use a hand-written dense reference
(:func:`_manual_attention`) that mirrors jax.nn exactly (f32 logits and
softmax, probabilities cast to the input dtype before P@V); a test checks that
it agrees with jax.nn when softcap is off.

Library semantics differ from jax.nn on one point: a query row with no visible
key (key/value length 0, or a window that falls past the keys) outputs 0 here,
whereas jax.nn outputs the mean of V.  References are therefore zeroed on
those rows (:func:`_row_valid`), and the kernel output on them (and on query
rows past ``query_seq_lengths``) is checked to be *exactly* 0.

Gradients use ``max|d - d_ref32| <= 3 * max|d_xla - d_ref32| + atol`` with
``atol = GRAD_ATOL + 2 * roundoff(d_ref32 in the input dtype)``.

Head dims are taken from ``jax_fa3._native.compiled_configs()``: head dim 128
(the "primary" one) gets the full sweep; every other compiled head dim gets a
reduced sweep automatically.
"""
from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fa3

pytestmark = pytest.mark.gpu

# ---------------------------------------------------------------------------
# Configuration.
# ---------------------------------------------------------------------------

FWD_ATOL = {"bfloat16": 2e-3, "float16": 1e-3}
GRAD_ATOL = {"bfloat16": 2e-3, "float16": 1e-3}
# The kernel path runs the same FFI call eagerly and under jit, so the two
# outputs must be bit-identical (the pure-JAX reference path is not: XLA fuses
# differently op-by-op vs jitted).
JIT_EAGER_BITWISE = True
LSE_ATOL = 1e-3  # plus the dtype roundoff of the lse (it is in key.dtype)

_DEFAULT_CONFIGS = frozenset({("bfloat16", 128), ("float16", 128)})


def _compiled_configs() -> frozenset:
  """(dtype_name, head_dim) pairs built into the native library.

  Falls back to the first-build set when the native module is missing so the
  tests still collect (and are skipped by conftest) on CPU-only machines.
  """
  try:
    from jax_fa3 import _native
    cfg = frozenset((str(d), int(h)) for d, h in _native.compiled_configs())
    if cfg:
      return cfg
  except Exception:  # noqa: BLE001 - no native library / no GPU
    pass
  return _DEFAULT_CONFIGS


CONFIGS = sorted(_compiled_configs(), key=lambda c: (c[1], c[0]))
_HDIMS = sorted({h for _, h in CONFIGS})
PRIMARY_HD = 128 if 128 in _HDIMS else _HDIMS[0]
PRIMARY = [c for c in CONFIGS if c[1] == PRIMARY_HD]
OTHER = [c for c in CONFIGS if c[1] != PRIMARY_HD]
DTYPES = sorted({d for d, _ in CONFIGS})

FWD_PAIRS = [(1, 1), (1, 239), (3, 799), (113, 203), (128, 217), (108, 256),
             (384, 256), (640, 128), (1023, 1024), (1024, 1023), (2048, 2048),
             (4224, 4224)]
# Reduced sweep for the non-primary head dims.
OTHER_PAIRS = [(1, 239), (113, 203), (128, 217), (640, 128), (1023, 1024)]


def _cid(c):
  return f"{'bf16' if c[0] == 'bfloat16' else 'fp16'}-d{c[1]}"


def _forward_params():
  out = []
  for cfg in PRIMARY:
    for t, s in FWD_PAIRS:
      if (t, s) == (4224, 4224) and cfg[0] != "bfloat16":
        continue  # biggest pair: bf16 only (runtime).
      for causal in (False, True):
        out.append(pytest.param(cfg, t, s, causal,
                                id=f"{_cid(cfg)}-{t}x{s}-c{int(causal)}"))
  for cfg in OTHER:
    for t, s in OTHER_PAIRS:
      for causal in (False, True):
        out.append(pytest.param(cfg, t, s, causal,
                                id=f"{_cid(cfg)}-{t}x{s}-c{int(causal)}"))
  return out


def _batch_heads(t, s):
  """Small batch; batch 1 / 2 heads for the big pairs (memory, runtime)."""
  return (1, 2) if t * s >= (1 << 20) else (2, 3)


# ---------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------


def _seed(*params) -> int:
  return zlib.crc32(repr(params).encode()) & 0x7FFFFFFF


def _inputs(seed, b, t, s, n, k, h, dtype, *, with_dout=False):
  """Fresh normal(0, 1) inputs (never zeros) in ``dtype``."""
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, h), jnp.float32).astype(dtype)
  kk = jax.random.normal(keys[1], (b, s, k, h), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (b, s, k, h), jnp.float32).astype(dtype)
  if with_dout:
    do = jax.random.normal(keys[3], (b, t, n, h), jnp.float32).astype(dtype)
    return q, kk, v, do
  return q, kk, v


def _lens(x):
  return None if x is None else jnp.asarray(np.asarray(x, np.int32))


def _row_valid(b, t, s, q_lens, kv_lens, causal, window):
  """bool [B, T]: query row is inside its length and sees >= 1 key."""
  i = jnp.arange(t, dtype=jnp.int32)[None, :]
  ql = (jnp.full((b,), t, jnp.int32) if q_lens is None
        else jnp.asarray(q_lens, jnp.int32))
  kl = (jnp.full((b,), s, jnp.int32) if kv_lens is None
        else jnp.minimum(jnp.asarray(kv_lens, jnp.int32), s))
  lo = jnp.zeros_like(i)
  hi = kl[:, None] - 1
  if causal:
    hi = jnp.minimum(hi, i)
  if window is not None:
    lo = jnp.maximum(lo, i - window[0])
    hi = jnp.minimum(hi, i + window[1])
  return (i < ql[:, None]) & (lo <= hi)


def _logit_mask(b, t, s, q_lens, kv_lens, causal, window):
  """bool [B, 1, T, S] of visible (query, key) pairs (jax.nn semantics)."""
  i = jnp.arange(t, dtype=jnp.int32)[:, None]
  j = jnp.arange(s, dtype=jnp.int32)[None, :]
  m = jnp.ones((t, s), bool)
  if causal:
    m &= j <= i
  if window is not None:
    m &= (j >= i - window[0]) & (j <= i + window[1])
  m = jnp.broadcast_to(m[None], (b, t, s))
  if q_lens is not None:
    m = m & (i[None] < jnp.asarray(q_lens)[:, None, None])
  if kv_lens is not None:
    m = m & (j[None] < jnp.asarray(kv_lens)[:, None, None])
  return m[:, None]


def _manual_attention(q, k, v, q_lens, kv_lens, *, scale, causal, window,
                      softcap):
  """Dense reference mirroring jax.nn's xla path, plus softcap.

  f32 logits (``preferred_element_type``), softcap and softmax in f32,
  probabilities cast to the input dtype before P@V (as jax.nn does).  With f32
  inputs call it under ``default_matmul_precision("highest")``.
  """
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  if kh != n:
    k = jnp.repeat(k, n // kh, axis=2)
    v = jnp.repeat(v, n // kh, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k,
                      preferred_element_type=jnp.float32)
  logits = logits * jnp.float32(scale)
  if softcap:
    logits = jnp.float32(softcap) * jnp.tanh(logits / jnp.float32(softcap))
  mask = _logit_mask(b, t, s, q_lens, kv_lens, causal, window)
  big_neg = jnp.float32(-0.7 * np.finfo(np.float32).max)
  logits = jnp.where(mask, logits, big_neg)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum("bnts,bsnh->btnh", probs, v)
  if q_lens is not None:  # like jax.nn: padded query rows -> 0
    keep = jnp.arange(t)[None, :] < jnp.asarray(q_lens)[:, None]
    out = out * keep[:, :, None, None].astype(out.dtype)
  return out


def _reference(q, k, v, q_lens, kv_lens, *, scale, causal, window, softcap):
  """jax.nn xla (or the manual reference for softcap), rows w/o keys -> 0."""
  b, t, _, h = q.shape
  s = k.shape[1]
  sc = (1.0 / np.sqrt(h)) if scale is None else scale
  if softcap:
    out = _manual_attention(q, k, v, q_lens, kv_lens, scale=sc, causal=causal,
                            window=window, softcap=softcap)
  else:
    out = jax.nn.dot_product_attention(
        q, k, v, scale=sc, is_causal=causal, local_window_size=window,
        query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
        implementation="xla")
  valid = _row_valid(b, t, s, q_lens, kv_lens, causal, window)
  return jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))


def _ref_pair(q, k, v, ql, kl, **kw):
  """(ref32, ref_same_dtype) as float32 numpy arrays."""
  f = jax.jit(functools.partial(_reference, **kw))
  with jax.default_matmul_precision("highest"):
    f32 = jax.jit(functools.partial(_reference, **kw))
    ref32 = f32(q.astype(jnp.float32), k.astype(jnp.float32),
                v.astype(jnp.float32), ql, kl)
  ref_d = f(q, k, v, ql, kl)
  return _np32(ref32), _np32(ref_d)


def _np32(x):
  return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _roundoff(x32: np.ndarray, dtype) -> float:
  """FA3's rounding slack: max|(x + 0.3 - 0.3) - x| computed in ``dtype``."""
  xd = jnp.asarray(x32).astype(dtype)
  r = (xd + jnp.asarray(0.3, dtype)) - jnp.asarray(0.3, dtype)
  return float(np.max(np.abs(_np32(r) - _np32(xd)))) if x32.size else 0.0


def _assert_rule(name, out, ref32, ref_d, atol, factor=2.0):
  out = _np32(out)
  assert out.shape == ref32.shape, (name, out.shape, ref32.shape)
  if out.size == 0:
    return
  err = float(np.max(np.abs(out - ref32)))
  base = float(np.max(np.abs(ref_d - ref32)))
  bound = factor * base + atol
  assert err <= bound, (
      f"{name}: max|out-ref32| = {err:.4g} > {factor}*max|xla-ref32| "
      f"({base:.4g}) + atol ({atol:.3g}) = {bound:.4g}")


def _assert_sane(name, out32: np.ndarray, valid: np.ndarray):
  """Poison checks: finite everywhere, exact 0 on invalid rows, not constant."""
  assert np.all(np.isfinite(out32)), f"{name}: NaN/Inf in output"
  invalid = ~valid
  if invalid.any():
    bad = out32[invalid]
    assert np.all(bad == 0), (
        f"{name}: rows without visible keys / past q length are not exactly 0 "
        f"(max |.| = {float(np.max(np.abs(bad))):.4g}, "
        f"{int(np.sum(np.any(bad != 0, axis=(-2, -1))))} rows)")
  if valid.any():
    good = out32[valid]
    assert np.any(good != 0), f"{name}: output is all zero on valid rows"
    assert float(np.max(good) - np.min(good)) > 0, f"{name}: output constant"


def _check_forward(dtype_name, hd, t, s, *, b, n, k, causal=False, window=None,
                   softcap=None, q_lens=None, kv_lens=None, scale=None,
                   tag=""):
  """Run the kernel eagerly and under jit, check vs the reference rule."""
  dtype = jnp.dtype(dtype_name)
  seed = _seed(dtype_name, hd, t, s, b, n, k, causal, window, softcap,
               q_lens, kv_lens, scale, tag)
  q, kk, v = _inputs(seed, b, t, s, n, k, hd, dtype)
  ql, kl = _lens(q_lens), _lens(kv_lens)

  def fa3(q, kk, v, ql, kl):
    return jax_fa3.attention(
        q, kk, v, scale=scale, is_causal=causal, local_window_size=window,
        query_seq_lengths=ql, key_value_seq_lengths=kl, softcap=softcap,
        implementation="fa3")

  out = fa3(q, kk, v, ql, kl)
  out_jit = jax.jit(fa3)(q, kk, v, ql, kl)
  assert out.shape == q.shape and out.dtype == dtype, (out.shape, out.dtype)
  assert out_jit.shape == q.shape and out_jit.dtype == dtype

  ref32, ref_d = _ref_pair(q, kk, v, ql, kl, scale=scale, causal=causal,
                           window=window, softcap=softcap)
  valid = np.asarray(_row_valid(b, t, s, ql, kl, causal, window))
  out32, jit32 = _np32(out), _np32(out_jit)
  _assert_sane("eager", out32, valid)
  _assert_sane("jit", jit32, valid)
  atol = FWD_ATOL[dtype_name]
  _assert_rule("eager", out32, ref32, ref_d, atol)
  _assert_rule("jit", jit32, ref32, ref_d, atol)
  if JIT_EAGER_BITWISE:
    assert np.asarray(out).tobytes() == np.asarray(out_jit).tobytes(), (
        "eager and jit outputs differ bitwise (same kernel, same inputs); "
        "set JIT_EAGER_BITWISE = False if the API gains XLA-side math")


def _lengths(b, t, s):
  """Per-batch lengths incl. 0 and values that are not multiples of 64."""
  def odd(x, hi):
    x = max(1, min(hi, x))
    return x - 1 if (x % 64 == 0 and x > 1) else x
  ql = [t, odd(37 + t // 2, t), t, 0][:b]
  kl = [s, odd(65 + s // 3, s), 0, odd(s - 3, s)][:b]
  return ql, kl


# ---------------------------------------------------------------------------
# Forward.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cfg,t,s,causal", _forward_params())
def test_forward(cfg, t, s, causal):
  b, n = _batch_heads(t, s)
  _check_forward(cfg[0], cfg[1], t, s, b=b, n=n, k=n, causal=causal)


def _gqa_params():
  out = []
  for cfg in CONFIGS:
    pairs = [(113, 203), (1024, 1023)] if cfg[1] == PRIMARY_HD else [(113, 203)]
    for t, s in pairs:
      for n, k in ((6, 2), (6, 1)):
        for causal in (False, True):
          out.append(pytest.param(
              cfg, t, s, n, k, causal,
              id=f"{_cid(cfg)}-{t}x{s}-n{n}k{k}-c{int(causal)}"))
  return out


@pytest.mark.parametrize("cfg,t,s,n,k,causal", _gqa_params())
def test_forward_gqa(cfg, t, s, n, k, causal):
  b = 1 if t * s >= (1 << 20) else 2
  _check_forward(cfg[0], cfg[1], t, s, b=b, n=n, k=k, causal=causal)


WINDOWS = [(0, 0), (17, 0), (64, 31), (3, 300)]
WINDOW_PAIRS = [(128, 217), (640, 128), (1024, 1023)]


def _window_params():
  out = []
  for cfg in PRIMARY:
    for t, s in WINDOW_PAIRS:
      for w in WINDOWS:
        out.append(pytest.param(cfg, t, s, w, False,
                                id=f"{_cid(cfg)}-{t}x{s}-w{w[0]}_{w[1]}-c0"))
      out.append(pytest.param(cfg, t, s, (64, 31), True,
                              id=f"{_cid(cfg)}-{t}x{s}-w64_31-c1"))
  for cfg in OTHER:
    out.append(pytest.param(cfg, 1024, 1023, (64, 31), False,
                            id=f"{_cid(cfg)}-1024x1023-w64_31-c0"))
  return out


@pytest.mark.parametrize("cfg,t,s,window,causal", _window_params())
def test_forward_window(cfg, t, s, window, causal):
  # (640, 128) with small left windows has rows with no visible key -> 0.
  b, n = _batch_heads(t, s)
  _check_forward(cfg[0], cfg[1], t, s, b=b, n=n, k=n, causal=causal,
                 window=window)


def _softcap_params():
  out = []
  for cfg in PRIMARY:
    for t, s in ((113, 203), (1023, 1024)):
      for cap in (30.0, 5.0):
        for causal in (False, True):
          out.append(pytest.param(
              cfg, t, s, cap, causal,
              id=f"{_cid(cfg)}-{t}x{s}-cap{cap:g}-c{int(causal)}"))
  return out


@pytest.mark.parametrize("cfg,t,s,softcap,causal", _softcap_params())
def test_forward_softcap(cfg, t, s, softcap, causal):
  b, n = _batch_heads(t, s)
  _check_forward(cfg[0], cfg[1], t, s, b=b, n=n, k=n, causal=causal,
                 softcap=softcap)


def _seqlen_params():
  out = []
  cases = ([("both", p) for p in ((113, 203), (384, 256), (1024, 1023))]
           + [("q", (128, 217)), ("kv", (128, 217)), ("kv", (1, 239))])
  for cfg in PRIMARY:
    for which, (t, s) in cases:
      for causal in (False, True):
        out.append(pytest.param(
            cfg, t, s, which, causal,
            id=f"{_cid(cfg)}-{t}x{s}-{which}-c{int(causal)}"))
  return out


@pytest.mark.parametrize("cfg,t,s,which,causal", _seqlen_params())
def test_forward_seqlens(cfg, t, s, which, causal):
  b = 4
  ql, kl = _lengths(b, t, s)
  if which == "q":
    kl = None
  elif which == "kv":
    ql = None
  _check_forward(cfg[0], cfg[1], t, s, b=b, n=2, k=2, causal=causal,
                 q_lens=ql, kv_lens=kl)


def _decode_params():
  out = []
  for cfg in PRIMARY:
    for s in (4224, 8191):
      for n, k in ((6, 6), (6, 1)):
        out.append(pytest.param(cfg, s, n, k, False,
                                id=f"{_cid(cfg)}-1x{s}-n{n}k{k}-c0"))
    out.append(pytest.param(cfg, 4224, 6, 2, True,
                            id=f"{_cid(cfg)}-1x4224-n6k2-c1"))
  return out


@pytest.mark.parametrize("cfg,s,n,k,causal", _decode_params())
def test_forward_decode(cfg, s, n, k, causal):
  """sq = 1 against a long KV (split-KV territory)."""
  _check_forward(cfg[0], cfg[1], 1, s, b=2, n=n, k=k, causal=causal)


def _combo_params():
  out = []
  for cfg in PRIMARY:
    out.append(pytest.param(cfg, 640, 700, True, id=f"{_cid(cfg)}-640x700-c1"))
    out.append(pytest.param(cfg, 1023, 1024, False,
                            id=f"{_cid(cfg)}-1023x1024-c0"))
  return out


@pytest.mark.parametrize("cfg,t,s,causal", _combo_params())
def test_forward_combined(cfg, t, s, causal):
  """GQA + window + softcap + both seq lengths + custom scale at once."""
  ql, kl = _lengths(4, t, s)
  _check_forward(cfg[0], cfg[1], t, s, b=4, n=6, k=2, causal=causal,
                 window=(96, 40), softcap=30.0, q_lens=ql, kv_lens=kl,
                 scale=0.07)


def test_manual_reference_matches_jax_nn():
  """The hand-written (softcap) reference equals jax.nn when softcap is off."""
  b, t, s, n, k, h = 3, 77, 131, 6, 2, 64
  q, kk, v = _inputs(_seed("manual"), b, t, s, n, k, h, jnp.float32)
  ql, kl = _lens([77, 40, 0]), _lens([131, 0, 70])
  for causal, window in ((False, None), (True, None), (False, (9, 4))):
    with jax.default_matmul_precision("highest"):
      ours = _manual_attention(q, kk, v, ql, kl, scale=0.125, causal=causal,
                               window=window, softcap=None)
      ref = jax.nn.dot_product_attention(
          q, kk, v, scale=0.125, is_causal=causal, local_window_size=window,
          query_seq_lengths=ql, key_value_seq_lengths=kl,
          implementation="xla")
    np.testing.assert_allclose(_np32(ours), _np32(ref), atol=1e-5, rtol=1e-5)
    # bf16 path mimics jax.nn's rounding closely as well.
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, kk, v))
    ours_b = _manual_attention(qb, kb, vb, ql, kl, scale=0.125, causal=causal,
                               window=window, softcap=None)
    ref_b = jax.nn.dot_product_attention(
        qb, kb, vb, scale=0.125, is_causal=causal, local_window_size=window,
        query_seq_lengths=ql, key_value_seq_lengths=kl, implementation="xla")
    np.testing.assert_allclose(_np32(ours_b), _np32(ref_b), atol=3e-2)


# ---------------------------------------------------------------------------
# Determinism.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["1024x1023-c1", "1x8191-gqa", "seqlens-c0"])
def test_deterministic(case):
  dtype_name, hd = PRIMARY[0]
  dtype = jnp.dtype(dtype_name)
  ql = kl = None
  if case == "1024x1023-c1":
    b, t, s, n, k, causal = 2, 1024, 1023, 4, 4, True
  elif case == "1x8191-gqa":
    b, t, s, n, k, causal = 2, 1, 8191, 6, 1, False
  else:
    b, t, s, n, k, causal = 4, 384, 256, 2, 2, False
    ql, kl = _lengths(b, t, s)
  q, kk, v = _inputs(_seed("det", case), b, t, s, n, k, hd, dtype)
  ql, kl = _lens(ql), _lens(kl)
  f = jax.jit(lambda q, kk, v, ql, kl: jax_fa3.attention(
      q, kk, v, is_causal=causal, query_seq_lengths=ql,
      key_value_seq_lengths=kl, implementation="fa3"))
  first = np.asarray(f(q, kk, v, ql, kl)).tobytes()
  for i in range(19):
    again = np.asarray(f(q, kk, v, ql, kl)).tobytes()
    assert again == first, f"run {i + 2} differs bitwise from run 1"


# ---------------------------------------------------------------------------
# Gradients.
# ---------------------------------------------------------------------------


def _grad_params():
  out = []
  for cfg in PRIMARY:
    for t, s in ((113, 203), (1024, 1023)):
      for causal in (False, True):
        out.append(pytest.param(cfg, t, s, causal, "mha",
                                id=f"{_cid(cfg)}-{t}x{s}-c{int(causal)}"))
    for causal in (False, True):
      out.append(pytest.param(cfg, 128, 217, causal, "gqa",
                              id=f"{_cid(cfg)}-128x217-gqa-c{int(causal)}"))
  bf = [c for c in PRIMARY if c[0] == "bfloat16"] or PRIMARY[:1]
  for cfg in bf:
    for extra in ("window", "softcap", "seqlens"):
      out.append(pytest.param(cfg, 384, 256, True, extra,
                              id=f"{_cid(cfg)}-384x256-{extra}-c1"))
  for cfg in OTHER:
    out.append(pytest.param(cfg, 113, 203, True, "mha",
                            id=f"{_cid(cfg)}-113x203-c1"))
  return out


@pytest.mark.parametrize("cfg,t,s,causal,extra", _grad_params())
def test_gradients(cfg, t, s, causal, extra):
  dtype_name, hd = cfg
  dtype = jnp.dtype(dtype_name)
  b, n, k = 2, 3, 3
  window = softcap = ql = kl = None
  if extra == "gqa":
    n, k = 6, 2
  elif extra == "window":
    window = (64, 31)
  elif extra == "softcap":
    softcap = 30.0
  elif extra == "seqlens":
    b = 4
    ql, kl = _lengths(b, t, s)
  q, kk, v, do = _inputs(_seed("grad", cfg, t, s, causal, extra),
                         b, t, s, n, k, hd, dtype, with_dout=True)
  ql, kl = _lens(ql), _lens(kl)

  def fa3(q, kk, v, ql, kl):
    return jax_fa3.attention(
        q, kk, v, is_causal=causal, local_window_size=window, softcap=softcap,
        query_seq_lengths=ql, key_value_seq_lengths=kl, implementation="fa3")

  ref = functools.partial(_reference, scale=None, causal=causal,
                          window=window, softcap=softcap)

  def vjp_of(f):
    def g(q, kk, v, do, ql, kl):
      _, pull = jax.vjp(lambda a, b_, c: f(a, b_, c, ql, kl), q, kk, v)
      return pull(do)
    return jax.jit(g)

  grads = vjp_of(fa3)(q, kk, v, do, ql, kl)
  grads_d = vjp_of(ref)(q, kk, v, do, ql, kl)
  with jax.default_matmul_precision("highest"):
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    grads32 = vjp_of(ref)(up(q), up(kk), up(v), up(do), ql, kl)
  for name, g, gd, g32 in zip(("dq", "dk", "dv"), grads, grads_d, grads32):
    assert g.dtype == dtype, (name, g.dtype)
    g_np, gd_np, g32_np = _np32(g), _np32(gd), _np32(g32)
    assert np.all(np.isfinite(g_np)), f"{name}: NaN/Inf"
    assert np.any(g_np != 0), f"{name}: all zero"
    atol = GRAD_ATOL[dtype_name] + 2 * _roundoff(g32_np, dtype)
    _assert_rule(name, g_np, g32_np, gd_np, atol, factor=3.0)


# ---------------------------------------------------------------------------
# Log-sum-exp residual.
# ---------------------------------------------------------------------------


def _lse_params():
  out = []
  for cfg in PRIMARY:
    for t, s in ((1, 239), (113, 203), (1024, 1023)):
      for causal in (False, True):
        out.append(pytest.param(cfg, t, s, 3, 3, causal,
                                id=f"{_cid(cfg)}-{t}x{s}-c{int(causal)}"))
    out.append(pytest.param(cfg, 128, 217, 6, 2, True,
                            id=f"{_cid(cfg)}-128x217-gqa-c1"))
  return out


@pytest.mark.parametrize("cfg,t,s,n,k,causal", _lse_params())
def test_lse_residual(cfg, t, s, n, k, causal):
  dtype_name, hd = cfg
  dtype = jnp.dtype(dtype_name)
  b = 2
  q, kk, v = _inputs(_seed("lse", cfg, t, s, n, k, causal), b, t, s, n, k, hd,
                     dtype)
  out, lse = jax_fa3.dot_product_attention(
      q, kk, v, is_causal=causal, implementation="fa3", return_residual=True)
  _, lse_d = jax.nn.dot_product_attention(
      q, kk, v, is_causal=causal, implementation="xla", return_residual=True)
  with jax.default_matmul_precision("highest"):
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    out32, lse32 = jax.nn.dot_product_attention(
        up(q), up(kk), up(v), is_causal=causal, implementation="xla",
        return_residual=True)
  out_d = jax.nn.dot_product_attention(q, kk, v, is_causal=causal,
                                       implementation="xla")
  assert lse.shape == (b, t, n), f"residual shape {lse.shape} != {(b, t, n)}"
  lse_np = _np32(lse)
  assert np.all(np.isfinite(lse_np)), "lse has NaN/Inf on rows with keys"
  lse32_np = _np32(lse32)
  # lse comes back in key.dtype (like jax.nn): allow one rounding of it.
  _assert_rule("lse", lse_np, lse32_np, _np32(lse_d),
               LSE_ATOL + _roundoff(lse32_np, dtype))
  _assert_rule("out", out, _np32(out32), _np32(out_d), FWD_ATOL[dtype_name])


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


def _bad_cases():
  cases = [
      ("float32", dict(dtype=jnp.float32)),
      ("hd80", dict(h=80)),
      ("heads-not-multiple", dict(n=5, k=2)),
      ("kv-shape-mismatch", dict(v_s=100)),
  ]
  missing = [h for h in (64, 96, 192, 256) if h not in _HDIMS]
  if missing:
    cases.append((f"hd{missing[0]}-not-compiled", dict(h=missing[0])))
  return [pytest.param(kw, id=name) for name, kw in cases]


@pytest.mark.parametrize("kw", _bad_cases())
def test_bad_input_raises(kw):
  dtype = kw.get("dtype", jnp.dtype(PRIMARY[0][0]))
  h = kw.get("h", PRIMARY_HD)
  n, k = kw.get("n", 4), kw.get("k", 4)
  key = jax.random.key(0)
  q = jax.random.normal(key, (1, 64, n, h), jnp.float32).astype(dtype)
  kk = jax.random.normal(key, (1, 96, k, h), jnp.float32).astype(dtype)
  v = jax.random.normal(key, (1, kw.get("v_s", 96), k, h),
                        jnp.float32).astype(dtype)
  with pytest.raises(ValueError):
    jax_fa3.attention(q, kk, v, implementation="fa3")


def test_mixed_dtypes_raise():
  key = jax.random.key(1)
  q = jax.random.normal(key, (1, 64, 2, PRIMARY_HD), jnp.bfloat16)
  kk = jax.random.normal(key, (1, 64, 2, PRIMARY_HD), jnp.float16)
  with pytest.raises((ValueError, TypeError)):
    jax_fa3.attention(q, kk, kk, implementation="fa3")

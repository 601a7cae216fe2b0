"""GPU truth tests of the FlashAttention-3 kernels (``implementation="fa3"``).

Every test here carries the ``gpu`` marker (module-level ``pytestmark``);
``tests/conftest.py`` skips them unless the compiled kernels and an sm_90 GPU
are present.

Accuracy rule (the one FlashAttention-3 itself uses)::

    max|out - ref64| <= 2 * max|ref_same - ref64| + atol

Both references are computed on the host in NumPy (:mod:`host_reference`,
itself checked against jax.nn on CPU by ``tests/test_host_reference.py``), so no XLA
program is compiled for them:

* ``ref64``: float64 dense attention of the *same* (rounded) inputs with the
  library's semantics (top-left causal, (left, right) window, q/kv lengths,
  softcap ``c * tanh(s / c)``, GQA head ``n`` -> kv head ``n // (N // K)``;
  padded query rows and rows with no visible key are 0).
* ``ref_same``: an emulation of ``jax.nn.dot_product_attention(...,
  implementation="xla")`` in the input dtype (what a JAX user gets today):
  f32 logits and softmax from the rounded inputs, P rounded to the input dtype
  before P@V with f32 accumulation, output rounded to the input dtype.  (jax.nn
  itself cannot be the fp16 reference: it forces DotAlgorithmPreset.F16_F16_F32,
  which XLA:GPU rejects.)
* ``atol``: ``FWD_ATOL`` = 1e-3 for fp16 and 2e-3 for bf16 (a tiny slack so a
  case where the emulation happens to be exact, e.g. one visible key, does not
  demand bit-exactness from the kernel).

Library semantics differ from jax.nn on one point: a query row with no visible
key outputs 0 here (jax.nn: the mean of V).  The kernel output on such rows
(and on query rows past ``query_seq_lengths``) is checked to be *exactly* 0,
and everywhere finite (poison / NaN checks).

Each kernel check is ONE ``jax.jit`` call; jitted functions are cached per
static configuration (:func:`_fa3_jit`), so identical static configs compile
once per shape.  Eager == jit (bitwise) is checked by one dedicated test.

Gradients (the backward kernel where compiled, else the reference backward;
tests/test_gpu_backward.py has the backward's own sweep) use
``max|d - d_ref64| <= 3 * max|d_same - d_ref64| + atol`` with
``atol = GRAD_ATOL + 2 * roundoff(d_ref64 in the input dtype)``; ``d_ref64``
and ``d_same`` (JAX autodiff of jax.nn's xla path in the input dtype, emulated)
come from :func:`host_reference.attention_grad_refs`, so only the kernel's vjp is
compiled.

Head dims are taken from ``jax_fa3._native.compiled_configs()``: head dim 128
(the "primary" one) gets the full sweep; every other compiled head dim gets a
reduced sweep automatically.

Input validation (dtypes, shapes, uncompiled head dims) happens in Python
before any kernel runs; ``tests/test_api.py`` checks it on every host.
"""
from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_fa3
from fa3_testing import cid, kernel_configs, np32, seq_lens, to_device
from host_reference import (GRAD_FACTOR, assert_fa3_rule, assert_sane,
                            attention_grad_refs, attention_refs, make_inputs,
                            np_dtype, roundoff, row_valid, seed_of)

pytestmark = pytest.mark.gpu

# ---------------------------------------------------------------------------
# Configuration.
# ---------------------------------------------------------------------------

FWD_ATOL = {"bfloat16": 2e-3, "float16": 1e-3}
GRAD_ATOL = {"bfloat16": 2e-3, "float16": 1e-3}
LSE_ATOL = 1e-3  # plus the dtype roundoff of the lse (it is in key.dtype)

CONFIGS = kernel_configs("fwd")
_HDIMS = sorted({h for _, h in CONFIGS})
PRIMARY_HD = 128 if 128 in _HDIMS else _HDIMS[0]
PRIMARY = [c for c in CONFIGS if c[1] == PRIMARY_HD]
OTHER = [c for c in CONFIGS if c[1] != PRIMARY_HD]
MAX_HD = _HDIMS[-1]

FWD_PAIRS = [(1, 1), (1, 239), (3, 799), (113, 203), (128, 217), (108, 256),
             (384, 256), (640, 128), (1023, 1024), (1024, 1023), (2048, 2048),
             (4224, 4224)]
# Reduced sweep for the non-primary head dims (odd lengths, T < S and T > S);
# the largest head dim also gets the biggest pair.
OTHER_PAIRS = [(1, 239), (3, 799), (113, 203), (108, 256), (640, 128),
               (1023, 1024)]
BIG_PAIR = (4224, 4224)


def _batch_heads(t, s):
  """Small batch/heads; fewer for the big pairs (host reference runtime)."""
  if t * s >= (1 << 24):
    return 1, 1
  if t * s >= (1 << 19):
    return 1, 2
  return 2, 3


# ---------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------

_JIT_CACHE: dict = {}
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1)


def _fa3_jit(*, scale=None, causal=False, window=None, softcap=None,
             residual=False):
  """Cached ``jax.jit`` of the fa3 kernel call for one static config.

  ``residual=True`` goes through ``jax_fa3.dot_product_attention(...,
  return_residual=True)`` (no softcap there) and returns ``(out, lse)``.
  """
  key = (scale, causal, window, softcap, residual)
  f = _JIT_CACHE.get(key)
  if f is None:
    if residual:
      assert softcap is None

      def f(q, k, v, ql, kl):
        return jax_fa3.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, local_window_size=window,
            query_seq_lengths=ql, key_value_seq_lengths=kl,
            implementation="fa3", return_residual=True)
    else:

      def f(q, k, v, ql, kl):
        return jax_fa3.attention(
            q, k, v, scale=scale, is_causal=causal, local_window_size=window,
            query_seq_lengths=ql, key_value_seq_lengths=kl, softcap=softcap,
            implementation="fa3")
    f = _JIT_CACHE[key] = jax.jit(f)
  return f


def _check_forward(dtype_name, hd, t, s, *, b, n, k, causal=False, window=None,
                   softcap=None, q_lens=None, kv_lens=None, scale=None,
                   tag=""):
  """One jitted kernel call, checked against the host references."""
  seed = seed_of(dtype_name, hd, t, s, b, n, k, causal, window, softcap,
                 q_lens, kv_lens, scale, tag)
  q, kk, v = make_inputs(seed, b, t, s, n, k, hd, dtype_name)
  # Host references in a worker thread (NumPy/BLAS release the GIL) while the
  # kernel call compiles and runs.
  fut = _POOL.submit(attention_refs, q, kk, v, q_lens, kv_lens, scale=scale,
                     causal=causal, window=window, softcap=softcap)
  f = _fa3_jit(scale=scale, causal=causal, window=window, softcap=softcap)
  out = np.asarray(f(*to_device(q, kk, v), seq_lens(q_lens),
                     seq_lens(kv_lens)))
  refs = fut.result()
  assert out.shape == q.shape and out.dtype == np_dtype(dtype_name), (
      out.shape, out.dtype)
  valid = row_valid(b, t, s, q_lens, kv_lens, causal, window)
  assert np.array_equal(valid, refs.valid)
  out32 = out.astype(np.float32)
  assert_sane("fa3", out32, valid)
  assert_fa3_rule("fa3", out32, refs.ref64, refs.same, FWD_ATOL[dtype_name])


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


def _forward_params():
  out = []
  for cfg in CONFIGS:
    if cfg in PRIMARY:
      pairs = FWD_PAIRS
    else:
      pairs = OTHER_PAIRS + ([BIG_PAIR] if cfg[1] == MAX_HD else [])
    for t, s in pairs:
      for causal in (False, True):
        out.append(pytest.param(cfg, t, s, causal,
                                id=f"{cid(cfg)}-{t}x{s}-c{int(causal)}"))
  return out


@pytest.mark.parametrize("cfg,t,s,causal", _forward_params())
def test_forward(cfg, t, s, causal):
  b, n = _batch_heads(t, s)
  _check_forward(cfg[0], cfg[1], t, s, b=b, n=n, k=n, causal=causal)


def _gqa_params():
  out = []
  for cfg in CONFIGS:
    if cfg in PRIMARY:
      cases = [(t, s, n, k, c) for t, s in ((113, 203), (1024, 1023))
               for n, k in ((6, 2), (6, 1)) for c in (False, True)]
    else:
      cases = [(113, 203, 6, 2, True), (113, 203, 6, 1, False)]
    for t, s, n, k, causal in cases:
      out.append(pytest.param(
          cfg, t, s, n, k, causal,
          id=f"{cid(cfg)}-{t}x{s}-n{n}k{k}-c{int(causal)}"))
  return out


@pytest.mark.parametrize("cfg,t,s,n,k,causal", _gqa_params())
def test_forward_gqa(cfg, t, s, n, k, causal):
  b = 1 if t * s >= (1 << 19) else 2
  _check_forward(cfg[0], cfg[1], t, s, b=b, n=n, k=k, causal=causal)


WINDOWS = [(0, 0), (17, 0), (64, 31), (3, 300), (4096, 0)]  # (4096, 0): past every row
WINDOW_PAIRS = [(128, 217), (640, 128), (1024, 1023)]


def _window_params():
  out = []

  def add(cfg, t, s, w, causal):
    out.append(pytest.param(cfg, t, s, w, causal,
                            id=f"{cid(cfg)}-{t}x{s}-w{w[0]}_{w[1]}"
                            f"-c{int(causal)}"))
  for cfg in CONFIGS:
    if cfg == PRIMARY[0]:  # full window sweep on one primary config
      for t, s in WINDOW_PAIRS:
        for w in WINDOWS:
          add(cfg, t, s, w, False)
        add(cfg, t, s, (64, 31), True)
    elif cfg in PRIMARY:  # the other dtype: rows without keys + causal
      for w in WINDOWS:
        add(cfg, 640, 128, w, False)
      add(cfg, 1024, 1023, (64, 31), True)
    else:
      add(cfg, 1024, 1023, (64, 31), False)
  return out


@pytest.mark.parametrize("cfg,t,s,window,causal", _window_params())
def test_forward_window(cfg, t, s, window, causal):
  # (640, 128) with small left windows has rows with no visible key -> 0.
  b, n = _batch_heads(t, s)
  _check_forward(cfg[0], cfg[1], t, s, b=b, n=n, k=n, causal=causal,
                 window=window)


def _softcap_params():
  out = []
  for cfg in CONFIGS:
    if cfg in PRIMARY:
      cases = [(113, 203, cap, c) for cap in (30.0, 5.0)
               for c in (False, True)]
      cases += [(1023, 1024, 30.0, c) for c in (False, True)]
    else:
      cases = [(113, 203, 30.0, True)]
    for t, s, cap, causal in cases:
      out.append(pytest.param(
          cfg, t, s, cap, causal,
          id=f"{cid(cfg)}-{t}x{s}-cap{cap:g}-c{int(causal)}"))
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
            id=f"{cid(cfg)}-{t}x{s}-{which}-c{int(causal)}"))
  return out


@pytest.mark.parametrize("cfg,t,s,which,causal", _seqlen_params())
def test_forward_seqlens(cfg, t, s, which, causal):
  # Lengths include 0 (whole batch element = 0) and q lengths past which rows
  # must be exactly 0.
  b = 4
  ql, kl = _lengths(b, t, s)
  if which == "q":
    kl = None
  elif which == "kv":
    ql = None
  n = 1 if t * s >= (1 << 19) else 2
  _check_forward(cfg[0], cfg[1], t, s, b=b, n=n, k=n, causal=causal,
                 q_lens=ql, kv_lens=kl)


def _decode_params():
  out = []
  for cfg in PRIMARY:
    for s in (4224, 8191):
      for n, k in ((6, 6), (6, 1)):
        out.append(pytest.param(cfg, s, n, k, False,
                                id=f"{cid(cfg)}-1x{s}-n{n}k{k}-c0"))
    out.append(pytest.param(cfg, 4224, 6, 2, True,
                            id=f"{cid(cfg)}-1x4224-n6k2-c1"))
  return out


@pytest.mark.parametrize("cfg,s,n,k,causal", _decode_params())
def test_forward_decode(cfg, s, n, k, causal):
  """sq = 1 against a long KV (split-KV territory)."""
  _check_forward(cfg[0], cfg[1], 1, s, b=2, n=n, k=k, causal=causal)


def _combo_params():
  out = []
  for cfg in PRIMARY:
    out.append(pytest.param(cfg, 640, 700, True, 6, 2,
                            id=f"{cid(cfg)}-640x700-n6k2-c1"))
    out.append(pytest.param(cfg, 1023, 1024, False, 4, 2,
                            id=f"{cid(cfg)}-1023x1024-n4k2-c0"))
  return out


@pytest.mark.parametrize("cfg,t,s,causal,n,k", _combo_params())
def test_forward_combined(cfg, t, s, causal, n, k):
  """GQA + window + softcap + both seq lengths + custom scale at once."""
  ql, kl = _lengths(4, t, s)
  _check_forward(cfg[0], cfg[1], t, s, b=4, n=n, k=k, causal=causal,
                 window=(96, 40), softcap=30.0, q_lens=ql, kv_lens=kl,
                 scale=0.07)


def test_eager_equals_jit():
  """Same kernel, same inputs: eager and jitted outputs are bit-identical."""
  dtype_name, hd = PRIMARY[0]
  b, t, s, n, k = 4, 113, 203, 6, 2
  ql, kl = _lengths(b, t, s)
  q, kk, v = to_device(*make_inputs(seed_of("eager", hd), b, t, s, n, k, hd,
                               dtype_name))
  kw = dict(scale=0.07, causal=True, window=(96, 40), softcap=30.0)
  args = (q, kk, v, seq_lens(ql), seq_lens(kl))
  out_jit = _fa3_jit(**kw)(*args)
  out = jax_fa3.attention(
      *args[:3], scale=0.07, is_causal=True, local_window_size=(96, 40),
      softcap=30.0, query_seq_lengths=args[3], key_value_seq_lengths=args[4],
      implementation="fa3")
  assert out.dtype == out_jit.dtype == np_dtype(dtype_name)
  assert np.asarray(out).tobytes() == np.asarray(out_jit).tobytes(), (
      "eager and jit outputs differ bitwise (same kernel, same inputs)")
  assert np.all(np.isfinite(np32(out)))


# ---------------------------------------------------------------------------
# Determinism.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["1024x1023-c1", "1x8191-gqa", "seqlens-c0"])
def test_deterministic(case):
  dtype_name, hd = PRIMARY[0]
  ql = kl = None
  if case == "1024x1023-c1":
    b, t, s, n, k, causal = 2, 1024, 1023, 4, 4, True
  elif case == "1x8191-gqa":
    b, t, s, n, k, causal = 2, 1, 8191, 6, 1, False
  else:
    b, t, s, n, k, causal = 4, 384, 256, 2, 2, False
    ql, kl = _lengths(b, t, s)
  q, kk, v = to_device(*make_inputs(seed_of("det", case), b, t, s, n, k, hd,
                               dtype_name))
  f = _fa3_jit(causal=causal)
  args = (q, kk, v, seq_lens(ql), seq_lens(kl))
  first = np.asarray(f(*args)).tobytes()
  for i in range(19):
    again = np.asarray(f(*args)).tobytes()
    assert again == first, f"run {i + 2} differs bitwise from run 1"


# ---------------------------------------------------------------------------
# Gradients.
# ---------------------------------------------------------------------------


def _grad_params():
  bf = [c for c in PRIMARY if c[0] == "bfloat16"] or PRIMARY[:1]
  fp = [c for c in PRIMARY if c[0] == "float16"] or PRIMARY[-1:]
  # GQA gradients (113x203, causal) are in test_gpu_backward's variants.
  return [
      pytest.param(fp[0], 384, 256, True, "seqlens+window",
                   id=f"{cid(fp[0])}-384x256-seqlens+window-c1"),
      pytest.param(bf[0], 128, 217, False, "softcap",
                   id=f"{cid(bf[0])}-128x217-softcap-c0"),
  ]


@pytest.mark.parametrize("cfg,t,s,causal,extra", _grad_params())
def test_gradients(cfg, t, s, causal, extra):
  dtype_name, hd = cfg
  dtype = np_dtype(dtype_name)
  b, n, k = 2, 3, 3
  window = softcap = ql = kl = None
  if "window" in extra:
    window = (64, 31)
  if "softcap" in extra:
    softcap = 30.0
  if "seqlens" in extra:
    b = 4
    ql, kl = _lengths(b, t, s)
  q, kk, v, do = make_inputs(seed_of("grad", cfg, t, s, causal, extra),
                             b, t, s, n, k, hd, dtype_name, with_dout=True)
  fut = _POOL.submit(attention_grad_refs, q, kk, v, do, ql, kl, causal=causal,
                     window=window, softcap=softcap)
  key = ("vjp", causal, window, softcap)
  g = _JIT_CACHE.get(key)
  if g is None:
    def fa3(q, kk, v, ql, kl):
      return jax_fa3.attention(
          q, kk, v, is_causal=causal, local_window_size=window,
          softcap=softcap, query_seq_lengths=ql, key_value_seq_lengths=kl,
          implementation="fa3")

    def g(q, kk, v, do, ql, kl):
      _, pull = jax.vjp(lambda a, b_, c: fa3(a, b_, c, ql, kl), q, kk, v)
      return pull(do)
    g = _JIT_CACHE[key] = jax.jit(g)
  grads = g(*to_device(q, kk, v, do), seq_lens(ql), seq_lens(kl))
  grads64, grads_d = fut.result()
  for name, gr, gd, g64 in zip(("dq", "dk", "dv"), grads, grads_d, grads64):
    assert gr.dtype == dtype, (name, gr.dtype)
    g_np = np32(gr)
    assert np.all(np.isfinite(g_np)), f"{name}: NaN/Inf"
    assert np.any(g_np != 0), f"{name}: all zero"
    atol = GRAD_ATOL[dtype_name] + 2 * roundoff(g64, dtype)
    assert_fa3_rule(name, g_np, g64, gd, atol, GRAD_FACTOR)


# ---------------------------------------------------------------------------
# Log-sum-exp residual.
# ---------------------------------------------------------------------------


def _lse_params():
  out = []
  for cfg in PRIMARY:
    for t, s, n, k, causal in ((1, 239, 3, 3, True), (113, 203, 3, 3, False),
                               (1024, 1023, 2, 2, False),
                               (1024, 1023, 2, 2, True),
                               (128, 217, 6, 2, True)):
      gqa = "-gqa" if n != k else ""
      out.append(pytest.param(cfg, t, s, n, k, causal,
                              id=f"{cid(cfg)}-{t}x{s}{gqa}-c{int(causal)}"))
  return out


@pytest.mark.parametrize("cfg,t,s,n,k,causal", _lse_params())
def test_lse_residual(cfg, t, s, n, k, causal):
  dtype_name, hd = cfg
  dtype = np_dtype(dtype_name)
  b = 2 if t * s < (1 << 19) else 1
  q, kk, v = make_inputs(seed_of("lse", cfg, t, s, n, k, causal), b, t, s, n,
                         k, hd, dtype_name)
  fut = _POOL.submit(attention_refs, q, kk, v, causal=causal)
  out, lse = _fa3_jit(causal=causal, residual=True)(*to_device(q, kk, v), None,
                                                    None)
  refs = fut.result()
  assert lse.shape == (b, t, n), f"residual shape {lse.shape} != {(b, t, n)}"
  assert lse.dtype == dtype, lse.dtype
  lse_np = np32(lse)
  assert np.all(np.isfinite(lse_np)), "lse has NaN/Inf on rows with keys"
  # lse comes back in key.dtype (like jax.nn): allow one rounding of it.
  assert_fa3_rule("lse", lse_np, refs.lse64, refs.lse_same,
                  LSE_ATOL + roundoff(refs.lse64, dtype))
  out32 = np32(out)
  assert_sane("out", out32, refs.valid)
  assert_fa3_rule("out", out32, refs.ref64, refs.same, FWD_ATOL[dtype_name])

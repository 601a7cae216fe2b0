"""Host-side (NumPy) attention references for the GPU truth tests, and the
FA3 tolerance rule they are judged by.

No XLA compile is involved: the GPU tests spend their time on the kernel,
not on compiling a jitted reference for every shape. ``test_host_reference.py``
checks these references against jax.nn on CPU.

:func:`attention_refs` returns, for bf16/fp16 (or f32) inputs ``q [B,T,N,H]``,
``k, v [B,S,K,H]``:

* ``ref64``: float64 dense attention with the library's exact semantics
  (see ``jax_fa3/api.py``): query row ``i`` of batch ``b`` sees key ``j`` iff
  ``i < q_len[b]``, ``j < kv_len[b]``, top-left causal ``j <= i`` (if causal)
  and ``i - left <= j <= i + right`` (window); scores ``scale * q.k``
  soft-capped as ``c * tanh(s / c)``; GQA query head ``n`` uses kv head
  ``n // (N // K)``; rows past ``q_len`` and rows with no visible key are 0.
* ``same``: an emulation of ``jax.nn.dot_product_attention(...,
  implementation="xla")`` in the input dtype (what a JAX user gets today):
  float32 logits accumulated from the rounded inputs, softcap and softmax in
  float32, probabilities rounded to the input dtype before ``P @ V`` (float32
  accumulation), output rounded to the input dtype; same zero rows as ref64.
* ``lse64`` / ``lse_same`` ``[B,T,N]``: the log-sum-exp residual (``+inf``
  on rows without a visible key, like the library); ``lse_same`` is float32
  math rounded to the input dtype, as jax.nn returns it.
* ``valid`` bool ``[B,T]``: the row is inside ``q_len`` and sees >= 1 key.

Both are computed per (batch, kv head) with float64 / float32 BLAS matmuls.
:func:`attention_grad_refs` does the same for (dq, dk, dv): a float64 dense
backward and an emulation of JAX autodiff through jax.nn's xla path in the
input dtype.

:func:`dense_reference_jax` is a jnp counterpart (differentiable), used by
``tests/test_host_reference.py`` to cross-check softcap and the gradient emulation:
it mirrors jax.nn's xla path without forcing a ``DotAlgorithmPreset`` (jax.nn's
F16_F16_F32 preset is rejected by XLA:GPU).
"""
from __future__ import annotations

import zlib
from typing import NamedTuple

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)


def np_dtype(name) -> np.dtype:
  """'bfloat16' / 'float16' / 'float32' (or a dtype) -> numpy dtype."""
  if isinstance(name, str) and name == "bfloat16":
    return BF16
  return np.dtype(name)


def seed_of(*params) -> int:
  return zlib.crc32(repr(params).encode()) & 0x7FFFFFFF


def make_inputs(seed, b, t, s, n, k, h, dtype, *, with_dout=False):
  """Host normal(0, 1) inputs rounded to ``dtype`` (numpy arrays)."""
  dt = np_dtype(dtype)
  rng = np.random.default_rng(seed)
  shapes = [(b, t, n, h), (b, s, k, h), (b, s, k, h)]
  if with_dout:
    shapes.append((b, t, n, h))
  return tuple(rng.standard_normal(sh, dtype=np.float32).astype(dt)
               for sh in shapes)


def visible_mask(t, s, q_len, kv_len, causal, window) -> np.ndarray:
  """bool [T, S]: query row i may attend key j (one batch element)."""
  i = np.arange(t)[:, None]
  j = np.arange(s)[None, :]
  m = (i < q_len) & (j < min(kv_len, s))
  if causal:
    m = m & (j <= i)
  if window is not None:
    wl, wr = window
    if wl >= 0:
      m = m & (j >= i - wl)
    if wr >= 0:
      m = m & (j <= i + wr)
  return np.broadcast_to(m, (t, s))


def _segment_mask(mask, segment_ids, b):
  """``mask`` and equal segment ids of batch row ``b`` (None: no ids)."""
  if segment_ids is None:
    return mask
  q_ids, kv_ids = (np.asarray(x) for x in segment_ids)
  return mask & (q_ids[b][:, None] == kv_ids[b][None, :])


def _zero_rows(x, vrow, value):
  """x [G, T, ...] = value on rows without a key: vrow [T] or per head [G, T]."""
  if vrow.ndim == 1:
    x[:, ~vrow] = value
  else:
    x[~vrow] = value


def _head_mask(user_mask, b, hs, base):
  """[G, T, S]: the position/segment mask ``base`` [T, S] and, if given,
  the user's bool mask [B|1, N|1, T, S] for batch b and heads hs."""
  if user_mask is None:
    return None
  um = np.asarray(user_mask, bool)
  um = um[b if um.shape[0] > 1 else 0]
  um = um[hs] if um.shape[0] > 1 else um
  return np.broadcast_to(base[None] & um, (hs.stop - hs.start,) + base.shape)


def row_valid(b, t, s, q_lens, kv_lens, causal, window) -> np.ndarray:
  """bool [B, T]: inside q length and >= 1 visible key (closed form)."""
  i = np.arange(t)[None, :]
  ql = np.full((b,), t) if q_lens is None else np.asarray(q_lens)
  kl = np.full((b,), s) if kv_lens is None else np.minimum(
      np.asarray(kv_lens), s)
  lo = np.zeros_like(i)
  hi = kl[:, None] - 1
  if causal:
    hi = np.minimum(hi, i)
  if window is not None:
    if window[0] >= 0:
      lo = np.maximum(lo, i - window[0])
    if window[1] >= 0:
      hi = np.minimum(hi, i + window[1])
  return (i < ql[:, None]) & (lo <= hi)


class Refs(NamedTuple):
  ref64: np.ndarray      # float64 [B,T,N,H]
  same: np.ndarray       # float32 values of the input-dtype emulation
  lse64: np.ndarray      # float64 [B,T,N]
  lse_same: np.ndarray   # float32 values (rounded to the input dtype)
  valid: np.ndarray      # bool [B,T]


def _round(x32: np.ndarray, dt: np.dtype) -> np.ndarray:
  """Round float32 values to ``dt`` and back (no-op for float32)."""
  if dt == np.float32:
    return x32
  return x32.astype(dt).astype(np.float32)


def _softmax_rows(l, mask, dtype):
  """In-place masked exp on l [G,T,S]; returns (p, row_max, row_sum).

  Masked entries become exactly 0; rows without a visible key have
  row_sum == 0 (and row_max == 0).
  """
  if mask is not None:
    np.copyto(l, -np.inf, where=~mask)
  m = l.max(axis=-1, keepdims=True)
  m[~np.isfinite(m)] = 0
  np.subtract(l, m, out=l)
  np.exp(l, out=l)
  return l, m[..., 0], l.sum(axis=-1, dtype=dtype)


def attention_refs(q, k, v, q_lens=None, kv_lens=None, *, scale=None,
                   causal=False, window=None, softcap=None,
                   same=True, segment_ids=None, mask=None) -> Refs:
  """float64 reference and input-dtype emulation (see module docstring).

  ``q, k, v``: numpy (or array-like) in bf16/fp16/f32.  ``window``: None or
  ``(left, right)`` (negative = unbounded).  ``same=False`` skips the
  emulation (``same`` / ``lse_same`` are then None).  ``segment_ids``:
  None or ``(q_ids [B,T], kv_ids [B,S])``: keys of other ids are masked.
  ``mask``: None or bool ``[B|1, N|1, T, S]`` (True = attend); with a
  per-head mask, ``valid`` says whether a row sees a key in some head.
  """
  q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
  dt = q.dtype
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  assert N % K == 0, (N, K)
  G = N // K
  sc = (1.0 / np.sqrt(H)) if scale is None else float(scale)
  cap = float(softcap) if softcap else 0.0
  ql = np.full((B,), T) if q_lens is None else np.asarray(q_lens)
  kl = np.full((B,), S) if kv_lens is None else np.asarray(kv_lens)
  ref64 = np.zeros((B, T, N, H), np.float64)
  lse64 = np.full((B, T, N), np.inf, np.float64)
  out_s = np.zeros((B, T, N, H), np.float32) if same else None
  lse_s = np.full((B, T, N), np.inf, np.float32) if same else None
  valid = np.zeros((B, T), bool)
  if T == 0 or S == 0:
    return Refs(ref64, out_s, lse64, lse_s, valid)
  user_mask = mask
  for b in range(B):
    mask = _segment_mask(visible_mask(T, S, int(ql[b]), int(kl[b]), causal,
                                      window), segment_ids, b)
    if user_mask is not None:
      um = np.asarray(user_mask, bool)[b if np.shape(user_mask)[0] > 1 else 0]
      mask = mask & um.any(axis=0)
    vrow = mask.any(axis=1)
    valid[b] = vrow
    if not vrow.any():
      continue
    full = bool(mask.all())
    mk = None if full else mask[None]
    for kh in range(K):
      hs = slice(kh * G, (kh + 1) * G)
      hm = _head_mask(user_mask, b, hs, mask)
      if hm is not None:
        mk, vrow = hm, hm.any(axis=-1)  # per head [G, T]
      qg = np.ascontiguousarray(np.swapaxes(q[b, :, hs, :], 0, 1))  # G,T,H
      kk = k[b, :, kh, :]
      vv = v[b, :, kh, :]
      # ---- float64 reference.
      q64 = qg.astype(np.float64).reshape(G * T, H)
      l = (q64 @ kk.astype(np.float64).T).reshape(G, T, S)
      l *= sc
      if cap:
        l /= cap
        np.tanh(l, out=l)
        l *= cap
      p, m, den = _softmax_rows(l, mk, np.float64)
      o = (p.reshape(G * T, S) @ vv.astype(np.float64)).reshape(G, T, H)
      with np.errstate(divide="ignore", invalid="ignore"):
        o /= den[..., None]
        lse = m + np.log(den)
      _zero_rows(o, vrow, 0)
      _zero_rows(lse, vrow, np.inf)
      ref64[b, :, hs, :] = np.swapaxes(o, 0, 1)
      lse64[b, :, hs] = lse.T
      if not same:
        continue
      # ---- input-dtype emulation of jax.nn (xla): f32 math on rounded data.
      q32 = qg.astype(np.float32).reshape(G * T, H)
      l = (q32 @ kk.astype(np.float32).T).reshape(G, T, S)
      l *= np.float32(sc)
      if cap:
        l /= np.float32(cap)
        np.tanh(l, out=l)
        l *= np.float32(cap)
      p, m, den = _softmax_rows(l, mk, np.float32)
      with np.errstate(divide="ignore", invalid="ignore"):
        p /= np.where(den > 0, den, np.float32(1))[..., None]
        lse = (m + np.log(den)).astype(np.float32)
      p = _round(p, dt)
      o = (p.reshape(G * T, S) @ vv.astype(np.float32)).reshape(G, T, H)
      o = _round(o, dt)
      _zero_rows(o, vrow, 0)
      lse = _round(lse, dt)
      _zero_rows(lse, vrow, np.inf)
      out_s[b, :, hs, :] = np.swapaxes(o, 0, 1)
      lse_s[b, :, hs] = lse.T
  return Refs(ref64, out_s, lse64, lse_s, valid)


def attention_grad_refs(q, k, v, dout, q_lens=None, kv_lens=None, *,
                        scale=None, causal=False, window=None, softcap=None,
                        segment_ids=None, mask=None):
  """Gradients (dq, dk, dv) of the attention output w.r.t. q, k, v.

  Returns ``(grads64, grads_same)``: float64 dense backward of the library
  semantics (rows without a visible key / past q length have output 0, so
  they get no gradient), and an emulation of JAX autodiff through jax.nn's
  xla path in the input dtype (as float32 values): ``dP = dO @ V^T`` and
  ``dV = P^T @ dO`` rounded to the input dtype (bf16 dots with f32
  accumulation), softmax / softcap / scale backward in f32 from the f32
  probabilities, ``dQ = dS @ K`` and ``dK = dS^T @ Q`` in f32 then rounded.
  ``segment_ids`` and ``mask`` as in :func:`attention_refs`.
  """
  q, k, v, dout = (np.asarray(x) for x in (q, k, v, dout))
  dt = q.dtype
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  sc = (1.0 / np.sqrt(H)) if scale is None else float(scale)
  cap = float(softcap) if softcap else 0.0
  ql = np.full((B,), T) if q_lens is None else np.asarray(q_lens)
  kl = np.full((B,), S) if kv_lens is None else np.asarray(kv_lens)
  g64 = [np.zeros(x.shape, np.float64) for x in (q, k, v)]
  gsm = [np.zeros(x.shape, np.float32) for x in (q, k, v)]
  user_mask = mask
  for b in range(B):
    mask = _segment_mask(visible_mask(T, S, int(ql[b]), int(kl[b]), causal,
                                      window), segment_ids, b)
    vrow = mask.any(axis=1)
    if not vrow.any():
      continue
    mk = mask[None]
    for kh in range(K):
      hs = slice(kh * G, (kh + 1) * G)
      hm = _head_mask(user_mask, b, hs, mask)
      if hm is not None:
        mk, vrow = hm, hm.any(axis=-1)  # per head [G, T]
      qg = np.ascontiguousarray(np.swapaxes(q[b, :, hs, :], 0, 1))  # G,T,H
      dog = np.ascontiguousarray(np.swapaxes(dout[b, :, hs, :], 0, 1))
      _zero_rows(dog, vrow, 0)  # output is where(valid, ., 0): no gradient there
      kk, vv = k[b, :, kh, :], v[b, :, kh, :]
      for ft, rnd, acc in ((np.float64, False, g64),
                           (np.float32, True, gsm)):
        r = (lambda x: _round(x, dt)) if rnd else (lambda x: x)
        Q = qg.astype(ft).reshape(G * T, H)
        Kf, Vf = kk.astype(ft), vv.astype(ft)
        dO = dog.astype(ft).reshape(G * T, H)
        lg = (Q @ Kf.T) * ft(sc)
        th = None
        if cap:
          th = np.tanh(lg / ft(cap))
          lg = ft(cap) * th
        lg = lg.reshape(G, T, S)
        p, _, den = _softmax_rows(lg, mk, ft)
        p /= np.where(den > 0, den, ft(1))[..., None]
        p = p.reshape(G * T, S)
        pr = r(p)
        dv = r(pr.T @ dO)
        dp = r(dO @ Vf.T)
        ds = p * dp
        ds -= p * ds.sum(axis=-1, keepdims=True)
        if cap:
          ds *= ft(1) - th * th
        ds *= ft(sc)
        dq = r(ds @ Kf).reshape(G, T, H)
        dk = r(ds.T @ Q)
        acc[0][b, :, hs, :] = np.swapaxes(dq, 0, 1)
        acc[1][b, :, kh, :] = dk
        acc[2][b, :, kh, :] = dv
  return tuple(g64), tuple(gsm)


def roundoff(x, dtype) -> float:
  """FA3's rounding slack: max|(x + 0.3 - 0.3) - x| computed in ``dtype``."""
  x = np.asarray(x, np.float32)
  if x.size == 0:
    return 0.0
  dt = np_dtype(dtype)
  xd = x.astype(dt)
  c = np.asarray(0.3, dt)
  r = (xd + c) - c
  return float(np.max(np.abs(r.astype(np.float32) - xd.astype(np.float32))))


def max_abs_diff(a, b) -> float:
  """max |a - b| on the host (also for arrays sharded over several devices)."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b))) if a.size else 0.0


# FA3 tolerance rule: kernel results are judged against an fp32/fp64
# reference relative to what plain XLA attention in the same 16-bit dtype
# achieves: at most 2x (forward) / 3x (gradients) as far from the reference
# as XLA is, plus a small atol (so a case where XLA happens to be exact does
# not demand bit-exactness).
FWD_FACTOR, GRAD_FACTOR = 2.0, 3.0
FA3_ATOL = 1e-3


def fa3_bound(i, base_err, atol=FA3_ATOL):
  """Allowed error of result ``i`` (0 = forward output, the rest gradients)
  given XLA's error ``base_err``."""
  return (FWD_FACTOR if i == 0 else GRAD_FACTOR) * base_err + atol


def assert_fa3_rule(name, got, ref, same, atol, factor=FWD_FACTOR):
  """``max|got - ref| <= factor * max|same - ref| + atol``; ``same`` is the
  same-dtype XLA result (computed or emulated). Returns (err, base err)."""
  got = np.asarray(got)
  ref = np.asarray(ref)
  assert got.shape == ref.shape, (name, got.shape, ref.shape)
  err, base = max_abs_diff(got, ref), max_abs_diff(same, ref)
  bound = factor * base + atol
  assert err <= bound, (
      f"{name}: max|got - ref| = {err:.4g} > {factor:g} * max|xla same dtype"
      f" - ref| ({base:.4g}) + atol ({atol:.3g}) = {bound:.4g}")
  return err, base


def assert_fa3_tolerance(got, base, ref, names=None, atol=FA3_ATOL):
  """The FA3 rule for results ``got`` = (out, grads...) against ``ref``
  (fp32), ``base`` being XLA in bf16/fp16. Returns ``[(err, base err)...]``."""
  got, base, ref = list(got), list(base), list(ref)
  assert len(got) == len(base) == len(ref)
  names = names or [f"result {i}" for i in range(len(got))]
  return [assert_fa3_rule(names[i], g, r, b, atol,
                          FWD_FACTOR if i == 0 else GRAD_FACTOR)
          for i, (g, b, r) in enumerate(zip(got, base, ref))]


def assert_out_and_grads(names, got, want, same, dtype):
  """The FA3 rule for (out, grads...) of a ``dtype`` call: finite results,
  the gradients' atol widened by ``dtype``'s rounding of the float32
  reference ``want``; ``same``: the same-dtype XLA results."""
  for i, name in enumerate(names):
    g = np.asarray(got[i]).astype(np.float32)
    r = np.asarray(want[i]).astype(np.float32)
    assert np.all(np.isfinite(g)), name
    atol = FA3_ATOL + (0 if i == 0 else 2 * roundoff(r, dtype))
    assert_fa3_rule(name, g, r, np.asarray(same[i]).astype(np.float32), atol,
                    FWD_FACTOR if i == 0 else GRAD_FACTOR)


def assert_sane(name, out32, valid):
  """Poison checks of an output ``[B,T,N,H]``: finite everywhere, exactly 0
  on rows that are padded or see no key (``valid`` ``[B,T]`` False), and
  neither all-zero nor constant on the other rows."""
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


def rmse(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2))) if a.size else 0.0


def fold_causal(causal, window):
  """(causal, window or None) -> the kernel's (left, right) window: causal is
  the window right = 0 (negative = unbounded)."""
  wl, wr = window if window is not None else (-1, -1)
  if causal:
    wr = 0 if wr < 0 else min(wr, 0)
  return wl, wr


# ---------------------------------------------------------------------------
# FP8 (e4m3) kernel emulation.
# ---------------------------------------------------------------------------

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def dequantize(x8, scales, rows):
  """e4m3 ``[B,S,H',D]`` and block scales ``[B,H',ceil(S/rows)]`` -> float32
  values (``e4m3 value * scale`` of its block of ``rows`` rows)."""
  x8 = np.asarray(x8)
  expanded = np.repeat(np.swapaxes(np.asarray(scales), 1, 2), rows, axis=1)
  return x8.astype(np.float32) * expanded[:, :x8.shape[1], :, None]


def fp8_kernel_emulation(qd, kd, vd, q_lens, kv_lens, window, scale, out_dt):
  """The FP8 kernel's arithmetic on dequantized float32 operands: float32
  scores, P = 2**8 * exp(s - rowmax) rounded to e4m3 (with the final row max,
  not the running one), P @ V in float32, divided by the float32 row sum of
  the unrounded P, output rounded to ``out_dt``; rows without a key are 0.
  ``window``: (left, right) with causal already folded in."""
  B, T, N, H = qd.shape
  S, K = kd.shape[1], kd.shape[2]
  G = N // K
  out = np.zeros(qd.shape, np.float32)
  for b in range(B):
    vis = visible_mask(T, S, int(q_lens[b]), int(kv_lens[b]), False, window)
    for n in range(N):
      s = (qd[b, :, n] @ kd[b, :, n // G].T) * np.float32(scale)
      s = np.where(vis, s, -np.inf)
      m = s.max(axis=1, keepdims=True)
      m = np.where(np.isfinite(m), m, 0)
      p = np.exp(s - m) * 256
      den = p.sum(axis=1, keepdims=True)
      pq = p.astype(E4M3).astype(np.float32)
      o = pq @ vd[b, :, n // G]
      out[b, :, n] = np.where(den > 0, o / np.where(den > 0, den, 1), 0)
  return out.astype(out_dt)


# ---------------------------------------------------------------------------
# jnp dense reference (differentiable; gradient references).
# ---------------------------------------------------------------------------


def dense_reference_jax(q, k, v, q_lens, kv_lens, *, scale, causal, window,
                        softcap):
  """jax.nn xla path (f32 logits/softmax, P in the input dtype before P@V),
  plus softcap, with the library's zero rows.  float32 inputs use HIGHEST
  matmul precision (also in the backward: transposes keep the precision).
  No DotAlgorithmPreset is forced, so fp16 works on XLA:GPU.
  """
  import jax
  import jax.numpy as jnp

  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  prec = (jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None)
  sc = (1.0 / np.sqrt(h)) if scale is None else scale
  qg = q.reshape(b, t, kh, n // kh, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, precision=prec,
                      preferred_element_type=jnp.float32)
  logits = logits * jnp.float32(sc)
  if softcap:
    logits = jnp.float32(softcap) * jnp.tanh(logits / jnp.float32(softcap))
  i = jnp.arange(t)[:, None]
  j = jnp.arange(s)[None, :]
  m = jnp.ones((t, s), bool)
  if causal:
    m &= j <= i
  if window is not None:
    if window[0] >= 0:
      m &= j >= i - window[0]
    if window[1] >= 0:
      m &= j <= i + window[1]
  m = jnp.broadcast_to(m, (b, t, s))
  ql = jnp.full((b,), t) if q_lens is None else q_lens
  kl = jnp.full((b,), s) if kv_lens is None else kv_lens
  m = m & (i[None] < ql[:, None, None]) & (j[None] < kl[:, None, None])
  big_neg = jnp.float32(-0.7 * np.finfo(np.float32).max)
  logits = jnp.where(m[:, None, None], logits, big_neg)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v, precision=prec)
  out = out.reshape(b, t, n, h)
  valid = m.any(axis=-1)  # [b, t]
  return jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))

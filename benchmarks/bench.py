#!/usr/bin/env python3
"""FlashAttention-3 paper sweep: jax_fa3 vs cuDNN (and optionally XLA) in JAX.

Sweep (FlashAttention-3 paper, Sec. 4.1): 16k tokens in total
(``batch = 16384 // seqlen``), hidden size 2048 (``heads = 2048 // head_dim``),
seqlen 512 .. 16k, head dim 64 / 128 / 256, causal off / on, forward and
backward, BTNH layout, bf16 by default.

FLOPs: ``2 * batch * heads * seqlen**2 * (head_dim + value_dim)`` for the
forward (``4 * b * h * s**2 * d`` when the value head dim equals the query/key
one), halved when causal; the backward counts
``2 * b * h * s**2 * (3 * head_dim + 2 * value_dim)`` (2.5x the forward at
equal dims).

``--shapes mla``: multi-head latent attention, a value head dim below the
query/key one (DeepSeek's 192/128, and 128/64).  jax.nn.dot_product_attention
requires equal dims, so cuDNN runs these through JAX's lower-level cuDNN
wrapper (cuDNN >= 9.10 on Hopper).

Timing: every implementation is a ``jax.jit``-ed function, all of them in the
same process on the same inputs.  After a warm-up (compile + a few calls) the
time of one call is estimated, then ``N`` back-to-back calls (``N`` chosen so a
run lasts >= ``--min-run-ms``) are timed with ``jax.block_until_ready`` on the
last result (device-synchronized, wall clock); the reported time is the min
over ``--repeats`` runs of the per-call mean.  Per shape the runs of the
implementations alternate (fa3, cuDNN, fa3, cuDNN, ...), so a drift of the
GPU's clocks over the shape's measurements affects both alike.
``--bwd-timing direct`` times the jitted pullback alone instead of the
subtraction (residuals computed beforehand, passed in as a pytree).  Calls rotate over
``--rotate`` independent input sets (each tensor is 64 MiB, larger than the
H100/H200 L2, so this mostly guards against cross-call reuse).
Backward time = time(forward + backward through ``jax.vjp``) - time(forward).

Configurations an implementation cannot run (``ValueError`` /
``NotImplementedError`` at trace time, e.g. a head dim the fa3 build lacks, or
cuDNN limits) or that run out of memory are skipped with a printed reason.

This file imports without a GPU (and without jax, for ``--help`` and
``--dry-run``).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import functools
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace

TOTAL_TOKENS = 16384
HIDDEN = 2048
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_HDIMS = (64, 128, 256)
QUICK_SEQLENS = (1024, 4096, 8192)
QUICK_HDIMS = (128,)
# fa3det: deterministic=True backward; fa3sinks: with attention sinks
# (their cost); fa3ref: the Dao-AILab FA3 kernels
# (flash_attn3_jax.flash_mha); tokamax: its Mosaic GPU kernels -- the last two
# when importable.
IMPLS = ("fa3", "fa3det", "fa3sinks", "cudnn", "xla", "fa3ref", "tokamax")
# Peers are checked against a float32 reference before they are timed.
PEERS = ("cudnn", "fa3ref", "tokamax", "fa3sinks")
MODES = ("fwd", "bwd")

CSV_FIELDS = ("impl", "mode", "dtype", "hdim", "causal", "seqlen", "batch",
              "heads", "kv_heads", "ms", "tflops", "ratio_vs_cudnn", "iters", "status",
              "sm_mhz", "power_w", "clock_reasons", "window_left", "spread", "hdim_v")


# ---------------------------------------------------------------------------
# Plan, FLOPs, formatting (no jax needed).
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
  hdim: int
  causal: bool
  seqlen: int
  batch: int
  heads: int
  group: int = 1  # query heads per K/V head (GQA); 1 = MHA
  window_left: int = -1  # causal sliding window: query i sees keys [i - left, i]; -1 = none
  hdim_v: int = 0  # value head dim (latent attention); 0 = hdim

  def __post_init__(self):
    # One spelling per shape, so equal configs compare (and group) equal.
    if self.hdim_v == self.hdim:
      object.__setattr__(self, "hdim_v", 0)

  @property
  def dv(self) -> int:
    """The effective value head dim."""
    return self.hdim_v or self.hdim


# Shapes of real models beside the sweep (--shapes real): GQA 32/8 (Llama-3 8B-like)
# 8k causal, GQA 64/8 (70B-like) 2k causal, the 70B-like layer's share of one GPU
# under 8-way tensor parallelism (8/1, 8k causal), a (4096, 0) sliding window at 16k.
REAL_SHAPES = (Shape(128, True, 8192, 2, 32, 4), Shape(128, True, 2048, 4, 64, 8),
               Shape(128, True, 8192, 1, 8, 8), Shape(128, True, 16384, 1, 16, 1, 4096))
# Multi-head latent attention (--shapes mla): value head dim below the query/key
# one, DeepSeek's 192/128 without and with the causal mask, and 128/64 causal;
# 8k tokens x batch 2, 16 heads.
MLA_SHAPES = (Shape(192, False, 8192, 2, 16, hdim_v=128), Shape(192, True, 8192, 2, 16, hdim_v=128),
              Shape(128, True, 8192, 2, 16, hdim_v=64))


@dataclass
class Row:
  impl: str
  mode: str
  dtype: str
  shape: Shape
  ms: float | None = None
  tflops: float | None = None
  ratio: float | None = None
  iters: int = 0
  status: str = "ok"
  sm_mhz: float | None = None   # --clocks: mean SM clock / board power over the timed runs
  power_w: float | None = None
  clock_reasons: str = ""       # --clocks: why the clock was below its maximum (share of samples)
  spread: float | None = None   # (max - min) / min of the timed runs


def attn_flops(batch: int, heads: int, seqlen: int, hdim: int, causal: bool,
               mode: str = "fwd", window_left: int = -1, hdim_v: int = 0) -> float:
  """FLOPs of one call over the visible (query, key) pairs P (s^2, /2 if
  causal; a causal sliding window counts its pairs): forward 2*b*h*P*(d + dv)
  (S = QK^T over d, O = PV over dv), backward 2*b*h*P*(3*d + 2*dv) (S again,
  dQ and dK over d; dP and dV over dv).  At dv == d: 4*b*h*P*d, x2.5."""
  dv = hdim_v or hdim
  pairs = float(seqlen) * seqlen
  if causal and 0 <= window_left < seqlen - 1:
    w = window_left + 1  # keys per row once the window is full
    pairs = w * (w + 1) / 2 + (seqlen - w) * w
  elif causal:
    pairs /= 2
  if mode == "fwd":
    per_pair = hdim + dv
  elif mode == "bwd":
    per_pair = 3 * hdim + 2 * dv
  else:
    raise ValueError(f"mode must be fwd or bwd, got {mode!r}")
  return 2.0 * batch * heads * pairs * per_pair


def tflops_of(flops: float, ms: float | None) -> float | None:
  if ms is None or ms <= 0:
    return None
  return flops / (ms * 1e-3) / 1e12


def plan(seqlens, hdims, causals, tokens: int = TOTAL_TOKENS,
         hidden: int = HIDDEN, group: int = 1, hdim_v: int = 0) -> list[Shape]:
  """The sweep: batch = tokens // seqlen (>= 1), heads = hidden // hdim
  query heads, heads // group K/V heads; value head dim hdim_v (0: hdim)."""
  out = []
  for hd in hdims:
    if hidden % hd:
      raise ValueError(f"head dim {hd} does not divide hidden {hidden}")
    if (hidden // hd) % group:
      raise ValueError(f"--group {group} does not divide {hidden // hd} heads")
    for causal in causals:
      for s in seqlens:
        b = max(1, tokens // s)
        out.append(Shape(hd, causal, s, b, hidden // hd, group, hdim_v=hdim_v))
  return out


def fill_ratios(rows: list[Row]) -> None:
  """ratio_vs_cudnn = TFLOP/s(impl) / TFLOP/s(cudnn) on the same config."""
  cud = {(r.mode, r.shape): r.tflops for r in rows
         if r.impl == "cudnn" and r.tflops}
  for r in rows:
    base = cud.get((r.mode, r.shape))
    r.ratio = (r.tflops / base) if (r.tflops and base) else None


TABLE_COLS = ("impl", "mode", "d", "causal", "seqlen", "batch", "heads", "ms",
              "TFLOP/s", "ratio_vs_cudnn", "spread%")


def _cells(r: Row, max_status: int = 0) -> list[str]:
  s = r.shape
  if r.status != "ok":
    st = r.status.replace("|", "/")
    if max_status and len(st) > max_status:
      st = st[:max_status - 3] + "..."
    tail = ["-", "-", st]
  else:
    tail = [f"{r.ms:.3f}", f"{r.tflops:.1f}",
            f"{r.ratio:.2f}" if r.ratio is not None else "-"]
  return [r.impl, r.mode, _hdim_name(s), _mask_name(s),
          str(s.seqlen), str(s.batch), _heads(s)] + tail + [
              "-" if r.spread is None else f"{100 * r.spread:.1f}"]


def _mask_name(s: Shape) -> str:
  if s.causal and s.window_left >= 0:
    return f"w{s.window_left}"
  return "yes" if s.causal else "no"


def _hdim_name(s: Shape) -> str:
  """'128', or 'query-key dim/value dim' ('192/128') for latent attention."""
  return str(s.hdim) if s.dv == s.hdim else f"{s.hdim}/{s.dv}"


def shape_flops(s: Shape, mode: str) -> float:
  return attn_flops(s.batch, s.heads, s.seqlen, s.hdim, s.causal, mode, s.window_left,
                    s.hdim_v)


def _heads(s: Shape) -> str:
  return str(s.heads) if s.group == 1 else f"{s.heads}/{s.heads // s.group}"


def _sort_key(r: Row):
  s = r.shape
  return (MODES.index(r.mode) if r.mode in MODES else 9, s.hdim, s.dv, s.causal, s.window_left,
          s.seqlen, s.group, IMPLS.index(r.impl) if r.impl in IMPLS else 9)


def format_table(rows: list[Row], markdown: bool = False) -> str:
  rows = sorted(rows, key=_sort_key)
  body = [_cells(r, 0 if markdown else 60) for r in rows]
  if markdown:
    lines = ["| " + " | ".join(TABLE_COLS) + " |",
             "|" + "|".join(["---"] * 7 + ["---:"] * 4) + "|"]
    lines += ["| " + " | ".join(c) + " |" for c in body]
    return "\n".join(lines)
  widths = [max(len(h), *(len(c[i]) for c in body)) if body else len(h)
            for i, h in enumerate(TABLE_COLS)]
  fmt = lambda cells: " | ".join(  # noqa: E731
      c.rjust(w) if 4 <= i < len(TABLE_COLS) - 2 or i == len(TABLE_COLS) - 1 else c.ljust(w)
      for i, (c, w) in enumerate(zip(cells, widths)))
  lines = [fmt(TABLE_COLS), "-+-".join("-" * w for w in widths)]
  lines += [fmt(c) for c in body]
  return "\n".join(lines)


def write_csv(rows: list[Row], path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(CSV_FIELDS)
    for r in sorted(rows, key=_sort_key):
      s = r.shape
      w.writerow([r.impl, r.mode, r.dtype, s.hdim, int(s.causal), s.seqlen,
                  s.batch, s.heads, s.heads // s.group,
                  "" if r.ms is None else f"{r.ms:.5f}",
                  "" if r.tflops is None else f"{r.tflops:.2f}",
                  "" if r.ratio is None else f"{r.ratio:.3f}",
                  r.iters, r.status,
                  "" if r.sm_mhz is None else f"{r.sm_mhz:.0f}",
                  "" if r.power_w is None else f"{r.power_w:.0f}",
                  r.clock_reasons, s.window_left,
                  "" if r.spread is None else f"{r.spread:.4f}", s.dv])
  os.replace(tmp, path)


def read_csv(path: str) -> list[Row]:
  """The rows of a results.csv written by write_csv (for --replot)."""
  def num(x):
    return None if x == "" else float(x)
  rows = []
  with open(path, newline="") as f:
    for d in csv.DictReader(f):
      heads, kv_heads = int(d["heads"]), int(d["kv_heads"])
      shape = Shape(int(d["hdim"]), d["causal"] == "1", int(d["seqlen"]),
                    int(d["batch"]), heads, heads // kv_heads,
                    int(d.get("window_left") or -1), int(d.get("hdim_v") or 0))
      rows.append(Row(d["impl"], d["mode"], d["dtype"], shape, num(d["ms"]),
                      num(d["tflops"]), num(d["ratio_vs_cudnn"]),
                      int(d["iters"] or 0), d["status"], num(d.get("sm_mhz", "")),
                      num(d.get("power_w", "")), d.get("clock_reasons", ""),
                      num(d.get("spread") or "")))
  return rows


def pyplot():
  """matplotlib.pyplot on the Agg backend, or None (tables work without it)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except Exception as e:  # noqa: BLE001
    print(f"[plot] matplotlib not available ({e}); no plot")
    return None
  return plt


def save_figure(plt, fig, path: str, title: str = "") -> bool:
  if title:
    fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  print(f"[plot] wrote {path}")
  return True


def plot(rows: list[Row], path: str, title: str = "") -> bool:
  """TFLOP/s vs seqlen, one panel per (mode, causal, head dim)."""
  plt = pyplot()
  if plt is None:
    return False
  # The sweep's curves; the real-model and latent-attention shapes are table rows only.
  # (A real-model shape stays one with --value-hdim.)
  fixed = set(REAL_SHAPES) | set(MLA_SHAPES)
  ok = [r for r in rows if r.status == "ok" and r.tflops
        and r.shape not in fixed and replace(r.shape, hdim_v=0) not in fixed]
  if not ok:
    print("[plot] no successful measurements; skipping plot")
    return False
  modes = [m for m in MODES if any(r.mode == m for r in ok)]
  panels = sorted({(r.shape.causal, r.shape.hdim, r.shape.dv) for r in ok})
  impls = [i for i in IMPLS if any(r.impl == i for r in ok)]
  style = {"fa3": ("tab:red", "o"), "fa3det": ("tab:orange", "D"),
           "fa3sinks": ("tab:purple", "v"),
           "cudnn": ("tab:green", "s"),
           "xla": ("tab:blue", "^")}
  nr, nc = len(modes), len(panels)
  fig, axes = plt.subplots(nr, nc, figsize=(3.6 * nc, 3.0 * nr),
                           squeeze=False, sharey="row")
  for i, m in enumerate(modes):
    for j, (causal, hd, dv) in enumerate(panels):
      ax = axes[i][j]
      for impl in impls:
        pts = sorted((r.shape.seqlen, r.tflops) for r in ok
                     if r.mode == m and r.impl == impl
                     and r.shape.causal == causal and r.shape.hdim == hd
                     and r.shape.dv == dv)
        if not pts:
          continue
        c, mk = style.get(impl, (None, "x"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=mk, color=c,
                label=impl)
      ax.set_xscale("log", base=2)
      xs = sorted({r.shape.seqlen for r in ok})
      ax.set_xticks(xs)
      ax.set_xticklabels([f"{x // 1024}k" if x >= 1024 else str(x)
                          for x in xs])
      ax.set_title(f"{m}, d={hd if dv == hd else f'{hd}/{dv}'}, "
                   f"{'causal' if causal else 'non-causal'}",
                   fontsize=9)
      ax.grid(True, alpha=0.3)
      if j == 0:
        ax.set_ylabel("TFLOP/s")
      if i == nr - 1:
        ax.set_xlabel("seqlen")
      ax.legend(fontsize=7)
  return save_figure(plt, fig, path, title)


def _run(cmd: list[str]) -> str | None:
  try:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    return out.stdout.strip() if out.returncode == 0 else None
  except Exception:  # noqa: BLE001
    return None


def environment(with_jax: bool = True) -> dict:
  """GPU, driver, versions and date for the header line."""
  env = {"date": datetime.datetime.now().astimezone().isoformat(
      timespec="seconds"), "python": platform.python_version()}
  drv = _run(["nvidia-smi", "--query-gpu=driver_version",
              "--format=csv,noheader"])
  env["driver"] = drv.splitlines()[0] if drv else "n/a"
  if not with_jax:
    return env
  import jax
  env["jax"] = jax.__version__
  try:
    from importlib.metadata import version
    env["jaxlib"] = version("jaxlib")
  except Exception:  # noqa: BLE001
    env["jaxlib"] = getattr(getattr(jax, "lib", None), "__version__", "n/a")
  try:
    from jax._src.lib import cuda_versions  # type: ignore
    v = cuda_versions.cudnn_get_version() if cuda_versions else None
    env["cudnn"] = str(v) if v else "n/a"
  except Exception:  # noqa: BLE001
    env["cudnn"] = "n/a"
  try:
    env["gpu"] = jax.devices()[0].device_kind
    env["platform"] = jax.devices()[0].platform
  except Exception as e:  # noqa: BLE001
    env["gpu"] = f"n/a ({e})"
  try:
    _import_jax_fa3()
    import jax_fa3._native as native
    cfg = sorted(native.compiled_configs(), key=lambda c: (c[0], c[1]))
    env["fa3_configs"] = ",".join(f"{d}:{h}" for d, h in cfg) or "none"
  except Exception as e:  # noqa: BLE001
    env["fa3_configs"] = f"n/a ({type(e).__name__})"
  return env


def header_line(env: dict) -> str:
  keys = ("gpu", "driver", "jax", "jaxlib", "cudnn", "fa3_configs", "python",
          "date")
  return "# " + " | ".join(f"{k}={env[k]}" for k in keys if k in env)


# ---------------------------------------------------------------------------
# Measurement (jax imported lazily).
# ---------------------------------------------------------------------------


def _import_jax_fa3():
  try:
    import jax_fa3
  except ImportError:  # run from a checkout: python benchmarks/bench.py
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
      sys.path.insert(0, root)
    import jax_fa3
  return jax_fa3


def _attn_fn(impl: str, shape: Shape):
  """``impl``'s attention ``(q, k, v) -> out`` for ``shape``'s mask (with
  ``window_left >= 0``, causal: query i sees keys [i - left, i]) and dims."""
  import jax
  causal, window_left = shape.causal, shape.window_left
  win = {} if window_left < 0 else {"local_window_size": (window_left, 0)}
  if impl in ("fa3", "fa3det"):
    jax_fa3 = _import_jax_fa3()
    return functools.partial(jax_fa3.attention, is_causal=causal,
                             implementation="fa3",
                             deterministic=impl == "fa3det", **win)
  if impl == "fa3sinks":  # the cost of attention sinks
    jax_fa3 = _import_jax_fa3()

    def with_sinks(q, k, v):
      # A logit far below every score: the result equals fa3's (so the
      # peer check applies) at the full cost.  The sinks depend on q so that
      # the backward computes dsinks (a constant's would be dead code).
      sinks = -1e4 + 0.0 * q[0, 0, :, 0].astype(jax.numpy.float32)
      return jax_fa3.attention(q, k, v, is_causal=causal, implementation="fa3",
                               sinks=sinks, **win)
    return with_sinks
  if impl == "cudnn" and shape.dv != shape.hdim:
    # jax.nn.dot_product_attention rejects Hv != H; its cuDNN wrapper runs it
    # (cuDNN >= 9.10, sm90) and, like jax.nn's cudnn path, takes GQA as is.
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dpa
    # The window as jax.nn hands it to cuDNN: keys (i - length, i].
    return functools.partial(
        cudnn_dpa, scale=1.0 / math.sqrt(shape.hdim), qkv_layout="BTNH",
        mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK,
        sliding_window_length=window_left + 1 if window_left >= 0 else None)
  if impl in ("cudnn", "xla"):
    return functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                             implementation=impl, **win)
  if impl == "fa3ref":
    from flash_attn3_jax import flash_mha  # causal: bottom-right, = top-left at T == S
    return functools.partial(flash_mha, is_causal=causal,
                             window_size=(window_left, 0) if win else (-1, -1))
  if impl == "tokamax":
    import tokamax
    return functools.partial(tokamax.dot_product_attention, is_causal=causal,
                             implementation="mosaic", **win)
  raise ValueError(f"unknown impl {impl!r}")


def softmax_attention(q, k, v, causal: bool, window_left: int = -1):
  """Plain attention ``[B,T,N,H] x [B,S,K,H] x [B,S,K,Hv] -> [B,T,N,Hv]`` as
  jax.nn's xla path computes it (float32 scores and softmax, probabilities in
  v's dtype), for any Hv: scale 1/sqrt(H); causal top-left (query i sees keys
  <= i); a window keeps keys >= i - window_left; GQA repeats K/V heads."""
  import jax
  import jax.numpy as jnp
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  scores = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
  scores = scores * (1.0 / math.sqrt(q.shape[-1]))
  t, s = q.shape[1], k.shape[1]
  qi, kj = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
  keep = jnp.ones((t, s), bool)
  if causal:
    keep &= kj <= qi
  if window_left >= 0:
    keep &= kj >= qi - window_left
  scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bnts,bsnh->btnh", probs, v)


_CHECKED: dict = {}


def fa3_rule(i, got, ref, same, name, slack=4e-3):
  """None if ``got`` (the output for i = 0, a gradient after) is within the
  FA3 rule of the float32 ``ref``: finite, error <= 2x (gradients 3x) the
  error of the same computation in the input dtype (``same``) + ``slack``;
  else why not."""
  import numpy as np
  err, base = float(np.abs(got - ref).max()), float(np.abs(same - ref).max())
  bound = (2.0 if i == 0 else 3.0) * base + slack
  if np.isfinite(got).all() and err <= bound:
    return None
  return f"{name} error {err:.3g} > {bound:.3g}"


def check_peer(impl: str, shape: Shape, dtype, with_grads: bool) -> tuple:
  """(forward error or None, gradient error or None) of ``impl`` on a
  reduced copy of ``shape`` (batch 1, two K/V heads' worth of query heads, at
  most 1024 tokens) against jax.nn's xla path in float32 (``softmax_attention``
  where the value head dim differs, which jax.nn rejects): the FA3 rule, error
  <= 2x (gradients 3x) the same-dtype reference's error + 4e-3."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  # A window needs rows past its width to show.
  s = min(shape.seqlen, 1024 + max(shape.window_left, 0))
  heads = min(shape.heads, 2 * shape.group)
  key = (impl, shape.hdim, shape.dv, shape.causal, shape.group, shape.window_left, s,
         str(dtype), with_grads)
  if key in _CHECKED:
    return _CHECKED[key]
  small = replace(shape, seqlen=s, batch=1, heads=heads)
  q, k, v, do = make_inputs(small, dtype, 1, seed=99)[0]
  if shape.dv == shape.hdim:
    ref_fn = _attn_fn("xla", shape)
  else:
    ref_fn = functools.partial(softmax_attention, causal=shape.causal,
                               window_left=shape.window_left)

  def run(fn, x_dtype):
    args = [x.astype(x_dtype) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
      out, pull = jax.vjp(fn, *args)
      grads = pull(do.astype(x_dtype)) if with_grads else ()
    return [np.asarray(x, np.float32) for x in (out, *grads)]

  try:
    ref, same = run(ref_fn, jnp.float32), run(ref_fn, dtype)
    got = run(_attn_fn(impl, shape), dtype)
  except Exception as e:  # noqa: BLE001
    first = str(e).strip().splitlines()[0][:120] if str(e).strip() else ""
    _CHECKED[key] = (f"unavailable ({type(e).__name__}: {first})", None)
    return _CHECKED[key]
  why = [fa3_rule(i, g, r, m, ("out", "dq", "dk", "dv")[i])
         for i, (g, r, m) in enumerate(zip(got, ref, same))]
  bad_grads = [w for w in why[1:] if w]
  _CHECKED[key] = (why[0], "; ".join(bad_grads) or None)
  return _CHECKED[key]


def make_inputs(shape: Shape, dtype, n_sets: int, seed: int = 0):
  import jax
  import jax.numpy as jnp
  b, s, n, kv = shape.batch, shape.seqlen, shape.heads, shape.heads // shape.group
  dims = ((b, s, n, shape.hdim), (b, s, kv, shape.hdim),  # q, k
          (b, s, kv, shape.dv), (b, s, n, shape.dv))      # v, dout
  sets = []
  for i in range(n_sets):
    ks = jax.random.split(jax.random.key(seed * 1000 + i), 4)
    sets.append(tuple(jax.random.normal(k, d, jnp.float32).astype(dtype)
                      for k, d in zip(ks, dims)))
  jax.block_until_ready(sets)
  return sets


class RunTimer:
  """Timed runs of one jitted function: warm-up (compile + calls) and an
  estimate of one call at construction, then ``run()`` issues ``iters``
  back-to-back calls and returns the mean time per call (s). One run at a
  time, so the runs of several functions can alternate (measure_shape)."""

  def __init__(self, fn, arg_sets, *, warmup: int, min_run_s: float,
               max_iters: int):
    import jax
    self.fn, self.arg_sets = fn, arg_sets
    n = len(arg_sets)
    for i in range(max(1, warmup)):
      jax.block_until_ready(fn(*arg_sets[i % n]))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    est = max(time.perf_counter() - t0, 1e-6)
    self.iters = int(min(max_iters, max(3, math.ceil(min_run_s / est))))

  def run(self) -> float:
    import jax
    n = len(self.arg_sets)
    out = None
    t0 = time.perf_counter()
    for i in range(self.iters):
      out = self.fn(*self.arg_sets[i % n])
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / self.iters


# NVML clock-event reason bits (nvidia-smi clocks_event_reasons.active).
CLOCK_REASONS = {0x1: "idle", 0x2: "app_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                 0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal",
                 0x80: "hw_power_brake", 0x100: "display_clock"}


def clock_reason_shares(masks) -> str:
  """'sw_power_cap:40%;hw_slowdown:5%' from clock-event bitmasks (share of
  samples with each reason); '' for no samples or no reasons."""
  masks = [m for m in masks if m is not None]
  if not masks:
    return ""
  out = []
  for bit, name in CLOCK_REASONS.items():
    n = sum(1 for m in masks if m & bit)
    if n:
      out.append(f"{name}:{100 * n // len(masks)}%")
  return ";".join(out)


class ClockSampler:
  """Samples the GPU's SM clock, board power and clock-event reasons with
  ``nvidia-smi -lms`` while open (``--clocks``): a library that hits the power
  limit runs at a lower clock than another on the same GPU, which TFLOP/s
  alone does not show. Yields no samples where nvidia-smi is missing."""

  def __init__(self, period_ms: int = 50):
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    self.cmd = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                "--format=csv,noheader,nounits", "-lms", str(period_ms),
                "-i", visible if visible.isdigit() else "0"]
    self.proc = None
    self.samples: list[tuple[float, float, int | None]] = []

  def __enter__(self):
    try:
      self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True)
    except OSError:
      self.proc = None
    return self

  def __exit__(self, *exc):
    if self.proc is None:
      return False
    self.proc.terminate()
    try:
      out, _ = self.proc.communicate(timeout=5)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      out, _ = self.proc.communicate()
    for line in out.splitlines():
      parts = [p.strip() for p in line.split(",")]
      try:
        mhz, watts = float(parts[0]), float(parts[1])
      except (IndexError, ValueError):
        continue
      try:
        mask = int(parts[2], 16)
      except (IndexError, ValueError):
        mask = None
      self.samples.append((mhz, watts, mask))
    return False


def time_fn(fn, arg_sets, *, warmup: int, repeats: int, min_run_s: float,
            max_iters: int, stat: str = "min") -> tuple[float, int]:
  """Min (``stat="median"``: median) over `repeats` of the mean time (s) of N
  back-to-back calls."""
  if stat not in ("min", "median"):
    raise ValueError(f"stat must be 'min' or 'median', got {stat!r}")
  timer = RunTimer(fn, arg_sets, warmup=warmup, min_run_s=min_run_s,
                   max_iters=max_iters)
  runs = [timer.run() for _ in range(repeats)]
  return (min(runs) if stat == "min" else statistics.median(runs)), timer.iters


# The two timing regimes of the side benchmarks (packed_bench.py,
# decode_bench.py): one run of 20 back-to-back calls, and runs of >= 100 ms.
REGIMES = {"burst": dict(min_run_s=1e9, max_iters=20),
           "steady": dict(min_run_s=0.1, max_iters=100000)}


def regime_timers(key: tuple, fn, arg_sets, warmup: int = 2) -> dict:
  """``{key + (regime,): RunTimer}`` for each of :data:`REGIMES`."""
  return {key + (regime,): RunTimer(fn, arg_sets, warmup=warmup, **kw)
          for regime, kw in REGIMES.items()}


def interleaved_times(timers: dict, reps: int) -> dict:
  """``{key: [s per call, one per repetition]}``: every timer runs once per
  repetition, in turn, so a clock drift hits all of them alike."""
  times = {key: [] for key in timers}
  for _ in range(reps):
    for key, t in timers.items():
      times[key].append(t.run())
  return times


def write_markdown(out: str, name: str, env: dict, body: str) -> None:
  """``out/name``: the environment line, then ``body``."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, name), "w") as fh:
    fh.write(header_line(env) + "\n\n" + body + "\n")


def _classify(e: BaseException) -> str | None:
  """Skip reason for expected failures, None for unexpected ones."""
  msg = str(e)
  low = msg.lower()
  if ("resource_exhausted" in low or "out of memory" in low
      or "oom" in low.split()):
    return "OOM"
  first = msg.strip().splitlines()[0] if msg.strip() else ""
  if isinstance(e, (ValueError, NotImplementedError, TypeError)):
    return f"unsupported ({type(e).__name__}: {first[:160]})"
  return None


def measure_shape(shape: Shape, impls, modes, dtype_name: str, args) -> list:
  import jax
  import jax.numpy as jnp
  dtype = jnp.dtype(dtype_name)
  rows = []
  try:
    sets = make_inputs(shape, dtype, args.rotate)
  except Exception as e:  # noqa: BLE001
    reason = _classify(e) or f"error ({type(e).__name__})"
    print(f"  skip all impls {shape}: inputs: {reason}", flush=True)
    for impl in impls:
      for m in modes:
        rows.append(Row(impl, m, dtype_name, shape, status=reason))
    return rows

  kw = dict(warmup=args.warmup, min_run_s=args.min_run_ms / 1e3,
            max_iters=args.max_iters)
  # Timers per (impl, "fwd" | "fb"): fb is forward + backward through jax.vjp;
  # the backward's time is fb - fwd. A failure skips that impl's later modes.
  timers, failed, wrong_bwd = {}, {}, {}
  for impl in impls:
    if impl in PEERS:
      fwd_err, bwd_err = check_peer(impl, shape, dtype, "bwd" in modes)
      if fwd_err:
        failed[impl] = fwd_err if fwd_err.startswith("unavailable") else f"wrong result ({fwd_err})"
        print(f"  {impl}: not timed, {failed[impl]}", flush=True)
        continue
      if bwd_err:
        wrong_bwd[impl] = f"wrong gradients ({bwd_err})"
        print(f"  {impl}: backward not timed, {wrong_bwd[impl]}", flush=True)
    try:
      attn = _attn_fn(impl, shape)
      fns = {"fwd": jax.jit(lambda q, k, v, do, attn=attn: attn(q, k, v))}
      if "bwd" in modes and args.bwd_timing == "subtract" and impl not in wrong_bwd:
        @jax.jit
        def fwd_bwd(q, k, v, do, attn=attn):
          _, pull = jax.vjp(attn, q, k, v)
          return pull(do)
        fns["fb"] = fwd_bwd
      for what, fn in fns.items():
        timers[impl, what] = RunTimer(fn, sets, **kw)
      if "bwd" in modes and args.bwd_timing == "direct" and impl not in wrong_bwd:
        # The pullback alone: its residuals (the forward's outputs) are
        # computed once per input set and passed in as a pytree.
        fwd_pull = jax.jit(lambda q, k, v, attn=attn: jax.vjp(attn, q, k, v)[1])
        pulls = [(fwd_pull(*x[:3]), x[3]) for x in sets]
        timers[impl, "bwd"] = RunTimer(jax.jit(lambda pull, do: pull(do)), pulls, **kw)
    except Exception as e:  # noqa: BLE001
      failed[impl] = _failure(e, impl, shape)
      timers = {key: t for key, t in timers.items() if key[0] != impl}
  # The runs alternate between the implementations (fa3, cuDNN, fa3, ...), so
  # a drift of the GPU's clock or temperature over the shape's minute of
  # measurements does not favour whichever ran first.
  runs = {key: [] for key in timers}
  clocks = {key: [] for key in timers}  # (MHz, W, reasons) samples, with --clocks
  for _ in range(args.repeats):
    for key, timer in list(timers.items()):
      try:
        if args.clocks:
          with ClockSampler() as sampler:
            runs[key].append(timer.run())
          clocks[key] += sampler.samples
        else:
          runs[key].append(timer.run())
      except Exception as e:  # noqa: BLE001
        failed[key[0]] = _failure(e, key[0], shape)
        for k2 in [k for k in timers if k[0] == key[0]]:
          del timers[k2]
  for impl in impls:
    for m in modes:
      row = Row(impl, m, dtype_name, shape)
      if impl in failed:
        row.status = failed[impl]
      elif m == "bwd" and impl in wrong_bwd:
        row.status = wrong_bwd[impl]
      else:
        t_fwd = min(runs[impl, "fwd"])
        t, row.iters = t_fwd, timers[impl, "fwd"].iters
        if m == "bwd" and args.bwd_timing == "direct":
          t, row.iters = min(runs[impl, "bwd"]), timers[impl, "bwd"].iters
        elif m == "bwd":
          t_fb = min(runs[impl, "fb"])
          t, row.iters = t_fb - t_fwd, timers[impl, "fb"].iters
          if t <= 0:
            row.status = (f"error (fwd+bwd {t_fb * 1e3:.3f} ms <= fwd "
                          f"{t_fwd * 1e3:.3f} ms)")
        timed = (impl, "fwd" if m == "fwd" else ("bwd" if args.bwd_timing == "direct" else "fb"))
        ts = runs.get(timed, [])
        row.spread = (max(ts) - min(ts)) / min(ts) if len(ts) > 1 and min(ts) > 0 else None
        # The clocks of the timed function itself (for bwd: forward + backward).
        samples = clocks.get(timed, [])
        if samples:
          row.sm_mhz = statistics.fmean(c for c, _, _ in samples)
          row.power_w = statistics.fmean(p for _, p, _ in samples)
          row.clock_reasons = clock_reason_shares(r for _, _, r in samples)
        if row.status == "ok":
          row.ms = t * 1e3
          row.tflops = tflops_of(shape_flops(shape, m), row.ms)
          print(f"  {impl:5s} {m} d={_hdim_name(shape)} causal={int(shape.causal)} "
                f"s={shape.seqlen:5d} b={shape.batch:2d} h={shape.heads:2d}: "
                f"{row.ms:8.3f} ms {row.tflops:7.1f} TFLOP/s"
                + ("" if row.sm_mhz is None else
                   f"  ({row.sm_mhz:.0f} MHz, {row.power_w:.0f} W"
                   + (f", {row.clock_reasons}" if row.clock_reasons else "") + ")"),
                flush=True)
      rows.append(row)
  del timers, runs, sets
  return rows


def _failure(e: BaseException, impl: str, shape: Shape) -> str:
  """A skip reason for rows of `impl`, printed once."""
  reason = _classify(e)
  if reason is None:
    first = (str(e).strip().splitlines() or [""])[0]
    reason = f"error ({type(e).__name__}: {first[:160]})"
  print(f"  skip {impl} d={_hdim_name(shape)} causal={int(shape.causal)} "
        f"s={shape.seqlen}: {reason}", flush=True)
  return reason


# ---------------------------------------------------------------------------
# CLI.
# ---------------------------------------------------------------------------


def measure_all(jobs, measure, save) -> list:
  """rows of measure(job) for every job; save(rows) after each, so partial
  results survive a crash or Ctrl-C."""
  rows: list = []
  try:
    for job in jobs:
      rows += measure(job)
      save(rows)
  except KeyboardInterrupt:
    print("interrupted; writing partial results", flush=True)
  return rows


def _int_list(s: str) -> list[int]:
  out = []
  for tok in s.split(","):
    tok = tok.strip().lower()
    if not tok:
      continue
    mult = 1024 if tok.endswith("k") else 1
    out.append(int(tok[:-1] if mult > 1 else tok) * mult)
  return out


def parse_args(argv=None):
  p = argparse.ArgumentParser(
      description="FlashAttention-3 paper sweep: jax_fa3 vs cuDNN (vs XLA).",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--seqlens", type=_int_list,
                 default=list(DEFAULT_SEQLENS),
                 help="comma list, 'k' suffix allowed (512,1k,2k,...)")
  p.add_argument("--hdims", type=_int_list, default=list(DEFAULT_HDIMS),
                 help="comma list of head dims")
  p.add_argument("--causal", choices=("0", "1", "both"), default="both")
  p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
  p.add_argument("--modes", default="fwd,bwd", help="fwd, bwd or fwd,bwd")
  p.add_argument("--impls", default="fa3,cudnn",
                 help=f"comma list from {','.join(IMPLS)}")
  p.add_argument("--tokens", type=int, default=TOTAL_TOKENS,
                 help="total tokens per call: batch = tokens // seqlen")
  p.add_argument("--group", type=int, default=1,
                 help="GQA: query heads per K/V head (the demo uses 4)")
  p.add_argument("--hidden", type=int, default=HIDDEN,
                 help="hidden size: heads = hidden // head_dim")
  p.add_argument("--value-hdim", type=int, default=0,
                 help="value head dim of the sweep and real-model shapes (latent "
                      "attention); 0 = each shape's query/key head dim")
  p.add_argument("--shapes", choices=("sweep", "real", "mla", "all"), default="sweep",
                 help="the seqlen x head-dim sweep, the real-model shapes (GQA 32/8 8k and "
                      "64/8 2k causal, window (4096, 0) 16k; d128), or both ('all'); "
                      "'mla': latent attention, head dims 192/128 (causal and not) and "
                      "128/64 (causal), 8k, batch 2, 16 heads")
  p.add_argument("--quick", action="store_true",
                 help="d=128 only, seqlens 1k,4k,8k, causal both")
  p.add_argument("--out", default=os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "out"),
                 help="output dir for results.csv and bench.png")
  p.add_argument("--markdown", action="store_true",
                 help="also print the table as markdown (for RESULTS.md)")
  p.add_argument("--dry-run", action="store_true",
                 help="print the planned configs and FLOPs; no GPU work")
  p.add_argument("--no-plot", action="store_true")
  p.add_argument("--replot", metavar="CSV",
                 help="no measuring: print the table of a results.csv and plot it "
                      "to --out/bench.png (e.g. for a run made with --no-plot)")
  p.add_argument("--rotate", type=int, default=3,
                 help="number of input sets calls rotate over")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--min-run-ms", type=float, default=100.0,
                 help="each timed run lasts at least this long")
  p.add_argument("--max-iters", type=int, default=500)
  p.add_argument("--clocks", action="store_true",
                 help="sample the SM clock, board power and clock-event reasons "
                      "(nvidia-smi) during each timed run; per row in results.csv")
  p.add_argument("--bwd-timing", choices=("subtract", "direct"), default="subtract",
                 help="backward time: time(forward + backward through jax.vjp) - "
                      "time(forward), or 'direct': the jitted pullback alone, on "
                      "residuals computed beforehand")
  a = p.parse_args(argv)
  if a.quick:
    a.seqlens, a.hdims, a.causal = list(QUICK_SEQLENS), list(QUICK_HDIMS), "both"
  a.causals = {"0": [False], "1": [True], "both": [False, True]}[a.causal]
  a.mode_list = [m.strip() for m in a.modes.split(",") if m.strip()]
  a.impl_list = [i.strip() for i in a.impls.split(",") if i.strip()]
  for m in a.mode_list:
    if m not in MODES:
      p.error(f"--modes: unknown mode {m!r}")
  for i in a.impl_list:
    if i not in IMPLS:
      p.error(f"--impls: unknown impl {i!r}")
  a.mode_list = [m for m in MODES if m in a.mode_list]
  a.dtype_name = {"bf16": "bfloat16", "fp16": "float16"}[a.dtype]
  if a.rotate < 1 or a.repeats < 1:
    p.error("--rotate and --repeats must be >= 1")
  if a.value_hdim < 0:
    p.error("--value-hdim must be >= 0")
  return a


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.replot:
    rows = read_csv(args.replot)
    print(format_table(rows, markdown=args.markdown))
    os.makedirs(args.out, exist_ok=True)
    title = os.path.basename(os.path.dirname(os.path.abspath(args.replot)))  # the run's folder
    return 0 if plot(rows, os.path.join(args.out, "bench.png"), title=title) else 1
  shapes = []
  if args.shapes in ("sweep", "all"):
    shapes += plan(args.seqlens, args.hdims, args.causals, args.tokens,
                   args.hidden, args.group, args.value_hdim)
  if args.shapes in ("real", "all"):
    shapes += [replace(s, hdim_v=args.value_hdim) for s in REAL_SHAPES]
  if args.shapes == "mla":
    shapes += list(MLA_SHAPES)

  if args.dry_run:
    env = environment(with_jax=False)
    print(header_line(env) + " | dry-run")
    rows = [Row(i, m, args.dtype_name, s, status="planned")
            for s in shapes for i in args.impl_list for m in args.mode_list]
    print(f"# {len(shapes)} shapes x {len(args.impl_list)} impls x "
          f"{len(args.mode_list)} modes = {len(rows)} measurements, "
          f"dtype={args.dtype_name}")
    for s in shapes:
      fl = ", ".join(f"{m} {shape_flops(s, m) / 1e12:.3f} TFLOP" for m in args.mode_list)
      print(f"  d={_hdim_name(s):>3s} causal={_mask_name(s)} seqlen={s.seqlen:5d} "
            f"batch={s.batch:2d} heads={_heads(s):>2s}: {fl}")
    print(format_table(rows, markdown=args.markdown))
    return 0

  env = environment(with_jax=True)
  # The timing regime goes with every table: on an H200 the runs' length
  # decides whether they see the boost clock or the 700 W cap (RESULTS.md,
  # Method), which moves the backward's ratio to cuDNN by up to 5%.
  header = (header_line(env) + f" | dtype={args.dtype_name} | min_run_ms={args.min_run_ms:g}"
            f" | repeats={args.repeats} | bwd_timing={args.bwd_timing}")
  print(header, flush=True)
  if env.get("platform") not in ("gpu", "cuda"):
    print(f"warning: default device platform is {env.get('platform')!r}; "
          "numbers will not be meaningful", flush=True)

  os.makedirs(args.out, exist_ok=True)
  csv_path = os.path.join(args.out, "results.csv")
  t_start = time.time()

  def save(rows):
    fill_ratios(rows)
    write_csv(rows, csv_path)

  rows = measure_all(
      sorted(shapes, key=lambda x: (x.hdim, x.dv, x.seqlen, x.causal, x.window_left, x.group)),
      lambda s: measure_shape(s, args.impl_list, args.mode_list,
                              args.dtype_name, args), save)
  fill_ratios(rows)
  write_csv(rows, csv_path)
  print(f"\n{header} | wall={time.time() - t_start:.0f}s")
  print(format_table(rows))
  if args.markdown:
    print()
    print(f"{header}\n")
    print(format_table(rows, markdown=True))
  print(f"\nwrote {csv_path}")
  if not args.no_plot:
    plot(rows, os.path.join(args.out, "bench.png"),
         title=f"{env.get('gpu', '')} {args.dtype_name} "
               f"({args.tokens} tokens, hidden {args.hidden})")
  return 0


if __name__ == "__main__":
  sys.exit(main())

#!/usr/bin/env python3
"""Ring attention scaling: 1 GPU vs P GPUs, sequence sharded.

Problem (per seqlen in 32k, 64k; causal off/on): batch 1, 16 heads x d128
(hidden 2048), kv heads = heads unless ``--kv-heads``, bf16.

* 1 GPU: ``jax_fa3.attention`` on the whole sequence on device 0.
* P GPUs (P = 2, 4, 8 up to the local device count): ``shard_map`` over mesh
  axis ``"sp"`` of ``jax_fa3.ring_attention``, the sequence split over it;
  causal uses the zig-zag layout (equal work per device), non-causal the
  contiguous one.  Inputs are permuted into zig-zag order before timing (a
  model keeps its activations in that order, as ``jax_fa3.demo`` does).

Modes: ``fwd`` and ``fwd+bwd`` (one ``jax.vjp`` program, what a training step
pays).  FLOPs: ``4*b*h*s^2*d`` for the forward, halved when causal, the
backward 2.5x the forward (``bench.attn_flops``); TFLOP/s per GPU = total / P;
speedup = t(1 GPU) / t(P GPUs); scaling efficiency = speedup / P.

Overlap check: one ring step's local kernel alone (same local shapes: the
contiguous ring's step is (S/P) x (S/P) non-causal; every zig-zag causal step
is (S/P) query rows x S/(2P) keys or the equivalent causal diagonal) is timed
on one GPU; ``P x t_step`` is what the ring would cost with fully hidden K/V
transfers (merges aside), so ``exposed = (t_ring - P * t_step) / t_ring``
estimates the share of the ring time spent waiting for communication (or in
the merge; negative: noise).

Timing: ``bench.time_fn`` with ``stat="median"``: warm-up (compile + calls),
then the median over ``--repeats`` runs of the mean of N back-to-back calls
(each run >= ``--min-run-ms``), ``block_until_ready`` on the last result,
rotating over ``--rotate`` input sets.

``--quick --cpu-devices 4`` runs tiny shapes on virtual CPU devices (the
reference path: a smoke test of this script, not a measurement).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import dataclass, fields

# NVLink multicast (NVLS) off by default, as in the runs of RESULTS.md (set these
# to override); NCCL reads them when its first communicator is created, so they
# must be set before any collective.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (no jax at import)

MODES = ("fwd", "fwd+bwd")
BAR_SEQLEN, BAR_SPEEDUP = 65536, 1.8  # target: >= 1.8x on 2 GPUs, 64k causal


@dataclass
class Row:
  seqlen: int
  causal: bool
  mode: str
  gpus: int
  layout: str
  batch: int
  heads: int
  kv_heads: int
  hdim: int
  ms: float | None = None
  tflops: float | None = None
  tflops_per_gpu: float | None = None
  speedup: float | None = None
  efficiency: float | None = None
  step_ms: float | None = None
  kernel_sum_ms: float | None = None
  exposed_frac: float | None = None
  iters: int = 0
  status: str = "ok"


def flops(r: Row) -> float:
  f = bench.attn_flops(r.batch, r.heads, r.seqlen, r.hdim, r.causal, "fwd")
  if r.mode == "fwd+bwd":
    f += bench.attn_flops(r.batch, r.heads, r.seqlen, r.hdim, r.causal, "bwd")
  return f


# ----------------------------------------------------------------- output
COLS = ("seqlen", "causal", "mode", "GPUs", "layout", "ms", "TFLOP/s",
        "TFLOP/s/GPU", "speedup", "eff", "P*step ms", "exposed")


def _f(x, fmt):
  return "-" if x is None else format(x, fmt)


def _cells(r: Row) -> list[str]:
  head = [str(r.seqlen), "yes" if r.causal else "no", r.mode, str(r.gpus),
          r.layout]
  if r.status != "ok":
    return head + ["-"] * 6 + [r.status[:60]]
  return head + [_f(r.ms, ".3f"), _f(r.tflops, ".1f"),
                 _f(r.tflops_per_gpu, ".1f"), _f(r.speedup, ".2f"),
                 _f(r.efficiency, ".1%"), _f(r.kernel_sum_ms, ".3f"),
                 _f(r.exposed_frac, ".1%")]


def _key(r: Row):
  return (r.seqlen, r.causal, MODES.index(r.mode), r.gpus)


def format_table(rows, markdown=False) -> str:
  body = [_cells(r) for r in sorted(rows, key=_key)]
  if markdown:
    out = ["| " + " | ".join(COLS) + " |",
           "|" + "|".join(["---"] * 5 + ["---:"] * (len(COLS) - 5)) + "|"]
    return "\n".join(out + ["| " + " | ".join(c) + " |" for c in body])
  w = [max([len(h)] + [len(c[i]) for c in body]) for i, h in enumerate(COLS)]
  fmt = lambda cs: " | ".join(  # noqa: E731
      c.rjust(w[i]) if i >= 5 or i in (0, 3) else c.ljust(w[i])
      for i, c in enumerate(cs))
  return "\n".join([fmt(COLS), "-+-".join("-" * x for x in w)] +
                   [fmt(c) for c in body])


def write_csv(rows, path):
  names = [f.name for f in fields(Row)]
  tmp = path + ".tmp"
  with open(tmp, "w", newline="") as fh:
    wr = csv.writer(fh)
    wr.writerow(names)
    for r in sorted(rows, key=_key):
      vals = []
      for n in names:
        v = getattr(r, n)
        vals.append("" if v is None else int(v) if isinstance(v, bool)
                    else f"{v:.5g}" if isinstance(v, float) else v)
      wr.writerow(vals)
  os.replace(tmp, path)


def bar_lines(rows) -> list[str]:
  """The scaling target: 2 GPUs >= 1.8x one GPU at 64k causal."""
  out = []
  for r in sorted(rows, key=_key):
    if (r.seqlen == BAR_SEQLEN and r.causal and r.gpus == 2
        and r.status == "ok" and r.speedup is not None):
      ok = r.speedup >= BAR_SPEEDUP
      out.append(f"bar ({r.mode}, 64k causal, 2 GPUs): speedup "
                 f"{r.speedup:.2f}x (efficiency {r.efficiency:.1%}) -> "
                 f"{'PASS' if ok else 'FAIL'} (>= {BAR_SPEEDUP}x)")
  return out


def plot(rows, path, title) -> bool:
  plt = bench.pyplot()
  if plt is None:
    return False
  ok = [r for r in rows if r.status == "ok" and r.tflops_per_gpu]
  if not ok:
    return False
  modes = [m for m in MODES if any(r.mode == m for r in ok)]
  fig, axes = plt.subplots(2, len(modes), figsize=(5 * len(modes), 7),
                           squeeze=False)
  gpus = sorted({r.gpus for r in ok})
  for j, m in enumerate(modes):
    for s, c in sorted({(r.seqlen, r.causal) for r in ok if r.mode == m}):
      pts = sorted((r.gpus, r.tflops_per_gpu, r.efficiency) for r in ok
                   if r.mode == m and r.seqlen == s and r.causal == c)
      lab = (f"{s // 1024}k" if s >= 1024 else str(s)) + (
          " causal" if c else " non-causal")
      axes[0][j].plot([p[0] for p in pts], [p[1] for p in pts], "o-",
                      label=lab)
      axes[1][j].plot([p[0] for p in pts],
                      [100 * (p[2] or 0) for p in pts], "o-", label=lab)
    axes[0][j].set_title(m)
    axes[0][j].set_ylabel("TFLOP/s per GPU")
    axes[1][j].set_ylabel("scaling efficiency (%)")
    axes[1][j].axhline(100 * BAR_SPEEDUP / 2, color="gray", ls="--", lw=0.8)
    for ax in (axes[0][j], axes[1][j]):
      ax.set_xscale("log", base=2)
      ax.set_xticks(gpus)
      ax.set_xticklabels([str(g) for g in gpus])
      ax.set_xlabel("GPUs")
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
  return bench.save_figure(plt, fig, path, title)


# ------------------------------------------------------------ measurement
class Bench:
  def __init__(self, args):
    import jax
    import jax.numpy as jnp
    self.jax_fa3 = bench._import_jax_fa3()  # also from a bare checkout
    from jax_fa3 import _native, _validate
    self.jax, self.jnp = jax, jnp
    self.args = args
    self.devs = jax.devices()
    self.dtype = jnp.bfloat16
    blocker = _validate.kernel_blocker(self.dtype, args.hdim, _native)
    # The kernels or an error on a GPU; the reference for the CPU smoke test.
    self.impl = "fa3" if blocker is None else None
    self.path = "FA3 kernel" if blocker is None else f"reference ({blocker})"
    self.kw = dict(warmup=args.warmup, repeats=args.repeats,
                   min_run_s=args.min_run_ms / 1e3, max_iters=args.max_iters,
                   stat="median")

  def _attn(self, causal):
    return lambda q, k, v: self.jax_fa3.attention(
        q, k, v, is_causal=causal, implementation=self.impl)

  def _fns(self, attn):
    jax = self.jax
    fwd = jax.jit(lambda q, k, v, do: attn(q, k, v))
    fb = jax.jit(lambda q, k, v, do: jax.vjp(attn, q, k, v)[1](do))
    return {"fwd": fwd, "fwd+bwd": fb}

  def _ring(self, mesh, causal, layout):
    from jax.sharding import PartitionSpec as P
    spec = P(None, "sp")
    local = lambda q, k, v: self.jax_fa3.ring_attention(  # noqa: E731
        q, k, v, axis_name="sp", is_causal=causal, layout=layout,
        implementation=self.impl)
    return self.jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3,
                              out_specs=spec)

  def _time(self, fns, sets, mode):
    t, iters = bench.time_fn(fns[mode], sets, **self.kw)
    return t * 1e3, iters

  def _sets(self, seqlen):
    """Natural-order input sets (q, k, v, dout) on device 0."""
    jax, jnp, a = self.jax, self.jnp, self.args
    out = []
    with jax.default_device(self.devs[0]):
      for i in range(a.rotate):
        ks = jax.random.split(jax.random.key(1000 * seqlen + i), 4)
        shp = lambda h: (a.batch, seqlen, h, a.hdim)  # noqa: E731
        out.append(tuple(
            jax.random.normal(kk, shp(h), jnp.float32).astype(self.dtype)
            for kk, h in zip(ks, (a.heads, a.kv_heads, a.kv_heads,
                                  a.heads))))
    jax.block_until_ready(out)
    return out

  def measure(self, seqlen, causal, procs, modes) -> list[Row]:
    jax = self.jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import numpy as np
    a = self.args
    layout = "zigzag" if causal else "contiguous"
    mk = lambda mode, g, lay, **kw: Row(  # noqa: E731
        seqlen, causal, mode, g, lay, a.batch, a.heads, a.kv_heads, a.hdim,
        **kw)
    rows, base = [], {}

    def record(row, ms, iters):
      row.ms, row.iters = ms, iters
      row.tflops = bench.tflops_of(flops(row), ms)
      row.tflops_per_gpu = row.tflops / row.gpus
      if row.mode in base:
        row.speedup = base[row.mode] / ms
        row.efficiency = row.speedup / row.gpus
      print(f"  s={seqlen} causal={int(causal)} {row.mode:7s} "
            f"P={row.gpus} {row.layout:10s}: {ms:9.3f} ms "
            f"{row.tflops:7.1f} TFLOP/s ({row.tflops_per_gpu:.1f}/GPU)"
            + (f" speedup {row.speedup:.2f}x eff {row.efficiency:.1%}"
               if row.speedup else "")
            + (f" exposed {row.exposed_frac:.1%}"
               if row.exposed_frac is not None else ""), flush=True)

    def fail(row, e):
      row.status = bench._classify(e) or (
          f"error ({type(e).__name__}: "
          f"{(str(e).strip().splitlines() or [''])[0][:120]})")
      print(f"  skip s={seqlen} causal={int(causal)} {row.mode} "
            f"P={row.gpus}: {row.status}", flush=True)

    sets = self._sets(seqlen)
    # (a) one GPU, whole sequence.
    fns = self._fns(self._attn(causal))
    for m in modes:
      row = mk(m, 1, "single")
      try:
        ms, it = self._time(fns, sets, m)
        base[m] = ms
        record(row, ms, it)
      except Exception as e:  # noqa: BLE001
        fail(row, e)
      rows.append(row)
    del fns

    # (b) P GPUs, ring over the sequence.
    for p in procs:
      if seqlen % (2 * p if causal else p):
        for m in modes:
          rows.append(mk(m, p, layout, status=f"seqlen % {p} shards"))
        continue
      mesh = Mesh(np.array(self.devs[:p]), ("sp",))
      sh = NamedSharding(mesh, P(None, "sp"))
      step = self._step_times(seqlen, p, causal, modes, sets) \
          if a.overlap else {}
      zz = (lambda x: self.jax_fa3.to_zigzag(x, p)) if causal else (
          lambda x: x)
      psets = [tuple(jax.device_put(zz(x), sh) for x in s) for s in sets]
      jax.block_until_ready(psets)
      fns = self._fns(self._ring(mesh, causal, layout))
      for m in modes:
        row = mk(m, p, layout)
        try:
          ms, it = self._time(fns, psets, m)
          if m in step:
            row.step_ms = step[m]
            row.kernel_sum_ms = p * step[m]
            row.exposed_frac = (ms - p * step[m]) / ms
          record(row, ms, it)
        except Exception as e:  # noqa: BLE001
          fail(row, e)
        rows.append(row)
      del fns, psets
    del sets
    return rows

  def _step_times(self, seqlen, p, causal, modes, sets) -> dict:
    """One ring step's local attention alone on device 0 (ms per mode)."""
    c = seqlen // p  # local rows
    # zig-zag causal: every step is the work of (c rows x c/2 keys), e.g.
    # "all my rows vs the first half of the visiting K/V"; contiguous
    # non-causal: (c x c).
    ck = c // 2 if causal else c
    ssets = [(q[:, :c], k[:, :ck], v[:, :ck], do[:, :c])
             for q, k, v, do in sets]
    fns = self._fns(self._attn(False))
    out = {}
    for m in modes:
      try:
        out[m], _ = self._time(fns, ssets, m)
      except Exception as e:  # noqa: BLE001
        print(f"  step kernel P={p} {m}: {type(e).__name__}: "
              f"{str(e)[:120]}", flush=True)
    return out


# -------------------------------------------------------------------- CLI
def parse_args(argv=None):
  p = argparse.ArgumentParser(
      description=__doc__.splitlines()[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--seqlens", type=bench._int_list, default=[32768, 65536],
                 help="comma list, 'k' suffix allowed")
  p.add_argument("--causal", choices=("0", "1", "both"), default="both")
  p.add_argument("--modes", default="fwd,fwd+bwd")
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, default=0,
                 help="kv heads (GQA); 0: = --heads")
  p.add_argument("--hdim", type=int, default=128)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--procs", type=bench._int_list, default=[2, 4, 8],
                 help="ring sizes, those <= the local device count are run")
  p.add_argument("--no-overlap", dest="overlap", action="store_false",
                 default=True,
                 help="skip the one-step kernel timing (overlap check; run "
                      "unless given)")
  p.add_argument("--rotate", type=int, default=3,
                 help="input sets the calls rotate over")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--min-run-ms", type=float, default=100.0)
  p.add_argument("--max-iters", type=int, default=200)
  p.add_argument("--out", default=os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "out"),
      help="dir for ring_scaling.{csv,md,png}")
  p.add_argument("--no-plot", action="store_true")
  p.add_argument("--quick", action="store_true",
                 help="tiny shapes (smoke test, e.g. with --cpu-devices 4)")
  p.add_argument("--cpu-devices", type=int, default=0,
                 help="N virtual CPU devices instead of the GPUs")
  a = p.parse_args(argv)
  if a.quick:
    a.seqlens, a.heads, a.hdim = [256, 512], 2, 32
    a.rotate, a.warmup, a.repeats, a.min_run_ms = 2, 1, 3, 10.0
  a.kv_heads = a.kv_heads or a.heads
  if a.heads % a.kv_heads:
    p.error("--heads must be a multiple of --kv-heads")
  a.causals = {"0": [False], "1": [True], "both": [False, True]}[a.causal]
  a.mode_list = [m for m in MODES if m in
                 [x.strip() for x in a.modes.split(",")]]
  if not a.mode_list:
    p.error(f"--modes: pick from {','.join(MODES)}")
  return a


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.cpu_devices:  # before jax creates its backends
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") +
        f" --xla_force_host_platform_device_count={args.cpu_devices}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
  b = Bench(args)
  n = len(b.devs)
  procs = sorted({p for p in args.procs if 2 <= p <= n})
  env = bench.environment(with_jax=True)
  header = (bench.header_line(env) + f" | devices={n} x "
            f"{b.devs[0].device_kind} | path={b.path} | "
            f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
  print(header, flush=True)
  print(f"# batch {args.batch}, heads {args.heads}/{args.kv_heads} x "
        f"d{args.hdim}, bf16; ring sizes {procs or 'none (1 device)'}",
        flush=True)
  if b.devs[0].platform != "gpu":
    print(f"warning: platform {b.devs[0].platform!r}: a smoke test, the "
          "numbers mean nothing", flush=True)

  os.makedirs(args.out, exist_ok=True)
  csv_path = os.path.join(args.out, "ring_scaling.csv")
  t0 = time.time()
  rows = bench.measure_all(
      [(s, c) for s in args.seqlens for c in args.causals],
      lambda sc: b.measure(sc[0], sc[1], procs, args.mode_list),
      lambda rows: write_csv(rows, csv_path))
  write_csv(rows, csv_path)
  table = format_table(rows)
  bars = bar_lines(rows)
  print(f"\n{header} | wall={time.time() - t0:.0f}s\n{table}")
  for line in bars:
    print(line)
  md_path = os.path.join(args.out, "ring_scaling.md")
  with open(md_path, "w") as fh:
    fh.write(f"{header}\n\n{format_table(rows, markdown=True)}\n")
    if bars:
      fh.write("\n" + "\n".join(f"- {x}" for x in bars) + "\n")
  print(f"wrote {csv_path}, {md_path}")
  if not args.no_plot:
    plot(rows, os.path.join(args.out, "ring_scaling.png"),
         title=f"ring attention scaling: {env.get('gpu', '')}, batch "
               f"{args.batch}, heads {args.heads}/{args.kv_heads} x "
               f"d{args.hdim}, bf16")
  return 0


if __name__ == "__main__":
  sys.exit(main())

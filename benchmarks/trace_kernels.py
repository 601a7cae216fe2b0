#!/usr/bin/env python3
"""Where one benchmarked call spends its GPU time, kernel by kernel.

``bench.py`` times whole jitted calls with the wall clock; the kernel-only
drivers (``jax_fa3_*_check --time``) time one launch with CUDA events. When the
two disagree, this tool says why: it runs the same jitted functions as
``bench.py`` (same inputs, same back-to-back loop) under ``jax.profiler.trace``
(CUPTI, no nsys needed) and prints, per implementation and mode, every GPU
kernel of one call with its mean duration, the GPU-busy time per call, and the
idle gap per call (wall span on the GPU / calls - busy).

  python3 benchmarks/trace_kernels.py --hdim 128 --seqlen 8192 --modes fwd,fwdbwd
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def gpu_kernels(xplane_path: str):
  """(name, start_ns, duration_ns) of every kernel/memset/memcpy on GPU 0."""
  from jax.profiler import ProfileData
  data = ProfileData.from_file(xplane_path)
  out = []
  for plane in data.planes:
    if not plane.name.startswith("/device:GPU:0"):
      continue
    for line in plane.lines:
      if not line.name.startswith("Stream"):  # skip the "XLA Ops"/"XLA Modules" summaries
        continue
      for e in line.events:
        out.append((e.name, e.start_ns, e.duration_ns))
  return sorted(out, key=lambda x: x[1])


def host_events(xplane_path: str):
  """(name, duration_ns) of every host-side trace event (XLA runtime, Python)."""
  from jax.profiler import ProfileData
  out = []
  for plane in ProfileData.from_file(xplane_path).planes:
    if plane.name.startswith("/host"):
      for line in plane.lines:
        out += [(f"{line.name[:24]}: {e.name}", e.duration_ns) for e in line.events]
  return out


def trace_calls(fn, arg_sets, calls: int):
  import jax
  for i in range(3):
    jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
  tmp = tempfile.mkdtemp(prefix="jax_fa3_trace_")
  with jax.profiler.trace(tmp):
    out = None
    for i in range(calls):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
  paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
  if not paths:
    raise RuntimeError(f"no trace written under {tmp}")
  return gpu_kernels(paths[0]), host_events(paths[0])


def summarize_host(events, calls: int, top: int) -> None:
  per = collections.defaultdict(float)
  for name, dur in events:
    per[name] += dur
  for name, total in sorted(per.items(), key=lambda kv: -kv[1])[:top]:
    print(f"  host {total / calls / 1e3:9.1f} us/call  {name[:120]}")


def summarize(events, calls: int, label: str) -> None:
  if not events:
    print(f"{label}: no GPU events (is this a GPU run?)")
    return
  per = collections.OrderedDict()
  for name, _, dur in events:
    n, total = per.get(name, (0, 0.0))
    per[name] = (n + 1, total + dur)
  span = events[-1][1] + events[-1][2] - events[0][1]
  busy = sum(d for _, _, d in events)
  print(f"{label}: {calls} calls, per call: GPU span {span / calls / 1e3:.1f} us, "
        f"busy {busy / calls / 1e3:.1f} us, idle {(span - busy) / calls / 1e3:.1f} us")
  for name, (n, total) in sorted(per.items(), key=lambda kv: -kv[1][1]):
    print(f"  {total / calls / 1e3:9.1f} us/call  x{n / calls:4.1f}  {total / n / 1e3:9.1f} us each  "
          f"{name[:110]}")
  # Where the GPU sits idle: the gaps before each kernel, by kernel.
  gaps = collections.defaultdict(float)
  for (_, s0, d0), (name, s1, _) in zip(events, events[1:]):
    gaps[name] += max(0, s1 - (s0 + d0))
  for name, g in sorted(gaps.items(), key=lambda kv: -kv[1])[:4]:
    if g / calls >= 1e3:
      print(f"  idle {g / calls / 1e3:7.1f} us/call before {name[:100]}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--hdim", type=int, default=128)
  p.add_argument("--seqlen", type=int, default=8192)
  p.add_argument("--causal", type=int, default=0)
  p.add_argument("--tokens", type=int, default=bench.TOTAL_TOKENS)
  p.add_argument("--hidden", type=int, default=bench.HIDDEN)
  p.add_argument("--group", type=int, default=1)
  p.add_argument("--impls", default="fa3,cudnn")
  p.add_argument("--modes", default="fwd,fwdbwd", help="fwd and/or fwdbwd (forward + vjp)")
  p.add_argument("--calls", type=int, default=20)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--host", type=int, default=0, help="also list the N costliest host events")
  args = p.parse_args(argv)

  import jax
  import jax.numpy as jnp
  shape = bench.plan([args.seqlen], [args.hdim], [bool(args.causal)], args.tokens,
                     args.hidden, args.group)[0]
  sets = bench.make_inputs(shape, jnp.dtype(args.dtype), 2)
  print(f"# {shape}, {args.dtype}")
  for impl in args.impls.split(","):
    attn = bench._attn_fn(impl, shape)
    fns = {"fwd": jax.jit(lambda q, k, v, do: attn(q, k, v))}

    @jax.jit
    def fwdbwd(q, k, v, do):
      _, pull = jax.vjp(attn, q, k, v)
      return pull(do)
    fns["fwdbwd"] = fwdbwd
    for mode in args.modes.split(","):
      gpu, host = trace_calls(fns[mode], sets, args.calls)
      summarize(gpu, args.calls, f"{impl} {mode}")
      if args.host:
        summarize_host(host, args.calls, args.host)
  return 0


if __name__ == "__main__":
  sys.exit(main())

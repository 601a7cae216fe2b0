#!/usr/bin/env python3
"""What each level of FA3's overlap buys: the same shapes with compiled kernel
variants (build with JAX_FA3_ABLATION=ON), each in its own process because the
variant is chosen once per process by JAX_FA3_FWD_VARIANT. cuDNN runs in every
process as the same-run yardstick.

  python benchmarks/ablation.py [--seqlens 8k] [--out DIR]
"""
import argparse
import csv
import os
import subprocess
import sys

VARIANTS = [
    ("default", "everything: warp specialization + ping-pong + intra-WG overlap + persistent"),
    ("no_pingpong", "no inter-warpgroup ping-pong"),
    ("no_overlap", "no intra-warpgroup overlap"),
    ("no_overlap_no_pingpong", "warp specialization only"),
    ("static_grid", "everything, static grid instead of persistent scheduler"),
    ("no_warp_specialization", "ping-pong + overlap, but no producer warpgroup (a consumer thread loads)"),
]
# (variant, head dim) pairs beyond d128
EXTRA = [("default", 256, "d256: everything"), ("no_overlap", 256, "d256: no intra-WG overlap")]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seqlens", default="8k")
  ap.add_argument("--causal", default="both")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
  ap.add_argument("--timeout", type=float, default=300, help="seconds per variant")
  args = ap.parse_args()
  here = os.path.dirname(os.path.abspath(__file__))
  rows = []
  for variant, hdim, what in [(v, 128, w) for v, w in VARIANTS] + EXTRA:
    out = os.path.join(args.out, f"ablation_{variant}_d{hdim}")
    env = dict(os.environ, JAX_FA3_FWD_VARIANT=variant)
    cmd = [sys.executable, os.path.join(here, "bench.py"), "--hdims", str(hdim), "--seqlens", args.seqlens,
           "--causal", args.causal, "--modes", "fwd", "--impls", "fa3,cudnn", "--no-plot", "--out", out]
    try:  # an untested variant must not hang the whole ablation
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
      print(f"{variant}: timed out after {args.timeout} s")
      continue
    if proc.returncode != 0:
      print(f"{variant}: bench failed\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
      continue
    with open(os.path.join(out, "results.csv")) as f:
      for r in csv.DictReader(f):
        if r["impl"] == "fa3" and r["status"] == "ok":
          rows.append((variant, what, r["causal"], r["seqlen"], float(r["tflops"]), r["ratio_vs_cudnn"]))
  print("| variant | what | causal | seqlen | TFLOP/s | vs cuDNN (same process) |")
  print("|---|---|---|---|---|---|")
  for v, what, c, s, tf, ratio in rows:
    print(f"| {v} | {what} | {c} | {s} | {tf:.1f} | {ratio} |")


if __name__ == "__main__":
  main()

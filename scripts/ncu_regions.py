#!/usr/bin/env python3
"""Where a kernel's warps wait, by code region, from an ncu source-page export.

Input: ``ncu --import X.ncu-rep --page source --csv --print-source sass > X.csv``
(device_run.sh's ``profile`` stage writes ``prof_<shape>_sass.csv``). Consecutive
SASS instructions with the same execution count form one region: in a
persistent kernel that separates code run once per tile (tile start, first
block, epilogue), per K/V block (the GEMM issue and softmax of each unrolled
body) and by the producer warp. Per region it prints the share of the warp-state
samples, the top stall reasons and the commonest opcodes; ``--top N`` also lists
the N instructions with the most samples.

  python3 scripts/ncu_regions.py prof_4_4096_16_128_1_sass.csv [--min-share 0.4] [--top 20]
"""
from __future__ import annotations

import argparse
import csv
import sys


def _num(x: str) -> float:
  try:
    return float(x)
  except ValueError:
    return 0.0


def load(path: str):
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  # The first row names the kernel; the header follows.
  start = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
  hdr, data = rows[start], rows[start + 1:]
  col = {name: hdr.index(name) for name in
         ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed")}
  stalls = [(i, h[len("stall_"):]) for i, h in enumerate(hdr)
            if h.startswith("stall_") and "Not Issued" not in h]
  return data, col, stalls


def opcode(sass: str) -> str:
  parts = sass.split()
  if parts and parts[0].startswith("@"):
    parts = parts[1:]
  return parts[0].split(".")[0] if parts else ""


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("csv")
  ap.add_argument("--min-share", type=float, default=0.4, help="hide regions below this %% of samples")
  ap.add_argument("--top", type=int, default=0, help="also list the N hottest instructions")
  args = ap.parse_args(argv)

  data, col, stalls = load(args.csv)
  i_src, i_smp, i_exe = (col["Source"], col["Warp Stall Sampling (All Samples)"],
                         col["Instructions Executed"])
  total = sum(_num(r[i_smp]) for r in data) or 1.0
  regions = []
  for k, r in enumerate(data):
    ex = int(_num(r[i_exe]))
    if not regions or regions[-1]["ex"] != ex:
      regions.append({"first": k, "ex": ex, "n": 0, "samples": 0.0, "stall": {}, "ops": {}})
    g = regions[-1]
    g["last"] = k
    g["n"] += 1
    g["samples"] += _num(r[i_smp])
    op = opcode(r[i_src])
    g["ops"][op] = g["ops"].get(op, 0) + 1
    for i, name in stalls:
      g["stall"][name] = g["stall"].get(name, 0.0) + _num(r[i])

  print(f"{args.csv}: {int(total)} samples, {len(data)} instructions")
  print(f"{'instrs':>11} {'executed':>9} {'n':>4} {'share':>6}  top stalls | commonest opcodes")
  for g in regions:
    share = 100 * g["samples"] / total
    if share < args.min_share:
      continue
    st = sorted(g["stall"].items(), key=lambda kv: -kv[1])[:3]
    ops = sorted(g["ops"].items(), key=lambda kv: -kv[1])[:4]
    print(f"{g['first']:5d}-{g['last']:5d} {g['ex']:9d} {g['n']:4d} {share:5.1f}%  "
          + " ".join(f"{k}:{100 * v / total:.1f}" for k, v in st) + " | "
          + " ".join(f"{k}x{v}" for k, v in ops))
  if args.top:
    print(f"\nhottest {args.top} instructions:")
    hot = sorted(range(len(data)), key=lambda k: -_num(data[k][i_smp]))[:args.top]
    for k in sorted(hot):
      r = data[k]
      st = max(stalls, key=lambda s: _num(r[s[0]]))
      print(f"{k:5d} {100 * _num(r[i_smp]) / total:5.1f}% exec={r[i_exe]:>8} {st[1]:>14}  {r[i_src][:70]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

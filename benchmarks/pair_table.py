#!/usr/bin/env python3
"""results.csv -> markdown table pairing jax_fa3 with cuDNN per shape (for RESULTS.md).

  python benchmarks/pair_table.py benchmarks/out/results.csv
"""
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
by = {}
for r in rows:
  if r["status"] != "ok": continue
  by.setdefault((r["mode"], int(r["hdim"]), r["causal"], int(r["seqlen"])), {})[r["impl"]] = float(r["tflops"])
print("| mode | d | causal | seqlen | jax_fa3 TFLOP/s | cuDNN TFLOP/s | ratio |")
print("|---|---|---|---|---|---|---|")
for (mode, d, c, s), v in sorted(by.items()):
  if "fa3" in v and "cudnn" in v:
    print(f"| {mode} | {d} | {'yes' if c == '1' else 'no'} | {s} | {v['fa3']:.0f} | {v['cudnn']:.0f} | {v['fa3']/v['cudnn']:.2f} |")

"""Benchmark tooling that needs no GPU: bench.py's FLOPs and --clocks sampler
(run against a stand-in nvidia-smi), scripts/ncu_regions.py on a synthetic export."""
import csv
import importlib.util
import os
import pathlib
import stat
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
  spec = importlib.util.spec_from_file_location("bench", ROOT / "benchmarks" / "bench.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod  # dataclasses look their module up while it loads
  spec.loader.exec_module(mod)
  return mod


def test_flops_follow_the_paper():
  b = _bench()
  f = b.attn_flops(2, 16, 8192, 128, False)
  assert f == 4.0 * 2 * 16 * 8192 ** 2 * 128
  assert b.attn_flops(2, 16, 8192, 128, True) == f / 2
  assert b.attn_flops(2, 16, 8192, 128, False, "bwd") == 2.5 * f


def test_window_flops_and_real_shapes():
  b = _bench()
  # (4096, 0) window at 16k: rows 0..4095 see i + 1 keys, the rest 4097.
  pairs = sum(min(i, 4096) + 1 for i in range(16384))
  assert b.attn_flops(1, 16, 16384, 128, True, window_left=4096) == 4.0 * 16 * 128 * pairs
  # A window as long as the sequence is plain causal.
  assert b.attn_flops(1, 16, 4096, 128, True, window_left=5000) == b.attn_flops(
      1, 16, 4096, 128, True)
  names = {b._mask_name(s) for s in b.REAL_SHAPES}
  assert names == {"yes", "w4096"}
  assert {b._heads(s) for s in b.REAL_SHAPES} == {"32/8", "64/8", "16"}


def test_clock_reason_shares():
  b = _bench()
  assert b.clock_reason_shares([]) == ""
  assert b.clock_reason_shares([None, None]) == ""
  assert b.clock_reason_shares([0, 0]) == ""
  assert b.clock_reason_shares([0x4 | 0x8, 0x4, 0, 0]) == "sw_power_cap:50%;hw_slowdown:25%"


def test_clock_sampler_parses_nvidia_smi(tmp_path, monkeypatch):
  fake = tmp_path / "nvidia-smi"
  fake.write_text("#!/bin/sh\n"
                  "while true; do\n"
                  "  echo '1830, 450.25, 0x0000000000000004'\n"
                  "  echo 'garbage'\n"
                  "  echo '1980, 300.00, [N/A]'\n"
                  "  sleep 0.02\n"
                  "done\n")
  fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
  b = _bench()
  with b.ClockSampler(period_ms=20) as sampler:
    time.sleep(0.3)
  assert sampler.samples, "no samples parsed"
  assert (1830.0, 450.25, 4) in sampler.samples
  assert (1980.0, 300.0, None) in sampler.samples
  assert all(len(s) == 3 for s in sampler.samples)


def test_results_csv_round_trip_and_replot(tmp_path):
  b = _bench()
  shape = b.Shape(128, True, 8192, 2, 16, 4)
  rows = [b.Row("fa3", "fwd", "bfloat16", shape, 1.5, 700.0, None, 40, "ok", 1800.0, 450.0,
                "sw_power_cap:100%"),
          b.Row("cudnn", "fwd", "bfloat16", shape, 1.65, 636.4, None, 38),
          b.Row("cudnn", "bwd", "bfloat16", shape, status="OOM")]
  b.fill_ratios(rows)
  path = tmp_path / "run" / "results.csv"
  b.write_csv(rows, str(path))
  back = b.read_csv(str(path))
  key = lambda r: (r.impl, r.mode)  # noqa: E731
  for want, got in zip(sorted(rows, key=key), sorted(back, key=key)):
    assert (got.impl, got.mode, got.dtype, got.shape, got.iters, got.status, got.clock_reasons) == (
        want.impl, want.mode, want.dtype, want.shape, want.iters, want.status, want.clock_reasons)
    for a, c in ((got.ms, want.ms), (got.tflops, want.tflops), (got.ratio, want.ratio),
                 (got.sm_mhz, want.sm_mhz)):
      assert (a is None) == (c is None) and (a is None or abs(a - c) <= 5e-3 * abs(c))
  assert abs(next(r for r in back if r.impl == "fa3").ratio - 700.0 / 636.4) < 1e-3
  out = tmp_path / "plot"
  rc = b.main(["--replot", str(path), "--out", str(out)])
  if b.pyplot() is not None:  # the plot needs matplotlib; the table does not
    assert rc == 0 and (out / "bench.png").stat().st_size > 1000


def test_ncu_regions_groups_by_execution_count(tmp_path, capsys):
  """scripts/ncu_regions.py: consecutive instructions with one execution count form
  a region, whose share of the samples and top stall are reported."""
  spec = importlib.util.spec_from_file_location("ncu_regions", ROOT / "scripts" / "ncu_regions.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
         "stall_wait", "stall_barrier", "stall_wait (Not Issued)"]
  rows = [["0x0", "IMAD R1, R2, R3", "10", "16", "10", "0", "0"],      # per tile
          ["0x10", "@P0 BRA 0x40", "30", "16", "0", "30", "0"],
          ["0x20", "MUFU.EX2 R4, R4", "50", "256", "45", "5", "0"],    # per block
          ["0x30", "FADD R5, R5, R4", "10", "256", "10", "0", "0"]]
  path = tmp_path / "src.csv"
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["Kernel Name", "k"])
    w.writerow(hdr)
    w.writerows(rows)
  assert mod.main([str(path), "--min-share", "0", "--top", "1"]) == 0
  out = capsys.readouterr().out
  regions = [l for l in out.split("hottest")[0].splitlines()[2:] if l.strip()]
  shares = [[t for t in l.split() if t.endswith("%")][0] for l in regions]
  assert shares == ["40.0%", "60.0%"], out
  assert "barrier:30.0" in regions[0] and "BRAx1" in regions[0]
  assert "wait:55.0" in regions[1] and "MUFUx1" in regions[1]
  assert "MUFU.EX2" in out.split("hottest")[1]


def _decode_bench():
  sys.path.insert(0, str(ROOT / "benchmarks"))
  spec = importlib.util.spec_from_file_location("decode_bench", ROOT / "benchmarks" / "decode_bench.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_decode_bench_pages_points_and_check(cpu_backend):
  import jax
  import jax.numpy as jnp
  import numpy as np
  d = _decode_bench()
  assert d.parse_points("1x131072,64X4096") == [(1, 131072), (64, 4096)]
  assert d.kv_bytes(2, 1000, 8, 128) == 2 * 2 * 1000 * 8 * 128 * 2
  # The pool the shuffled table addresses holds every row's tokens in order.
  table, _ = d.paged_layout(3, 150, 64, seed=1)
  assert table.shape == (3, 3) and sorted(table.reshape(-1)) == list(range(9))
  cache = jax.random.normal(jax.random.key(0), (3, 150, 2, 4))
  pool = d.to_pages(cache, table, 64)
  pos = np.arange(150)
  for b in range(3):
    np.testing.assert_array_equal(pool[table[b, pos // 64], pos % 64], cache[b])
  # The check passes the reference itself and rejects a wrong answer.
  seq, _ = d.paged_layout(2, 150, 64, shuffled=False)
  np.testing.assert_array_equal(seq, [[0, 1, 2], [3, 4, 5]])
  args = d.make_point(jax.random.key(2), 2, 100, 3, 4, 2, 16, [64, 32])
  assert d.check("ref", lambda q, k, v, lens, *_: d.reference(q, k, v, lens), args) is None
  wrong = lambda q, k, v, lens, *_: d.reference(q, k, v, lens - 1)  # noqa: E731
  assert d.check("wrong", wrong, args) is not None
  impls = d._impls(["jax_fa3_paged"], [64, 32])
  assert sorted(impls) == ["jax_fa3_paged", "jax_fa3_paged32"]
  for fn in impls.values():
    assert d.check("pure JAX", fn, args) is None

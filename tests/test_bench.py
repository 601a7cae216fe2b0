"""benchmarks/bench.py pieces that need no GPU: FLOPs and the --clocks sampler
(run against a stand-in nvidia-smi)."""
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

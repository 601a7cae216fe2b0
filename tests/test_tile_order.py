"""The backward's key-block dispatch order (cc/bwd/tile_scheduler.h) covers
every (key block, KV head, batch) exactly once and keeps its order's promise
(longest first: chunks of key blocks never go back; deterministic causal:
key blocks descending per head). Host-only: built with nvcc, no GPU needed.
"""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cutlass_include():
  try:
    import cutlass_library
  except ImportError:
    return None
  inc = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
  return inc if os.path.isdir(inc) else None


def test_bwd_tile_order_is_a_permutation(tmp_path):
  nvcc = shutil.which("nvcc") or (
      "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
  inc = _cutlass_include()
  if nvcc is None or inc is None:
    pytest.skip("needs nvcc and the nvidia-cutlass headers")
  exe = str(tmp_path / "tile_order_check")
  subprocess.run([nvcc, "-std=c++17", "-I", os.path.join(ROOT, "cc"), "-I", inc,
                  os.path.join(ROOT, "tests", "tile_order_check.cu"), "-o", exe],
                 check=True, capture_output=True, text=True)
  run = subprocess.run([exe], capture_output=True, text=True)
  lines = run.stdout.strip().splitlines()
  assert lines[-1] == "failures=0", "\n".join(l for l in lines if "ok=1 monotone=1" not in l)
  assert run.returncode == 0
  # All three orders were exercised.
  assert {l.split("order=")[1].split()[0] for l in lines[:-1]} == {"0", "1", "2"}

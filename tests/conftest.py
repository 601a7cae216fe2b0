"""pytest setup shared by every test: XLA flags, the `gpu` marker and its skip
rule, and the `cpu_backend` fixture.

Tests without the `gpu` marker run everywhere (CPU CI machine and H100/H200
hosts). Tests marked `gpu` need the compiled kernels and an sm_90 device and
are skipped anywhere else. Shared helpers live in `fa3_testing.py` (inputs,
compiled-config discovery) and `host_reference.py` (NumPy references and the
FA3 tolerance rule).
"""
import os
import zlib


def _add_xla_flag(flag):
  if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


# XLA reads XLA_FLAGS when it creates its first backend, so this runs before
# anything touches a device. 8 virtual CPU devices for the sharding tests
# (the flag affects only the CPU platform).
_add_xla_flag("--xla_force_host_platform_device_count=8")

import jax_fa3._native as _native  # noqa: E402  (creates no backend)

if not _native.available():
  # The CPU suite's time is XLA:CPU compiling many tiny programs: skip LLVM
  # optimizations. Hosts with the kernels keep XLA:GPU's default code.
  _add_xla_flag("--xla_backend_optimization_level=0")

import jax  # noqa: E402
import pytest  # noqa: E402

from fa3_testing import sm90_kernels_present  # noqa: E402

HAS_SM90 = sm90_kernels_present()


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "gpu: needs the compiled kernels and an sm_90 (H100/H200) GPU")


def pytest_addoption(parser):
  parser.addoption(
      "--part", default=None, metavar="I/N",
      help="run only part I (0-based) of N fixed parts of the collected tests "
           "(split by a hash of each test's id), so a long suite can run in "
           "N shorter runs that together cover every test exactly once")


def _select_part(config, items):
  spec = config.getoption("--part")
  if spec is None:
    return
  try:
    i, n = (int(x) for x in spec.split("/"))
  except ValueError:
    raise pytest.UsageError(f"--part wants I/N (e.g. 0/2), got {spec!r}") from None
  if not 0 <= i < n:
    raise pytest.UsageError(f"--part {spec}: I must be in [0, N)")
  keep, drop = [], []
  for item in items:
    (keep if zlib.crc32(item.nodeid.encode()) % n == i else drop).append(item)
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_collection_modifyitems(config, items):
  _select_part(config, items)
  if HAS_SM90:
    return
  skip = pytest.mark.skip(reason="no sm_90 GPU with jax_fa3 kernels")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def cpu_backend():
  """Runs the test's computations on XLA:CPU, also on a GPU host.

  CPU tests check the reference path and the API against jax.nn with float32
  tolerances; on a GPU, float32 matmuls default to TF32, so the same numbers
  are only guaranteed on the CPU backend. Apply per module with
  ``pytestmark = pytest.mark.usefixtures("cpu_backend")``.
  """
  with jax.default_device(jax.devices("cpu")[0]):
    yield

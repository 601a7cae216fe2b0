"""jax_fa3._native: warning when the extension is missing, FFI registration
when it is present (with a fake extension), capability queries."""
import os
import subprocess
import sys
import textwrap

import jax

import jax_fa3
from jax_fa3 import _native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Makes the binding unimportable in a subprocess, wherever it is installed
# (this checkout, site-packages): the "not built" case on any machine.
NO_BINDING = """
import sys, importlib.abc, importlib.machinery
class _NoBinding(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name == "jax_fa3._jax_fa3":
      raise ImportError("no binding", name=name)
sys.meta_path.insert(0, _NoBinding())
importlib.machinery.EXTENSION_SUFFIXES[:] = []
"""


def _run(code, quiet):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep +
             os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
  env.pop("JAX_FA3_QUIET", None)
  if quiet:
    env["JAX_FA3_QUIET"] = "1"
  r = subprocess.run([sys.executable, "-W", "always", "-c",
                      textwrap.dedent(code)], env=env, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  return r


def test_queries_match_this_machine():
  # The binding may or may not be installed here (CI installs it, a source
  # checkout alone has none), and there may be an H100/H200 or not.
  if _native.available():
    assert ("bfloat16", 128) in _native.compiled_configs()
    assert _native.compiled_bwd_configs() <= _native.compiled_configs()
    for dtype, h, hv in _native.compiled_value_configs():
      assert (dtype, h) in _native.compiled_configs() and hv != h
    assert (_native.compiled_bwd_value_configs()
            <= _native.compiled_value_configs())
  else:
    assert _native.compiled_configs() == frozenset()
    assert _native.compiled_bwd_configs() == frozenset()
    assert _native.compiled_fp8_configs() == frozenset()
    assert _native.compiled_value_configs() == frozenset()
    assert _native.compiled_bwd_value_configs() == frozenset()
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  sm90 = any(getattr(d, "compute_capability", "") == "9.0" for d in gpus)
  assert _native.sm90_gpu_present() is sm90
  assert jax_fa3.kernels_available() is _native.available()


def test_installed_binding_found_from_source_checkout():
  """`python3 -m jax_fa3.demo` in the repo root after `pip install .` imports the
  source tree (no binding in it); the installed binding must still load."""
  code = """
      import os, jax_fa3, jax_fa3._native as n
      here = os.path.dirname(jax_fa3.__file__)
      if n.available():
        print("binding from", os.path.dirname(n._jax_fa3.__file__), "source", here)
      else:
        print("no binding installed")
  """
  r = _run(code, quiet=True)
  out = r.stdout.strip().splitlines()[-1]
  assert out.startswith(("binding from", "no binding installed")), r.stdout + r.stderr


def test_missing_extension_warns_once_unless_quiet():
  code = NO_BINDING + """
import importlib, jax_fa3, jax_fa3._native
importlib.import_module("jax_fa3")
assert not jax_fa3.kernels_available()
"""
  r = _run(code, quiet=False)
  assert r.stderr.count("kernels were not built") == 1, r.stderr
  assert "circular" not in r.stderr
  assert "UserWarning" in r.stderr and "reference" in r.stderr
  r = _run(code, quiet=True)
  assert "kernels were not built" not in r.stderr, r.stderr


def test_present_extension_registers_ffi_targets():
  code = """
      import sys, types, warnings
      import jax, jax.ffi
      calls = []
      jax.ffi.register_ffi_target = lambda *a, **k: calls.append((a, k))
      fake = types.ModuleType("jax_fa3._jax_fa3")
      caps = {"jax_fa3_fwd": object(), "jax_fa3_bwd": object()}
      fake.registrations = lambda: caps
      fake.compiled_configs = lambda: [("bfloat16", 128), ("float16", 128)]
      fake.compiled_bwd_configs = lambda: [("bfloat16", 128)]
      fake.compiled_fp8_configs = lambda: [("bfloat16", 128)]
      sys.modules["jax_fa3._jax_fa3"] = fake
      with warnings.catch_warnings():
        warnings.simplefilter("error")
        import jax_fa3
      from jax_fa3 import _native
      assert jax_fa3.kernels_available() and _native.available()
      assert _native.compiled_configs() == frozenset(
          {("bfloat16", 128), ("float16", 128)})
      assert _native.compiled_bwd_configs() == frozenset({("bfloat16", 128)})
      assert _native.compiled_fp8_configs() == frozenset({("bfloat16", 128)})
      # a binding without the value-head-dim queries still loads
      assert _native.compiled_value_configs() == frozenset()
      assert _native.compiled_bwd_value_configs() == frozenset()
      got = sorted((a[0], a[1] is caps[a[0]], k.get("platform")) for a, k in calls)
      assert got == [("jax_fa3_bwd", True, "CUDA"), ("jax_fa3_fwd", True, "CUDA")], got
      assert all(len(a) == 2 and set(k) == {"platform"} for a, k in calls)
      assert _native.sm90_gpu_present() is False  # CPU-only jax
      print("OK")
  """
  r = _run(code, quiet=False)
  assert "OK" in r.stdout and "not built" not in r.stderr, r.stderr


def test_broken_extension_warns_and_falls_back():
  code = """
      import sys, types, importlib.abc, importlib.machinery
      class Broken(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
          if name == "jax_fa3._jax_fa3":
            raise ImportError("libjax_fa3_kernels.so: cannot open shared object")
      sys.meta_path.insert(0, Broken())
      import jax_fa3
      assert not jax_fa3.kernels_available()
  """
  r = _run(code, quiet=False)
  assert "could not be loaded" in r.stderr and "libjax_fa3_kernels" in r.stderr

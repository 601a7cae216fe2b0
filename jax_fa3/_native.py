"""Loader for the compiled FlashAttention-3 kernels (``jax_fa3._jax_fa3``).

The nanobind extension is optional: when it was not built (e.g. no ``nvcc`` at
install time) a single ``UserWarning`` is emitted at import (silenced by
``JAX_FA3_QUIET=1``) and the pure-JAX reference path is used everywhere.
When present, its XLA FFI handlers are registered for the CUDA platform.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings

import jax



def _load_binding():
  """Returns ``(module or None, ImportError or None)``.

  Running from a source checkout (``python3 -m jax_fa3.demo`` in the repo root,
  as the README does right after ``pip install .``) imports this directory,
  which has no compiled binding, and shadows the installed package, which has
  it: then the installed copy's binding is loaded from its directory (its
  RPATH finds the kernel library next to it).
  """
  try:
    return importlib.import_module("jax_fa3._jax_fa3"), None
  except ImportError as e:
    if getattr(e, "name", None) != "jax_fa3._jax_fa3":
      return None, e  # built but not loadable
    err = e
  here = os.path.dirname(os.path.abspath(__file__))
  for entry in sys.path:
    pkg = os.path.join(os.path.abspath(entry or os.getcwd()), "jax_fa3")
    if pkg == here or not os.path.isdir(pkg):
      continue
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
      path = os.path.join(pkg, "_jax_fa3" + suffix)
      if os.path.isfile(path):
        spec = importlib.util.spec_from_file_location("jax_fa3._jax_fa3", path)
        module = importlib.util.module_from_spec(spec)
        try:
          spec.loader.exec_module(module)
        except ImportError as e:
          return None, e
        sys.modules["jax_fa3._jax_fa3"] = module
        return module, None
  return None, err


_jax_fa3, _IMPORT_ERROR = _load_binding()

__all__ = ["available", "compiled_configs", "compiled_value_configs",
           "compiled_bwd_configs", "compiled_bwd_value_configs",
           "compiled_fp8_configs", "sm90_gpu_present"]

if _jax_fa3 is None:
  if os.environ.get("JAX_FA3_QUIET", "") != "1":
    if getattr(_IMPORT_ERROR, "name", None) == "jax_fa3._jax_fa3":
      _why = ("the FlashAttention-3 CUDA kernels were not built (e.g. no nvcc "
              "/ CUDA toolkit at install time)")
    else:
      _why = ("the FlashAttention-3 CUDA kernels were built but could not be "
              f"loaded ({_IMPORT_ERROR}); treating them as not built")
    warnings.warn(
        f"jax_fa3: {_why}; the pure-JAX reference implementation will be "
        "used. Set JAX_FA3_QUIET=1 to silence this warning.",
        UserWarning, stacklevel=2)
  _CONFIGS = _BWD_CONFIGS = _FP8_CONFIGS = frozenset()
  _VALUE_CONFIGS = _BWD_VALUE_CONFIGS = frozenset()
else:
  for _name, _capsule in _jax_fa3.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
  _CONFIGS, _BWD_CONFIGS, _FP8_CONFIGS = (
      frozenset((str(d), int(h)) for d, h in configs()) for configs in (
          _jax_fa3.compiled_configs, _jax_fa3.compiled_bwd_configs,
          _jax_fa3.compiled_fp8_configs))
  # A binding built before these lists existed has no such query.
  _VALUE_CONFIGS, _BWD_VALUE_CONFIGS = (
      frozenset((str(d), int(h), int(hv))
                for d, h, hv in getattr(_jax_fa3, name, list)())
      for name in ("compiled_value_configs", "compiled_bwd_value_configs"))


def available() -> bool:
  """True iff the compiled kernel extension was loaded and registered."""
  return _jax_fa3 is not None


def compiled_configs() -> frozenset:
  """``frozenset`` of ``(dtype_name, head_dim)`` the kernels were built for,
  e.g. ``{("bfloat16", 128), ("float16", 128)}``; empty when not built."""
  return _CONFIGS


def compiled_value_configs() -> frozenset:
  """``frozenset`` of ``(dtype_name, head_dim, value_head_dim)`` with a
  forward kernel for a V head dim unlike Q/K's, e.g. ``("bfloat16", 192,
  128)``; those missing from :func:`compiled_bwd_value_configs`
  differentiate through the reference backward."""
  return _VALUE_CONFIGS


def compiled_bwd_configs() -> frozenset:
  """``frozenset`` of ``(dtype_name, head_dim)`` with a backward kernel (a
  subset of :func:`compiled_configs`); the others differentiate through the
  reference backward."""
  return _BWD_CONFIGS


def compiled_bwd_value_configs() -> frozenset:
  """``frozenset`` of ``(dtype_name, head_dim, value_head_dim)`` with a
  backward kernel for a V head dim unlike Q/K's, e.g. ``("bfloat16", 192,
  128)``; empty when not built."""
  return _BWD_VALUE_CONFIGS


def compiled_fp8_configs() -> frozenset:
  """``frozenset`` of ``(output dtype name, head_dim)`` with an FP8 kernel."""
  return _FP8_CONFIGS


_SM90: bool | None = None


def sm90_gpu_present() -> bool:
  """True iff JAX sees at least one GPU of compute capability 9.0 (cached)."""
  global _SM90
  if _SM90 is None:
    try:
      devs = jax.devices("gpu")
    except RuntimeError:
      devs = []
    _SM90 = any(getattr(d, "compute_capability", "") == "9.0" for d in devs)
  return _SM90

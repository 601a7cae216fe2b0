"""Shared pytest setup: the `gpu` marker and the skip rule for kernel tests.

GPU tests need the compiled kernels *and* an sm_90 device; anywhere else (the
CPU-only CI machine) they are skipped, so CI proves build + JAX layer + the
reference path while the GPU truth is proven on the H200.
"""
import os

# 8 virtual CPU devices for the sharding tests (test_sharding.py); this has to
# happen before JAX creates its CPU backend and affects only the CPU platform.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import pytest


def _sm90_kernels_available() -> bool:
    try:
        import jax
        import jax_fa3._native as native
    except Exception:
        return False
    if not native.available():
        return False
    try:
        devs = jax.devices("gpu")
    except RuntimeError:
        return False
    return any(getattr(d, "compute_capability", "") == "9.0" for d in devs)


HAS_SM90 = _sm90_kernels_available()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs the compiled kernels and an sm_90 (H100/H200) GPU")


def pytest_collection_modifyitems(config, items):
    if HAS_SM90:
        return
    skip = pytest.mark.skip(reason="no sm_90 GPU with jax_fa3 kernels")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

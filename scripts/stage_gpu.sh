#!/usr/bin/env bash
# Builds for a GPU machine on another one (no GPU needed): the kernel library
# once (it does not depend on the Python version) and the nanobind binding for
# the GPU machine's Python, both copied into jax_fa3/ (git-ignored) so that
# `PYTHONPATH=.` imports them there.
#   PY_DEVICE=/path/to/python3.12 scripts/stage_gpu.sh
#   JAX_FA3_HEAD_DIMS=128 TOOLS=1 scripts/stage_gpu.sh   # one head dim, plus the check drivers
# PY_KERNELS: the Python whose jaxlib gives the FFI headers (python3); PY_DEVICE:
# the GPU machine's Python version, with nanobind installed (default: PY_KERNELS);
# TOOLS=1 also builds build-k/jax_fa3_*_check; JOBS: parallel compiles (2).
set -euo pipefail
cd "$(dirname "$0")/.."
PY_KERNELS=${PY_KERNELS:-python3}
PY_DEVICE=${PY_DEVICE:-$PY_KERNELS}
JOBS=${JOBS:-2}
tools=OFF; [ "${TOOLS:-0}" = 1 ] && tools=ON

cmake -S . -B build-k -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY_KERNELS")" \
  -DJAX_FA3_BUILD_TOOLS=$tools >/dev/null
ninja -C build-k -j"$JOBS" jax_fa3_kernels $([ $tools = ON ] && echo jax_fa3_fwd_check jax_fa3_bwd_check jax_fa3_fp8_check)
cmake -S . -B build-py -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY_DEVICE")" \
  -DJAX_FA3_KERNEL_LIB="$PWD/build-k/libjax_fa3_kernels.so" >/dev/null
ninja -C build-py _jax_fa3
cp build-k/libjax_fa3_kernels.so build-py/_jax_fa3*.so jax_fa3/
ls -la jax_fa3/*.so

#!/usr/bin/env bash
# Builds what a GPU machine needs, here (no GPU required): the kernel library
# (once, Python-independent) and the nanobind binding for the device's Python
# (3.12), both dropped into jax_fa3/ (git-ignored) so `PYTHONPATH=.` imports
# them there. Then prints the SASS census of the kernels.
#   scripts/stage_gpu.sh            # all head dims / dtypes
#   JAX_FA3_HEAD_DIMS=128 scripts/stage_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY_KERNELS=${PY_KERNELS:-python3}                                  # its jaxlib gives the FFI headers
PY_DEVICE=${PY_DEVICE:-$(PYENV_VERSION=3.12.1 pyenv which python)}  # the GPU machine's Python version
JOBS=${JOBS:-2}

cmake -S . -B build-k -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PY_KERNELS")" >/dev/null
ninja -C build-k -j"$JOBS" jax_fa3_kernels
cmake -S . -B build-py312 -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PY_DEVICE" \
  -DJAX_FA3_KERNEL_LIB="$PWD/build-k/libjax_fa3_kernels.so" >/dev/null
ninja -C build-py312 _jax_fa3
cp build-k/libjax_fa3_kernels.so build-py312/_jax_fa3*.so jax_fa3/
ls -la jax_fa3/*.so
if [ -f ../shared/tools/sass_report.py ]; then
  python3 ../shared/tools/sass_report.py jax_fa3/libjax_fa3_kernels.so --require HGMMA,UTMALDG,USETMAXREG
fi

#!/usr/bin/env bash
# Builds only the forward kernels and cc/tools/fwd_check into $B (no CMake, no
# Python): the quick loop for sanitizer / ncu / A-B timing runs on the device.
#   HD="64 128 256" DT="bf16" [EXTRA_FLAGS=-DJAX_FA3_D64_BLOCK_M=192] scripts/build_fwd_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-build-fwdcheck}; HD=${HD:-64 128 256}; DT=${DT:-bf16}
CUT=${CUTLASS_INCLUDE_DIR:-$PWD/.carry/cutlass/include}
FFI=$(python3 -c 'import jax; print(jax.ffi.include_dir())')
FLAGS="-std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math --expt-relaxed-constexpr -O3
       -DNDEBUG -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -Icc -I$CUT -I$FFI ${EXTRA_FLAGS:-}"
mkdir -p "$B"
decls=""; rows=""; n=0
for dt in $DT; do
  case $dt in bf16) ct=cutlass::bfloat16_t; en=kBF16;; fp16) ct=cutlass::half_t; en=kFP16;; esac
  for hd in $HD; do
    fn=launch_fwd_${dt}_hd${hd}
    printf '#include "fwd/kernel.h"\nnamespace jax_fa3 {\ncudaError_t %s(const FwdParams& p, cudaStream_t s) { return launch_fwd<%s, %s>(p, s); }\n}\n' \
      "$fn" "$ct" "$hd" > "$B/$fn.cu"
    decls+="cudaError_t $fn(const FwdParams&, cudaStream_t);"$'\n'
    rows+="  {DType::$en, $hd, \"default\", &$fn},"$'\n'
    n=$((n + 1))
  done
done
printf '#include "fwd/params.h"\nnamespace jax_fa3 {\n%s\nconst FwdKernelEntry kFwdKernels[] = {\n%s};\nconst int kNumFwdKernels = %d;\n}\n' \
  "$decls" "$rows" "$n" > "$B/fwd_table.cc"
ls "$B"/*.cu "$B/fwd_table.cc" cc/ffi/fwd_handler.cc | xargs -P "$(nproc)" -I{} sh -c \
  'nvcc '"$(echo $FLAGS)"' -x cu -c {} -o '"$B"'/$(basename {}).o'
nvcc $FLAGS -o "$B/jax_fa3_fwd_check" cc/tools/fwd_check.cc "$B"/*.o
echo "built $B/jax_fa3_fwd_check ($n kernels)"

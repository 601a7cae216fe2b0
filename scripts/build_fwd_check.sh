#!/usr/bin/env bash
# Builds only the forward kernels and cc/tools/fwd_check into $B (no CMake, no
# Python), with BWD=1 also the backward kernels and cc/tools/bwd_check, with
# FP8=1 also the FP8 kernels (bf16 output), the quantize pre-pass and
# cc/tools/fp8_check: the quick loop for sanitizer / ncu / A-B timing runs on
# the device (or here, to carry). FWD=0 leaves the forward out.
#   HD="64 128 256" DT="bf16" [BWD=1] [FP8=1] [EXTRA_FLAGS=-DJAX_FA3_D64_BLOCK_M=192] scripts/build_fwd_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
B=${B:-build-fwdcheck}; HD=${HD:-64 128 256}; DT=${DT:-bf16}
CUT=${CUTLASS_INCLUDE_DIR:-$PWD/.carry/cutlass/include}
FFI=$(python3 -c 'import jax; print(jax.ffi.include_dir())')
FLAGS="-std=c++17 -gencode=arch=compute_90a,code=sm_90a --use_fast_math --expt-relaxed-constexpr -O3
       -DNDEBUG -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -Icc -I$CUT -I$FFI ${EXTRA_FLAGS:-}"
mkdir -p "$B"
families=""; [ "${FWD:-1}" = 1 ] && families="fwd"
[ "${BWD:-0}" = 1 ] && families+=" bwd"; [ "${FP8:-0}" = 1 ] && families+=" fp8"
sources=""
for fam in $families; do
  # Fam: the params / entry / table name stem; launch_<launcher> the template.
  case $fam in fwd) Fam=Fwd; launcher=fwd; params=FwdParams;; bwd) Fam=Bwd; launcher=bwd; params=BwdParams;;
               fp8) Fam=Fp8Fwd; launcher=fp8_fwd; params=Fp8FwdParams;; esac
  decls=""; rows=""; n=0
  for dt in $DT; do
    case $dt in bf16) ct=cutlass::bfloat16_t; en=kBF16;; fp16) ct=cutlass::half_t; en=kFP16;; esac
    for hd in $HD; do
      [ $fam = fp8 ] && ! [[ $hd =~ ^(64|128|256)$ ]] && continue
      # FP8: both V layouts (CMakeLists.txt: "default" transposes V in-kernel, "vt" reads V^T).
      # FP8_VARIANTS narrows that for quick A/B builds.
      variants="default"; [ $fam = fp8 ] && variants="${FP8_VARIANTS:-default vt}"
      for var in $variants; do
        fn=launch_${fam}_${dt}_hd${hd}_${var}; targs=""; [ $var = vt ] && targs=", true"
        printf '#include "%s/kernel.h"\nnamespace jax_fa3 {\ncudaError_t %s(const %s& p, cudaStream_t s) { return launch_%s<%s, %s%s>(p, s); }\n}\n' \
          "$fam" "$fn" "$params" "$launcher" "$ct" "$hd" "$targs" > "$B/$fn.cu"
        decls+="cudaError_t $fn(const $params&, cudaStream_t);"$'\n'
        if [ $fam = bwd ]; then rows+="  {DType::$en, $hd, &$fn},"$'\n'
        else rows+="  {DType::$en, $hd, \"$var\", &$fn},"$'\n'; fi
        sources+=" $B/$fn.cu"; n=$((n + 1))
      done
    done
  done
  printf '#include "%s/params.h"\nnamespace jax_fa3 {\n%s\nconst %sKernelEntry k%sKernels[] = {\n%s};\nconst int kNum%sKernels = %d;\n}\n' \
    "$fam" "$decls" "$Fam" "$Fam" "$rows" "$Fam" "$n" > "$B/${fam}_table.cc"
  sources+=" $B/${fam}_table.cc"
  case $fam in fwd) sources+=" cc/ffi/fwd_handler.cc";; bwd) sources+=" cc/ffi/bwd_handler.cc";;
               fp8) sources+=" cc/ffi/fp8_handler.cc cc/fp8/quantize.cu";; esac
done
echo $sources | tr ' ' '\n' | xargs -P "${JOBS:-$(nproc)}" -I{} sh -c \
  'nvcc '"$(echo $FLAGS)"' -x cu -c {} -o '"$B"'/$(basename {}).o'
objs=$(for s in $sources; do echo "$B/$(basename $s).o"; done)
for fam in $families; do
  nvcc $FLAGS -o "$B/jax_fa3_${fam}_check" cc/tools/${fam}_check.cc $objs
  echo "built $B/jax_fa3_${fam}_check"
done

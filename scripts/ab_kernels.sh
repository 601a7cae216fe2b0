#!/usr/bin/env bash
# Kernel-only A/B of this tree against other source trees on a GPU machine:
# builds each tree's XLA-free check driver with CMake (in parallel), checks
# each against the float64 host reference, then times the shapes interleaved
# (tree 0, tree 1, ..., tree 0, ...) so that clock drift affects all alike.
# Another tree needs only cc/ and CMakeLists.txt, e.g.
#   mkdir -p /tmp/base && git archive main cc CMakeLists.txt | tar -x -C /tmp/base
#   DRIVER=fp8 HD="128 256" bash scripts/ab_kernels.sh /tmp/base -- 2,8192,8,256,0 2,8192,16,128,0
# DRIVER: fwd (default), bwd or fp8; HD: head dims to build (128); DT: dtypes
# (bf16); REPS: timing rounds (2); ITERS: back-to-back calls per timing (the
# drivers' default, 20, is a burst at the boost clock; 300-1000 measure the
# sustained, power-capped state that JAX-level runs see); CMAKE_ARGS: extra
# configure arguments for every tree; TIME_ARGS: extra timing flags for every shape (the
# backward driver's "--kv-heads 8" for GQA); CHECK=0 skips the host-reference checks (a
# repeated run on trees already checked); PREBUILT=1 takes each tree's build-ab/ drivers as
# they are (built elsewhere with the same nvcc; the drivers find libjax_fa3_kernels.so next to
# them). Logs go to $OUT/ab (default /tmp/jax_fa3_out/ab).
set -uo pipefail
cd "$(dirname "$0")/.."
DRIVER=${DRIVER:-fwd}; HD=${HD:-128}; DT=${DT:-bf16}; REPS=${REPS:-2}
OUT=${OUT:-/tmp/jax_fa3_out}; L=$OUT/ab; mkdir -p "$L"
trees=(.); while [ $# -gt 0 ] && [ "$1" != "--" ]; do trees+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || { echo "usage: $0 [tree ...] -- B,T,N,D,CAUSAL ..."; exit 2; }
case $DRIVER in fwd|bwd|fp8) ;; *) echo "DRIVER must be fwd, bwd or fp8"; exit 2;; esac
cut=${CUTLASS_INCLUDE_DIR:-}
if [ -z "$cut" ] && [ -d .carry/cutlass/include ]; then cut=$PWD/.carry/cutlass/include; fi
jobs=$(( $(nproc) / ${#trees[@]} )); [ $jobs -ge 1 ] || jobs=1
for i in "${!trees[@]}"; do
  [ "${PREBUILT:-0}" = 1 ] && continue
  ( cd "${trees[$i]}" \
    && cmake -S . -B build-ab -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
         -DJAX_FA3_BUILD_TOOLS=ON -DJAX_FA3_HEAD_DIMS="${HD// /,}" -DJAX_FA3_DTYPES="${DT// /,}" \
         ${cut:+-DCUTLASS_INCLUDE_DIR="$cut"} ${CMAKE_ARGS:-} \
    && ninja -C build-ab -j"$jobs" "jax_fa3_${DRIVER}_check" ) > "$L/build_$i.log" 2>&1 &
done
wait
bins=(); rc=0
for i in "${!trees[@]}"; do
  bin="${trees[$i]}/build-ab/jax_fa3_${DRIVER}_check"
  if [ ! -x "$bin" ]; then echo "tree $i (${trees[$i]}): build failed, see $L/build_$i.log"; tail -3 "$L/build_$i.log"; rc=1; continue; fi
  if [ "${CHECK:-1}" = 1 ]; then
    timeout 300 "$bin" --hdims "${HD// /,}" > "$L/check_$i.log" 2>&1
    r=$?; echo "tree $i (${trees[$i]}): check rc=$r"; [ $r -eq 0 ] || rc=1
  fi
  bins+=("$i:$bin")
done
for rep in $(seq "$REPS"); do
  for s in "${shapes[@]}"; do
    for entry in "${bins[@]}"; do
      i=${entry%%:*}; bin=${entry#*:}
      echo "$s tree $i: $("$bin" --time "$s" ${ITERS:+--iters $ITERS} ${TIME_ARGS:-} 2>&1 | grep -E 'ms|TFLOP' | tail -1)"
    done
  done
done | tee "$L/timing.txt"
exit $rc

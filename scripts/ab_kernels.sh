#!/usr/bin/env bash
# Kernel-only A/B of the working tree against other source trees, on the GPU
# machine: builds each tree's XLA-free driver with scripts/build_fwd_check.sh
# (in parallel), checks each against the float64 host reference, then times
# the shapes interleaved (base, variant 1, ..., base, ...) so that clock drift
# affects all alike. Only the working tree travels to the device, so put a
# branch's sources into an ignored, carried folder first (here):
#   git archive wip/x cc scripts | tar -x -C .carry/x        # mkdir -p first
# and on the device (carry .carry/cutlass and .carry/x):
#   DRIVER=fp8 HD="128 256" bash scripts/ab_kernels.sh .carry/x -- 2,8192,8,256,0 2,8192,16,128,0
# DRIVER: fwd (default), bwd or fp8; HD: head dims to build; REPS: timing
# rounds (2); ITERS: back-to-back calls per timing (the drivers' default, 20,
# is a burst at the boost clock; 300-1000 measure the sustained, power-capped
# state that JAX-level runs see, RESULTS.md session 11); EXTRA_FLAGS: extra
# nvcc flags for every build. Logs go to $OUT/ab (default /tmp/jax_fa3_out/ab).
set -uo pipefail
cd "$(dirname "$0")/.."
DRIVER=${DRIVER:-fwd}; HD=${HD:-128}; REPS=${REPS:-2}
OUT=${OUT:-/tmp/jax_fa3_out}; L=$OUT/ab; mkdir -p "$L"
trees=(.); while [ $# -gt 0 ] && [ "$1" != "--" ]; do trees+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || { echo "usage: $0 [tree ...] -- B,T,N,D,CAUSAL ..."; exit 2; }
case $DRIVER in
  fwd) flags="FWD=1";; bwd) flags="FWD=1 BWD=1";; fp8) flags="FWD=0 FP8=1";;
  *) echo "DRIVER must be fwd, bwd or fp8"; exit 2;;
esac
cut=${CUTLASS_INCLUDE_DIR:-$PWD/.carry/cutlass/include}
jobs=$(( $(nproc) / ${#trees[@]} )); [ $jobs -ge 1 ] || jobs=1
for i in "${!trees[@]}"; do
  ( cd "${trees[$i]}" && env $flags CUTLASS_INCLUDE_DIR="$cut" B=build-ab HD="$HD" JOBS=$jobs \
      EXTRA_FLAGS="${EXTRA_FLAGS:-}" bash scripts/build_fwd_check.sh ) > "$L/build_$i.log" 2>&1 &
done
wait
bins=(); rc=0
for i in "${!trees[@]}"; do
  bin="${trees[$i]}/build-ab/jax_fa3_${DRIVER}_check"
  if [ ! -x "$bin" ]; then echo "tree $i (${trees[$i]}): build failed, see $L/build_$i.log"; tail -3 "$L/build_$i.log"; rc=1; continue; fi
  timeout 300 "$bin" --hdims "$(echo $HD | tr ' ' ,)" > "$L/check_$i.log" 2>&1
  r=$?; echo "tree $i (${trees[$i]}): check rc=$r"; [ $r -eq 0 ] || rc=1
  bins+=("$i:$bin")
done
for rep in $(seq "$REPS"); do
  for s in "${shapes[@]}"; do
    for entry in "${bins[@]}"; do
      i=${entry%%:*}; bin=${entry#*:}
      echo "$s tree $i: $("$bin" --time "$s" ${ITERS:+--iters $ITERS} 2>&1 | grep -E 'ms|TFLOP' | tail -1)"
    done
  done
done | tee "$L/timing.txt"
exit $rc

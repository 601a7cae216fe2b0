#!/usr/bin/env bash
# Everything one GPU call does, in order; each stage logs under $OUT.
#   bash scripts/device_run.sh smoke tests sanitize bench
# Expects jax_fa3/*.so staged by scripts/stage_gpu.sh (carried: they are git-ignored).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_fa3_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
rc=0
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"; } 2>&1 | tee "$OUT/env.txt"
for stage in "$@"; do
  echo "=== $stage ==="
  case "$stage" in
    demo) python3 -m jax_fa3.demo 2>&1 | tee "$OUT/demo.log" ;;
    smoke) python3 scripts/smoke.py 2>&1 | tee "$OUT/smoke.log" ;;
    tests) python3 -m pytest -q -x -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    alltests) python3 -m pytest -q tests -p no:cacheprovider 2>&1 | tee "$OUT/alltests.log" | tail -40 ;;
    sanitize)
      for tool in memcheck racecheck; do
        XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool $tool --kernel-name kns=fwd_kernel \
          python3 scripts/smoke.py --quick --hdims 64,128,256 --dtypes bfloat16 2>&1 | tee "$OUT/sanitize_$tool.log" | tail -6
      done ;;
    ablation) python3 benchmarks/ablation.py --out "$OUT/ablation" 2>&1 | tee "$OUT/ablation.log" | tail -20 ;;
    bench) python3 benchmarks/bench.py ${BENCH_ARGS:---quick} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -60 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
exit $rc

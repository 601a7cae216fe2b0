#!/usr/bin/env bash
# Everything one GPU call does, in order; each stage logs under $OUT.
#   bash scripts/device_run.sh smoke tests sanitize bench
# Expects jax_fa3/*.so staged by scripts/stage_gpu.sh (carried: they are git-ignored).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_fa3_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Multi-GPU machines: NVLink multicast stays off in every program (device KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rc=0
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; nvidia-smi topo -m; nproc;
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"; } 2>&1 | tee "$OUT/env.txt"
for stage in "$@"; do
  echo "=== $stage ==="
  case "$stage" in
    build)  # on the device (16 cores): kernels + binding for its python3, into jax_fa3/
      { cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
          -DCUTLASS_INCLUDE_DIR="$PWD/.carry/cutlass/include" ${BUILD_CMAKE_ARGS:-} \
        && ninja -C build-dev -j"$(nproc)" \
        && cp build-dev/libjax_fa3_kernels.so build-dev/_jax_fa3*.so jax_fa3/; } > "$OUT/build.log" 2>&1
      tail -5 "$OUT/build.log"; grep -iE "error|spill" "$OUT/build.log" | head -20 ;;
    pack)  # the built .so files and drivers come back (.tgz is not re-packed): carry them next time
      tar czf "$OUT/build_so.tgz" jax_fa3/*.so build-dev/jax_fa3_*_check && ls -la "$OUT/build_so.tgz" ;;
    demo) python3 -m jax_fa3.demo --plot "$OUT/demo_loss.png" ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo.log" ;;  # DEMO_ARGS="--attention fa3,cudnn"
    smoke) python3 scripts/smoke.py 2>&1 | tee "$OUT/smoke.log" ;;
    tests) python3 -m pytest -q -m gpu tests ${TEST_ARGS:-} -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    gputests)  # each GPU test file on its own, time-boxed (a hung kernel costs one file, not the run)
      for f in ${GPU_TEST_FILES:-test_gpu_forward test_gpu_backward test_gpu_fp8 test_sharding}; do
        timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -m gpu "tests/$f.py" -p no:cacheprovider --maxfail=15 \
          ${TEST_ARGS:-} > "$OUT/t_$f.log" 2>&1
        echo "$f rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/t_$f.log" | head -${TEST_LINES:-12}
      done ;;
    alltests) python3 -m pytest -q tests -p no:cacheprovider 2>&1 | tee "$OUT/alltests.log" | tail -40 ;;
    build_fwd)  # forward kernels + fwd_check only (scripts/build_fwd_check.sh), no CMake
      B=build-fwdcheck bash scripts/build_fwd_check.sh > "$OUT/build_fwd.log" 2>&1; tail -3 "$OUT/build_fwd.log"
      export CHECK_BIN=build-fwdcheck/jax_fa3_fwd_check ;;
    check)  # kernels vs a float64 host reference, without XLA (cc/tools/fwd_check.cc)
      { ${CHECK_BIN:-build-dev/jax_fa3_fwd_check} --hdims 64,96,128,192,256 && ${CHECK_BIN:-build-dev/jax_fa3_fwd_check} --dtype fp16 --hdims 64,128,256 \
        && ${CHECK_BIN:-build-dev/jax_fa3_fwd_check} --hdims 64 --variant m192 && ${CHECK_BIN:-build-dev/jax_fa3_fwd_check} --dtype fp16 --hdims 64 --variant m192; } \
        2>&1 | tee "$OUT/check.log" | grep -E "FAIL|PASSED|FAILED" ;;
    sanitize)  # XLA-free driver: sanitizer runs take seconds, not an XLA compile per shape
      for tool in memcheck racecheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 9 ${CHECK_BIN:-build-dev/jax_fa3_fwd_check} --hdims 64,128,256 \
          > "$OUT/sanitize_$tool.log" 2>&1
        echo "$tool rc=$?"; tail -3 "$OUT/sanitize_$tool.log"
      done ;;
    timing)  # kernel-only timings (CUDA events), bf16, 16k tokens, hidden 2048; causal A/B knobs
      for d in ${TIMING_HDIMS:-128}; do for t in 512 1024 2048 4096 8192 16384; do
        ${CHECK_BIN:-build-dev/jax_fa3_fwd_check} --time $((16384 / t)),$t,$((2048 / d)),$d,0 ${TIMING_ARGS:-}  # e.g. "--variant m192"
        for knob in ${TIMING_KNOBS:-JAX_FA3_CAUSAL_ORDER=pairs JAX_FA3_CAUSAL_ORDER=mmajor JAX_FA3_CAUSAL_PINGPONG=0}; do
          echo -n "$knob "; env $knob ${CHECK_BIN:-build-dev/jax_fa3_fwd_check} --time $((16384 / t)),$t,$((2048 / d)),$d,1 ${TIMING_ARGS:-}
        done
      done; done 2>&1 | tee "$OUT/timing.log" ;;
    profile)  # ncu on PROFILE_SHAPES (B,T,N,D,CAUSAL ...), one launch each
      # (read prof_*_sass.csv with scripts/ncu_regions.py: warp stalls per code region);
      # the backward: PROFILE_KERNEL=bwd_kernel CHECK_BIN=build-dev/jax_fa3_bwd_check
      for shape in ${PROFILE_SHAPES:-8,2048,16,128,1 8,2048,16,128,0}; do
        tag=$(echo "$shape" | tr , _)
        ncu --clock-control none --set full -k regex:${PROFILE_KERNEL:-fwd_kernel} --launch-skip 3 --launch-count 1 \
          -o "$OUT/prof_$tag" -f ${CHECK_BIN:-build-dev/jax_fa3_fwd_check} --time "$shape" --iters 1 > "$OUT/prof_$tag.log" 2>&1
        ncu --import "$OUT/prof_$tag.ncu-rep" --page details > "$OUT/prof_$tag.txt" 2>&1
        ncu --import "$OUT/prof_$tag.ncu-rep" --page raw --csv > "$OUT/prof_${tag}_raw.csv" 2>&1
        ncu --import "$OUT/prof_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/prof_${tag}_sass.csv" 2>&1
        rm -f "$OUT/prof_$tag.ncu-rep"
        grep -E "Duration|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible" "$OUT/prof_$tag.txt" | head -12
      done ;;
    bwdcheck)  # backward vs a float64 host reference, without XLA (cc/tools/bwd_check.cc); fp16 runs even if bf16 fails
      ( r=0
        timeout 300 ${BWD_CHECK_BIN:-build-dev/jax_fa3_bwd_check} --hdims 64,96,128,192,256 || r=1
        timeout 200 ${BWD_CHECK_BIN:-build-dev/jax_fa3_bwd_check} --dtype fp16 --hdims 64,128,256 || r=1
        exit $r ) 2>&1 | tee "$OUT/bwd_check.log" | grep -E "^FAIL|skipped|^PASSED|^FAILED|HANG|ERROR" ;;
    bwdsanitize)  # the backward driver under each tool, time-boxed (deterministic dQ spins on semaphores:
      # a hang costs one tool, and the driver's watchdog names the case); BWD_SANITIZE_TOOLS="racecheck" runs one
      bad=0
      for tool in ${BWD_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
        timeout ${SANITIZE_TIMEOUT:-180} compute-sanitizer --tool $tool --error-exitcode 9 \
          ${BWD_CHECK_BIN:-build-dev/jax_fa3_bwd_check} --hdims ${BWD_SANITIZE_HDIMS:-64,128,256} --watchdog 150 \
          > "$OUT/bwd_sanitize_$tool.log" 2>&1
        r=$?; echo "$tool rc=$r"; [ $r -eq 0 ] || bad=1
        grep -E "^FAIL|HANG" "$OUT/bwd_sanitize_$tool.log" | head -5; tail -3 "$OUT/bwd_sanitize_$tool.log"
      done; (exit $bad) ;;
    bwdtiming)  # backward kernels alone (CUDA events; one forward call supplies out/lse), 16k tokens, hidden 2048
      for d in ${BWD_TIMING_HDIMS:-64 128 256}; do for t in 1024 2048 4096 8192 16384; do for c in 0 1; do
        timeout 60 ${BWD_CHECK_BIN:-build-dev/jax_fa3_bwd_check} --dtype ${BWD_TIMING_DTYPE:-bf16} \
          --time $((16384 / t)),$t,$((2048 / d)),$d,$c ${BWD_TIMING_ARGS:-}  # e.g. "--deterministic 1"
      done; done; done 2>&1 | tee "$OUT/bwd_timing.log" ;;
    ablation) python3 benchmarks/ablation.py --out "$OUT/ablation" 2>&1 | tee "$OUT/ablation.log" | tail -20 ;;
    bench)  # JAX's default allocator: PREALLOCATE=false costs the fa3 backward 35-45 us per call
      # (RESULTS.md, session 11; session 7 measured 1.6 ms with older jax)
      env -u XLA_PYTHON_CLIENT_PREALLOCATE python3 benchmarks/bench.py ${BENCH_ARGS:---quick} --out "$OUT" 2>&1 \
        | tee "$OUT/bench.log" | tail -60 ;;
    steady)  # the sweep in the power-capped steady state: 1 s timed runs, clocks and power per row
      # (RESULTS.md, session 11: 100 ms runs and 1 s runs disagree by up to 5% on the backward)
      env -u XLA_PYTHON_CLIENT_PREALLOCATE python3 benchmarks/bench.py --modes fwd,bwd --seqlens 1024,2048,4096,8192,16384 \
        --repeats 2 --min-run-ms 1000 --max-iters 5000 --clocks --markdown ${STEADY_ARGS:-} --out "$OUT/steady" 2>&1 \
        | tee "$OUT/steady.log" | grep -E "^\| (fa3|cudnn)" | head -130 ;;
    fp8check)  # FP8 pre-pass + kernel vs host float64, without XLA (cc/tools/fp8_check.cc); then timings.
      # Every launch is bracketed by flushed "[fp8_check]" lines and a 10 s host watchdog (exit 3, "HANG in ...").
      { timeout 60 build-dev/jax_fa3_fp8_check --stage prepass --watchdog 10; echo "prepass rc=$?"
        for d in 64 128 256; do timeout 40 build-dev/jax_fa3_fp8_check --hdims $d --case 0 --watchdog 10; echo "d$d case0 rc=$?"; done
        timeout 90 build-dev/jax_fa3_fp8_check --watchdog 10; echo "all rc=$?"
        for d in 128 256; do for c in 0 1; do
          timeout 30 build-dev/jax_fa3_fp8_check --watchdog 10 --time $((16384 / 8192)),8192,$((2048 / d)),$d,$c; done; done; } 2>&1 \
        | tee "$OUT/fp8_check.log" | grep -vE "^\[fp8_check\] (launch|  done)" | tail -40 ;;
    fp8sanitize)  # the standalone binary: no JAX_FA3_FP8_KERNEL gate; time-boxed in case the kernel still hangs
      for tool in memcheck racecheck synccheck; do
        timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 build-dev/jax_fa3_fp8_check --hdims 64,128,256 --watchdog 60 \
          > "$OUT/fp8_sanitize_$tool.log" 2>&1
        echo "$tool rc=$?"; tail -3 "$OUT/fp8_sanitize_$tool.log"
      done ;;
    # The Python FP8 stages run the FP8 kernel (on by default; JAX_FA3_FP8_KERNEL=0 would switch it off), time-boxed.
    fp8acc) timeout 240 python3 benchmarks/fp8_accuracy.py --json "$OUT/fp8_accuracy.json" 2>&1 | tee "$OUT/fp8_accuracy.log" | tail -20 ;;  # issue 5 table
    fp8bench) timeout 240 python3 benchmarks/fp8_bench.py ${FP8_BENCH_ARGS:-} 2>&1 | tee "$OUT/fp8_bench.log" | tail -70 ;;  # issue 5 speed
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
# Few files come back from the device: pack everything but the tarball itself.
(cd "$OUT" && files=$(ls | grep -v '\.tgz$') && [ -n "$files" ] && tar czf "logs_$(date +%H%M%S).tgz" $files && rm -rf $files)
exit $rc

#!/usr/bin/env bash
# The developer loop on a GPU machine, as named stages run in order; each
# stage logs under $OUT (default /tmp/jax_fa3_out):
#   bash scripts/device_run.sh build check bwdcheck fp8check gputests bench
# `build` configures build-dev/ with the check drivers on and copies the
# built .so files into jax_fa3/, so `PYTHONPATH=.` imports them. A narrow
# kernel loop builds one head dim and one driver:
#   BUILD_CMAKE_ARGS="-DJAX_FA3_HEAD_DIMS=128 -DJAX_FA3_DTYPES=bf16" BUILD_TARGETS=jax_fa3_fwd_check \
#     bash scripts/device_run.sh build check sanitize
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_fa3_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# NVLink multicast stays off in every program: on a shared multi-GPU host a
# program that uses it can take the GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FWD_CHECK=${FWD_CHECK:-build-dev/jax_fa3_fwd_check}
BWD_CHECK=${BWD_CHECK:-build-dev/jax_fa3_bwd_check}
FP8_CHECK=${FP8_CHECK:-build-dev/jax_fa3_fp8_check}
rc=0
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv; nvidia-smi topo -m; nproc;
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"; } 2>&1 | tee "$OUT/env.txt"
for stage in "$@"; do
  echo "=== $stage ==="
  case "$stage" in
    carried)  # what a call carries in .carry/ and .whl/: CUTLASS headers, a built tree, peer wheels
      if [ -f .carry/cutlass.tgz ]; then mkdir -p .carry/cutlass && tar xzf .carry/cutlass.tgz -C .carry/cutlass; fi
      if [ -f .carry/build_so.tgz ]; then tar xzf .carry/build_so.tgz; fi
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
          && export PYTHONPATH=$PYTHONPATH:/tmp/site
        # tokamax imports xprof only for its own profiler: an empty module will do.
        python3 -c "import xprof" 2>/dev/null || { mkdir -p /tmp/site/xprof && : > /tmp/site/xprof/__init__.py; }
      fi; ls .carry .whl 2>/dev/null ;;
    build)  # kernels, binding and check drivers for this machine's python3; BUILD_TARGETS narrows it.
      # CUTLASS headers: $CUTLASS_INCLUDE_DIR, else .carry/cutlass/include if present (a machine
      # without the nvidia-cutlass package), else CMake asks the package.
      cut=${CUTLASS_INCLUDE_DIR:-}
      if [ -z "$cut" ] && [ -d .carry/cutlass/include ]; then cut=$PWD/.carry/cutlass/include; fi
      { cmake -S . -B build-dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
          -DJAX_FA3_BUILD_TOOLS=ON ${cut:+-DCUTLASS_INCLUDE_DIR="$cut"} ${BUILD_CMAKE_ARGS:-} \
        && ninja -C build-dev -j"$(nproc)" ${BUILD_TARGETS:-} \
        && for f in build-dev/libjax_fa3_kernels.so build-dev/_jax_fa3*.so; do
             if [ -e "$f" ]; then cp "$f" jax_fa3/; fi
           done; } > "$OUT/build.log" 2>&1
      b=$?; tail -5 "$OUT/build.log"; grep -iE "error|spill" "$OUT/build.log" | head -20; (exit $b) ;;
    pack)  # the built .so files and drivers in one tarball, to reuse them elsewhere
      # (the drivers load build-dev/libjax_fa3_kernels.so: it travels too)
      tar czf "$OUT/build_so.tgz" jax_fa3/*.so build-dev/jax_fa3_*_check build-dev/libjax_fa3_kernels.so \
        && ls -la "$OUT/build_so.tgz" ;;
    demo) python3 -m jax_fa3.demo --plot "$OUT/demo_loss.png" ${DEMO_ARGS:-} 2>&1 | tee "$OUT/demo.log" ;;  # DEMO_ARGS="--attention fa3,cudnn"
    tests) python3 -m pytest -q -m gpu tests ${TEST_ARGS:-} -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    gputests)  # each GPU test file on its own, time-boxed (a hung kernel costs one file, not the run)
      for f in ${GPU_TEST_FILES:-test_gpu_forward test_gpu_backward test_gpu_fp8 test_sharding}; do
        timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -m gpu "tests/$f.py" -p no:cacheprovider --maxfail=15 \
          ${TEST_ARGS:-} > "$OUT/t_$f.log" 2>&1
        echo "$f rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/t_$f.log" | head -${TEST_LINES:-12}
      done ;;
    alltests)  # the README's test command, on pytest-xdist's workers where it is installed
      # (TEST_WORKERS, default nproc). About 1240 tests take 12 minutes or more on 16 workers, longer
      # than one 10-minute device call: SUITE_PART="0/4" .. "3/4" run four fixed parts that together
      # are the whole suite (tests/conftest.py --part); a third of it has taken 6 to over 9.5 minutes
      # (every part pays its own jit compiles).
      workers=""; python3 -c "import xdist" 2>/dev/null && workers="-n ${TEST_WORKERS:-$(nproc)}"
      python3 -m pytest -q tests -p no:cacheprovider $workers ${SUITE_PART:+--part "$SUITE_PART"} 2>&1 \
        | tee "$OUT/alltests${SUITE_PART:+_${SUITE_PART//\//_of_}}.log" | tail -40 ;;
    check)  # forward kernels vs a float64 host reference, without XLA (cc/tools/fwd_check.cc)
      { $FWD_CHECK --hdims 64,96,128,192,256 && $FWD_CHECK --dtype fp16 --hdims 64,128,256 \
        && $FWD_CHECK --hdims 64 --variant m192 && $FWD_CHECK --dtype fp16 --hdims 64 --variant m192 \
        && $FWD_CHECK --hdims 192 --dv 128 && $FWD_CHECK --hdims 128 --dv 64 \
        && $FWD_CHECK --dtype fp16 --hdims 192 --dv 128 && $FWD_CHECK --dtype fp16 --hdims 128 --dv 64; } \
        2>&1 | tee "$OUT/check.log" | grep -E "FAIL|PASSED|FAILED|skipped" ;;
    sanitize)  # the forward driver under each compute-sanitizer tool: seconds, not an XLA compile per shape
      # (SANITIZE_ARGS="--only kv": the KV-cache cases alone)
      for tool in memcheck racecheck synccheck; do
        timeout ${SANITIZE_TIMEOUT:-300} compute-sanitizer --tool $tool --error-exitcode 9 $FWD_CHECK --hdims 64,128,256 \
          ${SANITIZE_ARGS:-} > "$OUT/sanitize_$tool.log" 2>&1
        echo "$tool rc=$?"; grep -E "^FAIL" "$OUT/sanitize_$tool.log" | head -5; tail -3 "$OUT/sanitize_$tool.log"
      done ;;
    timing)  # forward kernels alone (CUDA events), bf16, 16k tokens, hidden 2048, unmasked and causal
      for d in ${TIMING_HDIMS:-128}; do for t in 512 1024 2048 4096 8192 16384; do for c in 0 1; do
        $FWD_CHECK --time $((16384 / t)),$t,$((2048 / d)),$d,$c ${TIMING_ARGS:-}  # e.g. "--variant m192"
      done; done; done 2>&1 | tee "$OUT/timing.log" ;;
    profile)  # ncu on PROFILE_SHAPES (B,T,N,D,CAUSAL ...), one launch each
      # (read prof_*_sass.csv with scripts/ncu_regions.py: warp stalls per code region);
      # the backward: PROFILE_KERNEL=bwd_kernel PROFILE_BIN=build-dev/jax_fa3_bwd_check;
      # PROFILE_ARGS="--dv 128": a value-head-dim kernel
      for shape in ${PROFILE_SHAPES:-8,2048,16,128,1 8,2048,16,128,0}; do
        tag=$(echo "$shape" | tr , _)
        ncu --clock-control none --set full -k regex:${PROFILE_KERNEL:-fwd_kernel} --launch-skip 3 --launch-count 1 \
          -o "$OUT/prof_$tag" -f ${PROFILE_BIN:-$FWD_CHECK} --time "$shape" --iters 1 ${PROFILE_ARGS:-} \
          > "$OUT/prof_$tag.log" 2>&1
        ncu --import "$OUT/prof_$tag.ncu-rep" --page details > "$OUT/prof_$tag.txt" 2>&1
        ncu --import "$OUT/prof_$tag.ncu-rep" --page raw --csv > "$OUT/prof_${tag}_raw.csv" 2>&1
        ncu --import "$OUT/prof_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/prof_${tag}_sass.csv" 2>&1
        rm -f "$OUT/prof_$tag.ncu-rep"
        grep -E "Duration|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible" "$OUT/prof_$tag.txt" | head -12
      done ;;
    bwdcheck)  # backward vs a float64 host reference, without XLA (cc/tools/bwd_check.cc); fp16 runs even if bf16 fails
      ( r=0
        timeout 300 $BWD_CHECK --hdims 64,96,128,192,256 || r=1
        timeout 200 $BWD_CHECK --dtype fp16 --hdims 64,128,256 || r=1
        for dt in bf16 fp16; do  # the value-head-dim kernels (192/128, 128/64)
          timeout 120 $BWD_CHECK --dtype $dt --hdims 192 --dv 128 || r=1
          timeout 120 $BWD_CHECK --dtype $dt --hdims 128 --dv 64 || r=1
        done
        exit $r ) 2>&1 | tee "$OUT/bwd_check.log" | grep -E "^FAIL|skipped|^PASSED|^FAILED|HANG|ERROR" ;;
    bwdsanitize)  # the backward driver under each tool, time-boxed (deterministic dQ spins on semaphores:
      # a hang costs one tool, and the driver's watchdog names the case); BWD_SANITIZE_TOOLS="racecheck" runs one,
      # BWD_SANITIZE_HDIMS=192 BWD_SANITIZE_ARGS="--dv 128" a value-head-dim kernel
      bad=0
      for tool in ${BWD_SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
        timeout ${SANITIZE_TIMEOUT:-180} compute-sanitizer --tool $tool --error-exitcode 9 \
          $BWD_CHECK --hdims ${BWD_SANITIZE_HDIMS:-64,128,256} --watchdog 150 ${BWD_SANITIZE_ARGS:-} \
          > "$OUT/bwd_sanitize_$tool.log" 2>&1
        r=$?; echo "$tool rc=$r"; [ $r -eq 0 ] || bad=1
        grep -E "^FAIL|HANG" "$OUT/bwd_sanitize_$tool.log" | head -5; tail -3 "$OUT/bwd_sanitize_$tool.log"
      done; (exit $bad) ;;
    bwdtiming)  # backward kernels alone (CUDA events; one forward call supplies out/lse), 16k tokens, hidden 2048
      for d in ${BWD_TIMING_HDIMS:-64 128 256}; do for t in 1024 2048 4096 8192 16384; do for c in 0 1; do
        timeout 60 $BWD_CHECK --dtype ${BWD_TIMING_DTYPE:-bf16} \
          --time $((16384 / t)),$t,$((2048 / d)),$d,$c ${BWD_TIMING_ARGS:-}  # e.g. "--deterministic 1"
      done; done; done 2>&1 | tee "$OUT/bwd_timing.log" ;;
    bench)  # JAX's default allocator: with PREALLOCATE=false the backward's scratch allocation is timed too
      env -u XLA_PYTHON_CLIENT_PREALLOCATE python3 benchmarks/bench.py ${BENCH_ARGS:---quick} --out "$OUT" 2>&1 \
        | tee "$OUT/bench.log" | tail -60 ;;
    steady)  # the sweep in the power-capped steady state: 1 s timed runs, clocks and power per row
      # (short runs see the boost clock; the backward differs by up to 5% between the two)
      env -u XLA_PYTHON_CLIENT_PREALLOCATE python3 benchmarks/bench.py --modes fwd,bwd --seqlens 1024,2048,4096,8192,16384 \
        --repeats 2 --min-run-ms 1000 --max-iters 5000 --clocks --markdown ${STEADY_ARGS:-} --out "$OUT/steady" 2>&1 \
        | tee "$OUT/steady.log" | grep -E "^\| (fa3|cudnn)" | head -130 ;;
    packed)  # packed documents (segment ids) vs the documents one by one and the FA3 varlen kernel
      timeout ${PACKED_TIMEOUT:-300} python3 benchmarks/packed_bench.py --out "$OUT/packed" ${PACKED_ARGS:-} 2>&1 \
        | tee "$OUT/packed.log" | tail -25 ;;
    maskbias)  # a Flax nnx layer with make_causal_mask, and an ALiBi bias with its gradient, against cuDNN
      timeout ${MASKBIAS_TIMEOUT:-400} python3 benchmarks/mask_bias_bench.py --out "$OUT/mask_bias" ${MASKBIAS_ARGS:-} 2>&1 \
        | tee "$OUT/mask_bias.log" | tail -30 ;;
    decode)  # KV-cache decode: K/V read bandwidth against a device copy, the FA3 KV-cache kernel, cuDNN
      timeout ${DECODE_TIMEOUT:-400} python3 benchmarks/decode_bench.py --out "$OUT/decode" ${DECODE_ARGS:-} 2>&1 \
        | tee "$OUT/decode.log" | tail -40 ;;
    peers)  # the sweep and the real-model shapes against cuDNN, Dao-AILab FA3 and tokamax (carried wheels)
      env -u XLA_PYTHON_CLIENT_PREALLOCATE python3 benchmarks/bench.py --shapes all --impls ${PEERS_IMPLS:-fa3,cudnn,fa3ref,tokamax} \
        --seqlens 1024,2048,4096,8192,16384 --markdown --out "$OUT/peers" ${PEERS_ARGS:-} 2>&1 \
        | tee "$OUT/peers.log" | grep -E "^\| (fa3|cudnn|fa3ref|tokamax) " | head -260 ;;
    fp8check)  # FP8 pre-pass + kernel vs host float64, without XLA (cc/tools/fp8_check.cc); then timings.
      # Every launch is bracketed by flushed "[fp8_check]" lines and a 10 s host watchdog (exit 3, "HANG in ...").
      { timeout 60 $FP8_CHECK --stage prepass --watchdog 10; echo "prepass rc=$?"
        for d in 64 128 256; do timeout 40 $FP8_CHECK --hdims $d --case 0 --watchdog 10; echo "d$d case0 rc=$?"; done
        timeout 90 $FP8_CHECK --watchdog 10; echo "all rc=$?"
        for d in 128 256; do for c in 0 1; do
          timeout 30 $FP8_CHECK --watchdog 10 --time $((16384 / 8192)),8192,$((2048 / d)),$d,$c; done; done; } 2>&1 \
        | tee "$OUT/fp8_check.log" | grep -vE "^\[fp8_check\] (launch|  done)" | tail -40 ;;
    fp8sanitize)  # the FP8 driver under each tool, time-boxed
      for tool in memcheck racecheck synccheck; do
        timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $FP8_CHECK --hdims 64,128,256 --watchdog 60 \
          > "$OUT/fp8_sanitize_$tool.log" 2>&1
        echo "$tool rc=$?"; tail -3 "$OUT/fp8_sanitize_$tool.log"
      done ;;
    # FP8 accuracy and speed through JAX, time-boxed.
    fp8acc) timeout 240 python3 benchmarks/fp8_accuracy.py --json "$OUT/fp8_accuracy.json" 2>&1 | tee "$OUT/fp8_accuracy.log" | tail -20 ;;
    fp8bench) timeout 240 python3 benchmarks/fp8_bench.py ${FP8_BENCH_ARGS:-} 2>&1 | tee "$OUT/fp8_bench.log" | tail -70 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
  [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
done
# All logs in one tarball (the tarballs themselves excepted).
(cd "$OUT" && files=$(ls | grep -v '\.tgz$') && [ -n "$files" ] && tar czf "logs_$(date +%H%M%S).tgz" $files && rm -rf $files)
exit $rc

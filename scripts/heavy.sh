#!/usr/bin/env bash
# Runs one heavy compile (a CUTLASS translation unit: minutes, up to ~10 GB RAM)
# holding one of two machine-wide slots, so parallel work on a 2-core box queues
# instead of thrashing:   scripts/heavy.sh nvcc ... -c x.cu -o x.o
while true; do
  for s in 0 1; do
    exec 9>"/tmp/jax_fa3_slot$s.lock"
    if flock -n 9; then "$@"; exit $?; fi
  done
  sleep 3
done

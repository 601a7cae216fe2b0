// Inter-warpgroup ping-pong: the two consumer warpgroups take turns issuing
// their WGMMAs, so that while one warpgroup's GEMMs occupy the tensor cores the
// other runs its softmax (FA3 paper, Sec. 3.1). Two named barriers hand the
// turn back and forth; every GEMM "round" is bracketed by wait_turn/pass_turn,
// and both warpgroups run the same number of rounds per tile.
#pragma once

#include <cutlass/arch/barrier.h>

namespace jax_fa3 {

template <bool kEnabled, int kNumMmaThreads>
struct WarpGroupPingPong {
  // User ids (NamedBarrier adds CUTLASS's reserved offset); 0 is the epilogue's.
  static constexpr uint32_t kBarrierBase = 1;
  int wg;       // consumer warpgroup index, 0 or 1
  bool active;  // run-time switch: off for causal/windowed problems, where the
                // forced alternation was measured slower (d128 8k causal: 556
                // TFLOP/s without, 519 with; non-causal: 642 without, 658 with)

  // Called once per CTA: warpgroup 1 hands the first turn to warpgroup 0.
  CUTE_DEVICE void init() const {
    if constexpr (kEnabled) {
      if (active && wg == 1) { cutlass::arch::NamedBarrier::arrive(kNumMmaThreads, kBarrierBase + 0); }
    }
  }
  CUTE_DEVICE void wait_turn() const {
    if constexpr (kEnabled) {
      if (active) { cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBarrierBase + wg); }
    }
  }
  CUTE_DEVICE void pass_turn() const {
    if constexpr (kEnabled) {
      if (active) { cutlass::arch::NamedBarrier::arrive(kNumMmaThreads, kBarrierBase + (1 - wg)); }
    }
  }
};

}  // namespace jax_fa3

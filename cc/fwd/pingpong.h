// Inter-warpgroup ping-pong: the consumer warpgroups take turns issuing their
// WGMMAs, so that while one warpgroup's GEMMs occupy the tensor cores the
// others run their softmax (FA3 paper, Sec. 3.1). One named barrier per
// warpgroup passes the turn around the ring 0 -> 1 -> ... -> 0; every GEMM
// "round" is bracketed by wait_turn/pass_turn, and all warpgroups run the same
// number of rounds per tile (they share the tile's K/V blocks).
#pragma once

#include <cutlass/arch/barrier.h>
#include "../common/barriers.h"

namespace jax_fa3 {

template <bool kEnabled, int kNumMmaThreads>
struct WarpGroupPingPong {
  static constexpr int kNumWG = kNumMmaThreads / cutlass::NumThreadsPerWarpGroup;
  // Each barrier joins the passing and the waiting warpgroup.
  static constexpr int kBarrierThreads = 2 * cutlass::NumThreadsPerWarpGroup;
  static_assert(kBarrierPingPong + kNumWG <= kBarrierStoreO, "one turn barrier per consumer warpgroup");
  int wg;  // consumer warpgroup index, 0 .. kNumWG - 1

  // Called once per CTA: the last warpgroup hands the first turn to warpgroup 0.
  CUTE_DEVICE void init() const {
    if constexpr (kEnabled) {
      if (wg == kNumWG - 1) { cutlass::arch::NamedBarrier::arrive(kBarrierThreads, kBarrierPingPong + 0); }
    }
  }
  CUTE_DEVICE void wait_turn() const {
    if constexpr (kEnabled) { cutlass::arch::NamedBarrier::sync(kBarrierThreads, kBarrierPingPong + wg); }
  }
  CUTE_DEVICE void pass_turn() const {
    if constexpr (kEnabled) {
      cutlass::arch::NamedBarrier::arrive(kBarrierThreads, kBarrierPingPong + (wg + 1) % kNumWG);
    }
  }
};

}  // namespace jax_fa3

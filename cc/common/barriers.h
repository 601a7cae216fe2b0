// Named-barrier ids of every kernel (cutlass::arch::NamedBarrier's user ids,
// 0..7 after CUTLASS's reserved ones; NamedBarrier adds that offset). A
// barrier "per consumer warpgroup" takes the base id + the warpgroup index.
// The forward and backward are separate kernels: their ids may coincide.
#pragma once

#include <cstdint>

namespace jax_fa3 {

enum BarrierId : uint32_t {
  // Forward (16-bit and FP8), up to three consumer warpgroups.
  kBarrierPingPong = 1,  // + wg, 1..3: the turn to issue GEMMs (fwd/pingpong.h)
  kBarrierStoreO = 4,    // + wg, 4..6: a warpgroup's O staging (fwd/epilogue.h)
  // Backward, both consumer warpgroups (bwd/mainloop.h, bwd/epilogue.h).
  kBarrierdSFree = 0,    // the previous block's dQ GEMMs have read dS (and P)
  kBarrierdSReady = 1,   // every row of dS (and P) is staged
  kBarrierdQFree = 3,    // the dQ staging buffer is free (d64)
  kBarrierdQReady = 4,   // the dQ block is staged for its bulk reduce
  kBarrierBwdEpilogue = 5,  // dK / dV staging, split-tile combine
};
constexpr uint32_t kNumUserBarriers = 8;

}  // namespace jax_fa3

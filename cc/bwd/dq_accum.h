// Layout of one query block (kBlockM x d, fp32) of the dQ accumulator.
//
// The block is stored in the order the dQ GEMM's accumulator fragments sit in
// the consumer threads' registers, not row-major: element i of thread t (of
// kNumMmaThreads) in column chunk c lives at
//     c * kBlockM * kDqCols + (i / 4) * (4 * kNumMmaThreads) + 4 * t + i % 4.
// Why: staging a row-major block from WGMMA fragments puts the 8 row-groups of
// a warp on the same banks (8-way conflicts on every store, about as long as the
// block's GEMMs); in this order each warp stores 512 contiguous bytes per float4,
// conflict-free. The block stays one contiguous range, so a single bulk
// reduce-add (or coalesced atomics) still moves it; the postprocess undoes the
// permutation with the same fragment coordinates.
#pragma once

#include <cute/tensor.hpp>
#include "traits.h"

namespace jax_fa3 {

template <class Traits>
struct DqAccumLayout {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kThreads = Traits::kNumMmaThreads;
  static constexpr int kDqCols = Traits::kHeadDim / Traits::kDqChunks;
  using TileQc = Shape<Int<kBlockM>, Int<kDqCols>>;
  // fp32 values one thread owns per chunk.
  static constexpr int kFrag = kBlockM * kDqCols / kThreads;
  static_assert(kFrag % 4 == 0, "float4 groups");

  CUTE_HOST_DEVICE static constexpr int offset(int chunk, int tid, int i) {
    return chunk * kBlockM * kDqCols + (i / 4) * (4 * kThreads) + 4 * tid + i % 4;
  }

  // Tile-local (row, column-in-chunk) of fragment element i of thread tid.
  CUTE_DEVICE static auto coords(int tid) {
    typename Traits::TiledMmaQ mma;
    return mma.get_thread_slice(tid).partition_C(make_identity_tensor(TileQc{}));
  }
};

}  // namespace jax_fa3

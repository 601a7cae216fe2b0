// The two small kernels around the main backward kernel:
//  - preprocess (Hv / 8 lanes per query row): delta = rowsum(dO * O) in fp32,
//    lse in base-2 units (+inf on the padding rows so they contribute
//    nothing), dQ accumulator zeroed;
//  - postprocess: dQ = scale * dQ_accum (fragment order, see dq_accum.h),
//    converted to the input dtype, BTNH.
#pragma once

#include <cute/tensor.hpp>
#include "params.h"
#include "dq_accum.h"

namespace jax_fa3 {

constexpr int kBwdPreWarps = 8;  // warps per block of the preprocess

// Thread -> (row, 8-element column group) map of the preprocess: a row takes
// d / 8 lanes; a warp packs as many whole rows as fit (d64: 4, d128: 2), so
// every lane moves 16 bytes per array (d96 / d192 leave lanes idle).
template <class Element, int HeadDim>
struct PreprocessMap {
  static constexpr int kVec = 16 / sizeof(Element);
  static constexpr int kLanesPerRow = HeadDim / kVec;
  static_assert(HeadDim % kVec == 0 && kLanesPerRow <= 32);
  static constexpr int kRowsPerWarp = 32 % kLanesPerRow == 0 ? 32 / kLanesPerRow : 1;
  static constexpr int kRowsPerBlock = kBwdPreWarps * kRowsPerWarp;
  // Lanes summed per row: the row's lane group, or the whole warp when one
  // row leaves some lanes idle (they contribute 0).
  static constexpr int kReduceLanes = kRowsPerWarp > 1 ? kLanesPerRow : 32;
};

// O and dO rows are HeadDimV wide, the dQ accumulator's HeadDim.
template <class Element, int HeadDim, int HeadDimV = HeadDim>
__global__ void __launch_bounds__(kBwdPreWarps * 32)
bwd_preprocess(const BwdParams p) {
  using Map = PreprocessMap<Element, HeadDimV>;
  constexpr int kVec = Map::kVec;
  const int lane = threadIdx.x % 32;
  const int sub = lane / Map::kLanesPerRow;  // row within the warp
  const int col = (lane % Map::kLanesPerRow) * kVec;
  const int row = (blockIdx.x * kBwdPreWarps + threadIdx.x / 32) * Map::kRowsPerWarp + sub;
  const int head = blockIdx.y, batch = blockIdx.z;
  // No early return: the shuffles below need the whole warp.
  const bool active = sub < Map::kRowsPerWarp && row < p.t_pad;
  const int64_t r = (int64_t(batch) * p.n + head) * p.t_pad + row;
  if (p.dkv_split != nullptr && row == 0 && head == 0 && batch == 0 && lane == 0) {
    reinterpret_cast<int*>(p.dkv_split)[kBwdTileCounter] = 0;  // the main kernel's tile counter
  }
  float acc = 0.f;
  if (active && row < p.t) {
    const int64_t off = ((int64_t(batch) * p.t + row) * p.n + head) * HeadDimV + col;
    const uint4 ov = *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.o) + off);
    const uint4 dv = *reinterpret_cast<const uint4*>(static_cast<const Element*>(p.dout) + off);
    const Element* oe = reinterpret_cast<const Element*>(&ov);
    const Element* de = reinterpret_cast<const Element*>(&dv);
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < kVec; ++e) { acc += float(oe[e]) * float(de[e]); }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int w = Map::kReduceLanes / 2; w > 0; w /= 2) { acc += __shfl_xor_sync(0xffffffff, acc, w); }
  if (!active) { return; }
  if (col == 0) {
    p.delta[r] = acc;
    p.lse_log2[r] = row < p.t ? p.lse[(int64_t(batch) * p.n + head) * p.t + row] * 1.44269504088896340736f
                              : INFINITY;
  }
  // The row's lanes zero its HeadDim accumulator columns in float4 steps.
  static_assert(HeadDim % (4 * Map::kLanesPerRow) == 0);
  constexpr int kDqVecs = HeadDim / (4 * Map::kLanesPerRow);
  float4* dq = reinterpret_cast<float4*>(p.dq_accum + r * HeadDim) + col / kVec * kDqVecs;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kDqVecs; ++i) { dq[i] = make_float4(0.f, 0.f, 0.f, 0.f); }
}

// One CTA of kNumMmaThreads per (query block, head, batch): thread t reads
// back exactly the fragment elements it would have held in the main kernel
// (float4 loads, coalesced), scales and converts them into a row-major tile in
// shared memory, and the CTA writes whole rows with 16-byte stores. (Storing
// the fragments straight to BTNH wrote 2-byte pieces, 4x the DRAM sectors.)
template <class Traits>
__global__ void __launch_bounds__(Traits::kNumMmaThreads)
bwd_postprocess(const BwdParams p) {
  using Element = typename Traits::Element;
  using Layout = DqAccumLayout<Traits>;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim, kThreads = Traits::kNumMmaThreads;
  constexpr int kVec = 16 / sizeof(Element);
  constexpr int kLd = kHeadDim + kVec;  // padded row: 16-byte aligned, rows start on different banks
  constexpr int kVecPerRow = kHeadDim / kVec;
  __shared__ alignas(16) Element tile[kBlockM * kLd];
  const int tid = threadIdx.x;
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const float* src = p.dq_accum + ((int64_t(batch) * p.n + head) * p.t_pad + m_block * kBlockM) * kHeadDim;
  const auto c = Layout::coords(tid);
  CUTLASS_PRAGMA_UNROLL
  for (int chunk = 0; chunk < Traits::kDqChunks; ++chunk) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < Layout::kFrag; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(src + Layout::offset(chunk, tid, i));
      const float vals[4] = {v.x, v.y, v.z, v.w};
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int col = chunk * Layout::kDqCols + get<1>(c(i + e));
        tile[get<0>(c(i + e)) * kLd + col] = Element(vals[e] * p.scale);
      }
    }
  }
  __syncthreads();
  Element* dst = static_cast<Element*>(p.dq) + (int64_t(batch) * p.t * p.n + head) * kHeadDim;
  CUTLASS_PRAGMA_UNROLL
  for (int v = tid; v < kBlockM * kVecPerRow; v += kThreads) {
    const int r = v / kVecPerRow, col = (v % kVecPerRow) * kVec;
    const int row = m_block * kBlockM + r;
    if (row < p.t) {
      *reinterpret_cast<uint4*>(dst + int64_t(row) * p.n * kHeadDim + col) =
          *reinterpret_cast<const uint4*>(tile + r * kLd + col);
    }
  }
}

}  // namespace jax_fa3

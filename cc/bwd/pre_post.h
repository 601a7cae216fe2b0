// The two small kernels around the main backward kernel:
//  - preprocess (one warp per query row): delta = rowsum(dO * O) in fp32,
//    lse in base-2 units (+inf on the padding rows so they contribute
//    nothing), dQ accumulator zeroed;
//  - postprocess: dQ = scale * dQ_accum (fragment order, see dq_accum.h),
//    converted to the input dtype, BTNH.
#pragma once

#include <cute/tensor.hpp>
#include "params.h"
#include "dq_accum.h"

namespace jax_fa3 {

constexpr int kBwdRowsPerBlock = 8;  // warps per block of the preprocess

template <class Element>
__global__ void __launch_bounds__(kBwdRowsPerBlock * 32)
bwd_preprocess(const BwdParams p) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kBwdRowsPerBlock + threadIdx.x / 32;
  const int head = blockIdx.y, batch = blockIdx.z;
  if (row >= p.t_pad) { return; }
  const int64_t r = (int64_t(batch) * p.n + head) * p.t_pad + row;
  float acc = 0.f;
  if (row < p.t) {
    const int64_t off = ((int64_t(batch) * p.t + row) * p.n + head) * p.d;
    const Element* o = static_cast<const Element*>(p.o) + off;
    const Element* dout = static_cast<const Element*>(p.dout) + off;
    for (int c = lane; c < p.d; c += 32) { acc += float(o[c]) * float(dout[c]); }
  }
  for (int w = 16; w > 0; w /= 2) { acc += __shfl_xor_sync(0xffffffff, acc, w); }
  if (lane == 0) {
    p.delta[r] = acc;
    p.lse_log2[r] = row < p.t ? p.lse[(int64_t(batch) * p.n + head) * p.t + row] * 1.44269504088896340736f
                              : INFINITY;
  }
  float* dq = p.dq_accum + r * p.d;
  for (int c = lane; c < p.d; c += 32) { dq[c] = 0.f; }
}

// One CTA of kNumMmaThreads per (query block, head, batch): thread t reads
// back exactly the fragment elements it would have held in the main kernel
// (float4 loads, coalesced) and writes them to their (row, column).
template <class Traits>
__global__ void __launch_bounds__(Traits::kNumMmaThreads)
bwd_postprocess(const BwdParams p) {
  using Element = typename Traits::Element;
  using Layout = DqAccumLayout<Traits>;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  const int tid = threadIdx.x;
  const int m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const float* src = p.dq_accum + ((int64_t(batch) * p.n + head) * p.t_pad + m_block * kBlockM) * kHeadDim;
  Element* dst = static_cast<Element*>(p.dq) + (int64_t(batch) * p.t * p.n + head) * kHeadDim;
  const auto c = Layout::coords(tid);
  CUTLASS_PRAGMA_UNROLL
  for (int chunk = 0; chunk < Traits::kDqChunks; ++chunk) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < Layout::kFrag; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(src + Layout::offset(chunk, tid, i));
      const float vals[4] = {v.x, v.y, v.z, v.w};
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int row = m_block * kBlockM + get<0>(c(i + e));
        const int col = chunk * Layout::kDqCols + get<1>(c(i + e));
        if (row < p.t) { dst[int64_t(row) * p.n * kHeadDim + col] = Element(vals[e] * p.scale); }
      }
    }
  }
}

}  // namespace jax_fa3

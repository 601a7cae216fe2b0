// The two small kernels around the main backward kernel, one warp per query
// row:
//  - preprocess: delta = rowsum(dO * O) in fp32, lse in base-2 units (+inf on
//    the padding rows so they contribute nothing), dQ accumulator zeroed;
//  - postprocess: dQ = scale * dQ_accum, converted to the input dtype, BTNH.
#pragma once

#include <cute/config.hpp>
#include "params.h"

namespace jax_fa3 {

constexpr int kBwdRowsPerBlock = 8;  // warps per block of the two kernels

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

template <class Element>
__global__ void __launch_bounds__(kBwdRowsPerBlock * 32)
bwd_postprocess(const BwdParams p) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kBwdRowsPerBlock + threadIdx.x / 32;
  const int head = blockIdx.y, batch = blockIdx.z;
  if (row >= p.t) { return; }
  const float* src = p.dq_accum + ((int64_t(batch) * p.n + head) * p.t_pad + row) * p.d;
  Element* dst = static_cast<Element*>(p.dq) + ((int64_t(batch) * p.t + row) * p.n + head) * p.d;
  for (int c = lane; c < p.d; c += 32) { dst[c] = Element(src[c] * p.scale); }
}

}  // namespace jax_fa3

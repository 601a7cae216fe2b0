// Online softmax over K/V blocks, all state in FP32 registers. Scores are kept
// in "x" units (raw q.k, or tanh(q.k * scale / cap) with a softcap); the
// factor to base-2 exponent units is applied inside one FMA per element.
#pragma once

#include <cute/tensor.hpp>
#include "../common/utils.h"

namespace jax_fa3 {

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];  // per-thread partial sums; reduced over the quad at the end
  float scale_log2;      // x * scale_log2 = score * log2(e)

  CUTE_DEVICE explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }
  }

  // Folds one block of scores into the running max/sum and overwrites the
  // scores with P (unnormalized). Returns, per row, the factor by which the
  // output accumulated so far must be rescaled -- separately, so that with
  // intra-warpgroup overlap the rescale can wait for the in-flight P.V GEMM.
  template <class TS>
  CUTE_DEVICE void max_and_exp(TS& scores, float (&correction)[kRows]) {
    Tensor s = as_rowcol(scores);
    static_assert(decltype(size<0>(s))::value == kRows);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float m = row_max[r];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(s); ++c) { m = fmaxf(m, s(r, c)); }
      m = quad_max(m);
      // A row that has seen only masked keys keeps max -inf: use 0 as the
      // offset so exp2 gives 0 rather than NaN.
      float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      correction[r] = exp2f(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      float sum = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = exp2f(s(r, c) * scale_log2 - m_scaled);
        sum += s(r, c);
      }
      row_sum[r] = row_sum[r] * correction[r] + sum;
    }
  }

  template <class TO>
  CUTE_DEVICE static void rescale(TO& acc_o, const float (&correction)[kRows]) {
    Tensor o = as_rowcol(acc_o);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(o); ++c) { o(r, c) *= correction[r]; }
    }
  }

  // Normalizes the output and returns the natural-log LSE per row
  // (finish_row: the sink, in base-2 units, joins the denominator; -inf: none).
  template <class TO>
  CUTE_DEVICE void finalize(TO& acc_o, float (&lse)[kRows], float sink_log2 = -INFINITY) {
    Tensor o = as_rowcol(acc_o);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float inv = finish_row(quad_sum(row_sum[r]), row_max[r] * scale_log2, sink_log2, lse[r]);
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(o); ++c) { o(r, c) *= inv; }
    }
  }
};

}  // namespace jax_fa3

// Online softmax for the FP8 forward. Differs from fwd/softmax.h in two ways:
//  - the descale q_scale * k_scale changes per K block, so the running max is
//    kept in base-2 exponent units (already multiplied by the block's factor)
//    rather than in raw-score units; the factor still enters one FFMA per
//    element;
//  - P is produced as 2^kPShift * exp2(s - max), which uses the e4m3 range
//    ([0, 256] instead of [0, 1]: values below 2^-9 would flush to zero); the
//    shift is undone in the final normalization (it cancels in O = PV / sum P)
//    and in the LSE.
// V's per-block scale is folded into the per-row rescale of O (mainloop.h).
#pragma once

#include <cute/tensor.hpp>
#include "../fwd/utils.h"

namespace jax_fa3 {

// v[0] = max(v[0 .. 2W)), halving the width per step (compile-time: a
// run-time halving loop was left rolled, through local memory).
template <int W, int N>
CUTE_DEVICE void fold_max(float (&v)[N]) {
  if constexpr (W >= 1) {
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < W; ++c) { v[c] = fmaxf(v[c], v[c + W]); }
    fold_max<W / 2>(v);
  }
}

template <int kRows>
struct Fp8OnlineSoftmax {
  static constexpr float kPShift = 8.f;
  float row_max[kRows];  // log2 units
  float row_sum[kRows];  // per-thread partial sums of 2^kPShift-scaled P

  CUTE_DEVICE Fp8OnlineSoftmax() {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) { row_max[r] = -INFINITY; row_sum[r] = 0.f; }
  }

  // scores: raw QGMMA accumulator; to_log2 = softmax scale * log2(e) *
  // q_scale * k_scale (> 0). Overwrites scores with scaled P; correction[r] is
  // the factor for the O accumulated so far (before V-scale folding).
  template <class TS>
  CUTE_DEVICE void max_and_exp(TS& scores, float to_log2, float (&correction)[kRows]) {
    Tensor s = as_rowcol(scores);
    static_assert(decltype(size<0>(s))::value == kRows);
    constexpr int kCols = decltype(size<1>(s))::value;
    static_assert((kCols & (kCols - 1)) == 0, "tree reduction over a power-of-two row");
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // Pairwise tree: log2(kCols) dependent FMNMX instead of a kCols-long
      // chain (max is exact in any order). The row max gates everything
      // after it in the softmax, which sits on the warpgroup's critical path.
      float part[kCols / 2];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kCols / 2; ++c) { part[c] = fmaxf(s(r, c), s(r, c + kCols / 2)); }
      fold_max<kCols / 4>(part);
      float m = fmaxf(row_max[r], quad_max(part[0]) * to_log2);
      // Rows that have seen only masked keys keep max -inf: offset 0 then.
      const float m_safe = m == -INFINITY ? 0.f : m;
      correction[r] = exp2f(row_max[r] - m_safe);
      row_max[r] = m;
      const float offset = m_safe - kPShift;
      float sum = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = exp2f(s(r, c) * to_log2 - offset);
        sum += s(r, c);
      }
      row_sum[r] = row_sum[r] * correction[r] + sum;
    }
  }

  template <class TO>
  CUTE_DEVICE static void rescale(TO& acc_o, const float (&factor)[kRows]) {
    Tensor o = as_rowcol(acc_o);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(o); ++c) { o(r, c) *= factor[r]; }
    }
  }

  // O = acc_o * v_scale_last / sum; natural-log LSE (+inf for empty rows).
  template <class TO>
  CUTE_DEVICE void finalize(TO& acc_o, float v_scale_last, float (&lse)[kRows]) {
    Tensor o = as_rowcol(acc_o);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float sum = quad_sum(row_sum[r]);
      bool empty = !(sum > 0.f);
      float inv = empty ? 0.f : v_scale_last / sum;
      lse[r] = empty ? INFINITY : (row_max[r] - kPShift + __log2f(sum)) * 0.69314718055994530942f;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(o); ++c) { o(r, c) *= inv; }
    }
  }
};

}  // namespace jax_fa3

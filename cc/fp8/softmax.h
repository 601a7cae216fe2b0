// Online softmax for the FP8 forward. Differs from fwd/softmax.h in two ways:
//  - the descale q_scale * k_scale changes per K block, so the running max is
//    kept in base-2 exponent units (already multiplied by the block's factor)
//    rather than in raw-score units; the factor still enters one FFMA per
//    element;
//  - P is produced as 2^kPShift * exp2(s - max) (times the V block scale
//    ratio, and against a lazily moved max: max_and_exp), which uses the e4m3 range
//    ([0, 256] instead of [0, 1]: values below 2^-9 would flush to zero); the
//    shift is undone in the final normalization (it cancels in O = PV / sum P)
//    and in the LSE.
#pragma once

#include <cute/tensor.hpp>
#include "../common/utils.h"

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
  // q_scale * k_scale (> 0); v_log2 = log2(v_scale_j / v_scale_ref) <= 0.
  // Overwrites scores with P' = 2^(kPShift + v_log2) * exp2(s - max): the V
  // block's scale relative to the tile's largest enters P before its e4m3
  // cast, so O is accumulated in the one frame of v_scale_ref and needs no
  // per-block rescale for V. row_sum still sums unscaled P (times 2^kPShift).
  //
  // Lazy max: a warp moves its rows' running max only when some row's block
  // max exceeds it by more than kSlack (log2 units); otherwise P' is taken
  // against the stale max, which is exact (O and row_sum share the frame),
  // and stays <= 2^(8 + 0.8) < 448, e4m3's largest value. Returns whether
  // the warp moved its max, i.e. whether O must be rescaled by correction
  // (warp-uniform, so the 64-128 FMULs of that rescale are skipped by
  // branch). Long rows settle after a few blocks.
  static constexpr float kSlack = 0.8f;
  template <class TS>
  CUTE_DEVICE bool max_and_exp(TS& scores, float to_log2, float v_log2, float (&correction)[kRows]) {
    Tensor s = as_rowcol(scores);
    static_assert(decltype(size<0>(s))::value == kRows);
    constexpr int kCols = decltype(size<1>(s))::value;
    static_assert((kCols & (kCols - 1)) == 0, "tree reduction over a power-of-two row");
    float m_blk[kRows];
    bool grow = false;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      // Pairwise tree: log2(kCols) dependent FMNMX instead of a kCols-long
      // chain (max is exact in any order). The row max gates everything
      // after it in the softmax, which sits on the warpgroup's critical path.
      float part[kCols / 2];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kCols / 2; ++c) { part[c] = fmaxf(s(r, c), s(r, c + kCols / 2)); }
      fold_max<kCols / 4>(part);
      m_blk[r] = quad_max(part[0]) * to_log2;
      grow |= m_blk[r] > row_max[r] + kSlack;  // -inf + kSlack: any finite score grows
    }
    grow = __any_sync(0xffffffffu, grow);
    const float inv_v = exp2f(-v_log2);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float m = grow ? fmaxf(row_max[r], m_blk[r]) : row_max[r];
      // Rows that have seen only masked keys keep max -inf: offset 0 then.
      const float m_safe = m == -INFINITY ? 0.f : m;
      correction[r] = grow ? exp2f(row_max[r] - m_safe) : 1.f;
      row_max[r] = m;
      const float offset = m_safe - kPShift - v_log2;
      float sum = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = exp2f(s(r, c) * to_log2 - offset);
        sum += s(r, c);
      }
      row_sum[r] = row_sum[r] * correction[r] + sum * inv_v;
    }
    return grow;
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

  // O = acc_o * v_scale_ref / sum; natural-log LSE (+inf for empty rows).
  template <class TO>
  CUTE_DEVICE void finalize(TO& acc_o, float v_scale_ref, float (&lse)[kRows]) {
    Tensor o = as_rowcol(acc_o);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float inv = v_scale_ref * finish_row(quad_sum(row_sum[r]), row_max[r] - kPShift, -INFINITY, lse[r]);
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(o); ++c) { o(r, c) *= inv; }
    }
  }
};

}  // namespace jax_fa3

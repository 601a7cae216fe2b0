// Which keys a query tile sees. Visibility of key j from query i (batch b):
//   i < q_len[b], j < kv_len[b], j >= i - left (left >= 0), j <= i + right (right >= 0).
// Causal (top-left aligned, as jax.nn) is right = 0. The producer and the
// consumers derive the same block range from this struct, so they agree on
// the number of K/V tiles without talking to each other.
#pragma once

#include <cute/tensor.hpp>
#include "utils.h"

namespace jax_fa3 {

template <int kBlockM, int kBlockN>
struct TileMask {
  int m_start, m_end;      // valid query rows [m_start, m_end) of this tile
  int kv_len;
  int left, right;
  int n_block_min, n_block_max;  // K/V blocks to visit: [min, max), visited high to low

  CUTE_DEVICE TileMask(int m_block, int q_len, int kv_len_, int left_, int right_)
      : kv_len(kv_len_), left(left_), right(right_) {
    m_start = m_block * kBlockM;
    m_end = min(m_start + kBlockM, q_len);
    int key_lo = 0, key_hi = kv_len;  // keys [lo, hi) any row of the tile may see
    if (right >= 0) { key_hi = min(key_hi, m_end - 1 + right + 1); }
    if (left >= 0) { key_lo = max(0, m_start - left); }
    if (m_end <= m_start || key_hi <= key_lo) {
      n_block_min = n_block_max = 0;
    } else {
      n_block_min = key_lo / kBlockN;
      n_block_max = (key_hi + kBlockN - 1) / kBlockN;
    }
  }

  CUTE_DEVICE bool empty() const { return n_block_max <= n_block_min; }

  // Interior blocks (every key visible from every row) skip the element test.
  CUTE_DEVICE bool needs_mask(int n_block) const {
    int col_first = n_block * kBlockN, col_last = col_first + kBlockN - 1;
    return col_last >= kv_len ||
           (right >= 0 && col_last > m_start + right) ||
           (left >= 0 && col_first < m_start + kBlockM - 1 - left);
  }

  // scores: an accumulator fragment; coords: the matching identity partition
  // (tile-local (row, col) of each element). Per row the visible columns form
  // one interval [lo, hi), so each element costs two compares and a select;
  // the element-wise short-circuit test it replaces compiled to branches
  // (BSSY/BRA per element) and made a causal diagonal block cost about as
  // much as two unmasked ones (ncu, d128 causal 512). Without a left bound
  // (causal, padding) the lower compare is dropped: one compare and a select.
  template <class TS, class TC>
  CUTE_DEVICE void apply(TS& scores, TC const& coords, int n_block) const {
    if (left >= 0) {
      apply_rows<true>(scores, coords, n_block);
    } else {
      apply_rows<false>(scores, coords, n_block);
    }
  }

 private:
  template <bool kLeft, class TS, class TC>
  CUTE_DEVICE void apply_rows(TS& scores, TC const& coords, int n_block) const {
    Tensor s = as_rowcol(scores);
    Tensor c = as_rowcol(coords);
    const int col0 = n_block * kBlockN;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      const int i = m_start + get<0>(c(r, 0));
      int hi = kv_len - col0;                            // tile-local, exclusive
      if (right >= 0) { hi = min(hi, i + right + 1 - col0); }
      const int lo = i - left - col0;                    // tile-local, inclusive (kLeft)
      CUTLASS_PRAGMA_UNROLL
      for (int col = 0; col < size<1>(s); ++col) {
        const int j = get<1>(c(r, col));
        const bool visible = kLeft ? ((j >= lo) & (j < hi)) : (j < hi);
        s(r, col) = visible ? s(r, col) : -INFINITY;
      }
    }
  }
};

}  // namespace jax_fa3

// Which query blocks see a key block, with the forward's visibility rule
// (cc/fwd/mask.h): key j visible from query i iff i < q_len, j < kv_len,
// j >= i - left (left >= 0) and j <= i + right (right >= 0). The producer and
// the consumers derive the same query-block range from it.
#pragma once

#include <cute/tensor.hpp>
#include "../fwd/utils.h"

namespace jax_fa3 {

template <int kBlockM, int kBlockN>
struct KeyBlockMask {
  int n_start, q_len, kv_len, left, right;
  int m_block_min, m_block_max;  // query blocks to visit: [min, max), ascending

  CUTE_DEVICE KeyBlockMask(int n_block, int q_len_, int kv_len_, int left_, int right_)
      : q_len(q_len_), kv_len(kv_len_), left(left_), right(right_) {
    n_start = n_block * kBlockN;
    const int key_last = min(n_start + kBlockN, kv_len) - 1;
    int row_lo = 0, row_hi = q_len;  // query rows [lo, hi) that may see a key of the block
    if (right >= 0) { row_lo = max(0, n_start - right); }
    if (left >= 0) { row_hi = min(row_hi, key_last + left + 1); }
    if (n_start >= kv_len || row_hi <= row_lo) {
      m_block_min = m_block_max = 0;
    } else {
      m_block_min = row_lo / kBlockM;
      m_block_max = (row_hi + kBlockM - 1) / kBlockM;
    }
  }

  // A split key block (tile_scheduler.h): share `piece` of `pieces` visits an
  // equal part of the query blocks.
  CUTE_DEVICE void take_share(int piece, int pieces) {
    const int lo = m_block_min, len = m_block_max - m_block_min;
    m_block_min = lo + len * piece / pieces;
    m_block_max = lo + len * (piece + 1) / pieces;
  }

  // Deterministic dQ: the key blocks that visit query block m are contiguous,
  // [first, last]. Each adds its share in a fixed order, which is this key
  // block's turn. With a right bound (causal, windows) the order descends from
  // the diagonal block: that block visits m first (it starts there), so no CTA
  // waits at its first query block, where ascending order made key block j
  // idle for about j blocks of work (2.3x the non-deterministic time at 8k
  // causal). Key blocks are then dispatched in descending order too
  // (tile_scheduler.h), so a CTA only ever waits on CTAs dispatched before it
  // (no deadlock when a head has more key blocks than the GPU holds CTAs).
  CUTE_DEVICE int dq_turn(int n_block, int m_block) const {
    if (right >= 0) {
      // The block's last valid row: a key block whose rows start past q_len
      // visits nothing, so it cannot be the one that goes first.
      const int m_last = min(m_block * kBlockM + kBlockM, q_len) - 1;
      return min(m_last + right, kv_len - 1) / kBlockN - n_block;
    }
    const int first = left >= 0 ? max(0, m_block * kBlockM - left) / kBlockN : 0;
    return n_block - first;
  }

  CUTE_DEVICE bool needs_mask(int m_block) const {
    const int m_first = m_block * kBlockM, m_last = m_first + kBlockM - 1;
    const int n_last = n_start + kBlockN - 1;
    return n_last >= kv_len || m_last >= q_len ||
           (right >= 0 && n_last > m_first + right) ||
           (left >= 0 && n_start < m_last - left);
  }

  // scores: the S^T accumulator (rows = keys, cols = queries); coords: its
  // identity partition (tile-local (key, query)). Per key row the visible
  // queries form one interval [lo, hi), so each element costs two compares and
  // a select (the element-wise short-circuit test compiled to a branch pair
  // per element, as it did in the forward: cc/fwd/mask.h).
  template <class TS, class TC>
  CUTE_DEVICE void apply(TS& scores, TC const& coords, int m_block) const {
    Tensor s = as_rowcol(scores);
    Tensor c = as_rowcol(coords);
    const int row0 = m_block * kBlockM;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(s); ++r) {
      const int j = n_start + get<0>(c(r, 0));
      // Queries i with i < q_len, i >= j - right, i <= j + left; none if j >= kv_len.
      int hi = j < kv_len ? q_len - row0 : -kBlockM;             // tile-local, exclusive
      if (left >= 0) { hi = min(hi, j + left + 1 - row0); }
      const int lo = right >= 0 ? j - right - row0 : -kBlockM;   // tile-local, inclusive
      CUTLASS_PRAGMA_UNROLL
      for (int col = 0; col < size<1>(s); ++col) {
        const int i = get<1>(c(r, col));
        s(r, col) = ((i >= lo) & (i < hi)) ? s(r, col) : -INFINITY;
      }
    }
  }
};

}  // namespace jax_fa3

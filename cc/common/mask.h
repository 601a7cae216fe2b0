// Which keys a query sees, for every kernel family. One visibility rule:
//   key j is visible from query i (batch b) iff
//   i < q_len[b], j < kv_len[b], j >= i - left (left >= 0), j <= i + right (right >= 0).
// Causal (top-left aligned, as jax.nn) is right = 0.
//
// MaskRule answers it as intervals: the keys some row of a row range may see
// (key_range), and, through the rule with queries and keys swapped
// (transposed), the rows some key of a key range is seen by (row_range). Two
// block views derive from it:
//  - QueryBlockMask (forward, FP8): the key blocks one query block visits,
//    which of them straddle a boundary, and the element mask of a score tile;
//  - KeyBlockMask (backward): the query blocks that see one key block, its
//    deterministic dQ turn and split shares, and the element mask of an S^T tile.
// Producers and consumers build the same view, so they agree on the block
// range without talking to each other.
//
// Segment ids (packed sequences) add: key j is visible from query i only if
// their ids are equal. A view narrows its block range to the spans the
// pre-pass computed (PairRuleView), skips the element mask on blocks that
// every row sees whole, and compares ids on the others. apply() takes the
// PairRuleView from its caller, rebuilt from the kernel parameters there, so
// the block loops keep no id pointers live in registers.
#pragma once

#include <climits>
#include <cute/tensor.hpp>
#include "../fwd/params.h"
#include "utils.h"

namespace jax_fa3 {

// A half-open index range [lo, hi); empty when hi <= lo.
struct Interval {
  int lo, hi;
  CUTE_HOST_DEVICE bool empty() const { return hi <= lo; }
};

struct MaskRule {
  int q_len, kv_len;  // valid query rows, valid keys
  int left, right;    // window bounds, -1: unbounded

  // The same rule with the roles of queries and keys exchanged: key j sees
  // query i iff i < q_len, i >= j - right, i <= j + left.
  CUTE_HOST_DEVICE MaskRule transposed() const { return {kv_len, q_len, right, left}; }

  // Keys [lo, hi) that some row of [row_begin, row_end) may see; the caller
  // clips row_end to q_len (an empty row range is the caller's test).
  CUTE_HOST_DEVICE Interval key_range(int row_begin, int row_end) const {
    int lo = 0, hi = kv_len;
    if (right >= 0) { hi = min(hi, row_end - 1 + right + 1); }
    if (left >= 0) { lo = max(0, row_begin - left); }
    return {lo, hi};
  }
  // Query rows [lo, hi) that some key of [key_begin, key_end) is seen by.
  CUTE_HOST_DEVICE Interval row_range(int key_begin, int key_end) const {
    return transposed().key_range(key_begin, key_end);
  }

  // The keys row `row` sees, relative to key0: [lo, hi). lo holds only with
  // a left bound (left >= 0); without one every key below hi is visible.
  CUTE_DEVICE Interval keys_of_row(int row, int key0) const {
    int hi = kv_len - key0;
    if (right >= 0) { hi = min(hi, row + right + 1 - key0); }
    return {row - left - key0, hi};
  }
};

// Blocks of `block` indices that overlap a range: [min, max).
template <int kBlock>
CUTE_HOST_DEVICE Interval blocks_of(Interval r) {
  return r.empty() ? Interval{0, 0} : Interval{r.lo / kBlock, (r.hi + kBlock - 1) / kBlock};
}

// Where a lane's mask bits for a block lie (params.h, mask bits): the word
// holding its first 8-column group and the shift that puts fragment column 0
// at bit 0 of the two-word window. first_col: the tile column of the lane's
// first element (base + 2 t); col0: the block's first column (a multiple of 16).
struct MaskBitsAt {
  int64_t word;
  int shift;
};
CUTE_HOST_DEVICE MaskBitsAt mask_bits_at(int row, int first_col, int col0, int chunks) {
  const int g0 = (col0 + first_col) / 8;
  return {(int64_t(row) * 4 + (first_col / 2) % 4) * chunks + g0 / 16, 2 * (g0 % 16)};
}

// The pair rule (segment ids or a mask, params.h) of one batch row and head
// seen from one side: rows are the block's own positions (queries in the
// forward, keys in the backward), cols the other side's.
struct PairRuleView {
  const int32_t* row_ids = nullptr;  // [rows] segment ids, or null
  const int32_t* col_ids = nullptr;  // [cols]
  const uint32_t* row_bits = nullptr;  // or mask bits [rows, 4, chunks] (params.h)
  const int4* spans = nullptr;         // [ceil(rows / kSpanGranule)]; null: no rule
  int rows = 0, cols = 0;
  int chunks = 0;

  // Enabled = false: a kernel built without the pair rule (the view is empty
  // at compile time, so its code folds away).
  // The views are built where they are used (a masked block); the empty asm
  // keeps their loop-invariant addresses from being hoisted out of the block
  // loops, where they held registers across the whole loop.
  template <bool Enabled = true, class Params>
  CUTE_DEVICE static PairRuleView queries(const Params& p, int batch, int head) {
    const PairRuleParams& s = p.pair;
    if (!Enabled || s.q_spans == nullptr) { return {}; }
    asm volatile("" : "+r"(batch), "+r"(head));
    const int64_t slice = slice_of(s.mask_b, s.mask_n, batch, head);
    const int4* spans = reinterpret_cast<const int4*>(s.q_spans) + slice * granules(p.t);
    if (s.mask != nullptr) {
      const int chunks = int(mask_chunks(p.s));
      return {nullptr, nullptr, s.mask + slice * p.t * 4 * chunks, spans, p.t, p.s, chunks};
    }
    return {s.q_ids + int64_t(batch) * p.t, s.kv_ids + int64_t(batch) * p.s, nullptr, spans, p.t, p.s};
  }
  // The key side: spans of kv head kv_head (block ranges), mask rows of
  // query head `head` (element tests).
  template <class Params>
  CUTE_DEVICE static PairRuleView keys(const Params& p, int batch, int kv_head, int head) {
    const PairRuleParams& s = p.pair;
    if (s.q_spans == nullptr) { return {}; }
    asm volatile("" : "+r"(batch), "+r"(kv_head), "+r"(head));
    const int4* spans = reinterpret_cast<const int4*>(s.kv_spans) +
                        slice_of(s.mask_b, s.mask_kh, batch, kv_head) * granules(p.s);
    if (s.mask != nullptr) {
      const int chunks = int(mask_chunks(p.t));
      return {nullptr, nullptr, s.mask_t + slice_of(s.mask_b, s.mask_n, batch, head) * p.s * 4 * chunks, spans,
              p.s, p.t, chunks};
    }
    return {s.kv_ids + int64_t(batch) * p.s, s.q_ids + int64_t(batch) * p.t, nullptr, spans, p.s, p.t};
  }
  CUTE_HOST_DEVICE static int64_t slice_of(int nb, int nh, int batch, int head) {
    return int64_t(nb > 1 ? batch : 0) * nh + (nh > 1 ? head : 0);
  }
  CUTE_HOST_DEVICE static int granules(int len) { return (len + kSpanGranule - 1) / kSpanGranule; }
  CUTE_HOST_DEVICE bool active() const { return spans != nullptr; }

  // Over rows [begin, end): the cols some row sees (`any`) and the cols
  // every row sees (`all`). Without segment ids: everything, both.
  CUTE_DEVICE void block(int begin, int end, Interval& any, Interval& all) const {
    any = {INT_MIN, INT_MAX};
    all = {INT_MIN, INT_MAX};
    if (!active()) { return; }
    any = {INT_MAX, INT_MIN};
    const int g_end = granules(min(end, rows));
    for (int g = begin / kSpanGranule; g < g_end; ++g) {
      const int4 sp = __ldg(spans + g);
      any.lo = min(any.lo, sp.x); any.hi = max(any.hi, sp.y);
      all.lo = max(all.lo, sp.z); all.hi = min(all.hi, sp.w);
    }
  }

  // Masks the elements of a tile the rule excludes; row0 / col0: the tile's
  // origin. Rows or cols past the arrays' ends read the last id or mask entry
  // (those are masked or dropped by the interval rule).
  template <class TS, class TC>
  CUTE_DEVICE void apply(TS& scores, TC const& coords, int row0, int col0) const {
    Tensor s = as_rowcol(scores);
    Tensor c = as_rowcol(coords);
    if (row_bits != nullptr) {
      // Two words per row hold this lane's columns of the block (params.h).
      // The row-col view of a WGMMA accumulator orders a lane's columns
      // base + 8 j + 2 t + e as 2 j + e (base: where its warpgroup's columns
      // start, 0 unless the warpgroups split the columns): fragment column
      // `col` is bit `col` after the shift, a constant (a per-element
      // computed shift would be hoisted out of the block loop as dozens of
      // live registers).
      static_assert(decltype(size<1>(s))::value <= 32, "a block's lane columns fit one 32-bit window");
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < size<0>(s); ++r) {
        const MaskBitsAt at = mask_bits_at(min(row0 + get<0>(c(r, 0)), rows - 1), get<1>(c(r, 0)), col0, chunks);
        const uint32_t* w = row_bits + at.word;
        const uint32_t bits = uint32_t(((uint64_t(__ldg(w + 1)) << 32) | __ldg(w)) >> at.shift);
        CUTLASS_PRAGMA_UNROLL
        for (int col = 0; col < size<1>(s); ++col) { s(r, col) = (bits >> col) & 1u ? s(r, col) : -INFINITY; }
      }
      return;
    }
    int rid[size<0>(s)];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(s); ++r) { rid[r] = __ldg(row_ids + min(row0 + get<0>(c(r, 0)), rows - 1)); }
    CUTLASS_PRAGMA_UNROLL
    for (int col = 0; col < size<1>(s); ++col) {
      const int cid = __ldg(col_ids + min(col0 + get<1>(c(0, col)), cols - 1));
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < size<0>(s); ++r) { s(r, col) = rid[r] == cid ? s(r, col) : -INFINITY; }
    }
  }
};

// Intersection of two ranges.
CUTE_HOST_DEVICE Interval intersect(Interval a, Interval b) { return {max(a.lo, b.lo), min(a.hi, b.hi)}; }

// Per row of an accumulator tile the visible columns form one interval [lo,
// hi), so each element costs two compares and a select (one without a lower
// bound). The element-wise short-circuit test this replaces compiled to a
// branch pair per element. scores: an accumulator fragment; coords: its
// identity partition (tile-local (row, col) of each element); interval(row):
// the tile-local visible columns of tile row `row`.
template <bool kLowerBound, class TS, class TC, class RowInterval>
CUTE_DEVICE void mask_rows(TS& scores, TC const& coords, RowInterval&& interval) {
  Tensor s = as_rowcol(scores);
  Tensor c = as_rowcol(coords);
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    const Interval iv = interval(get<0>(c(r, 0)));
    CUTLASS_PRAGMA_UNROLL
    for (int col = 0; col < size<1>(s); ++col) {
      const int j = get<1>(c(r, col));
      const bool visible = kLowerBound ? ((j >= iv.lo) & (j < iv.hi)) : (j < iv.hi);
      s(r, col) = visible ? s(r, col) : -INFINITY;
    }
  }
}

// The position of each query row for the position rule: (row >> pack_log2)
// + offset (FwdParams::bottom_right, q_pack_log2). Rows are positions unless a KV
// cache shifts them (bottom-right alignment) or packs a GQA group's heads as
// rows (a power of two of them: a shift, where a division's hoisted
// reciprocal cost the consumers registers).
struct RowPositions {
  int offset = 0, pack_log2 = 0;
  CUTE_HOST_DEVICE int of(int row) const { return (row >> pack_log2) + offset; }
};

// Forward view: the key blocks query block m_block visits, [n_block_min,
// n_block_max), visited high to low.
template <int kBlockM, int kBlockN>
struct QueryBlockMask {
  MaskRule rule;
  Interval pair_all;  // keys every row of the block sees by segment id
  RowPositions pos;
  int m_start;  // first query row of the block
  int n_block_min, n_block_max;

  CUTE_DEVICE QueryBlockMask(int m_block, int q_len, int kv_len, int left, int right, PairRuleView pairs = {},
                             RowPositions positions = {})
      : rule{q_len, kv_len, left, right}, pos(positions) {
    m_start = m_block * kBlockM;
    const int m_end = min(m_start + kBlockM, q_len);
    Interval pair_any;
    pairs.block(m_start, m_start + kBlockM, pair_any, pair_all);
    const Interval keys = intersect(rule.key_range(pos.of(m_start), pos.of(m_end - 1) + 1), pair_any);
    const Interval blocks = m_end <= m_start ? Interval{0, 0} : blocks_of<kBlockN>(keys);
    n_block_min = blocks.lo;
    n_block_max = blocks.hi;
  }
  // The view of query block m_block of batch row `batch` (FwdParams-like p).
  // Positions: the kernel takes KV-cache row positions (FwdParams::bottom_right,
  // q_pack_log2); without, rows are positions at compile time.
  template <bool PairRule = true, bool Positions = false, class Params>
  CUTE_DEVICE static QueryBlockMask of(const Params& p, int m_block, int batch, int head) {
    const int q_len = p.q_lens != nullptr ? min(p.q_lens[batch], p.t) : p.t;
    const int kv_len = min(min(max(p.kv_lens[batch], 0), p.s) + p.kv_len_add, p.s);
    const int offset = Positions && p.bottom_right ? kv_len - (p.t >> p.q_pack_log2) : 0;
    return QueryBlockMask(m_block, q_len, kv_len, p.window_left, p.window_right,
                          PairRuleView::queries<PairRule>(p, batch, head),
                          Positions ? RowPositions{offset, p.q_pack_log2} : RowPositions{});
  }

  // Split-KV (FwdParams::num_splits): part `split` of `splits` visits an
  // equal share of the key blocks.
  CUTE_DEVICE void take_split(int split, int splits) {
    const int lo = n_block_min, len = max(n_block_max - n_block_min, 0);
    n_block_min = lo + len * split / splits;
    n_block_max = lo + len * (split + 1) / splits;
  }

  CUTE_DEVICE bool empty() const { return n_block_max <= n_block_min; }

  // Interior blocks (every key visible from every row) skip the element mask.
  // Rows past q_len are not masked: the epilogue zeroes them.
  CUTE_DEVICE bool needs_mask(int n_block) const {
    int col_first = n_block * kBlockN, col_last = col_first + kBlockN - 1;
    return col_last >= rule.kv_len || col_first < pair_all.lo || col_last >= pair_all.hi ||
           (rule.right >= 0 && col_last > pos.of(m_start) + rule.right) ||
           (rule.left >= 0 && col_first < pos.of(m_start + kBlockM - 1) - rule.left);
  }

  // S tile (rows = queries, cols = keys) of key block n_block; seg: the
  // block's PairRuleView::queries.
  template <class TS, class TC>
  CUTE_DEVICE void apply(TS& scores, TC const& coords, int n_block, const PairRuleView& pair) const {
    const int col0 = n_block * kBlockN;
    auto interval = [&](int row) { return rule.keys_of_row(pos.of(m_start + row), col0); };
    if (rule.left >= 0) {
      mask_rows<true>(scores, coords, interval);
    } else {
      mask_rows<false>(scores, coords, interval);
    }
    if (pair.active() && (col0 < pair_all.lo || col0 + kBlockN > pair_all.hi)) {
      pair.apply(scores, coords, m_start, col0);
    }
  }
};

// Backward view: the query blocks that see key block n_block, [m_block_min,
// m_block_max) (bwd/tile_scheduler.h, BwdBlockWalk: the order they are visited).
template <int kBlockM, int kBlockN>
struct KeyBlockMask {
  MaskRule rule;
  Interval pair_all;  // queries that see every key of the block by segment id
  int n_start;  // first key of the block
  int m_block_min, m_block_max;

  // narrow: skip query blocks whose segment ids cannot match. Deterministic
  // dQ does not: its turns (dq_turn) count every key block the position rule
  // lets visit a query block, so each of them must take its turn.
  CUTE_DEVICE KeyBlockMask(int n_block, int q_len, int kv_len, int left, int right, PairRuleView pairs = {},
                           bool narrow = true)
      : rule{q_len, kv_len, left, right} {
    n_start = n_block * kBlockN;
    const int n_end = min(n_start + kBlockN, kv_len);
    Interval pair_any;
    pairs.block(n_start, n_start + kBlockN, pair_any, pair_all);
    Interval rows = rule.row_range(n_start, n_end);
    if (narrow) { rows = intersect(rows, pair_any); }
    const Interval blocks = n_end <= n_start ? Interval{0, 0} : blocks_of<kBlockM>(rows);
    m_block_min = blocks.lo;
    m_block_max = blocks.hi;
  }
  // The view of key block n_block of batch row `batch` (BwdParams-like p).
  template <class Params>
  CUTE_DEVICE static KeyBlockMask of(const Params& p, int n_block, int batch, int kv_head, bool narrow) {
    return KeyBlockMask(n_block, min(p.q_lens[batch], p.t), min(p.kv_lens[batch], p.s), p.window_left,
                        p.window_right, PairRuleView::keys(p, batch, kv_head, kv_head), narrow);
  }

  // A split key block (bwd/tile_scheduler.h): share `piece` of `pieces`
  // visits an equal part of the query blocks.
  CUTE_DEVICE void take_share(int piece, int pieces) {
    const int lo = m_block_min, len = m_block_max - m_block_min;
    m_block_min = lo + len * piece / pieces;
    m_block_max = lo + len * (piece + 1) / pieces;
  }

  // Deterministic dQ: the key blocks that visit query block m are contiguous,
  // [first, last]. Each adds its share in a fixed order, which is this key
  // block's turn. With a right bound (causal, windows) the order descends from
  // the diagonal block: that block visits m first (it starts there), so no CTA
  // waits at its first query block, where an ascending order made key block j
  // idle for about j blocks of work. Key blocks are then dispatched in
  // descending order too (bwd/tile_scheduler.h), so a CTA only ever waits on
  // CTAs dispatched before it (no deadlock when a head has more key blocks
  // than the GPU holds CTAs).
  CUTE_DEVICE int dq_turn(int n_block, int m_block) const {
    if (rule.right >= 0) {
      // The block's last valid row: a key block whose rows start past q_len
      // visits nothing, so it cannot be the one that goes first.
      const int m_last = min(m_block * kBlockM + kBlockM, rule.q_len) - 1;
      return min(m_last + rule.right, rule.kv_len - 1) / kBlockN - n_block;
    }
    const int first = rule.left >= 0 ? max(0, m_block * kBlockM - rule.left) / kBlockN : 0;
    return n_block - first;
  }

  // Key rows past kv_len and query columns past q_len are masked here: both
  // would otherwise add to dK / dV.
  CUTE_DEVICE bool needs_mask(int m_block) const {
    const int m_first = m_block * kBlockM, m_last = m_first + kBlockM - 1;
    const int n_last = n_start + kBlockN - 1;
    return n_last >= rule.kv_len || m_last >= rule.q_len || m_first < pair_all.lo || m_last >= pair_all.hi ||
           (rule.right >= 0 && n_last > m_first + rule.right) ||
           (rule.left >= 0 && n_start < m_last - rule.left);
  }

  // S^T tile (rows = keys, cols = queries) of query block m_block: the
  // transposed rule's row intervals; a key past kv_len sees no query.
  // seg: the block's PairRuleView::keys.
  template <class TS, class TC>
  CUTE_DEVICE void apply(TS& scores, TC const& coords, int m_block, const PairRuleView& pair) const {
    const int row0 = m_block * kBlockM;
    const MaskRule t = rule.transposed();
    mask_rows<true>(scores, coords, [&](int key) {
      const int j = n_start + key;
      Interval iv = t.keys_of_row(j, row0);
      iv.lo = t.left >= 0 ? iv.lo : -kBlockM;
      iv.hi = j < rule.kv_len ? iv.hi : -kBlockM;
      return iv;
    });
    if (pair.active() && (row0 < pair_all.lo || row0 + kBlockM > pair_all.hi)) {
      pair.apply(scores, coords, n_start, row0);
    }
  }
};

}  // namespace jax_fa3

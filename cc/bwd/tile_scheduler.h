// Which (key block, KV head, batch) each CTA of the backward takes. The grid
// is 1-D and the launcher picks one of three orders:
//  - head-major: the key blocks of one (head, batch) are adjacent, so the CTAs
//    in flight share that head's Q, dO and dQ accumulator in L2.
//  - longest first, for causal-like masks without determinism (key block j
//    visits about T - j * kBlockN query rows, so low blocks are the long
//    ones): chunks of `chunk` key blocks, every head's chunk 0 first, then
//    chunk 1, ...; head-major inside a chunk, so the CTAs in flight still
//    share a few heads. Head-major alone started the last head's longest
//    blocks near the end of the grid (a tail of up to one such block: at GQA
//    16/4, 8k, the longest CTA is a quarter of an SM's share of the work).
//  - descending, for deterministic causal-like runs: head-major with key
//    blocks high to low, so a CTA waits only on CTAs dispatched before it
//    (common/mask.h, KeyBlockMask::dq_turn).
// Any order but the deterministic one may split the key blocks at the end of
// the grid (plan_split), where long ones would otherwise leave SMs idle while
// they finish. Each such block becomes `pieces` CTAs, at the end of the grid,
// that take equal shares of its query blocks; they combine dK/dV in fp32
// (epilogue.h).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <vector>
#include <cute/config.hpp>
#include "../common/mask.h"
#include "params.h"

namespace jax_fa3 {

// The (query head, query block) pairs of one tile (a key block of one KV
// head, or a share of it: the query blocks [m_min, m_max) of each of the
// group's query heads), in the order the producer loads them and the
// consumers compute them. Descending (every launch but a deterministic one):
// query blocks from the last, each block's query heads in turn. The CTAs of a
// KV head that start together then read the same Q/dO block and add into the
// same dQ block at about the same time, while it is in L2; walked head by head
// from each key block's diagonal up, they touched the whole group's Q, dO and
// dQ at once, and the backward waited on DRAM (benchmarks/RESULTS.md). The
// deterministic walk stays head by head, ascending: dq_turn's order.
template <bool Descending>
struct BwdBlockWalk {
  int g, m;  // query head in the group, query block
  int group, m_min, m_max;
  CUTE_HOST_DEVICE BwdBlockWalk(int group_, int m_min_, int m_max_)
      : g(0), m(Descending ? m_max_ - 1 : m_min_), group(group_), m_min(m_min_), m_max(m_max_) {}
  CUTE_HOST_DEVICE bool valid() const { return Descending ? m >= m_min : g < group && m < m_max; }
  CUTE_HOST_DEVICE void next() {
    if constexpr (Descending) {
      if (++g == group) { g = 0; --m; }
    } else {
      if (++m == m_max) { m = m_min; ++g; }
    }
  }
};

struct BwdTile {
  int n_block, kv_head, batch;
  int piece = 0, pieces = 1, slot = -1;  // split key blocks: share, share count, scratch slot
};

struct BwdTileOrder {
  enum : int { kHeadMajor = 0, kDescending = 1, kLongestFirst = 2 };
  // Key blocks per chunk (longest first). With one CTA per SM, about
  // sms / chunk KV heads are in flight, each reading and adding into its
  // query heads' Q, dO and fp32 dQ (8 bytes per row and head-dim column).
  // chunk_for takes kNarrowChunk where that working set fits in kL2Budget
  // (of the 50 MB L2; an upper bound under the descending walk, whose CTAs
  // of one KV head touch the same query blocks), else kDefaultChunk, or
  // kWideChunk when it does not fit even then and there are at least
  // kWideMinUnitsPerSm key blocks per SM. A chunk as wide as a head makes the order head-major
  // again, so the last heads' longest key blocks start late: a tail that
  // grows with the GQA group (fewer, longer units). Narrower chunks against
  // that tail lost more in L2 than they gained (GQA 64/8 2k, chunk 1: 14%
  // slower), so the working set alone decides.
  static constexpr int kDefaultChunk = 32, kNarrowChunk = 16, kWideChunk = 128, kWideMinUnitsPerSm = 15;
  static constexpr double kL2Budget = 40.0 * (1 << 20);
  static int chunk_for(const BwdParams& p, int num_units) {
    const double head_bytes = double(p.t) * (p.n / p.kh) * p.d * (2 + 2 + 4);  // Q, dO (16-bit), dQ fp32
    const int sms = p.num_sms > 0 ? p.num_sms : 132;
    auto fits = [&](int chunk) { return double(sms) / chunk * head_bytes <= kL2Budget; };
    if (fits(kNarrowChunk)) { return kNarrowChunk; }
    return !fits(kDefaultChunk) && num_units >= kWideMinUnitsPerSm * sms ? kWideChunk : kDefaultChunk;
  }
  // A split share should keep several query blocks: each CTA also pays for
  // the K/V load, the fp32 combine and the epilogue.
  static constexpr int kMaxPieces = 8, kMinBlocksPerPiece = 8;
  int order, num_n, num_hb, kh;
  int chunk = kDefaultChunk;
  int split_from = 0x7fffffff, pieces = 1;  // units >= split_from run as `pieces` CTAs each

  static BwdTileOrder make(const BwdParams& p, int block_n) {
    const bool causal_like = p.window_right >= 0 && p.window_left < 0;
    const int order = (p.deterministic && p.window_right >= 0) ? kDescending
                      : causal_like                            ? kLongestFirst
                                                               : kHeadMajor;
    BwdTileOrder o{order, (p.s + block_n - 1) / block_n, p.kh * p.b, p.kh};
    // Packed documents: a key block sees only its document's rows, so the
    // working set is far below chunk_for's estimate, and narrow chunks
    // balance the documents' uneven key blocks best.
    o.chunk = p.tile_chunk > 0 ? p.tile_chunk : p.pair.q_ids != nullptr ? kNarrowChunk : chunk_for(p, o.num_units());
    o.split_from = o.num_units();
    return o;
  }

  CUTE_HOST_DEVICE int num_units() const { return num_n * num_hb; }
  CUTE_HOST_DEVICE int num_ctas() const { return split_from + (num_units() - split_from) * pieces; }
  int num_split() const { return num_units() - split_from; }

  // make + plan_split for the launcher. The split plan simulates the
  // dispatch (~0.2 ms of host time for a 512-key-block grid), so each thread
  // keeps its last few plans: a model's layers repeat the same shapes.
  static BwdTileOrder planned(const BwdParams& p, int block_m, int block_n, int max_slots) {
    // Everything make and plan_split read (p.d: chunk_for's working set).
    using Key = std::array<int, 16>;
    const Key key{p.b, p.t, p.s, p.n, p.kh, p.d, p.window_left, p.window_right, int(p.deterministic),
                  int(p.pair.q_ids != nullptr), p.num_sms, p.tile_chunk, p.tile_pieces, block_m, block_n, max_slots};
    struct Entry { Key key; BwdTileOrder order; };
    static thread_local std::vector<Entry> recent;
    for (const Entry& e : recent) {
      if (e.key == key) { return e.order; }
    }
    BwdTileOrder o = make(p, block_n);
    o.plan_split(p, block_m, block_n, max_slots);
    if (recent.size() == 8) { recent.erase(recent.begin()); }
    recent.push_back({key, o});
    return o;
  }

  // Splitting the key blocks at the end of the grid into q shares each.
  //  - Equal units (head-major): r = units % sms of them take ceil(r q / sms)
  //    rounds of 1/q of a unit's time instead of one round of 1.
  //  - Longest first: the last r = min(units, max_slots) units split, q from
  //    a simulation of the dispatch. Where the chunk is as wide as a head (few
  //    key blocks, large GQA groups) the order is head-major, so the grid ends
  //    with the last heads' longest blocks (GQA 64/8, 2k: 257 query blocks of
  //    work against ~530 per SM); on one wave (GQA 8/1 per GPU: 64 key blocks
  //    on 132 SMs) the longest block bounds the finish.
  // Either way choose the q that saves the most, preferring fewer shares
  // unless more save another 5% of the time. A smaller gain is not worth it:
  // on MHA 16 heads, 2k, batch 8 a simulated 2% came out 2% slower (the
  // shares' K/V loads and fp32 adds cost more than the model's one query
  // block). tile_pieces (> 0) overrides the choice.
  void plan_split(const BwdParams& p, int block_m, int block_n, int max_slots) {
    const int units = num_units(), sms = p.num_sms;
    if (p.deterministic || sms <= 0 || max_slots <= 0) { return; }  // fixed-order dQ: never split
    const bool longest_first = order == kLongestFirst;
    // The work model assumes full rows; packed documents (segment ids) give
    // key blocks far less work, so their grids of several waves stay whole.
    if (longest_first && units > sms && p.pair.q_ids != nullptr && p.tile_pieces <= 0) { return; }
    const int r = longest_first ? min(units, max_slots) : units % sms;
    const int blocks_per_unit = (p.t + block_m - 1) / block_m * (p.n / p.kh);
    const int q_max = min(kMaxPieces, blocks_per_unit / kMinBlocksPerPiece);
    if (r == 0 || r > max_slots) { return; }
    constexpr double kStep = 0.05;
    std::vector<int> blocks(num_n);  // query blocks per head of each key block
    std::vector<double> prefix;      // the SMs' free times once the units before the split ones are dispatched
    if (longest_first) {
      // Splitting saves at most the longest unit's time: not worth a simulation
      // where that is below the step.
      double total = 0, longest = 0;
      for (int n = 0; n < num_n; ++n) {
        blocks[n] = query_blocks(p, block_m, block_n, n);
        const double w = work(p, blocks[n], 0, 1);
        total += w * num_hb;
        longest = fmax(longest, w);
      }
      if (longest < kStep * total / sms && p.tile_pieces <= 0) { return; }
      prefix.assign(sms, 0.0);
      dispatch(p, blocks, 0, units - r, prefix);
    }
    auto cost = [&](int q) {
      if (!longest_first) { return double((r * q + sms - 1) / sms) / q; }
      BwdTileOrder o = *this;
      o.pieces = q;
      o.split_from = q > 1 ? units - r : units;
      std::vector<double> at = prefix;
      return o.dispatch(p, blocks, units - r, o.num_ctas(), at);
    };
    if (p.tile_pieces > 0) {
      pieces = min(p.tile_pieces, kMaxPieces);
    } else {
      double best = cost(1);
      const double margin = kStep * (longest_first ? best : 1.0);
      for (int q = 2; q <= q_max; ++q) {
        const double c = cost(q);
        if (c < best - margin) { best = c; pieces = q; }
      }
    }
    if (pieces > 1) { split_from = units - r; }
  }

  // The query blocks (per head) whose rows see key block n at full length.
  static int query_blocks(const BwdParams& p, int block_m, int block_n, int n) {
    const Interval rows = MaskRule{p.t, p.s, p.window_left, p.window_right}.row_range(n * block_n,
                                                                                     min((n + 1) * block_n, p.s));
    return rows.empty() ? 0 : (rows.hi + block_m - 1) / block_m - rows.lo / block_m;
  }
  // Work of share `piece` of `pieces` of a unit whose key block spans
  // `blocks` query blocks per head: its part of them as
  // KeyBlockMask::take_share cuts them (times the GQA group), plus the K/V
  // load and epilogue, plus the combine of a split one.
  static constexpr double kUnitOverhead = 1.0, kShareOverhead = 1.0;
  static double work(const BwdParams& p, int blocks, int piece, int pieces) {
    const int share = blocks * (piece + 1) / pieces - blocks * piece / pieces;
    return double(p.n / p.kh) * share + kUnitOverhead + (pieces > 1 ? kShareOverhead : 0.0);
  }

  // Greedy dispatch of CTAs [begin, end) (each to the SM that frees first, as
  // the kernel's tile counter does) onto the SMs' free times `at`; returns
  // the last free time. blocks: query_blocks of each key block.
  double dispatch(const BwdParams& p, const std::vector<int>& blocks, int begin, int end,
                  std::vector<double>& at) const {
    const auto later = std::greater<double>();
    std::make_heap(at.begin(), at.end(), later);
    for (int bid = begin; bid < end; ++bid) {
      const BwdTile t = (*this)(bid);
      std::pop_heap(at.begin(), at.end(), later);
      at.back() += work(p, blocks[t.n_block], t.piece, t.pieces);
      std::push_heap(at.begin(), at.end(), later);
    }
    return *std::max_element(at.begin(), at.end());
  }

  CUTE_HOST_DEVICE BwdTile operator()(int bid) const {
    BwdTile t;
    int unit = bid;
    if (bid >= split_from) {
      const int k = bid - split_from;
      t.slot = k / pieces;
      t.piece = k - t.slot * pieces;
      t.pieces = pieces;
      unit = split_from + t.slot;
    }
    int n, hb;
    if (order == kLongestFirst) {
      const int per_chunk = chunk * num_hb;
      const int c = unit / per_chunk;  // all chunks but the last are full
      const int width = min(chunk, num_n - c * chunk);
      const int r = unit - c * per_chunk;
      hb = r / width;
      n = c * chunk + r % width;
    } else {
      hb = unit / num_n;
      n = unit % num_n;
      if (order == kDescending) { n = num_n - 1 - n; }
    }
    t.n_block = n;
    t.kv_head = hb % kh;
    t.batch = hb / kh;
    return t;
  }
};

}  // namespace jax_fa3

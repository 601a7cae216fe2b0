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
// Any order but the deterministic one may split the key blocks of the grid's
// last, partial wave (plan_split), which would otherwise leave SMs idle at
// the end of the grid. Each such block becomes `pieces` CTAs, appended at the
// end of the grid, that take equal shares of its query blocks; they combine
// dK/dV in fp32 (epilogue.h).
#pragma once

#include <cmath>
#include <cute/config.hpp>
#include "../common/mask.h"
#include "params.h"

namespace jax_fa3 {

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
  // (the H200 has 60 MB of L2), else kDefaultChunk, or kWideChunk when it
  // does not fit even then and there are at least kWideMinUnitsPerSm key
  // blocks per SM. A chunk as wide as a head makes the order head-major
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

  // Splitting the key blocks of the grid's last wave into q shares each.
  //  - Equal units (head-major): r = units % sms of them take ceil(r q / sms)
  //    rounds of 1/q of a unit's time instead of one round of 1.
  //  - Longest first: its last wave holds the shortest key blocks, so it
  //    splits only when everything fits in one wave; there the longest key
  //    block bounds the finish (GQA 8/1, 8k, batch 1: 64 key blocks on 132
  //    SMs, the first 2x the mean), so every block splits. The estimate:
  //    with greedy dispatch (the kernel's tile counter), a share of work w
  //    dispatched when R is left (its own and everything after it) ends
  //    about w - R / sms after the others, so the finish is about
  //    total / sms + max(w - R / sms).
  // Either way choose the q that saves the most, preferring fewer shares
  // unless more save another 5%. tile_pieces (> 0) overrides the choice.
  void plan_split(const BwdParams& p, int block_m, int block_n, int max_slots) {
    const int units = num_units(), sms = p.num_sms;
    const bool one_wave = order == kLongestFirst && units <= sms;
    if (order == kDescending || sms <= 0 || (order == kLongestFirst && !one_wave)) { return; }
    const int r = one_wave ? units : units % sms;
    const int blocks_per_unit = (p.t + block_m - 1) / block_m * (p.n / p.kh);
    const int q_max = min(kMaxPieces, blocks_per_unit / kMinBlocksPerPiece);
    if (r == 0 || r > max_slots) { return; }
    auto cost = [&](int q) {
      if (!one_wave) { return float((r * q + sms - 1) / sms) / q; }
      double left = 0, worst = 0;  // left: the work from this share on; all of it at the end
      for (int u = units - 1; u >= 0; --u) {
        const double w = share_work(p, block_m, block_n, u, q);
        for (int k = 0; k < q; ++k) {
          left += w;
          worst = fmax(worst, w - left / sms);
        }
      }
      return float(left / sms + worst);
    };
    if (p.tile_pieces > 0) {
      pieces = min(p.tile_pieces, kMaxPieces);
    } else {
      float best = cost(1);
      const float step = one_wave ? 0.05f * best : 0.05f;
      for (int q = 2; q <= q_max; ++q) {
        const float c = cost(q);
        if (c < best - step) { best = c; pieces = q; }
      }
    }
    if (pieces > 1) { split_from = units - r; }
  }
  // Work of one share of unit u (in dispatch order) split q ways, in query
  // blocks: its part of the blocks the key block's rows span at full length
  // (times the GQA group), plus the K/V load and epilogue, plus the combine.
  static constexpr double kUnitOverhead = 1.0, kShareOverhead = 1.0;
  double share_work(const BwdParams& p, int block_m, int block_n, int u, int q) const {
    const int j = (*this)(u).n_block;
    const Interval rows = MaskRule{p.t, p.s, p.window_left, p.window_right}.row_range(j * block_n,
                                                                                     min((j + 1) * block_n, p.s));
    const int blocks = rows.empty() ? 0 : (rows.hi + block_m - 1) / block_m - rows.lo / block_m;
    return double(p.n / p.kh) * blocks / q + kUnitOverhead + (q > 1 ? kShareOverhead : 0.0);
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

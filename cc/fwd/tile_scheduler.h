// Which (query block, head, batch) tile a CTA works on next. The kernel loops
// "for tile = first(); tile.valid; tile = next(tile)" over a persistent grid:
// at most one CTA per SM walking a strided list of work units (CTA c takes units c,
// c + grid, c + 2 grid, ...).
//  - With a causal-like window (work grows with m) a unit is a pair of tiles of
//    equal total cost (decode()).
//  - Otherwise a unit is one tile. The m-blocks of one (head, batch) are
//    adjacent, so concurrently running CTAs share K/V in L2, and row r of the
//    num_hb (head, batch) rows starts at m = r * num_m / num_hb: the stride is
//    often a multiple of num_m, and unrotated a CTA met the same m in every
//    row, which left it all the short (or all the long) tiles of a banded
//    window, whose first blocks see fewer keys; rotated, its m are spread
//    evenly over the row.
//  - With segment ids a tile's cost depends on the data (packed documents: a
//    sawtooth over m), which no fixed stride balances: one CTA per tile, so
//    the hardware hands the next tile to whichever SM frees first, in a
//    longest-first-like order (m high to low) within groups of kHeadGroup
//    (head, batch) rows, whose K/V then share L2. (Masks keep the persistent
//    orders: a causal mask costs like is_causal.)
// A head-major longest-first list handed some CTAs only heavy tiles under a
// fixed stride, and an m-major order (longest first across all heads) put
// every concurrent CTA on a different head, re-reading K/V from HBM.
#pragma once

#include <cute/config.hpp>
#include "params.h"

namespace jax_fa3 {

// batch: with split-KV (FwdParams::num_splits) the part's row of O and LSE,
// b * num_splits + part (data_batch() gives b).
struct WorkTile {
  int m_block, head, batch;
  bool valid;
};

CUTE_HOST_DEVICE int data_batch(const FwdParams& p, int batch) {
  return p.num_splits == 1 ? batch : batch / p.num_splits;
}

struct PersistentTileScheduler {
  static constexpr int kHeadGroup = 8;
  int num_m, num_heads, num_hb;
  bool pairs;  // causal-like: a work unit is a tile pair
  bool single;  // segment ids: one tile per CTA
  int num_pairs, num_units;
  int idx, half;  // current work unit; which tile of a pair

  CUTE_HOST_DEVICE static bool causal_like(const FwdParams& p) {  // work grows with m
    return p.window_right >= 0 && (p.window_left < 0 || p.window_left >= p.t - 1);  // no row meets the left bound
  }
  CUTE_HOST_DEVICE static bool one_tile_per_cta(const FwdParams& p) { return p.pair.q_ids != nullptr; }
  CUTE_HOST_DEVICE static int num_units_of(const FwdParams& p, int block_m) {
    const int num_m = (p.t + block_m - 1) / block_m;
    const int batches = p.b * p.num_splits;
    if (causal_like(p) && !one_tile_per_cta(p)) { return (num_m + 1) / 2 * p.n * batches; }
    return num_m * p.n * batches;
  }
  // The fewest CTAs that finish the equal-cost units in as many rounds as one
  // CTA per SM would: every CTA then stays busy to the end. (A memory-bound
  // decode grid of 256 or 512 tiles on 132 SMs read slower with the last
  // round on 124 or 116 SMs than with all rounds on 128.)
  static dim3 grid(const FwdParams& p, int block_m) {
    const long long units = num_units_of(p, block_m);
    if (one_tile_per_cta(p)) { return dim3(unsigned(units), 1, 1); }
    const long long sms = p.num_sms > 0 ? p.num_sms : 132;  // as the backward's scheduler assumes
    const long long rounds = (units + sms - 1) / sms;
    return dim3(unsigned((units + rounds - 1) / rounds), 1, 1);
  }
  CUTE_HOST_DEVICE PersistentTileScheduler(const FwdParams& p, int block_m) {
    num_m = (p.t + block_m - 1) / block_m;
    num_heads = p.n;
    num_hb = p.n * p.b * p.num_splits;
    single = one_tile_per_cta(p);
    pairs = causal_like(p) && !single;
    num_pairs = (num_m + 1) / 2;
    num_units = num_units_of(p, block_m);
  }
  // Causal-like problems: a work unit is the tile pair (m, num_m-1-m) of one
  // (head, batch), whose block counts sum to num_m + 1 whatever m is, so a
  // fixed stride over equal-cost units balances the CTAs; the units of one
  // head are adjacent, so the CTAs running at the same time share its K/V in L2.
  CUTE_HOST_DEVICE WorkTile decode() const {
    if (idx >= num_units) { return {0, 0, 0, false}; }
    int m, hb;
    if (single) {  // groups of kHeadGroup (head, batch) rows, m high to low, rows inner
      const int g = idx / (kHeadGroup * num_m);
      const int rows = min(kHeadGroup, num_hb - g * kHeadGroup);
      const int r = idx - g * kHeadGroup * num_m;
      m = num_m - 1 - r / rows;
      hb = g * kHeadGroup + r % rows;
    } else if (pairs) {
      hb = idx / num_pairs;
      const int pair = idx % num_pairs;
      m = half == 0 ? num_m - 1 - pair : pair;
    } else {
      hb = idx / num_m;
      m = (idx % num_m + hb * num_m / num_hb) % num_m;  // hb * num_m <= idx
    }
    return {m, hb % num_heads, hb / num_heads, true};
  }
  CUTE_DEVICE WorkTile first() { return start(blockIdx.x); }
  CUTE_DEVICE WorkTile next(const WorkTile& cur) { return step(cur, gridDim.x); }
  // CTA `cta`'s first tile, and the tile after `cur` on a grid of `grid` CTAs.
  CUTE_HOST_DEVICE WorkTile start(int cta) { idx = cta; half = 0; return decode(); }
  CUTE_HOST_DEVICE WorkTile step(const WorkTile& cur, int grid) {
    if (single) { return {0, 0, 0, false}; }
    // The second tile of a pair, unless the pair is the odd middle tile.
    if (pairs && half == 0 && cur.m_block != num_m - 1 - cur.m_block) {
      half = 1;
    } else {
      idx += grid; half = 0;
    }
    return decode();
  }
};

}  // namespace jax_fa3

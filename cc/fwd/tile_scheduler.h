// Which (query block, head, batch) tile a CTA works on next. The kernel loops
// "for tile = first(); tile.valid; tile = next(tile)", so schedulers are
// interchangeable.
//  - StaticTileScheduler: one tile per CTA (grid = all tiles).
//  - PersistentTileScheduler: one CTA per SM walking a strided tile list
//    (CTA c takes tiles c, c + grid, c + 2 grid, ...). Without a window all
//    tiles cost the same and the m-blocks of one (head, batch) are adjacent,
//    so concurrently running CTAs share K/V in L2. With a causal-like window
//    (work grows with m) see decode(): equal-cost tile pairs. (A head-major
//    longest-first tile list was measured: with a fixed stride it hands some
//    CTAs only heavy tiles -- at causal d128 16k it ran 439 TFLOP/s against
//    583 for the m-major order.)
#pragma once

#include <cute/config.hpp>
#include "params.h"

namespace jax_fa3 {

struct WorkTile {
  int m_block, head, batch;
  bool valid;
};

struct StaticTileScheduler {
  static dim3 grid(const FwdParams& p, int block_m) {
    return dim3((p.t + block_m - 1) / block_m, p.n, p.b);
  }
  CUTE_DEVICE StaticTileScheduler(const FwdParams&, int) {}
  CUTE_DEVICE WorkTile first() const {
    return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z), true};
  }
  CUTE_DEVICE WorkTile next(const WorkTile&) const { return {0, 0, 0, false}; }
};

struct PersistentTileScheduler {
  int num_m, num_hb, num_heads, total;
  int order;  // kHeadMajor, kPairs or kMMajor
  int num_pairs, num_units;
  int idx, half;  // current work unit; which tile of a pair (kPairs)

  enum : int { kHeadMajor = 0, kPairs = 1, kMMajor = 2 };

  CUTE_HOST_DEVICE static bool causal_like(const FwdParams& p) {
    return p.window_right >= 0 && p.window_left < 0;  // work grows with m
  }
  CUTE_HOST_DEVICE static int num_units_of(const FwdParams& p, int block_m) {
    const int num_m = (p.t + block_m - 1) / block_m;
    if (causal_like(p) && p.causal_order == 0) { return (num_m + 1) / 2 * p.n * p.b; }
    return num_m * p.n * p.b;
  }
  static dim3 grid(const FwdParams& p, int block_m) {
    long long units = num_units_of(p, block_m);
    return dim3(unsigned(units < p.num_sms ? units : p.num_sms), 1, 1);
  }
  CUTE_DEVICE PersistentTileScheduler(const FwdParams& p, int block_m) {
    num_m = (p.t + block_m - 1) / block_m;
    num_heads = p.n;
    num_hb = p.n * p.b;
    total = num_m * num_hb;
    order = !causal_like(p) ? kHeadMajor : (p.causal_order == 0 ? kPairs : kMMajor);
    num_pairs = (num_m + 1) / 2;
    num_units = num_units_of(p, block_m);
  }
  // Causal-like problems, kPairs: a work unit is the tile pair (m, num_m-1-m)
  // of one (head, batch), whose block counts sum to num_m + 1 whatever m is, so
  // a fixed stride over equal-cost units balances the CTAs; the units of one
  // head are adjacent, so the CTAs running at the same time share its K/V in
  // L2. (kMMajor, longest m first across all heads, balanced as well but with
  // every concurrent CTA on a different head it re-read K/V from HBM.)
  CUTE_DEVICE WorkTile decode() const {
    if (idx >= num_units) { return {0, 0, 0, false}; }
    int m, hb;
    if (order == kPairs) {
      hb = idx / num_pairs;
      const int pair = idx % num_pairs;
      m = half == 0 ? num_m - 1 - pair : pair;
    } else if (order == kMMajor) {
      m = num_m - 1 - idx / num_hb; hb = idx % num_hb;
    } else {
      m = idx % num_m; hb = idx / num_m;
    }
    return {m, hb % num_heads, hb / num_heads, true};
  }
  CUTE_DEVICE WorkTile first() { idx = blockIdx.x; half = 0; return decode(); }
  CUTE_DEVICE WorkTile next(const WorkTile& cur) {
    // The second tile of a pair, unless the pair is the odd middle tile.
    if (order == kPairs && half == 0 && cur.m_block != num_m - 1 - cur.m_block) {
      half = 1;
    } else {
      idx += gridDim.x; half = 0;
    }
    return decode();
  }
};

}  // namespace jax_fa3

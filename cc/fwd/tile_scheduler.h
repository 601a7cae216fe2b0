// Which (query block, head, batch) tile a CTA works on next. The kernel loops
// "for tile = first(); tile.valid; tile = next(tile)", so schedulers are
// interchangeable.
//  - StaticTileScheduler: one tile per CTA (grid = all tiles).
//  - PersistentTileScheduler: one CTA per SM walking a strided tile list
//    (CTA c takes tiles c, c + grid, c + 2 grid, ...). Without a window all
//    tiles cost the same and the m-blocks of one (head, batch) are adjacent,
//    so concurrently running CTAs share K/V in L2. With a causal-like window
//    (work grows with m) the list is m-major, longest m first across all
//    heads: every CTA's stride then walks down the same cost curve, so the
//    per-CTA totals match. (A head-major longest-first list was measured:
//    with a fixed stride it hands some CTAs only heavy tiles -- at causal d128
//    16k it ran 439 TFLOP/s against 583 for this order.)
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
  bool heavy_first;
  int idx;

  static dim3 grid(const FwdParams& p, int block_m) {
    long long tiles = (long long)((p.t + block_m - 1) / block_m) * p.n * p.b;
    return dim3(unsigned(tiles < p.num_sms ? tiles : p.num_sms), 1, 1);
  }
  CUTE_DEVICE PersistentTileScheduler(const FwdParams& p, int block_m) {
    num_m = (p.t + block_m - 1) / block_m;
    num_heads = p.n;
    num_hb = p.n * p.b;
    total = num_m * num_hb;
    heavy_first = p.window_right >= 0 && p.window_left < 0;  // causal-like: work grows with m
  }
  CUTE_DEVICE WorkTile decode(int i) const {
    if (i >= total) { return {0, 0, 0, false}; }
    int m, hb;
    if (heavy_first) { m = num_m - 1 - i / num_hb; hb = i % num_hb; }
    else { m = i % num_m; hb = i / num_m; }
    return {m, hb % num_heads, hb / num_heads, true};
  }
  CUTE_DEVICE WorkTile first() { idx = blockIdx.x; return decode(idx); }
  CUTE_DEVICE WorkTile next(const WorkTile&) { idx += gridDim.x; return decode(idx); }
};

}  // namespace jax_fa3

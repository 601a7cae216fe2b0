// Which (query block, head, batch) tile a CTA works on. The static scheduler
// maps one tile to one CTA; the kernel already loops over tiles, so a
// persistent scheduler can replace it without touching the pieces.
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
  CUTE_DEVICE WorkTile first() const {
    return {int(blockIdx.x), int(blockIdx.y), int(blockIdx.z), true};
  }
  CUTE_DEVICE WorkTile next(const WorkTile&) const { return {0, 0, 0, false}; }
};

}  // namespace jax_fa3

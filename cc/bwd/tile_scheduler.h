// Which (key block, KV head, batch) each CTA of the backward takes. The grid
// is 1-D and the launcher picks one of three orders:
//  - head-major: the key blocks of one (head, batch) are adjacent, so the CTAs
//    in flight share that head's Q, dO and dQ accumulator in L2.
//  - longest first, for causal-like masks without determinism (key block j
//    visits about T - j * kBlockN query rows, so low blocks are the long
//    ones): chunks of kChunk key blocks, every head's chunk 0 first, then
//    chunk 1, ...; head-major inside a chunk, so the CTAs in flight still
//    share a few heads. Head-major alone started the last head's longest
//    blocks near the end of the grid (a tail of up to one such block: at GQA
//    16/4, 8k, the longest CTA is a quarter of an SM's share of the work).
//  - descending, for deterministic causal-like runs: head-major with key
//    blocks high to low, so a CTA waits only on CTAs dispatched before it
//    (mask.h, dq_turn).
#pragma once

#include <cute/config.hpp>
#include "params.h"

namespace jax_fa3 {

struct BwdTile {
  int n_block, kv_head, batch;
};

struct BwdTileOrder {
  enum : int { kHeadMajor = 0, kDescending = 1, kLongestFirst = 2 };
  // Key blocks per chunk: with at most ~132 CTAs in flight, about four heads'
  // Q/dO/dQ working sets are live at once (a 16k head's fp32 dQ is 8 MB).
  static constexpr int kChunk = 32;
  int order, num_n, num_hb, kh;

  // head_major_only: the A/B knob (JAX_FA3_BWD_ORDER=head).
  static BwdTileOrder make(const BwdParams& p, int block_n, bool head_major_only) {
    const bool causal_like = p.window_right >= 0 && p.window_left < 0;
    const int order = (p.deterministic && p.window_right >= 0) ? kDescending
                      : (causal_like && !head_major_only)      ? kLongestFirst
                                                               : kHeadMajor;
    return {order, (p.s + block_n - 1) / block_n, p.kh * p.b, p.kh};
  }
  int num_ctas() const { return num_n * num_hb; }

  CUTE_HOST_DEVICE BwdTile operator()(int bid) const {
    int n, hb;
    if (order == kLongestFirst) {
      const int per_chunk = kChunk * num_hb;
      const int chunk = bid / per_chunk;  // all chunks but the last are full
      const int width = min(kChunk, num_n - chunk * kChunk);
      const int r = bid - chunk * per_chunk;
      hb = r / width;
      n = chunk * kChunk + r % width;
    } else {
      hb = bid / num_n;
      n = bid % num_n;
      if (order == kDescending) { n = num_n - 1 - n; }
    }
    return {n, hb % kh, hb / kh};
  }
};

}  // namespace jax_fa3

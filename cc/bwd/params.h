// Problem description of the backward pass, shared by the FFI handler and
// every backward instantiation. Plain data only (host code includes it).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "../fwd/params.h"  // DType

namespace jax_fa3 {

// Query rows of the fp32 scratch arrays are padded to a multiple of this, so
// the kernel's query blocks (<= 128 rows) never index past them.
constexpr int kBwdRowPad = 128;
// Query-block size of every backward instantiation; the deterministic-mode
// semaphores are per (batch, head, query block of this size).
constexpr int kBwdBlockM = 64;

// Split key blocks (tile_scheduler.h, BwdTileOrder::plan_split): the key
// blocks at the end of the grid may run as several CTAs that each take a
// share of the query blocks and add their fp32 dK/dV into a scratch slot;
// the last one to finish stores the sums. This caps the split key blocks
// per call (a wave and a fifth on an H100/H200 SXM's 132 SMs).
constexpr int kBwdMaxSplitUnits = 160;
// The last of those counters is the persistent kernel's tile counter (kernel.h;
// zeroed by the preprocess), so at most kBwdTileCounter key blocks split.
constexpr int kBwdTileCounter = kBwdMaxSplitUnits - 1;
// Scratch floats: kBwdMaxSplitUnits int32 counters, then per split key block
// dK and dV partials of up to 128 keys x d. jax_fa3/primitives.py mirrors it.
inline int64_t bwd_split_scratch_floats(int b, int s, int kh, int d) {
  const int64_t units = int64_t(b) * kh * ((s + 63) / 64);  // kBlockN >= 64 everywhere
  const int64_t slots = units < kBwdMaxSplitUnits ? units : kBwdMaxSplitUnits;
  return kBwdMaxSplitUnits + slots * 2 * 128 * d;
}

struct BwdParams {
  // BTNH tensors, contiguous, as in FwdParams (d_v: V's head dim).
  const void* q = nullptr;     // [b, t, n, d]
  const void* k = nullptr;     // [b, s, kh, d]
  const void* v = nullptr;     // [b, s, kh, d_v]
  const void* o = nullptr;     // [b, t, n, d_v]
  const void* dout = nullptr;  // [b, t, n, d_v]
  const float* lse = nullptr;  // [b, n, t] natural log, +inf for rows that see no key
  const int32_t* q_lens = nullptr;
  const int32_t* kv_lens = nullptr;
  PairRuleParams pair;
  BiasParams bias;  // grad: the bias gradient (fwd/params.h)
  void* dq = nullptr;          // [b, t, n, d]
  void* dk = nullptr;          // [b, s, kh, d]
  void* dv = nullptr;          // [b, s, kh, d_v]
  // Scratch (extra custom-call outputs; t_pad = round_up(t, kBwdRowPad)).
  float* dq_accum = nullptr;   // [b, n, t_pad, d] fp32 sum of dS K over key blocks
  float* delta = nullptr;      // [b, n, t_pad] rowsum(dO * O)
  float* lse_log2 = nullptr;   // [b, n, t_pad] lse * log2(e), +inf on padding rows
  int32_t* semaphore = nullptr;  // [b, n, t_pad / kBwdBlockM] deterministic dQ turn counters
  float* dkv_split = nullptr;    // [bwd_split_scratch_floats(b, s, kh, d)] split key blocks' sums
  int64_t dkv_split_floats = 0;

  int b = 0, t = 0, s = 0, n = 0, kh = 0, d = 0, t_pad = 0;
  float scale = 1.f;
  float softcap = 0.f;
  int window_left = -1, window_right = -1;
  bool deterministic = false;  // fixed-order dQ sums; never splits key blocks (tile_scheduler.h)
  int num_sms = 0;
  int d_v = 0;  // V's, O's and dV's head dim (latent attention: 128 at d = 192); 0: d
  // Dispatch overrides for the timing driver's sweeps (tile_scheduler.h):
  // key blocks per chunk of the longest-first order, shares per split key
  // block (1: none); 0: the launcher's choice.
  int tile_chunk = 0, tile_pieces = 0;
};

using BwdLauncher = cudaError_t (*)(const BwdParams&, cudaStream_t);

struct BwdKernelEntry {
  DType dtype;
  int head_dim;
  int head_dim_v;  // V's head dim: head_dim, or a value-head-dim tile's (fwd/traits.h, FwdTileConfigV)
  BwdLauncher launch;
};

extern const BwdKernelEntry kBwdKernels[];
extern const int kNumBwdKernels;

}  // namespace jax_fa3

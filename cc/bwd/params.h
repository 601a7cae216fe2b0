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

struct BwdParams {
  // BTNH tensors, contiguous, as in FwdParams.
  const void* q = nullptr;     // [b, t, n, d]
  const void* k = nullptr;     // [b, s, kh, d]
  const void* v = nullptr;     // [b, s, kh, d]
  const void* o = nullptr;     // [b, t, n, d]
  const void* dout = nullptr;  // [b, t, n, d]
  const float* lse = nullptr;  // [b, n, t] natural log, +inf for rows that see no key
  const int32_t* q_lens = nullptr;
  const int32_t* kv_lens = nullptr;
  void* dq = nullptr;          // [b, t, n, d]
  void* dk = nullptr;          // [b, s, kh, d]
  void* dv = nullptr;          // [b, s, kh, d]
  // Scratch (extra custom-call outputs; t_pad = round_up(t, kBwdRowPad)).
  float* dq_accum = nullptr;   // [b, n, t_pad, d] fp32 sum of dS K over key blocks
  float* delta = nullptr;      // [b, n, t_pad] rowsum(dO * O)
  float* lse_log2 = nullptr;   // [b, n, t_pad] lse * log2(e), +inf on padding rows
  int32_t* semaphore = nullptr;  // [b, n, t_pad / kBwdBlockM] deterministic dQ turn counters

  int b = 0, t = 0, s = 0, n = 0, kh = 0, d = 0, t_pad = 0;
  float scale = 1.f;
  float softcap = 0.f;
  int window_left = -1, window_right = -1;
  bool deterministic = false;
  // dQ reduction: false (default) stages the block's dQ in shared memory and
  // adds it with one bulk reduce (cp.reduce.async.bulk .add.f32); true uses
  // per-element fp32 atomics (JAX_FA3_BWD_DQ_ATOMIC=1, for A/B checks).
  bool dq_atomic = false;
};

using BwdLauncher = cudaError_t (*)(const BwdParams&, cudaStream_t);

struct BwdKernelEntry {
  DType dtype;
  int head_dim;
  BwdLauncher launch;
};

extern const BwdKernelEntry kBwdKernels[];
extern const int kNumBwdKernels;

}  // namespace jax_fa3

// Problem description shared by the FFI handler and every forward instantiation.
// Plain data only: this header is included by host code that never sees CuTe.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace jax_fa3 {

// A rule per (query, key) pair on top of the position rule, one of
//  - segment ids (packed sequences): query i sees key j only where
//    q_ids[i] == kv_ids[j];
//  - a boolean mask: query i of head h sees key j only where
//    mask[mb, mh, i, j] (mb, mh: 0 where the mask broadcasts), given as bits
//    in the order the accumulators hold them (mask_bit_index), and
//    transposed (the backward's S^T tiles have key rows).
// The spans summarize one side per granule of kSpanGranule positions as
// int32 {lo, hi, full_lo, full_hi}: the other side's positions that some row
// of the granule sees lie in [lo, hi), and every row sees all of
// [full_lo, full_hi) (empty where a row's visible keys are not one run).
// Query spans are per (mask_b, mask_n) slice, key spans per (mask_b,
// mask_kh) slice (a kv head's spans cover its query-head group).
// jax_fa3/pair_rule.py writes them. All null: no such rule.
constexpr int kSpanGranule = 16;
// Mask bits, [mask_b, mask_n, rows, 4, chunks] uint32 with chunks =
// ceil(cols / 128) + 1: word [row, t, c] holds the row's columns
// 128 c + 8 j + 2 t + e (j < 16, e < 2) at bit 2 j + e, i.e. what accumulator
// lane t % 4 of a WGMMA C fragment holds (columns 2t, 2t+1 of every 8), so a
// thread reads two words per row and block. The extra chunk keeps the second
// word of the last block inside the row.
inline constexpr int64_t mask_chunks(int64_t cols) { return (cols + 127) / 128 + 1; }

struct PairRuleParams {
  const int32_t* q_ids = nullptr;     // [b, t]
  const int32_t* kv_ids = nullptr;    // [b, s]
  const uint32_t* mask = nullptr;     // or the mask bits: [mask_b, mask_n, t, 4, mask_chunks(s)]
  const uint32_t* mask_t = nullptr;   //   and transposed: [mask_b, mask_n, s, 4, mask_chunks(t)]
  const int32_t* q_spans = nullptr;   // [slices, ceil(t / kSpanGranule), 4]: keys of query granules
  const int32_t* kv_spans = nullptr;  // [slices, ceil(s / kSpanGranule), 4]: queries of key granules
  int mask_b = 1, mask_n = 1, mask_kh = 1;  // mask extents (1: broadcast); ids: b, 1, 1
};

// An additive bias on the scores: softmax over scale * q.k + bias (with a
// softcap, cap * tanh(scale * q.k / cap) + bias), in the kernel's dtype,
// [bias_b, bias_n, t, row_stride] with bias_b in {1, b}, bias_n in {1, n}
// (strides 0 where it broadcasts) and row_stride = s rounded up to even (the
// forward reads column pairs). The backward writes dS, the bias gradient, to
// grad [b, n, t, row_stride] where grad is not null, in float32 where
// grad_f32 (the caller sums it over broadcast dims) else the kernel's dtype;
// its launcher zeroes grad first (tiles no query block visits are not
// written). ptr null: no bias.
struct BiasParams {
  const void* ptr = nullptr;
  void* grad = nullptr;
  bool grad_f32 = false;
  int64_t stride_b = 0, stride_n = 0;  // elements
  int64_t row_stride = 0;
};

// Where the keys of a KV cache live (the KV-cache entry point): key block j
// of batch row b is block (j % per_page) of page
// table[b * pages_per_row + j / per_page] of a [num_pages, page_size, kh, d]
// cache (per_page = page_size / kBlockN; page ids clamped to the cache). A
// contiguous [b, s, kh, d] cache has no table: block j of batch b.
struct PagedKV {
  const int32_t* table = nullptr;  // [b, pages_per_row]
  int pages_per_row = 0, page_size = 0, num_pages = 0;
};

struct FwdParams {
  // BTNH tensors, contiguous (XLA's default row-major layout).
  const void* q = nullptr;   // [b, t, n, d]
  const void* k = nullptr;   // [b, s, kh, d]
  const void* v = nullptr;   // [b, s, kh, dv]
  void* o = nullptr;         // [b, t, n, dv]
  float* lse = nullptr;      // [b, n, t], natural log; +inf for rows that see no key
  const int32_t* q_lens = nullptr;   // [b] valid query rows per batch (clamped to t); null: all t
  const int32_t* kv_lens = nullptr;  // [b] valid key rows per batch (clamped to [0, s])
  // [n] per-head logit of a virtual key with value 0 that joins every row's
  // softmax (attention sinks); null: none.
  const float* sinks = nullptr;
  PairRuleParams pair;
  BiasParams bias;
  // KV caches align queries bottom-right: query row i of batch b sits at
  // position kv_len[b] - (t >> q_pack_log2) + (i >> q_pack_log2) for the
  // position rule, kv_len[b] clamped to [0, s] in the kernel, so the caller's
  // cache lengths reach it as given (false: position i). q_pack_log2 > 0
  // stacks a kv head's query heads as rows (GQA packing: one K/V read serves
  // the group).
  bool bottom_right = false;
  int q_pack_log2 = 0;
  // Rows appended to the cache ahead of this call (kv_append.h): a batch
  // row's keys are min(clamp(kv_lens[b], 0, s) + kv_len_add, s).
  int kv_len_add = 0;
  PagedKV pages;
  // Split-KV: each (query block, head, batch) runs as num_splits parts of its
  // key blocks; part s of batch b writes O and LSE of batch b * num_splits + s
  // (o [b * num_splits, t, n, d], lse [b * num_splits, n, t]), normalized
  // over its own keys; the caller merges them by their LSE.
  int num_splits = 1;

  int b = 0, t = 0, s = 0, n = 0, kh = 0, d = 0;
  int dv = 0;  // V's and O's head dim (v [b, s, kh, dv], o [b, t, n, dv]); 0: d
  float scale = 1.f;
  float softcap = 0.f;     // 0 = off; else scores -> softcap * tanh(score / softcap)
  int window_left = -1;    // key j visible from query i iff j >= i - left (-1: unbounded)
  int window_right = -1;   //                          and j <= i + right (-1: unbounded)
  int num_sms = 0;
  // Q and O are stored heads-major, q [b, n, t, d] and o [b * num_splits, n,
  // t, dv] (the KV-cache entry point's packed GQA rows: a decode step's
  // queries need no transpose). Read by the host launcher only.
  bool heads_major = false;
};

// One entry per compiled (dtype, head dim) instantiation.
using FwdLauncher = cudaError_t (*)(const FwdParams&, cudaStream_t);

enum class DType : int { kBF16 = 0, kFP16 = 1 };

struct FwdKernelEntry {
  DType dtype;
  int head_dim;
  const char* variant;  // "default", or a tile the handler picks per problem ("m192")
  FwdLauncher launch;
};

// Generated at configure time (see CMakeLists.txt): the compiled instantiations.
extern const FwdKernelEntry kFwdKernels[];
extern const int kNumFwdKernels;

}  // namespace jax_fa3

#include "kv_append.h"

#include <algorithm>

#include <cuda_runtime.h>

namespace jax_fa3 {
namespace {

// One thread per 16-byte chunk of a new K or V row: a decode step appends a
// few KB, so the launch, not the copy, is the cost.
__global__ void kv_append_kernel(const KvAppendParams p) {
  const int chunks = p.row_bytes / 16;
  const int64_t rows = int64_t(p.b) * p.tq * p.kh;
  const int64_t total = 2 * rows * chunks;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(idx % chunks);
    const int64_t row = (idx / chunks) % rows;  // (b, i, h) of the new rows
    const bool is_v = idx >= rows * chunks;
    const int h = int(row % p.kh);
    const int i = int(row / p.kh % p.tq);
    const int b = int(row / p.kh / p.tq);
    const int pos = min(max(p.seqlens[b], 0), p.capacity) + i;
    if (pos >= p.capacity) { continue; }
    int64_t slot;  // [slot, kh] row of the cache
    if (p.pages.table != nullptr) {
      // A page id outside the pool (-1: unallocated) drops the row rather
      // than overwrite another row's page.
      const int page = p.pages.table[int64_t(b) * p.pages.pages_per_row + pos / p.pages.page_size];
      if (page < 0 || page >= p.pages.num_pages) { continue; }
      slot = int64_t(page) * p.pages.page_size + pos % p.pages.page_size;
    } else {
      slot = int64_t(b) * p.capacity + pos;
    }
    const int4* src = reinterpret_cast<const int4*>(is_v ? p.v_new : p.k_new) + row * chunks + c;
    int4* dst = reinterpret_cast<int4*>(is_v ? p.v_cache : p.k_cache) + (slot * p.kh + h) * chunks + c;
    *dst = *src;
  }
}

}  // namespace

cudaError_t launch_kv_append(const KvAppendParams& p, cudaStream_t stream) {
  if (p.row_bytes % 16 != 0 || p.row_bytes <= 0 || p.capacity < 0 ||
      (p.pages.table != nullptr && (p.pages.page_size < 1 || p.pages.num_pages < 1 ||
                                    int64_t(p.pages.pages_per_row) * p.pages.page_size != p.capacity))) {
    return cudaErrorInvalidValue;
  }
  const int64_t total = 2 * int64_t(p.b) * p.tq * p.kh * (p.row_bytes / 16);
  if (total == 0) { return cudaSuccess; }
  constexpr int kThreads = 256;
  const int blocks = int(std::min<int64_t>((total + kThreads - 1) / kThreads, 4096));
  kv_append_kernel<<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_fa3

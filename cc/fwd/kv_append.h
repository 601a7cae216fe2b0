// Appending new keys and values to a KV cache in place, ahead of the
// attention call that reads them (jax_fa3/kvcache.py). Plain data: included
// by host code.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "params.h"

namespace jax_fa3 {

// Row i of batch b of k_new / v_new [b, tq, kh, d] lands at position
// clamp(seqlens[b], 0, capacity) + i of that batch row's cache (through the
// page table when paged); rows at or past the capacity, or whose page id is
// outside the pool, are dropped (the attention kernels clamp page ids when
// they read, so nothing outside the pool is touched either way). The copy is
// dtype-blind: rows of row_bytes (a multiple of 16) bytes.
struct KvAppendParams {
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  void* k_cache = nullptr;  // contiguous [b, capacity, kh, d] or pages [num_pages, page_size, kh, d]
  void* v_cache = nullptr;
  const int32_t* seqlens = nullptr;  // [b], valid positions before the append
  PagedKV pages;                     // table null: contiguous
  int b = 0, tq = 0, kh = 0, row_bytes = 0, capacity = 0;
};

cudaError_t launch_kv_append(const KvAppendParams& p, cudaStream_t stream);

}  // namespace jax_fa3

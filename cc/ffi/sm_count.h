// Multiprocessor count of the current device, cached per device (a process
// may drive several GPUs of different kinds). Host code of every handler.
#pragma once

#include <atomic>
#include <cuda_runtime_api.h>

namespace jax_fa3 {

inline int sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> counts[kMaxDevices] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= kMaxDevices) { dev = 0; }
  int n = counts[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    counts[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

}  // namespace jax_fa3

// FP8 quantize pre-pass: plain data shared by the FFI handler and quantize.cu.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>
#include "../fwd/params.h"

namespace jax_fa3 {

// One tensor [b, seq, heads, d] to quantize in blocks of `block_rows` rows of
// one head: scales[b, heads, ceil(seq / block_rows)] = amax / 448 of the
// (rotated) block (or that rounded up to a power of two), out = e4m3(x / scale).
struct QuantTensor {
  const void* x = nullptr;
  void* out = nullptr;     // e4m3, same shape
  float* scales = nullptr;
  int seq = 0, heads = 0, block_rows = 0;
  int num_rb = 0;          // ceil(seq / block_rows), set by launch_fp8_quantize
  bool hadamard = false;   // rotate rows by diag(signs) * H_d / sqrt(d) first
  const float* fixed_scale = nullptr;  // non-null: per-tensor mode, use *fixed_scale
  // Scales rounded up to a power of two, an all-zero block FLT_MIN (V: the
  // kernel folds V's scale ratios into P, exact only for powers of two; see
  // cc/fp8/mainloop.h). Otherwise amax / 448, an all-zero block 1.
  bool pow2 = false;
  // Write V^T instead ([b, heads, d, fp8_vt_seq(seq)], fp8/params.h): the
  // layout the "vt" FP8 kernel loads with TMA. Needs block_rows == 128.
  bool transpose = false;
};

// Up to three tensors (Q, K, V) in one launch: the pre-pass reads each once.
struct QuantParams {
  QuantTensor t[3];
  int num_tensors = 0;
  int b = 0, d = 0;
  DType dtype = DType::kBF16;
  const float* signs = nullptr;  // [d], +-1
};

cudaError_t launch_fp8_quantize(const QuantParams& p, cudaStream_t stream);

}  // namespace jax_fa3

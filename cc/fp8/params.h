// FP8 forward: problem description shared by the FFI handler and every FP8
// instantiation. Plain data only (host code includes it without CuTe).
//
// Scale layout (float32, row-major), one scale per block the kernel consumes:
//   q_scale [b, n,  ceil(t / kBlockM)]   kBlockM = 128 for every head dim
//   k_scale [b, kh, ceil(s / kBlockN)]   kBlockN = fp8_block_n(d) below
//   v_scale [b, kh, ceil(s / kBlockN)]
// Dequantized value = e4m3 value * scale. Per-tensor scaling is the same
// layout with every entry equal.
#pragma once

#include "../fwd/params.h"

namespace jax_fa3 {

constexpr int kFp8BlockM = 128;
constexpr int fp8_block_n(int /*head_dim*/) { return 128; }  // every head dim (fp8/traits.h)

struct Fp8FwdParams {
  FwdParams base;  // q, k, v point at e4m3 data; o has the output dtype
  const float* q_scale = nullptr;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
};

using Fp8FwdLauncher = cudaError_t (*)(const Fp8FwdParams&, cudaStream_t);

struct Fp8FwdKernelEntry {
  DType out_dtype;  // dtype of O (the attention inputs' dtype before quantization)
  int head_dim;
  Fp8FwdLauncher launch;
};

// Generated at configure time (see the FP8 block of CMakeLists.txt).
extern const Fp8FwdKernelEntry kFp8FwdKernels[];
extern const int kNumFp8FwdKernels;

}  // namespace jax_fa3

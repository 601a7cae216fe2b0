// FP8 forward: problem description shared by the FFI handler and every FP8
// instantiation. Plain data only (host code includes it without CuTe).
//
// Scale layout (float32, row-major), one scale per block the kernel consumes:
//   q_scale [b, n,  ceil(t / kFp8BlockM)]   kFp8BlockM = 128 for every head dim
//   k_scale [b, kh, ceil(s / kFp8BlockN)]   kFp8BlockN = 128 for every head dim
//   v_scale [b, kh, ceil(s / kFp8BlockN)]
// Dequantized value = e4m3 value * scale. Per-tensor scaling is the same
// layout with every entry equal.
//
// V comes in one of two layouts (Fp8FwdParams::v_transposed):
//   [b, s, kh, d]                 as the user holds it (an FP8 KV cache); the
//                                 kernel transposes each tile in shared memory;
//   [b, kh, d, fp8_vt_seq(s)]     V^T as the quantize pre-pass writes it for
//                                 precision="fp8" (QuantTensor::transpose): key
//                                 index contiguous, zero-padded to whole kFp8BlockN
//                                 blocks, keys permuted inside every 32-key
//                                 slice as the P registers need (vt_key_of in
//                                 fp8/transpose.h). TMA loads it as is.
#pragma once

#include "../fwd/params.h"

namespace jax_fa3 {

// Rows of one Q scale block, and keys of one K/V scale block (= the kernel's
// K/V tile, fp8/traits.h), at every head dim.
constexpr int kFp8BlockM = 128;
constexpr int kFp8BlockN = 128;
#if defined(__CUDACC__)
#define JAX_FA3_HOST_DEVICE __host__ __device__
#else
#define JAX_FA3_HOST_DEVICE
#endif

// The key order inside every 32-key slice of V^T (in shared memory, and in
// the V^T layout in global memory): A-fragment position p = 16*h + 4*t + i
// (h: half, t: quad lane, i: byte) holds accumulator column
// 16*h + 8*(i/2) + 2*t + i%2 (the accumulator gives lane t columns 2t, 2t+1 of
// every 8-column group; the e4m3 A operand wants 4 consecutive k per lane).
// See pack_p_fp8 in fp8/mainloop.h.
JAX_FA3_HOST_DEVICE constexpr int vt_key_of(int p) {
  return (p & ~31) + 16 * ((p & 31) / 16) + 8 * ((p % 4) / 2) + 2 * ((p % 16) / 4) + (p % 2);
}

// Padded key count of the V^T layout.
constexpr int64_t fp8_vt_seq(int64_t s) {
  return (s + kFp8BlockN - 1) / kFp8BlockN * kFp8BlockN;
}

struct Fp8FwdParams {
  FwdParams base;  // q, k, v point at e4m3 data; o has the output dtype
  const float* q_scale = nullptr;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  bool v_transposed = false;  // v in the V^T layout above
};

using Fp8FwdLauncher = cudaError_t (*)(const Fp8FwdParams&, cudaStream_t);

struct Fp8FwdKernelEntry {
  DType out_dtype;  // dtype of O (the attention inputs' dtype before quantization)
  int head_dim;
  const char* variant;  // "default": V as [b, s, kh, d], transposed in-kernel; "vt": V^T layout
  Fp8FwdLauncher launch;
};

// Generated at configure time (see the FP8 block of CMakeLists.txt).
extern const Fp8FwdKernelEntry kFp8FwdKernels[];
extern const int kNumFp8FwdKernels;

}  // namespace jax_fa3

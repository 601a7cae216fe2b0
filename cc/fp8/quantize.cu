// The fused FP8 quantize pre-pass. One CTA per (row block, head, batch) of one
// tensor (at d64 / d128 staged in shared memory first, see quantize_kernel);
// each warp owns whole rows, each lane kD / 32 consecutive elements of a row.
// The normalized fast Walsh-Hadamard transform runs in registers: the
// butterflies with stride < kD / 32 inside a lane, the rest across lanes with
// shuffles. The block's rotated values stay in registers between the amax
// reduction and the quantization, so the input is read once.
#include <algorithm>
#include <cfloat>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cute/arch/copy_sm80.hpp>

#include "quantize.h"
#include "params.h"

namespace jax_fa3 {
namespace {

// Threads per CTA by head dim: more warps in flight per SM hide the load
// latency (one CTA is 128 rows of one head). H200, b2 t8192 (d64: b4 t4096
// n32), Q + K + V: d128 0.257 -> 0.178 ms with 512 threads instead of 256,
// d256 0.298 -> 0.205 (512) -> 0.176 ms (1024), d64 0.310 -> 0.285 (512;
// 1024: 0.375).
template <int kD> constexpr int kThreadsFor = kD >= 256 ? 1024 : 512;
// CTAs per SM the register budget must allow (launch bounds). Without a
// minimum ptxas gave d128 50 registers: 2 CTAs (1024 threads) per SM; capped
// at 40 (no spills) 3 fit: Q + K + V, 16k tokens, V^T 0.174 -> 0.159 ms,
// plain 0.141 -> 0.126 (H200, session 16; 4 CTAs at 32 registers spill and
// gave 0.137). d64 needs its 4 stated: with a minimum of 1 ptxas takes 56
// registers and the pre-pass slows by 16%. d256 (one 1024-thread CTA per SM)
// spills 156 B at the 32 registers two would need, and measured 4% slower.
template <int kD> constexpr int kMinCtasFor = kD == 64 ? 4 : kD == 128 ? 3 : 1;
template <int kD> constexpr bool kStagedFor = kD <= 128;  // see quantize_kernel
constexpr int kMaxBlockRows = 128;
constexpr float kE4M3Max = 448.f;

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// A lane's kD / 32 consecutive elements move as one vector access (8 B of
// bf16 and 4 B of e4m3 per lane at d128: full 256 B / 128 B rows per warp).
template <int kBytes> struct alignas(kBytes) Chunk { uint8_t b[kBytes]; };

template <class T, int kD>
__global__ void __launch_bounds__(kThreadsFor<kD>, kMinCtasFor<kD>)
quantize_kernel(const QuantParams p) {
  constexpr int kThreads = kThreadsFor<kD>, kWarps = kThreads / 32;
  constexpr int kE = kD / 32;                     // elements per lane
  constexpr int kRowsPerWarp = kMaxBlockRows / kWarps;
  __shared__ float warp_amax[kWarps];

  // Grid (row block, head, tensor x batch), sized for the largest tensor; a
  // CTA past its tensor's row blocks or heads (GQA K/V, sk != sq) exits. The
  // flat block index it replaces took four integer divisions per thread: 10%
  // of the pre-pass's instructions and 20% of its stall samples (ncu, d128).
  const int which = int(blockIdx.z >= unsigned(p.b)) + int(blockIdx.z >= 2u * unsigned(p.b));
  const int batch = int(blockIdx.z) - which * p.b;
  const QuantTensor& qt = p.t[which];
  const int num_rb = qt.num_rb;
  const int rb = blockIdx.x, head = blockIdx.y;
  if (rb >= num_rb || head >= qt.heads) { return; }  // CTA-uniform, before any barrier
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = rb * qt.block_rows;
  const int rows = min(qt.block_rows, qt.seq - row0);
  const int64_t row_stride = int64_t(qt.heads) * kD;
  // Element offset of this block's first row, in x and (e4m3) in out.
  const int64_t blk = (int64_t(batch) * qt.seq + row0) * row_stride + int64_t(head) * kD;
  // d64 / d128: the block is staged in shared memory first (cp.async, rows
  // past seq as zeros), every load in flight at once and no registers held
  // for them. Loading each row from global memory next to its Hadamard
  // shuffles kept one load in flight per warp. Q+K+V with V^T, 16k tokens:
  // d128 0.211 -> 0.185 ms, d64 0.316 -> 0.202 (H200, session 13). At d256
  // (1024 threads, one CTA per SM) the staged CTA's load / compute / store
  // phases no longer overlap another CTA's (0.211 -> 0.229 ms), so d256
  // keeps the direct loads. Also measured slower: all direct loads hoisted
  // into registers (82 registers at d128, spills at d256), and persistent
  // CTAs staging the next block while quantizing this one (d64 0.220, d128
  // 0.193, d256 0.213). The buffer later holds the V^T tile.
  constexpr bool kStaged = kStagedFor<kD>;
  extern __shared__ __align__(128) uint8_t staged[];
  if constexpr (kStaged) {
    constexpr int kChunksPerRow = kD * int(sizeof(T)) / 16;
    const T* xblk = static_cast<const T*>(qt.x) + blk;
    for (int c = threadIdx.x; c < kMaxBlockRows * kChunksPerRow; c += kThreads) {
      const int r = c / kChunksPerRow, k = c % kChunksPerRow;
      uint4* dst = reinterpret_cast<uint4*>(staged) + c;
      if (r < rows) {
        cute::SM80_CP_ASYNC_CACHEGLOBAL<uint4>::copy(
            *reinterpret_cast<const uint4*>(xblk + r * row_stride + k * (16 / int(sizeof(T)))), *dst);
      } else {
        *dst = make_uint4(0, 0, 0, 0);
      }
    }
    cute::cp_async_fence();
    cute::cp_async_wait<0>();
    __syncthreads();
  }
  // This lane's part of block row 0 and the distance between rows.
  const T* x = kStaged ? reinterpret_cast<const T*>(staged) + lane * kE : static_cast<const T*>(qt.x) + blk + lane * kE;
  const int64_t x_row = kStaged ? kD : row_stride;

  float sign[kE];
  #pragma unroll
  for (int e = 0; e < kE; ++e) { sign[e] = qt.hadamard ? p.signs[lane * kE + e] : 1.f; }
  const float norm = qt.hadamard ? rsqrtf(float(kD)) : 1.f;

  float v[kRowsPerWarp][kE];
  float amax = 0.f;
  #pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
    #pragma unroll
    for (int e = 0; e < kE; ++e) { v[i][e] = 0.f; }
    if (kStaged || r < rows) {
      const auto raw = *reinterpret_cast<const Chunk<kE * sizeof(T)>*>(x + r * x_row);
      const T* xs = reinterpret_cast<const T*>(raw.b);
      #pragma unroll
      for (int e = 0; e < kE; ++e) { v[i][e] = to_float(xs[e]) * sign[e]; }
    }
    if (qt.hadamard) {  // CTA-uniform, so the shuffles are safe (rows past seq are zeros)
      #pragma unroll
      for (int h = 1; h < kE; h *= 2) {
        #pragma unroll
        for (int e = 0; e < kE; ++e) {
          if ((e & h) == 0) { float a = v[i][e], b = v[i][e + h]; v[i][e] = a + b; v[i][e + h] = a - b; }
        }
      }
      #pragma unroll
      for (int m = 1; m < 32; m *= 2) {  // stride m * kE: partner lane ^ m
        const bool upper = lane & m;
        #pragma unroll
        for (int e = 0; e < kE; ++e) {
          float other = __shfl_xor_sync(0xffffffff, v[i][e], m);
          v[i][e] = upper ? other - v[i][e] : v[i][e] + other;
        }
      }
      #pragma unroll
      for (int e = 0; e < kE; ++e) { v[i][e] *= norm; }
    }
    #pragma unroll
    for (int e = 0; e < kE; ++e) { amax = fmaxf(amax, fabsf(v[i][e])); }
  }
  #pragma unroll
  for (int m = 16; m > 0; m /= 2) { amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, m)); }
  if (lane == 0) { warp_amax[warp] = amax; }
  __syncthreads();
  amax = warp_amax[0];
  #pragma unroll
  for (int w = 1; w < kWarps; ++w) { amax = fmaxf(amax, warp_amax[w]); }

  // Never 0 (x / scale below). pow2 (V): the smallest power of two >= amax /
  // 448, and an all-zero block gets FLT_MIN, below every real block, because
  // the kernel scales P by v_scale / (largest V scale of the tile).
  float scale;
  if (qt.fixed_scale) {
    scale = *qt.fixed_scale;
  } else if (!(amax > 0.f)) {
    scale = qt.pow2 ? FLT_MIN : 1.f;
  } else if (qt.pow2) {
    int e;
    const float m = frexpf(amax / kE4M3Max, &e);  // amax / 448 = m * 2^e, m in [0.5, 1)
    scale = ldexpf(1.f, m == 0.5f ? e - 1 : e);
  } else {
    scale = amax / kE4M3Max;
  }
  const float inv = 1.f / scale;
  if (threadIdx.x == 0) { qt.scales[(int64_t(batch) * qt.heads + head) * num_rb + rb] = scale; }

  auto quantized = [&](int i) {
    Chunk<kE> bytes;
    #pragma unroll
    for (int e = 0; e < kE; e += 2) {
      __nv_fp8x2_storage_t two = __nv_cvt_float2_to_fp8x2(
          make_float2(v[i][e] * inv, v[i][e + 1] * inv), __NV_SATFINITE, __NV_E4M3);
      bytes.b[e] = uint8_t(two & 0xff);
      bytes.b[e + 1] = uint8_t(two >> 8);
    }
    return bytes;
  };
  if (!qt.transpose) {
    uint8_t* out = static_cast<uint8_t*>(qt.out) + blk + lane * kE;
    #pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp + i * kWarps;
      if (r < rows) { *reinterpret_cast<Chunk<kE>*>(out + r * row_stride) = quantized(i); }
    }
    return;
  }

  // V^T (block_rows == 128, checked by the launcher): the block's bytes go
  // through shared memory, row-major [key][d] (rows past seq hold zeros: the
  // padding of the layout), then out as 128-byte rows of V^T, each 16-byte
  // chunk holding 16 positions of one head-dim column in vt_key_of order.
  // The 4-byte words of a row are XOR-swizzled by its 16-row group: a warp of
  // the second phase reads 4 columns (one word) of 8 row groups, which then
  // fall in 8 different banks (d >= 128).
  // The staging buffer is free: every thread read its rows before the amax barrier.
  uint8_t* tile = staged;
  auto tile_off = [](int r, int dd) {
    constexpr int kGroups = kD / 16 < 8 ? kD / 16 : 8;
    return r * kD + ((((dd >> 2) ^ (((r >> 4) & (kGroups - 1)) << 2))) << 2) + (dd & 3);
  };
  #pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + i * kWarps;
    *reinterpret_cast<Chunk<kE>*>(tile + tile_off(r, lane * kE)) = quantized(i);
  }
  __syncthreads();
  const int64_t seq_pad = int64_t(num_rb) * kMaxBlockRows;
  uint8_t* out_t = static_cast<uint8_t*>(qt.out) + (int64_t(batch) * qt.heads + head) * kD * seq_pad + row0;
  #pragma unroll
  for (int idx = threadIdx.x; idx < kD * 8; idx += kThreads) {
    const int dd = idx / 8, c = idx % 8;  // column dd, positions 16c .. 16c + 15
    uint32_t w[4];
    #pragma unroll
    for (int j = 0; j < 4; ++j) {  // positions 16c + 4j .. + 3
      uint32_t b[4];
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = vt_key_of(16 * c + 4 * j + i);
        b[i] = *reinterpret_cast<const uint32_t*>(tile + (tile_off(key, dd) & ~3));
      }
      const uint32_t sel = (dd & 3) | ((4 + (dd & 3)) << 4);  // byte dd%4 of the first and second word
      w[j] = __byte_perm(__byte_perm(b[0], b[1], sel), __byte_perm(b[2], b[3], sel), 0x5410);
    }
    *reinterpret_cast<uint4*>(out_t + int64_t(dd) * seq_pad + 16 * c) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <class T, int kD>
cudaError_t launch_typed(const QuantParams& params, cudaStream_t stream) {
  QuantParams p = params;
  int max_rb = 0, max_heads = 0;
  for (int i = 0; i < p.num_tensors; ++i) {
    QuantTensor& t = p.t[i];
    if (t.block_rows <= 0 || t.block_rows > kMaxBlockRows || t.block_rows % (kThreadsFor<kD> / 32) != 0 ||
        (t.transpose && (t.block_rows != kMaxBlockRows || t.block_rows != fp8_block_n(p.d)))) {
      return cudaErrorInvalidValue;
    }
    t.num_rb = (t.seq + t.block_rows - 1) / t.block_rows;
    max_rb = std::max(max_rb, t.num_rb);
    max_heads = std::max(max_heads, t.heads);
  }
  if (p.num_tensors <= 0 || p.num_tensors > 3 || p.b <= 0 || max_rb == 0 || max_heads == 0) { return cudaSuccess; }
  if (max_heads > 65535 || p.num_tensors * p.b > 65535) { return cudaErrorInvalidValue; }
  // The staged block, or just the V^T tile.
  constexpr int kSmem = kMaxBlockRows * kD * (kStagedFor<kD> ? int(sizeof(T)) : 1);
  if (kSmem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(quantize_kernel<T, kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) { return e; }
  }
  const dim3 grid(unsigned(max_rb), unsigned(max_heads), unsigned(p.num_tensors * p.b));
  quantize_kernel<T, kD><<<grid, kThreadsFor<kD>, kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <class T>
cudaError_t launch_dim(const QuantParams& p, cudaStream_t stream) {
  switch (p.d) {
    case 64: return launch_typed<T, 64>(p, stream);
    case 128: return launch_typed<T, 128>(p, stream);
    case 256: return launch_typed<T, 256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_fp8_quantize(const QuantParams& p, cudaStream_t stream) {
  return p.dtype == DType::kBF16 ? launch_dim<__nv_bfloat16>(p, stream)
                                 : launch_dim<__half>(p, stream);
}

}  // namespace jax_fa3

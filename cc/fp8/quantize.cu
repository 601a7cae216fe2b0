// The fused FP8 quantize pre-pass. One CTA per (row block, head, batch) of one
// tensor (at d64 / d128 staged in shared memory first, see quantize_kernel).
// A row is owned by kLanesPerRow lanes, each holding kGroups groups of 4
// consecutive elements, the groups 4 * kLanesPerRow elements apart. The
// normalized fast Walsh-Hadamard transform runs in registers in ascending
// stride order: strides 1, 2 inside a group, then the strides across the
// row's lanes with shuffles, then those between a lane's groups. The block's
// rotated values stay in registers between the amax reduction and the
// quantization, so the input is read once.
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
// latency (one CTA is 128 rows of one head); d64 at 1024 was slower.
template <int kD> constexpr int kThreadsFor = kD >= 256 ? 1024 : 512;
// CTAs per SM the register budget must allow (launch bounds). Without a
// minimum ptxas gave d128 50 registers, 2 CTAs per SM; capped at 40 (no
// spills) 3 fit (4 at 32 registers spill). d64 needs its 4 stated, else ptxas
// takes 56 registers. d256 (one 1024-thread CTA per SM) spills at the 32
// registers two would need.
template <int kD> constexpr int kMinCtasFor = kD == 64 ? 4 : kD == 128 ? 3 : 1;
template <int kD> constexpr bool kStagedFor = kD <= 128;  // see quantize_kernel
constexpr int kMaxBlockRows = 128;
constexpr float kE4M3Max = 448.f;

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Lanes per row: fewer lanes per row mean fewer shuffle rounds of the
// Hadamard butterfly per element (a row per warp takes 5). Staged d64: 4 (one
// row per thread, 2 rounds); d128: 8 (2 rows per thread, 3 rounds; ptxas
// spills 28 B at the 40-register cap). d256 (direct loads, 1024 threads): a
// row per warp, 4 rows per lane. The butterflies are the same operations in
// the same stride order for every choice, so the output does not depend on it.
template <int kD> constexpr int kLanesPerRowFor = kD == 64 ? 4 : kD == 128 ? 8 : 32;

template <class T, int kD>
__global__ void __launch_bounds__(kThreadsFor<kD>, kMinCtasFor<kD>)
quantize_kernel(const QuantParams p) {
  constexpr int kThreads = kThreadsFor<kD>, kWarps = kThreads / 32;
  constexpr int kLanesPerRow = kLanesPerRowFor<kD>;
  constexpr int kGroups = kD / (4 * kLanesPerRow);  // 4-element groups per lane and row
  constexpr int kRowsPerLane = kMaxBlockRows * kLanesPerRow / kThreads;
  static_assert(kGroups >= 1 && kRowsPerLane >= 1 && kMaxBlockRows * kLanesPerRow % kThreads == 0);
  __shared__ float warp_amax[kWarps];

  // Grid (row block, head, tensor x batch), sized for the largest tensor; a
  // CTA past its tensor's row blocks or heads (GQA K/V, sk != sq) exits (a
  // flat block index took four integer divisions per thread).
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
  // shuffles kept one load in flight per warp. At d256 (1024 threads, one
  // CTA per SM) the staged CTA's load / compute / store phases no longer
  // overlap another CTA's, so d256 keeps the direct loads. The buffer later
  // holds the V^T tile.
  constexpr bool kStaged = kStagedFor<kD>;
  extern __shared__ __align__(128) uint8_t staged[];
  if constexpr (kStaged) {
    constexpr int kChunksPerRow = kD * int(sizeof(T)) / 16;
    const T* xblk = static_cast<const T*>(qt.x) + blk;
    for (int c = threadIdx.x; c < kMaxBlockRows * kChunksPerRow; c += kThreads) {
      const int r = c / kChunksPerRow, k = c % kChunksPerRow;
      // 16-byte chunks XOR-swizzled by row % 8: a warp's 8-byte loads below
      // (8 rows x 4 lanes at d64, 4 x 8 at d128) then spread over the banks
      // instead of every row meeting in the same ones.
      uint4* dst = reinterpret_cast<uint4*>(staged) + r * kChunksPerRow + (k ^ (r % 8));
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
  // Lane's row i and the first element of its group g.
  auto row_of = [&](int i) { return (warp * 32 + lane) / kLanesPerRow + i * (kThreads / kLanesPerRow); };
  auto col_of = [&](int g) { return g * 4 * kLanesPerRow + 4 * (lane % kLanesPerRow); };
  // Group g of row i: 4 elements (8 bytes), from the staged block (with the
  // copy's chunk ^ (r % 8) swizzle above) or global memory. The staged rows
  // of a lane share r % 8 (rows i apart differ by a multiple of 8), so each
  // address is one base plus a constant.
  const uint8_t* lane_src;
  if constexpr (kStaged) {
    const int r = row_of(0);
    lane_src = staged + r * kD * int(sizeof(T)) + ((lane % kLanesPerRow) % 2) * 8;
  } else {
    lane_src = reinterpret_cast<const uint8_t*>(static_cast<const T*>(qt.x) + blk + row_of(0) * row_stride + col_of(0));
  }
  const int lane_swz = row_of(0) % 8;
  static_assert((kThreads / kLanesPerRow) % 8 == 0);
  auto load4 = [&](int i, int g) {
    if constexpr (kStaged) {
      const int chunk = (col_of(g) * int(sizeof(T)) / 16) ^ lane_swz;
      return *reinterpret_cast<const uint2*>(lane_src + i * (kThreads / kLanesPerRow) * kD * int(sizeof(T)) +
                                             chunk * 16);
    } else {
      return *reinterpret_cast<const uint2*>(lane_src + (i * (kThreads / kLanesPerRow) * row_stride +
                                                         g * 4 * kLanesPerRow) * int(sizeof(T)));
    }
  };
  const float norm = qt.hadamard ? rsqrtf(float(kD)) : 1.f;

  float v[kRowsPerLane][kGroups][4];
  float amax = 0.f;
  #pragma unroll
  for (int i = 0; i < kRowsPerLane; ++i) {
    const int r = row_of(i);
    #pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) { v[i][g][e] = 0.f; }
      if (kStaged || r < rows) {
        const uint2 raw = load4(i, g);
        const T* xs = reinterpret_cast<const T*>(&raw);
        const float4 sg = qt.hadamard ? *reinterpret_cast<const float4*>(p.signs + col_of(g))
                                      : make_float4(1.f, 1.f, 1.f, 1.f);
        v[i][g][0] = to_float(xs[0]) * sg.x;
        v[i][g][1] = to_float(xs[1]) * sg.y;
        v[i][g][2] = to_float(xs[2]) * sg.z;
        v[i][g][3] = to_float(xs[3]) * sg.w;
      }
    }
    if (qt.hadamard) {  // CTA-uniform, so the shuffles are safe (rows past seq are zeros)
      // Elements a, b at indices j < j + h become a + b, a - b: the same
      // operations in the same stride order for every layout.
      auto bfly = [](float& a, float& b) { const float x = a, y = b; a = x + y; b = x - y; };
      #pragma unroll
      for (int g = 0; g < kGroups; ++g) {  // strides 1, 2
        bfly(v[i][g][0], v[i][g][1]); bfly(v[i][g][2], v[i][g][3]);
        bfly(v[i][g][0], v[i][g][2]); bfly(v[i][g][1], v[i][g][3]);
      }
      #pragma unroll
      for (int m = 1; m < kLanesPerRow; m *= 2) {  // stride 4m: partner lane ^ m
        const bool upper = lane & m;
        #pragma unroll
        for (int g = 0; g < kGroups; ++g) {
          #pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float other = __shfl_xor_sync(0xffffffff, v[i][g][e], m);
            v[i][g][e] = upper ? other - v[i][g][e] : v[i][g][e] + other;
          }
        }
      }
      #pragma unroll
      for (int h = 1; h < kGroups; h *= 2) {  // stride 4 * kLanesPerRow * h: groups g, g + h
        #pragma unroll
        for (int g = 0; g < kGroups; ++g) {
          if ((g & h) == 0) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) { bfly(v[i][g][e], v[i][g + h][e]); }
          }
        }
      }
      #pragma unroll
      for (int g = 0; g < kGroups; ++g) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) { v[i][g][e] *= norm; }
      }
    }
    #pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) { amax = fmaxf(amax, fabsf(v[i][g][e])); }
    }
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
    int e;  // a tiny amax / 448 would flush to 0: FLT_MIN is the floor
    const float m = frexpf(fmaxf(amax / kE4M3Max, FLT_MIN), &e);  // = m * 2^e, m in [0.5, 1)
    scale = ldexpf(1.f, m == 0.5f ? e - 1 : e);
  } else {
    scale = fmaxf(amax / kE4M3Max, FLT_MIN);
  }
  const float inv = 1.f / scale;
  if (threadIdx.x == 0) { qt.scales[(int64_t(batch) * qt.heads + head) * num_rb + rb] = scale; }

  // Group g of row i as 4 e4m3 bytes.
  auto quantized = [&](int i, int g) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[i][g][0] * inv, v[i][g][1] * inv),
                                                 __NV_SATFINITE, __NV_E4M3);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[i][g][2] * inv, v[i][g][3] * inv),
                                                 __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
  };
  if (!qt.transpose) {
    uint8_t* out = static_cast<uint8_t*>(qt.out) + blk;
    #pragma unroll
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int r = row_of(i);
      if (r < rows) {
        #pragma unroll
        for (int g = 0; g < kGroups; ++g) {
          *reinterpret_cast<uint32_t*>(out + r * row_stride + col_of(g)) = quantized(i, g);
        }
      }
    }
    return;
  }

  // V^T (block_rows == 128, checked by the launcher): the block's bytes go
  // through shared memory, row-major [key][d] (rows past seq hold zeros: the
  // padding of the layout), then out as 128-byte rows of V^T, each 16-byte
  // chunk holding 16 positions of one head-dim column in vt_key_of order.
  // The 4-byte words of a row are XOR-swizzled by its 16-row group: a warp of
  // the second phase reads 4 columns (one word) of 8 row groups, which then
  // fall in 8 different banks (d >= 128). Staged, also by the row's place
  // among the rows one 4-byte write of a warp covers (d128: 4 rows x 8 lanes,
  // r % 8, 2-way conflicts instead of 4-way; d64: 8 rows x 4 lanes, two rows
  // per 32 banks, (r / 2) % 4, none instead of 4-way); the 8 rows a reading
  // warp touches share that part, so the reads keep their banks.
  // The staging buffer is free: every thread read its rows before the amax barrier.
  uint8_t* tile = staged;
  auto tile_off = [](int r, int dd) {
    constexpr int kRowGroups = kD / 16 < 8 ? kD / 16 : 8;
    const int swz = ((r >> 4) ^ (!kStaged ? 0 : kD >= 128 ? r : r >> 1)) & (kRowGroups - 1);
    return r * kD + (((dd >> 2) ^ (swz << 2)) << 2) + (dd & 3);
  };
  #pragma unroll
  for (int i = 0; i < kRowsPerLane; ++i) {
    #pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      *reinterpret_cast<uint32_t*>(tile + tile_off(row_of(i), col_of(g))) = quantized(i, g);
    }
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
        (t.transpose && (t.block_rows != kMaxBlockRows || t.block_rows != kFp8BlockN))) {
      return cudaErrorInvalidValue;
    }
    t.num_rb = (t.seq + t.block_rows - 1) / t.block_rows;
    max_rb = std::max(max_rb, t.num_rb);
    max_heads = std::max(max_heads, t.heads);
  }
  if (p.num_tensors <= 0 || p.num_tensors > 3 || p.b <= 0 || max_rb == 0 || max_heads == 0) { return cudaSuccess; }
  if (max_heads > 65535) { return cudaErrorInvalidValue; }
  // The staged block, or just the V^T tile.
  constexpr int kSmem = kMaxBlockRows * kD * (kStagedFor<kD> ? int(sizeof(T)) : 1);
  if (kSmem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(quantize_kernel<T, kD>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) { return e; }
  }
  // gridDim.z holds (tensor, batch) and stops at 65535: a larger batch launches
  // in slices, each with its tensors' pointers moved to its first batch row.
  const int slice = 65535 / p.num_tensors;
  for (int b0 = 0; b0 < params.b; b0 += slice) {
    QuantParams c = p;
    c.b = std::min(slice, params.b - b0);
    for (int i = 0; i < c.num_tensors; ++i) {
      QuantTensor& t = c.t[i];
      const int64_t elems = int64_t(b0) * t.seq * t.heads * kD;  // of x, and of out when not transposed
      t.x = static_cast<const T*>(t.x) + elems;
      t.out = static_cast<uint8_t*>(t.out) + (t.transpose ? int64_t(b0) * t.heads * kD * fp8_vt_seq(t.seq) : elems);
      t.scales += int64_t(b0) * t.heads * t.num_rb;
    }
    const dim3 grid(unsigned(max_rb), unsigned(max_heads), unsigned(c.num_tensors * c.b));
    quantize_kernel<T, kD><<<grid, kThreadsFor<kD>, kSmem, stream>>>(c);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) { return e; }
  }
  return cudaSuccess;
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

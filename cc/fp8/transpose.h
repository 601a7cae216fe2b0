// In-kernel V transpose for the FP8 P.V GEMM. FP8 WGMMA reads its B operand
// only K-major, i.e. V^T with the key index contiguous, while TMA delivers V
// with the head dim contiguous. Warps 1..3 of the producer warpgroup rewrite
// every V tile smem -> smem (no extra HBM pass), 4x4 bytes per lane at a
// time: four 32-bit loads from four key rows, a byte transpose with PRMT,
// four 32-bit stores into four head-dim rows of V^T.
//
// The key order inside V^T is permuted to match P's registers (vt_key_of):
// k-position p of the FP8 A fragment is filled, without any shuffle, with the
// score column vt_key_of(p) of the QK^T accumulator held by the same thread.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include "params.h"

namespace jax_fa3 {

using namespace cute;

// vt_key_of (the key order inside each 32-key slice of V^T) is in params.h:
// the quantize pre-pass writes V^T in global memory in the same order.

// 32-bit shared-memory accesses by 32-bit shared address (a dereference of
// the pointer CuTe hands out compiles to generic LD/ST, 64-bit addresses).
// volatile keeps them behind the pipeline waits; it also keeps them in
// program order, so transpose() issues all loads of a column block first.
CUTE_DEVICE uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
CUTE_DEVICE void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// __byte_perm, also on the host (cc/fp8/transpose_check.cu).
CUTE_HOST_DEVICE uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(a, b, sel);
#else
  const uint64_t x = (uint64_t(b) << 32) | a;
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k) { r |= uint32_t((x >> (8 * ((sel >> (4 * k)) & 7))) & 0xff) << (8 * k); }
  return r;
#endif
}

// The compiler may assume nothing about x's value after this (device only).
CUTE_HOST_DEVICE void opaque(uint32_t& x) {
#if defined(__CUDA_ARCH__)
  asm volatile("" : "+r"(x));
#else
  (void)x;
#endif
}

template <class Traits>
struct VTransposer {
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kWarps = Traits::kNumTransposeThreads / 32;
  static constexpr int kSlices = kBlockN / 32;   // k32 slices of P / keys
  static constexpr int kColBlocks = kHeadDim / 16;
  // Slices loaded before the first store. d256 (the consumers' P.V waits on
  // this warp there): all four, 16 words in flight, which fit in its 24
  // registers because the transpose loop keeps no scheduler state (kernel.h):
  // +4% over two slices (H200, b2 t8192). d64 / d128: two; all four measured
  // 1.4% slower at d128.
  static constexpr int kSliceBatch = kHeadDim >= 256 ? kSlices : 2;
  static_assert(kSlices % kSliceBatch == 0);
  // Work unit of a warp: 16 head-dim columns x 32 keys, 4x4 bytes per lane.
  // Lane = (dl: 4-column group, t: quad lane, h: slice half), so both the
  // loads from V (rows key(p), one 16-byte chunk) and the stores into V^T
  // (rows d, p in two chunks) hit at most 2 lanes per bank under the
  // 128-byte swizzle (a lane -> column mapping was 16-way on stores).
  //
  // Addresses. The layouts are swizzle(linear(coord)), the swizzle an XOR of
  // row bits into 16-byte-chunk bits, so an offset splits into a per-lane
  // part (computed once per kernel: lane_offsets), a per-column-block part
  // (uniform across the warp: cb is derived from the warp index) and
  // compile-time parts per key slice / V^T row, combined with + where the
  // parts occupy disjoint bits and ^ where they meet in the chunk bits. The
  // split is checked element by element against the CuTe layouts on the host
  // (cc/fp8/transpose_check.cu runs transpose_blocks on a byte array). The previous version evaluated the
  // layouts per unit: ~90 address instructions per 1 KB and, in the 24
  // registers the d256 producer has, 68 spill stores / 62 loads, most in
  // this loop -- a V tile took longer than the consumers' P.V on it.
  using LayoutV = typename Traits::SmemLayoutV;
  using LayoutVt = typename Traits::SmemLayoutVt;

  // Stage-0 byte offsets straight from the layouts (e4m3: 1 byte/element).
  CUTE_HOST_DEVICE static uint32_t v_off(int key, int d) { return uint32_t(LayoutV{}(key, d, 0)); }
  CUTE_HOST_DEVICE static uint32_t vt_off(int d, int p) { return uint32_t(LayoutVt{}(d, p, 0)); }
  CUTE_HOST_DEVICE static uint32_t v_stage_off(int stage) { return uint32_t(LayoutV{}(0, 0, stage)); }
  CUTE_HOST_DEVICE static uint32_t vt_stage_off(int stage) { return uint32_t(LayoutVt{}(0, 0, stage)); }

  struct Lane {
    uint32_t v0, v1;  // V: keys key0, key0 + 1 at column 4*dl (slice 0, column block 0)
    uint32_t vt;      // V^T: row 4*dl, position p0 (slice 0, column block 0)
  };
  CUTE_HOST_DEVICE static Lane lane_offsets(int lane) {
    const int dl = lane % 4, t = (lane / 4) % 4, h = lane / 16;
    const int p0 = 16 * h + 4 * t;     // k-position in slice 0 (4 consecutive bytes)
    const int key0 = vt_key_of(p0);    // its 4 keys: key0 + {0, 1, 8, 9}
    return {v_off(key0, 4 * dl), v_off(key0 + 1, 4 * dl), vt_off(4 * dl, p0)};
  }
  // transpose_blocks adds the stage base (a multiple of 1024 bytes) to
  // offsets it then XORs below bit 10: stages must keep that alignment.
  static_assert(cosize_v<LayoutV> % (1024 * Traits::kStages) == 0 &&
                    cosize_v<LayoutVt> % (1024 * Traits::kStagesVt) == 0,
                "stage bases must be 1024-byte aligned");

  // Column blocks over the warps. kColBlocks (4 / 8 / 16) does not divide by
  // 3 warps, and the warps run decoupled through the rings, so a fixed split
  // leaves one warp a block more on every tile (6 / 5 / 5 at d256, where the
  // transposer bounds the kernel). kRotate: the caller rotates `share` per
  // tile, and the block loop is unrolled with a warp-uniform skip, so its
  // layout offsets are compile-time constants. H200, b2 t8192, kernel-only:
  // d256 1019 -> 1082 TFLOP/s (rotation with the runtime loop: 1057;
  // unrolled without rotation: 1024); at d64 / d128 both lost 1-4%.
  static constexpr bool kRotate = kHeadDim >= 256;

  // Column blocks share, share + kWarps, ... (share in [0, kWarps), warp-
  // uniform) between stage bases v_base / vt_base (shared addresses,
  // 1024-aligned). Host-callable with other load/store functors for the
  // address check.
#pragma nv_exec_check_disable
  template <class Load, class Store>
  CUTE_HOST_DEVICE static void transpose_blocks(const Lane& lane, int share, uint32_t v_base,
                                                uint32_t vt_base, Load&& load, Store&& store) {
    if constexpr (kRotate) {
      CUTLASS_PRAGMA_UNROLL
      for (int cb = 0; cb < kColBlocks; ++cb) {
        if (cb % kWarps != share) { continue; }
        // Opaque copies: otherwise ptxas computes every block's addresses up
        // front and spills them (860 B at d256, in the producer's 24 registers).
        Lane l = lane;
        opaque(l.v0); opaque(l.v1); opaque(l.vt);
        column_block(l, cb, v_base, vt_base, load, store);
      }
    } else {
      CUTLASS_PRAGMA_NO_UNROLL
      for (int cb = share; cb < kColBlocks; cb += kWarps) {
        column_block(lane, cb, v_base, vt_base, load, store);
      }
    }
  }

  // One column block: 16 head-dim columns x kBlockN keys.
#pragma nv_exec_check_disable
  template <class Load, class Store>
  CUTE_HOST_DEVICE static void column_block(const Lane& lane, int cb, uint32_t v_base,
                                            uint32_t vt_base, Load& load, Store& store) {
    const uint32_t vc = v_off(0, 16 * cb);
    const uint32_t a0 = v_base + (lane.v0 ^ vc);
    const uint32_t a1 = v_base + (lane.v1 ^ vc);
    const uint32_t z = vt_base + (lane.vt ^ vt_off(16 * cb, 0));
    CUTLASS_PRAGMA_UNROLL
    for (int kg = 0; kg < kSlices; kg += kSliceBatch) {
      // All loads of a batch first: one shared-memory latency per batch
      // instead of one per slice (the asm is volatile: no reordering).
      uint32_t w[kSliceBatch][4];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kSliceBatch; ++i) {
        const int kb = kg + i;
        const uint32_t r0 = v_off(32 * kb, 0), r8 = v_off(32 * kb + 8, 0);  // compile-time
        w[i][0] = load(a0 + r0);
        w[i][1] = load(a1 + r0);
        w[i][2] = load(a0 + r8);
        w[i][3] = load(a1 + r8);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kSliceBatch; ++i) {
        const int kb = kg + i;
        // 4x4 byte transpose: out[r] byte j = w[i][j] byte r.
        const uint32_t lo01 = byte_perm(w[i][0], w[i][1], 0x5140);
        const uint32_t hi01 = byte_perm(w[i][0], w[i][1], 0x7362);
        const uint32_t lo23 = byte_perm(w[i][2], w[i][3], 0x5140);
        const uint32_t hi23 = byte_perm(w[i][2], w[i][3], 0x7362);
        // vt_base is 1024-aligned and vt_off(r, 32 kb) < 1024: ^ commutes with it.
        store(z ^ vt_off(0, 32 * kb), byte_perm(lo01, lo23, 0x5410));
        store(z ^ vt_off(1, 32 * kb), byte_perm(lo01, lo23, 0x7632));
        store(z ^ vt_off(2, 32 * kb), byte_perm(hi01, hi23, 0x5410));
        store(z ^ vt_off(3, 32 * kb), byte_perm(hi01, hi23, 0x7632));
      }
    }
  }

  // One V tile: stage indices of the V and V^T rings; share: which column
  // blocks this warp takes (transpose_blocks; rotated per tile if kRotate).
  CUTE_DEVICE static void transpose(typename Traits::SharedStorage& smem, const Lane& lane, int share,
                                    int v_stage, int vt_stage) {
    transpose_blocks(lane, share,
                     cute::cast_smem_ptr_to_uint(smem.v.data()) + v_stage_off(v_stage),
                     cute::cast_smem_ptr_to_uint(smem.vt.data()) + vt_stage_off(vt_stage),
                     [](uint32_t addr) { return lds32(addr); },
                     [](uint32_t addr, uint32_t v) { sts32(addr, v); });
    // Generic-proxy stores must be visible to WGMMA (async proxy) reads.
    cutlass::arch::fence_view_async_shared();
  }
};

}  // namespace jax_fa3

// In-kernel V transpose for the FP8 P.V GEMM. FP8 WGMMA reads its B operand
// only K-major, i.e. V^T with the key index contiguous, while TMA delivers V
// with the head dim contiguous. Warps 1..3 of the producer warpgroup rewrite
// every V tile smem -> smem (no extra HBM pass) in units of 16 keys x 32
// head-dim columns (512 bytes): one LDSM.x4.trans, four PRMTs, one STSM.x4.
//
// The key order inside V^T is permuted to match P's registers (vt_key_of):
// k-position p of the FP8 A fragment is filled, without any shuffle, with the
// score column vt_key_of(p) of the QK^T accumulator held by the same thread.
// That order is also what a 16-bit transposing ldmatrix hands out: lane
// (c = lane / 4, q = lane % 4) receives, per 8 x 8 matrix of b16, keys
// 2q, 2q + 1 at head-dim columns 2c, 2c + 1, so two matrices 8 keys apart
// give the bytes of positions 4q..4q+3 (keys 2q, 2q+1, 2q+8, 2q+9) for two
// head-dim rows, and one PRMT per row assembles them.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include "params.h"

namespace jax_fa3 {

using namespace cute;

// vt_key_of (the key order inside each 32-key slice of V^T) is in params.h:
// the quantize pre-pass writes V^T in global memory in the same order.

// The transposing 16-bit ldmatrix / the stmatrix of four 8 x 8 b16 matrices
// (warp-collective; lane l gives the address of row l % 8 of matrix l / 8).
// volatile keeps them behind the pipeline waits and in program order, so a
// batch's loads all issue before its stores.
CUTE_DEVICE void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
CUTE_DEVICE void stsm_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// __byte_perm, also on the host (cc/tools/fp8_transpose_check.cu).
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

template <class Traits>
struct VTransposer {
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kWarps = Traits::kNumTransposeThreads / 32;
  // Unit (kn, kd): keys 16 kn + [0, 16), head-dim columns 32 kd + [0, 32).
  static constexpr int kUnitsN = kBlockN / 16;
  static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0);
  // A warp's work item is a key row of units (16 keys x the whole head dim,
  // kUnitsD units), run as a loop over rows with the units of a row
  // unrolled: each address is then the row's base (one runtime XOR for V^T)
  // with a compile-time part. (Unrolling all units made ptxas build every
  // distinct base up front: 12 live registers, spills in the 24-register
  // d256 producer.)
  static constexpr int kUnitsD = kHeadDim / 32;
  // Units loaded before the first store (4 registers each): one shared-
  // memory latency per batch (1 and 4 ran the same).
  static constexpr int kBatch = 2;
  static_assert(kUnitsD % kBatch == 0);
  // The warps take rows share, share + kWarps, ...: 8 rows do not divide by 3
  // and the warps run decoupled through the rings, so the caller rotates
  // share per tile (one warp would otherwise do a row more on every tile).
  //
  // Bank conflicts: LDSM matrix rows are 8 consecutive keys at one 16-byte
  // chunk, which the 128-byte swizzle spreads over 8 chunks. STSM rows are
  // head-dim rows of V^T; a matrix of rows d = 2c (c = 0..7) would meet the
  // swizzle's row % 8 only at even values (2-way conflicts), so lanes with
  // c >= 4 swap their even and odd rows between matrices 0 / 1 (2 / 3): the
  // PRMT selector is per lane, so the swap is free. fp8_transpose_check
  // counts 1 wavefront per 128 bytes for both (the 32-bit version before
  // had 2).
  using LayoutV = typename Traits::SmemLayoutV;
  using LayoutVt = typename Traits::SmemLayoutVt;

  // Stage-0 byte offsets straight from the layouts (e4m3: 1 byte/element).
  CUTE_HOST_DEVICE static uint32_t v_off(int key, int d) { return uint32_t(LayoutV{}(key, d, 0)); }
  CUTE_HOST_DEVICE static uint32_t vt_off(int d, int p) { return uint32_t(LayoutVt{}(d, p, 0)); }
  CUTE_HOST_DEVICE static uint32_t v_stage_off(int stage) { return uint32_t(LayoutV{}(0, 0, stage)); }
  CUTE_HOST_DEVICE static uint32_t vt_stage_off(int stage) { return uint32_t(LayoutVt{}(0, 0, stage)); }

  struct Lane {
    uint32_t v;           // V: the LDSM row this lane addresses (unit 0)
    uint32_t vt;          // V^T: the STSM row this lane addresses (unit 0)
    uint32_t sel0, sel1;  // PRMT selectors: this lane's bytes of matrices 0 / 1 (and 2 / 3)
  };
  CUTE_HOST_DEVICE static Lane lane_offsets(int lane) {
    const int m = lane / 8, r = lane % 8;
    const bool swap = lane / 4 >= 4;  // this lane's data rows c = lane / 4 (see above)
    // LDSM matrix m: keys 8 * (m % 2) + [0, 8), columns 16 * (m / 2) + [0, 16).
    // STSM matrix m, row r: head-dim row 16 * (m / 2) + 2r + (m % 2), the
    // parity flipped for r >= 4; positions [0, 16).
    return {v_off(8 * (m % 2) + r, 16 * (m / 2)),
            vt_off(16 * (m / 2) + 2 * r + ((m % 2) ^ (r / 4)), 0),
            swap ? 0x7531u : 0x6420u, swap ? 0x6420u : 0x7531u};
  }
  // A unit's (or row's) offset, combined with a base holding a lane's: the layouts are swizzle(linear),
  // an XOR of row bits into 16-byte-chunk bits, hence linear over XOR; the
  // parts below bit 10 meet the lane's (^), the rest are added (they become
  // the instructions' immediate offsets). stage bases are 1024-aligned.
  // Checked address by address on the host (fp8_transpose_check).
  CUTE_HOST_DEVICE static uint32_t at(uint32_t base_lane, uint32_t unit) {
    return (base_lane ^ (unit & 1023u)) + (unit & ~1023u);
  }
  static_assert(cosize_v<LayoutV> % (1024 * Traits::kStages) == 0 &&
                    cosize_v<LayoutVt> % (1024 * Traits::kStagesVt) == 0,
                "stage bases must be 1024-aligned");

  // This warp's rows of one tile, between stage bases v_base / vt_base
  // (shared addresses). Ldsm / Stsm: the warp-collective loads and stores
  // (the host check passes emulations).
#pragma nv_exec_check_disable
  template <class Ldsm, class Stsm>
  CUTE_HOST_DEVICE static void transpose_units(const Lane& lane, int share, uint32_t v_base,
                                               uint32_t vt_base, Ldsm&& ldsm, Stsm&& stsm) {
    const uint32_t va0 = v_base + lane.v, ta0 = vt_base + lane.vt;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int kn = share; kn < kUnitsN; kn += kWarps) {
      const uint32_t va = at(va0, v_off(16 * kn, 0)), ta = at(ta0, vt_off(0, 16 * kn));
      CUTLASS_PRAGMA_UNROLL
      for (int k0 = 0; k0 < kUnitsD; k0 += kBatch) {
        uint32_t w[kBatch][4];
        CUTLASS_PRAGMA_UNROLL
        for (int b = 0; b < kBatch; ++b) { ldsm(at(va, v_off(0, 32 * (k0 + b))), w[b]); }
        CUTLASS_PRAGMA_UNROLL
        for (int b = 0; b < kBatch; ++b) {
          const uint32_t out[4] = {byte_perm(w[b][0], w[b][1], lane.sel0), byte_perm(w[b][0], w[b][1], lane.sel1),
                                   byte_perm(w[b][2], w[b][3], lane.sel0), byte_perm(w[b][2], w[b][3], lane.sel1)};
          stsm(at(ta, vt_off(32 * (k0 + b), 0)), out);
        }
      }
    }
  }

  // One V tile: stage indices of the V and V^T rings; share: which rows
  // this warp takes (rotated per tile by the caller).
  CUTE_DEVICE static void transpose(typename Traits::SharedStorage& smem, const Lane& lane, int share,
                                    int v_stage, int vt_stage) {
    transpose_units(lane, share,
                    cute::cast_smem_ptr_to_uint(smem.v.data()) + v_stage_off(v_stage),
                    cute::cast_smem_ptr_to_uint(smem.vt.data()) + vt_stage_off(vt_stage),
                    [](uint32_t addr, uint32_t (&r)[4]) { ldsm_x4_trans(addr, r); },
                    [](uint32_t addr, const uint32_t (&r)[4]) { stsm_x4(addr, r); });
    // Generic-proxy stores must be visible to WGMMA (async proxy) reads.
    cutlass::arch::fence_view_async_shared();
  }
};

}  // namespace jax_fa3

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

namespace jax_fa3 {

using namespace cute;

// Within each 32-key slice: A-fragment position p = 16*h + 4*t + i (h: half,
// t: quad lane, i: byte) holds accumulator column 16*h + 8*(i/2) + 2*t + i%2
// (the accumulator gives lane t columns 2t, 2t+1 of every 8-column group; the
// e4m3 A operand wants 4 consecutive k per lane). See pack_p_fp8 in mainloop.h.
CUTE_HOST_DEVICE constexpr int vt_key_of(int p) {
  int base = p & ~31, q = p & 31;
  int h = q / 16, t = (q % 16) / 4, i = q % 4;
  return base + 16 * h + 8 * (i / 2) + 2 * t + (i % 2);
}

// 32-bit shared-memory accesses by 32-bit shared address (a dereference of
// the pointer CuTe hands out compiles to generic LD/ST, 64-bit addresses).
CUTE_DEVICE uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
CUTE_DEVICE void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

template <class Traits>
struct VTransposer {
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kWarps = Traits::kNumTransposeThreads / 32;
  static constexpr int kSlices = kBlockN / 32;   // k32 slices of P / keys
  static constexpr int kColBlocks = kHeadDim / 16;
  // Work unit of a warp: 16 head-dim columns x 32 keys, 4x4 bytes per lane.
  // Lane = (dl: 4-column group, t: quad lane, h: slice half), so both the
  // loads from V (rows key(p), one 16-byte chunk) and the stores into V^T
  // (rows d, p in two chunks) hit at most 2 lanes per bank under the
  // 128-byte swizzle (a lane -> column mapping was 16-way on stores).
  //
  // A warp owns whole 16-column blocks and walks the key slices with
  // addresses computed once per block: slice kb of V starts 32 rows further
  // (a whole number of 8-row swizzle atoms, so the byte offset just grows by
  // layout_v(32, 0, 0)); slice kb of V^T is 32*kb bytes further along a
  // swizzled row, which only flips address bits 5-6 (XOR 32*kb), untouched
  // by the key offset of a slice (< 32) and by the 1024-aligned bases.

  // tid in [0, kNumTransposeThreads); stage indices of the V and V^T rings.
  CUTE_DEVICE static void transpose(typename Traits::SharedStorage& smem, int tid,
                                    int v_stage, int vt_stage) {
    // Byte offsets from the swizzled layouts (e4m3: one byte per element) on
    // 32-bit shared addresses: the producer warps run at 32-48 registers and
    // share issue slots with the consumers, so the inner loop is just
    // LDS / PRMT / LOP3 / STS.
    const typename Traits::SmemLayoutV layout_v{};
    const typename Traits::SmemLayoutVt layout_vt{};
    static_assert(kBlockN <= 128, "V^T rows of one swizzle atom: the XOR step needs it");
    const uint32_t v_base = cute::cast_smem_ptr_to_uint(smem.v.data()) + uint32_t(layout_v(0, 0, v_stage));
    const uint32_t vt_base = cute::cast_smem_ptr_to_uint(smem.vt.data()) + uint32_t(layout_vt(0, 0, vt_stage));
    const uint32_t v_slice = uint32_t(layout_v(32, 0, 0));
    const int warp = tid / 32, lane = tid % 32;
    const int dl = lane % 4, t = (lane / 4) % 4, h = lane / 16;
    const int p0 = 16 * h + 4 * t;     // k-position in slice 0 (4 consecutive bytes)
    const int key0 = vt_key_of(p0);    // its 4 keys: key0 + {0, 1, 8, 9}
    CUTLASS_PRAGMA_NO_UNROLL
    for (int cb = warp; cb < kColBlocks; cb += kWarps) {
      const int d0 = cb * 16 + 4 * dl;
      uint32_t ld[4], st[4];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 4; ++i) {
        ld[i] = v_base + uint32_t(layout_v(key0 + (i & 1) + 8 * (i >> 1), d0, 0));
        st[i] = vt_base + uint32_t(layout_vt(d0 + i, p0, 0));
      }
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < kSlices; ++kb) {
        uint32_t w[4];
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < 4; ++i) { w[i] = lds32(ld[i] + kb * v_slice); }
        // 4x4 byte transpose: out[j] byte i = w[i] byte j.
        uint32_t lo01 = __byte_perm(w[0], w[1], 0x5140), hi01 = __byte_perm(w[0], w[1], 0x7362);
        uint32_t lo23 = __byte_perm(w[2], w[3], 0x5140), hi23 = __byte_perm(w[2], w[3], 0x7362);
        sts32(st[0] ^ (32u * kb), __byte_perm(lo01, lo23, 0x5410));
        sts32(st[1] ^ (32u * kb), __byte_perm(lo01, lo23, 0x7632));
        sts32(st[2] ^ (32u * kb), __byte_perm(hi01, hi23, 0x5410));
        sts32(st[3] ^ (32u * kb), __byte_perm(hi01, hi23, 0x7632));
      }
    }
    // Generic-proxy stores must be visible to WGMMA (async proxy) reads.
    cutlass::arch::fence_view_async_shared();
  }
};

}  // namespace jax_fa3

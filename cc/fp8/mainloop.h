// FP8 consumer mainloop: per K/V block, S = Q K^T (SS QGMMA, FP32 accumulate),
// descale + online softmax in FP32, P -> e4m3 in registers, O += P V^T-tile
// (RS QGMMA). Ping-pong between the consumer warpgroups as in fwd/mainloop.h;
// within one, P.V overlaps the softmax through a double-buffered P (run()).
// V^T arrives through the transposer's pipeline, or straight from TMA
// (Traits::kVtInGmem).
//
// Block scales: S_true = S * qs * ks_j enters softmax as one factor per block
// (Fp8OnlineSoftmax). O is accumulated in units of the tile's largest V block
// scale vs_ref: P_j is scaled by vs_j / vs_ref before its e4m3 cast, and
// finalize multiplies by vs_ref. O is rescaled only when a warp's running
// max moved (Fp8OnlineSoftmax::max_and_exp).
#pragma once

#include <cuda_fp8.h>
#include <cute/tensor.hpp>
#include "traits.h"
#include "transpose.h"
#include "softmax.h"
#include "../common/mask.h"
#include "../fwd/pingpong.h"
#include "../common/utils.h"

namespace jax_fa3 {

// Accumulator S (fp32, per k32 slice 16 values ordered (col pair, row half,
// n8 group)) -> FP8 A fragment (per k32 slice 16 bytes ordered (k byte, row
// half, k half)). Register moves only; the resulting column order is the one
// vt_key_of describes, and V^T is stored in that order.
template <class TS, class TP>
CUTE_DEVICE void pack_p_fp8(TS const& tSrS, TP& tOrP) {
  constexpr int kSlices = decltype(size(tSrS))::value / 16;
  static_assert(decltype(size(tOrP))::value == kSlices * 16);
  const float* s = tSrS.data();
  uint32_t* p = reinterpret_cast<uint32_t*>(tOrP.data());
  auto pack4 = [](float a, float b, float c, float d) {
    uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
    return lo | (hi << 16);
  };
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < kSlices; ++kb) {
    const float* x = s + 16 * kb;
    p[4 * kb + 0] = pack4(x[0], x[1], x[4], x[5]);      // row g,   k 4t..4t+3
    p[4 * kb + 1] = pack4(x[2], x[3], x[6], x[7]);      // row g+8, k 4t..4t+3
    p[4 * kb + 2] = pack4(x[8], x[9], x[12], x[13]);    // row g,   k 16+4t..
    p[4 * kb + 3] = pack4(x[10], x[11], x[14], x[15]);  // row g+8, k 16+4t..
  }
}

template <class Traits>
struct Fp8ConsumerMainloop {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;

  static constexpr int kRows = decltype(size<0>(as_rowcol(partition_fragment_C(
      typename Traits::TiledMmaQK{}, TileS{}))))::value;
  using Softmax = Fp8OnlineSoftmax<kRows>;
  using PingPong = WarpGroupPingPong<Traits::kPingPong, Traits::kNumMmaThreads>;

  // Runs the tile's K/V blocks. q_to_log2 = softmax scale * log2(e) * q_scale;
  // k_scale / v_scale point at this (batch, kv head)'s block scales. Returns
  // the V scale acc_o is expressed in (1 when the tile is empty). state_vt
  // walks the V^T ring, which is deeper than the K/V ring (traits.h).
  //
  // Block j: issue S_j = Q K_j^T; wait for P_{j-2} V_{j-2}; rescale O into
  // block j-1's frame while S_j runs; issue O += P_{j-1} V_{j-1}; softmax of
  // S_j and packing of P_j overlap that GEMM, which is waited for only after
  // the next S GEMM has been issued. P is double-buffered (the loop is
  // unrolled by two) so that packing P_j never writes registers the P.V
  // GEMM in flight reads. With one buffer (FA3's order: wait for P.V, then
  // convert), ptxas hoists that wait above the softmax -- WARPGROUP.DEPBAR
  // right after the masking code, so softmax never overlapped P.V (seen in
  // this kernel's SASS and in the 16-bit forward's). O's arithmetic is
  // unchanged: O * correction_{j-1} + P_{j-1} V_{j-1}, in this order.
  // pairs() gives the tile's PairRuleView (common/mask.h).
  template <class Pairs, class PipelineKV, class StateKV, class PipelineVt, class StateVt, class TO>
  CUTE_DEVICE float run(typename Traits::SharedStorage& smem, int mma_tid, const PingPong& pingpong,
                        const QueryBlockMask<kBlockM, kBlockN>& mask, Pairs&& pairs, int ref_lo, int ref_hi, float q_to_log2,
                        const float* k_scale, const float* v_scale,
                        PipelineKV& pipe_k, StateKV& state_kv, PipelineVt& pipe_vt, StateVt& state_vt,
                        Softmax& softmax, TO& acc_o) {
    if (mask.empty()) { return 1.f; }
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(Traits::vt_data(smem)), typename Traits::SmemLayoutVt{});

    auto thr_qk = mma_qk.get_thread_slice(mma_tid);
    auto thr_pv = mma_pv.get_thread_slice(mma_tid);
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
    Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, D, N, stage of the V^T ring)
    Tensor cS = thr_qk.partition_C(make_identity_tensor(TileS{}));

    Tensor tSrS = partition_fragment_C(mma_qk, TileS{});
    Tensor tOrP0 = make_tensor<Element>(partition_shape_A(mma_pv, TileS{}));
    // Unused (eliminated) without intra-warpgroup overlap.
    Tensor tOrP1 = make_tensor<Element>(partition_shape_A(mma_pv, TileS{}));
    // Factor for O before the next P.V: the first block's is 0 (its running
    // max was -inf) and O is still zero then, so it stays zero.
    float correction[kRows];

    // vs_ref: the largest V scale among the blocks [ref_lo, ref_hi) this
    // warpgroup's rows see (P_j carries the ratio vs_j / vs_ref <= 1, so P
    // stays within e4m3's range; blocks outside are fully masked, P = 0). Formed while
    // the first S GEMM runs, the lanes of each warp taking every 32nd block
    // (one L2 round trip, then a shuffle max); it was a serial loop before
    // that GEMM, 2-4 L2 round trips at the start of every tile.
    float vs_ref = 0.f, log2_vs_ref = 0.f;
    auto find_vs_ref = [&] {
      for (int n = ref_lo + int(threadIdx.x % 32); n < ref_hi; n += 32) {
        vs_ref = fmaxf(vs_ref, v_scale[n]);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int o = 16; o > 0; o /= 2) { vs_ref = fmaxf(vs_ref, __shfl_xor_sync(0xffffffff, vs_ref, o)); }
      log2_vs_ref = __log2f(vs_ref);
    };
    // log2(vs_j / vs_ref), clamped at -100: an all-zero V block has scale
    // FLT_MIN (quantize.cu), and with vs_ref >= 4 the softmax's un-scaling
    // factor 2^-v_log2 would overflow to inf (times a flushed-to-zero block
    // sum: NaN). A block 2^100 below the tile's largest adds nothing visible
    // to O either way; the clamp only keeps the arithmetic finite.
    auto v_log2_of = [&](int n) { return fmaxf(__log2f(v_scale[n]) - log2_vs_ref, -100.f); };
    bool rescale_o = false;  // warp-uniform: the last softmax moved this warp's max

    int n_block = mask.n_block_max - 1;
    {
      const float ks = k_scale[n_block];
      pipe_k.consumer_wait(state_kv);
      pingpong.wait_turn();
      warpgroup_gemm</*ZeroInit=*/true, /*WaitDepth=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, state_kv.index()), tSrS);
      pingpong.pass_turn();
      find_vs_ref();
      warpgroup_wait<0>();
      pipe_k.consumer_release(state_kv);
      ++state_kv;
      if (mask.needs_mask(n_block)) { mask.apply(tSrS, cS, n_block, pairs()); }
      // O is still zero: its first rescale is moot.
      softmax.max_and_exp(tSrS, q_to_log2 * ks, v_log2_of(n_block), correction);
      pack_p_fp8(tSrS, tOrP0);
    }

    StateVt state_vt_busy = state_vt;  // oldest V^T stage a P.V may still read
    bool pv_in_flight = false;
    // One K/V block: p_prev holds the previous block's P, p_next receives this one's.
    auto block = [&](auto& p_prev, auto& p_next, int n) {
      const float ks_next = k_scale[n];
      const float v_log2 = v_log2_of(n);
      pipe_k.consumer_wait(state_kv);
      pingpong.wait_turn();
      warpgroup_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, state_kv.index()), tSrS);
      warpgroup_wait<1>();  // the previous P.V retired (S_j may run): O is free
      if (pv_in_flight) { pipe_vt.consumer_release(state_vt_busy); ++state_vt_busy; }
      if (rescale_o) { Softmax::rescale(acc_o, correction); }
      pipe_vt.consumer_wait(state_vt);
      warpgroup_gemm<false, -1>(mma_pv, p_prev, tOrV(_, _, _, state_vt.index()), acc_o);
      ++state_vt;
      pv_in_flight = true;
      pingpong.pass_turn();
      if constexpr (Traits::kIntraWgOverlap) {
        warpgroup_wait<1>();  // S_j done; P_{j-1} V_{j-1} may still run (it reads p_prev)
      } else {
        // One P buffer (p_prev is p_next): P_{j-1} V_{j-1} retires before
        // P_j is packed; its V^T stage is free now.
        warpgroup_wait<0>();
        pipe_vt.consumer_release(state_vt_busy);
        ++state_vt_busy;
        pv_in_flight = false;
      }
      pipe_k.consumer_release(state_kv);
      ++state_kv;
      if (mask.needs_mask(n)) { mask.apply(tSrS, cS, n, pairs()); }
      rescale_o = softmax.max_and_exp(tSrS, q_to_log2 * ks_next, v_log2, correction);
      pack_p_fp8(tSrS, p_next);
    };
    // The last block's P.V.
    auto last = [&](auto& p_last) {
      warpgroup_wait<0>();
      if (pv_in_flight) { pipe_vt.consumer_release(state_vt_busy); ++state_vt_busy; }
      if (rescale_o) { Softmax::rescale(acc_o, correction); }
      pipe_vt.consumer_wait(state_vt);
      pingpong.wait_turn();
      warpgroup_gemm<false, -1>(mma_pv, p_last, tOrV(_, _, _, state_vt.index()), acc_o);
      pingpong.pass_turn();
      warpgroup_wait<0>();
      pipe_vt.consumer_release(state_vt);
      ++state_vt;
    };
    if constexpr (Traits::kIntraWgOverlap) {
      for (--n_block;; n_block -= 2) {
        if (n_block < mask.n_block_min) { last(tOrP0); break; }
        block(tOrP0, tOrP1, n_block);
        if (n_block - 1 < mask.n_block_min) { last(tOrP1); break; }
        block(tOrP1, tOrP0, n_block - 1);
      }
    } else {
      for (--n_block; n_block >= mask.n_block_min; --n_block) { block(tOrP0, tOrP0, n_block); }
      last(tOrP0);
    }
    return vs_ref;
  }
};

}  // namespace jax_fa3

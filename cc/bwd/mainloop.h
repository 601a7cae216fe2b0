// Consumer mainloop of the backward: for each query block that sees the CTA's
// key block, recompute P^T from S^T = K Q^T and the forward's LSE, form
// dS^T = P^T o (dP^T - delta), accumulate dV and dK in registers and add this
// key block's share of dQ = dS K into the fp32 dQ accumulator.
//
// dS is staged in shared memory for the dQ GEMM, which needs all kBlockN keys
// (both warpgroups' rows) as its reduction dimension; two named barriers
// order the writes against the other warpgroup's reads.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include "traits.h"
#include "../common/bias.h"
#include "../common/mask.h"
#include "dq_accum.h"
#include "dq_writer.h"
#include "tile_scheduler.h"
#include "../common/barriers.h"
#include "../common/utils.h"

namespace jax_fa3 {

template <class Traits>
struct BwdMainloop {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kNumMmaThreads = Traits::kNumMmaThreads;
  static constexpr int kDqChunks = Traits::kDqChunks;
  static constexpr int kDqCols = kHeadDim / kDqChunks;  // dQ columns per chunk
  using TileQc = Shape<Int<kBlockM>, Int<kDqCols>>;
  using Mask = KeyBlockMask<kBlockM, kBlockN>;
  using DqLayout = DqAccumLayout<Traits>;
  static_assert(DqLayout::kFrag == decltype(size(partition_fragment_C(typename Traits::TiledMmaQ{}, TileQc{})))::value);

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmaKV mma_kv;
  typename Traits::TiledMmadV mma_dv;
  typename Traits::TiledMmaQ mma_q;
  int dq_buf = 0;  // staging buffer of the next dQ reduce (kDqBufs > 1), kept across tiles
  BwdDqHandoff<Traits> dq_writer;  // Traits::kDqWriter launches: blocks handed to the writer warp

  // Softcap is a template parameter: the plain path then keeps neither the
  // raw scores nor the tanh-derivative selects live (registers are tight).
  // So is Deterministic (== p.deterministic; a kernel parameter, kernel.h).
  // One tile: every (query head of kv_head, query block) pair that sees key
  // block n_block, in BwdBlockWalk's order (the producer's).
  template <bool Softcap, bool Deterministic, class PipelineQdO, class StateQdO, class TK, class TV>
  CUTE_DEVICE void run(const BwdParams& p, typename Traits::SharedStorage& smem, int mma_tid,
                       const Mask& mask, int n_block, int kv_head, int batch,
                       PipelineQdO& pipe, StateQdO& state, TK& acc_dk, TV& acc_dv) {
    using TileSdP = typename Traits::TileSdP;
    using TileQ = typename Traits::TileQ;
    // The GEMMs' shared-memory operands, as tensors over an opaque base that the
    // loop below rebuilds every block (so are their WGMMA descriptors): hoisted
    // out of the persistent tile loop (kernel.h), the per-k-step descriptors
    // stayed live across the mainloop and ptxas spilled them (reloaded every
    // block).
    auto smem_operand = [](auto* ptr, auto layout) {
      asm volatile("" : "+l"(ptr));
      return make_tensor(make_smem_ptr(ptr), layout);
    };

    // P^T / dS^T accumulators -> smem with transposing stmatrix: the
    // accumulator's rows (keys) are the contiguous dimension of dS in smem, so
    // plain copies were 16-bit generic stores with 64-bit swizzle arithmetic.
    // Their swizzled per-thread targets are rebuilt per block along with the
    // thread index (Traits::kFreshThreadIndex), else computed once.
    auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, mma_sdp);
    auto stage_target = [&](Element* ptr) {
      if constexpr (Traits::kFreshThreadIndex) {
        return smem_operand(ptr, typename Traits::SmemLayoutdSt{});
      } else {
        return make_tensor(make_smem_ptr(ptr), typename Traits::SmemLayoutdSt{});
      }
    };

    // With a softcap the forward's scores are cap * x, x = tanh(q.k * scale / cap);
    // otherwise scale * x with x = q.k. dS is formed w.r.t. x; the remaining
    // factor `scale` is applied to dK in the epilogue and to dQ in the postprocess.
    constexpr bool softcap = Softcap;
    const float raw_to_x = softcap ? p.scale / p.softcap : 1.f;
    const float scale_log2 = (softcap ? p.softcap : p.scale) * 1.44269504088896340736f;
    const int group = p.n / p.kh;
    // Query block m of a head as one index: its dQ accumulator block and its
    // deterministic semaphore (both kBlockM rows per block, t_pad rows per head).
    auto dq_index = [&](int head, int m) { return (int64_t(batch) * p.n + head) * (p.t_pad / kBlockM) + m; };
    // dQ reduction. stage_dq writes the fp32 block into smem in fragment order
    // (dq_accum.h: the same order as the block in the accumulator; no
    // barrier, the caller has made the buffer free); issue_dq makes every
    // thread's staging visible and lets one thread add the block with a bulk
    // reduce while the others move on.
    auto dq_stage = [&] { return smem.dq.data() + dq_buf * (kBlockM * kHeadDim); };
    auto stage_dq = [&](auto& acc, int chunk) {
      float* sdq = dq_stage();
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < DqLayout::kFrag; i += 4) {
        *reinterpret_cast<float4*>(sdq + DqLayout::offset(chunk, mma_tid, i)) =
            make_float4(acc(i), acc(i + 1), acc(i + 2), acc(i + 3));
      }
    };
    auto issue_dq = [&](int64_t index, int m) {
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBarrierdQReady);
      if (mma_tid == 0) {
        dq_bulk_add<Deterministic>(p.semaphore + index, Deterministic ? mask.dq_turn(n_block, m) : 0,
                                   p.dq_accum + index * (kBlockM * kHeadDim), dq_stage(),
                                   int(kBlockM * kHeadDim * sizeof(float)));
      }
      if constexpr (Traits::kDqBufs > 1) { dq_buf ^= 1; }
    };
    for (BwdBlockWalk<!Deterministic> walk(group, mask.m_block_min, mask.m_block_max); walk.valid(); walk.next()) {
      const int head = kv_head * group + walk.g, m_block = walk.m;
      if constexpr (Traits::kFreshThreadIndex) { asm volatile("" : "+r"(mma_tid)); }
      auto thr_sdp = mma_sdp.get_thread_slice(mma_tid);
      auto thr_kv = mma_kv.get_thread_slice(mma_tid);
      auto thr_dv = mma_dv.get_thread_slice(mma_tid);
      auto thr_q = mma_q.get_thread_slice(mma_tid);
      auto thr_r2s = r2s.get_thread_slice(mma_tid);
      Tensor cS = thr_sdp.partition_C(make_identity_tensor(TileSdP{}));
      Tensor tSrS = partition_fragment_C(mma_sdp, TileSdP{});
      Tensor tSrdP = partition_fragment_C(mma_sdp, TileSdP{});
      pipe.consumer_wait(state);
      Tensor tSrK = thr_sdp.partition_fragment_A(smem_operand(smem.k.data(), typename Traits::SmemLayoutK{}));
      Tensor tSrV = thr_sdp.partition_fragment_A(smem_operand(smem.v.data(), typename Traits::SmemLayoutV{}));
      // (MMA, N, K, stage)
      Tensor tSrQ = thr_sdp.partition_fragment_B(smem_operand(smem.q.data(), typename Traits::SmemLayoutQ{}));
      Tensor tSrdO = thr_sdp.partition_fragment_B(smem_operand(smem.dout.data(), typename Traits::SmemLayoutdO{}));
      // (MMA, d, m, stage)
      Tensor tKVrdOt = thr_dv.partition_fragment_B(smem_operand(smem.dout.data(), typename Traits::SmemLayoutdOt{}));
      Tensor tKVrQt = thr_kv.partition_fragment_B(smem_operand(smem.q.data(), typename Traits::SmemLayoutQt{}));
      // (MMA, m, n)
      Tensor tQrdS = thr_q.partition_fragment_A(smem_operand(smem.ds.data(), typename Traits::SmemLayoutdS{}));
      // B operand of dQ chunk i: columns [i * kDqCols, (i + 1) * kDqCols) of K.
      Tensor sKt = smem_operand(smem.k.data(), typename Traits::SmemLayoutKt{});
      auto tQrKt = [&](int chunk) {
        return thr_q.partition_fragment_B(
            local_tile(sKt, Shape<Int<kDqCols>, Int<kBlockN>>{}, make_coord(chunk, _0{})));
      };
      Tensor tR2SsdS = thr_r2s.partition_D(stage_target(smem.ds.data()));
      warpgroup_gemm</*ZeroInit=*/true, /*WaitDepth=*/-1>(mma_sdp, tSrK, tSrQ(_, _, _, state.index()), tSrS);
      warpgroup_gemm<true, -1>(mma_sdp, tSrV, tSrdO(_, _, _, state.index()), tSrdP);
      // The bias (common/bias.h): its slice is rebuilt from the parameters
      // wherever it is used, so no address stays live across the loop.
      auto bias = [&] { return BiasTile<Element>::of(p, batch, head); };
      // Recomputed where used: one more register live across the loop spilled.
      auto bias_to_x = [&] { return 1.f / (softcap ? p.softcap : p.scale); };
      const int m_start = m_block * kBlockM;
      const float* lse_s = smem.lse.data() + state.index() * kBlockM;
      const float* delta_s = smem.delta.data() + state.index() * kBlockM;
      Tensor s = as_rowcol(tSrS);
      Tensor dp = as_rowcol(tSrdP);
      Tensor cs = as_rowcol(cS);
      Tensor rP = make_tensor<Element>(tSrS.layout());
      Tensor rdS = make_tensor<Element>(tSrdP.layout());
      // The same registers as RS-WGMMA A operands (identical element order).
      Tensor tKVrP = make_tensor(rP.data(), acc_to_a_layout(rP.layout()));
      Tensor tKVrdS = make_tensor(rdS.data(), acc_to_a_layout(rdS.layout()));
      // Register path: dV += P^T dO needs only P, so it is issued as soon as P
      // is ready and runs under the dS arithmetic and staging.
      auto issue_dv = [&] {
        if constexpr (!Traits::kStagePdS) {
          warpgroup_gemm<false, -1>(mma_dv, tKVrP, tKVrdOt(_, _, _, state.index()), acc_dv);
        }
      };
      if constexpr (!softcap) {
        // P^T while the dP^T GEMM still runs (WGMMA batches retire in order).
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);
        if (const auto b = bias(); b.active()) { b.add_transposed(tSrS, cS, mask.n_start, m_start, bias_to_x()); }
        if (mask.needs_mask(m_block)) { mask.apply(tSrS, cS, m_block, PairRuleView::keys(p, batch, kv_head, head)); }
        CUTLASS_PRAGMA_UNROLL
        for (int col = 0; col < size<1>(s); ++col) {
          const float lse2 = lse_s[get<1>(cs(0, col))];  // +inf on rows that see nothing: P = 0
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < size<0>(s); ++r) { s(r, col) = exp2f(s(r, col) * scale_log2 - lse2); }
        }
        convert_into(tSrS, rP);
        issue_dv();
        warpgroup_wait<Traits::kStagePdS ? 0 : 1>();  // dP^T done (dV may still run)
        warpgroup_fence_operand(tSrdP);
        CUTLASS_PRAGMA_UNROLL
        for (int col = 0; col < size<1>(s); ++col) {
          const float delta = delta_s[get<1>(cs(0, col))];
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < size<0>(s); ++r) { dp(r, col) = s(r, col) * (dp(r, col) - delta); }
        }
        // dS is the gradient of the biased scores: the bias gradient.
        if (const auto b = bias(); b.grad != nullptr) { b.store_grad_transposed(tSrdP, cS, mask.n_start, m_start); }
      } else {
        // dS needs the capped score x next to P: one pass after both GEMMs.
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
        warpgroup_fence_operand(tSrdP);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); ++i) { tSrS(i) = tanhf(tSrS(i) * raw_to_x); }
        if (mask.needs_mask(m_block)) { mask.apply(tSrS, cS, m_block, PairRuleView::keys(p, batch, kv_head, head)); }
        // The bias joins the capped score here (softmax over cap * x + bias),
        // x stays tanh's for its derivative 1 - x^2. Masked entries (x = -inf,
        // P = 0) must stay 0, not NaN.
        const BiasTile<Element> b = bias();
        CUTLASS_PRAGMA_UNROLL
        for (int col = 0; col < size<1>(s); ++col) {
          const int row = get<1>(cs(0, col));
          const float lse2 = lse_s[row];
          const float delta = delta_s[row];
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < size<0>(s); ++r) {
            const float x = s(r, col);
            const float xb = b.active() ? fmaf(b.at(mask.n_start + get<0>(cs(r, col)), m_start + row), bias_to_x(), x) : x;
            const float pr = exp2f(xb * scale_log2 - lse2);
            const float ds = pr > 0.f ? pr * (dp(r, col) - delta) : 0.f;
            if (b.grad != nullptr) { b.store_grad(mask.n_start + get<0>(cs(r, col)), m_start + row, ds); }
            dp(r, col) = pr > 0.f ? ds * (1.f - x * x) : 0.f;
            s(r, col) = pr;
          }
        }
        convert_into(tSrS, rP);
        issue_dv();
      }
      convert_into(tSrdP, rdS);
      Tensor acc_dq = partition_fragment_C(mma_q, TileQc{});
      // dQ(m block) += this key block's share, reduced in L2. Where there is no
      // writer warp (d64, d >= 192) the consumers stage the block (stage_dq)
      // and issue the bulk reduce themselves (issue_dq).
      auto reduce_dq = [&] {
        CUTLASS_PRAGMA_UNROLL
        for (int chunk = 0; chunk < kDqChunks; ++chunk) {
          if (chunk > 0) {
            warpgroup_gemm<true, 0>(mma_q, tQrdS, tQrKt(chunk), acc_dq);
          } else {
            // Each reduce is one bulk group: with two buffers only the
            // latest (the other buffer's) may still be reading.
            if (mma_tid == 0) { tma_store_wait<Traits::kDqBufs - 1>(); }
            cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBarrierdQFree);
          }
          stage_dq(acc_dq, chunk);
        }
        issue_dq(dq_index(head, m_block), m_block);
      };
      if constexpr (!Traits::kStagePdS) {
        // Stage dS: the other warpgroup's dQ GEMM of the previous block is done
        // reading (FREE), and all rows are written before any dQ GEMM (READY).
        // The dQ staging buffer is the writer's (Traits::kDqWriter) or, at d64,
        // freed by its own barrier in reduce_dq just before staging.
        cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBarrierdSFree);
        copy(r2s, thr_r2s.retile_S(rdS), tR2SsdS);
        cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> WGMMA reads
        cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBarrierdSReady);

        // dQ first: its staging then runs while the tensor cores still work on dK.
        warpgroup_gemm<true, -1>(mma_q, tQrdS, tQrKt(0), acc_dq);
        warpgroup_gemm<false, -1>(mma_kv, tKVrdS, tKVrQt(_, _, _, state.index()), acc_dk);
        warpgroup_wait<1>();  // dV and dQ retired
        warpgroup_fence_operand(acc_dq);
        if constexpr (Traits::kDqWriter) {
          dq_writer.acquire(smem);
          dq_buf = dq_writer.buf();
          stage_dq(acc_dq, 0);
          dq_writer.commit(smem, mma_tid, dq_index(head, m_block), Deterministic ? mask.dq_turn(n_block, m_block) : 0);
        } else {
          reduce_dq();
        }
        warpgroup_wait<0>();
        // P and dS fed RS WGMMAs: keep their registers live until those retired.
        warpgroup_fence_operand(tKVrP);
        warpgroup_fence_operand(tKVrdS);
      } else {
        // Each warpgroup holds a column slice of P^T / dS^T but needs all of
        // it: stage both (same FREE / READY protocol as dS above).
        // (MMA, n, m) descriptors
        Tensor tKVsP = thr_dv.partition_fragment_A(smem_operand(smem.p.data(), typename Traits::SmemLayoutdSt{}));
        Tensor tKVsdS = thr_kv.partition_fragment_A(smem_operand(smem.ds.data(), typename Traits::SmemLayoutdSt{}));
        cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBarrierdSFree);
        copy(r2s, thr_r2s.retile_S(rP), thr_r2s.partition_D(stage_target(smem.p.data())));
        copy(r2s, thr_r2s.retile_S(rdS), tR2SsdS);
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBarrierdSReady);
        warpgroup_gemm<false, -1>(mma_dv, tKVsP, tKVrdOt(_, _, _, state.index()), acc_dv);
        warpgroup_gemm<false, -1>(mma_kv, tKVsdS, tKVrQt(_, _, _, state.index()), acc_dk);
        warpgroup_gemm<true, -1>(mma_q, tQrdS, tQrKt(0), acc_dq);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dq);
      }
      warpgroup_fence_operand(acc_dv);
      warpgroup_fence_operand(acc_dk);
      pipe.consumer_release(state);
      ++state;
      // Staged path: after the release, so the next Q/dO load (one stage at
      // d256) overlaps it; later dQ chunks read only dS and K, not the stage.
      if constexpr (Traits::kStagePdS) { reduce_dq(); }
    }
  }
};

}  // namespace jax_fa3

// Epilogue of one tile of the main backward kernel: dK (times the softmax
// scale) and dV, converted to the input dtype, are staged in the dQ staging
// buffer (free once the tile's last dQ bulk reduce has read it; K and V may
// already take the next tile's loads) and leave through one TMA store each.
// The stores are not waited for here: the next tile's first dQ staging and the
// kernel's exit wait (kernel.h). (Stores straight from the
// accumulator fragments were 2-byte scatters, 8 partial sectors per warp
// instruction, at the end of every CTA with nothing to hide them.)
// GQA needs no reduction here: the CTA already summed over the query heads
// of its KV head. TMA clips key rows past the sequence; rows past kv_len
// hold zeros (no query saw them).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include "../common/barriers.h"
#include "traits.h"
#include "../common/utils.h"

namespace jax_fa3 {

template <class Traits, class KernelParams>
struct BwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;

  // Split key block (tile_scheduler.h): every share adds its fp32 dK/dV into
  // the block's scratch slot, in fragment order (the same thread layout in
  // every share), and counts itself done. Returns the slot's sums to the
  // share that counts last (it stores them), nullptr to the others.
  template <class TK, class TV>
  CUTE_DEVICE static const float* combine_split(const BwdParams& p, typename Traits::SharedStorage& smem,
                                                int mma_tid, int slot, int pieces, TK const& acc_dk,
                                                TV const& acc_dv) {
    constexpr int kFragK = decltype(size(acc_dk))::value;
    constexpr int kFragV = decltype(size(acc_dv))::value;
    constexpr int kThreads = Traits::kNumMmaThreads;
    // A slot holds one key block's dK and dV: the launcher sizes and zeroes 2 x kBlockN x d floats per slot.
    static_assert(kFragK * kThreads == Traits::kBlockN * kHeadDim && kFragV * kThreads == Traits::kBlockN * kHeadDimV);
    float* sums = p.dkv_split + kBwdMaxSplitUnits + int64_t(slot) * 2 * kFragK * kThreads;
    // Element i of dK at sums[i][thread], of dV at sums[kFragK + i][thread]:
    // scalar adds, coalesced per warp (float4 adds cost the d64 mainloop 12
    // more spill instructions, whose register quads they constrain).
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kFragK; ++i) {  // kFragV <= kFragK (Hv <= H)
      atomicAdd(sums + i * kThreads + mma_tid, acc_dk(i));
      if (i < kFragV) { atomicAdd(sums + (kFragK + i) * kThreads + mma_tid, acc_dv(i)); }
    }
    __threadfence();  // the adds are visible before the count
    cutlass::arch::NamedBarrier::sync(kThreads, kBarrierBwdEpilogue);
    if (mma_tid == 0) {
      smem.split_last = atomicAdd(reinterpret_cast<int*>(p.dkv_split) + slot, 1) == pieces - 1;
    }
    cutlass::arch::NamedBarrier::sync(kThreads, kBarrierBwdEpilogue);
    if (!smem.split_last) { return nullptr; }
    __threadfence();
    return sums;
  }

  // sums: a split key block's totals (combine_split), read instead of the
  // accumulators.
  template <class TK, class TV>
  CUTE_DEVICE static void store(const KernelParams& params, typename Traits::SharedStorage& smem, int mma_tid,
                                int n_block, int kv_head, int batch, TK const& acc_dk, TV const& acc_dv,
                                const float* sums = nullptr) {
    const BwdParams& p = params.bwd;
    typename Traits::TiledMmaKV mma_kv;
    typename Traits::TiledMmadV mma_dv;
    auto thr_kv = mma_kv.get_thread_slice(mma_tid);
    auto thr_dv = mma_dv.get_thread_slice(mma_tid);
    Element* stage = reinterpret_cast<Element*>(smem.dq.data());
    Tensor sdK = make_tensor(make_smem_ptr(stage), typename Traits::SmemLayoutK{});
    Tensor sdV = make_tensor(make_smem_ptr(stage + Traits::kdKVStageElems), typename Traits::SmemLayoutV{});
    Tensor rdK = make_tensor<Element>(acc_dk.layout());
    Tensor rdV = make_tensor<Element>(acc_dv.layout());
    if (sums == nullptr) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc_dk); ++i) { rdK(i) = Element(acc_dk(i) * p.scale); }
      convert_into(acc_dv, rdV);
    } else {
      constexpr int kFragK = decltype(size(acc_dk))::value;
      constexpr int kFragV = decltype(size(acc_dv))::value;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kFragK; ++i) {  // L2: the other shares' adds
        rdK(i) = Element(__ldcg(sums + i * Traits::kNumMmaThreads + mma_tid) * p.scale);
        if (i < kFragV) { rdV(i) = Element(__ldcg(sums + (kFragK + i) * Traits::kNumMmaThreads + mma_tid)); }
      }
    }
    // The last dQ bulk reduce (and any earlier store) has read the buffer
    // before anyone overwrites it; thread 0 issued them all.
    if (mma_tid == 0) { tma_store_wait<0>(); }
    cutlass::arch::NamedBarrier::sync(Traits::kNumMmaThreads, kBarrierBwdEpilogue);
    copy(rdK, thr_kv.partition_C(sdK));
    copy(rdV, thr_dv.partition_C(sdV));
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> TMA reads
    cutlass::arch::NamedBarrier::sync(Traits::kNumMmaThreads, kBarrierBwdEpilogue);
    if (mma_tid == 0) {
      auto store_one = [&](const auto& tma, auto& sX, auto head_dim) {
        Tensor mX = tma.get_tma_tensor(make_shape(p.s, head_dim, p.kh, p.b));
        Tensor gX = local_tile(mX(_, _, kv_head, batch), make_shape(Int<kBlockN>{}, head_dim),
                               make_coord(n_block, _0{}));
        tma_store_tile(tma, sX, gX);
      };
      store_one(params.tma_dk, sdK, Int<kHeadDim>{});
      store_one(params.tma_dv, sdV, Int<kHeadDimV>{});
      tma_store_arrive();
    }
  }
};

}  // namespace jax_fa3

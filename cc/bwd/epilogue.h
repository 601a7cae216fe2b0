// Epilogue of the main backward kernel: dK (times the softmax scale) and dV,
// converted to the input dtype, are staged in the K and V shared-memory
// buffers and leave through one TMA store each. (Stores straight from the
// accumulator fragments were 2-byte scatters, 8 partial sectors per warp
// instruction, at the end of every CTA with nothing to hide them.)
// GQA needs no reduction here: the CTA already summed over the query heads
// of its KV head. TMA clips key rows past the sequence; rows past kv_len
// hold zeros (no query saw them).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include "traits.h"
#include "../fwd/utils.h"

namespace jax_fa3 {

template <class Traits, class KernelParams>
struct BwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  // After the mainloop's named barriers (0-4, BwdMainloop).
  static constexpr uint32_t kBarrierEpilogue = 5;

  template <class TKV>
  CUTE_DEVICE static void store(const KernelParams& params, typename Traits::SharedStorage& smem, int mma_tid,
                                int n_block, int kv_head, int batch, TKV const& acc_dk, TKV const& acc_dv) {
    const BwdParams& p = params.bwd;
    typename Traits::TiledMmaKV mma_kv;
    auto thr_kv = mma_kv.get_thread_slice(mma_tid);
    Tensor sdK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sdV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    Tensor rdK = make_tensor<Element>(acc_dk.layout());
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) { rdK(i) = Element(acc_dk(i) * p.scale); }
    Tensor rdV = convert_fragment<Element>(acc_dv);
    // Both warpgroups' GEMMs that read K and V (the dQ GEMM reads all of K)
    // have retired before either buffer is overwritten.
    cutlass::arch::NamedBarrier::sync(Traits::kNumMmaThreads, kBarrierEpilogue);
    copy(rdK, thr_kv.partition_C(sdK));
    copy(rdV, thr_kv.partition_C(sdV));
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> TMA reads
    cutlass::arch::NamedBarrier::sync(Traits::kNumMmaThreads, kBarrierEpilogue);
    if (mma_tid == 0) {
      auto store_one = [&](const auto& tma, auto& sX) {
        Tensor mX = tma.get_tma_tensor(make_shape(p.s, Int<kHeadDim>{}, p.kh, p.b));
        Tensor gX = local_tile(mX(_, _, kv_head, batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                               make_coord(n_block, _0{}));
        auto [tXgX, tXsX] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sX),
                                          group_modes<0, 2>(gX));
        copy(tma, tXsX, tXgX);
      };
      store_one(params.tma_dk, sdK);
      store_one(params.tma_dv, sdV);
      tma_store_arrive();
      // Shared memory must stay valid until the stores (and the last dQ bulk
      // reduce) have read it.
      tma_store_wait<0>();
    }
  }
};

}  // namespace jax_fa3

// Consumer mainloop: per K/V block, S = Q K^T (SS WGMMA), mask where the block
// straddles a boundary, online softmax in FP32, O += P V (RS WGMMA with P
// still in registers). Each consumer warpgroup owns 64 of the tile's rows.
#pragma once

#include <cute/tensor.hpp>
#include "traits.h"
#include "mask.h"
#include "softmax.h"
#include "utils.h"

namespace jax_fa3 {

template <class Traits>
struct ConsumerMainloop {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;

  // Rows of the S fragment owned by one thread.
  static constexpr int kRows = decltype(size<0>(as_rowcol(partition_fragment_C(
      typename Traits::TiledMmaQK{}, Shape<Int<kBlockM>, Int<kBlockN>>{}))))::value;
  using Softmax = OnlineSoftmax<kRows>;

  // Runs the tile's K/V blocks; acc_o ends unnormalized in softmax's frame.
  template <class PipelineKV, class StateKV, class TO>
  CUTE_DEVICE void run(typename Traits::SharedStorage& smem, int mma_tid,
                       const TileMask<kBlockM, kBlockN>& mask, float softcap_or_zero,
                       float raw_to_x, PipelineKV& pipe_k, PipelineKV& pipe_v, StateKV& state_kv,
                       Softmax& softmax, TO& acc_o) {
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});

    auto thr_qk = mma_qk.get_thread_slice(mma_tid);
    auto thr_pv = mma_pv.get_thread_slice(mma_tid);
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // smem descriptors
    Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, D, N, stage)
    Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

    for (int n_block = mask.n_block_max - 1; n_block >= mask.n_block_min; --n_block) {
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
      pipe_k.consumer_wait(state_kv);
      warpgroup_gemm</*ZeroInit=*/true, /*WaitDepth=*/0>(mma_qk, tSrQ, tSrK(_, _, _, state_kv.index()), tSrS);
      pipe_k.consumer_release(state_kv);

      if (softcap_or_zero > 0.f) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tSrS); ++i) { tSrS(i) = tanhf(tSrS(i) * raw_to_x); }
      }
      if (mask.needs_mask(n_block)) { mask.apply(tSrS, cS, n_block); }
      softmax.update(tSrS, acc_o);

      Tensor rP = convert_fragment<Element>(tSrS);
      Tensor tOrP = make_tensor(rP.data(), acc_to_a_layout(rP.layout()));
      pipe_v.consumer_wait(state_kv);
      warpgroup_gemm</*ZeroInit=*/false, /*WaitDepth=*/0>(mma_pv, tOrP, tOrV(_, _, _, state_kv.index()), acc_o);
      pipe_v.consumer_release(state_kv);
      ++state_kv;
    }
  }
};

}  // namespace jax_fa3

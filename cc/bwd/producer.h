// Producer: one elected thread issues every TMA load of the CTA. Per tile, K
// and V of the key block arrive once (one barrier for both; the buffers free
// up when the consumers' last GEMM of the previous tile retired); Q and dO of each visited
// query block stream through a kStages-deep ring, Q and dO sharing a stage
// barrier since every consumer GEMM of a block needs one of them first and
// both soon after; the block's LSE and delta rows (fp32 scratch written by the
// preprocess) ride on the same barrier as 1-D bulk copies. With GQA the CTA
// visits all query heads of its KV head.
#pragma once

#include <cute/tensor.hpp>
#include "traits.h"
#include "../common/mask.h"
#include "tile_scheduler.h"

namespace jax_fa3 {

template <class Traits, class KernelParams>
struct BwdProducer {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;

  const KernelParams& params;
  typename Traits::SharedStorage& smem;

  // One tile, its query blocks in BwdBlockWalk<Descending>'s order. The
  // pipeline states carry over from tile to tile.
  template <bool Descending, class PipelineKV, class PipelineQdO, class StateKV, class StateQdO>
  CUTE_DEVICE void run(int n_block, int kv_head, int batch, const KeyBlockMask<kBlockM, kBlockN>& mask,
                       PipelineKV& pipe_kv, StateKV& state_kv, PipelineQdO& pipe_qdo, StateQdO& state) {
    const BwdParams& p = params.bwd;
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutdO{});

    Tensor mK = params.tma_k.get_tma_tensor(make_shape(p.s, Int<kHeadDim>{}, p.kh, p.b));
    Tensor mV = params.tma_v.get_tma_tensor(make_shape(p.s, Int<kHeadDimV>{}, p.kh, p.b));
    Tensor mQ = params.tma_q.get_tma_tensor(make_shape(p.t, Int<kHeadDim>{}, p.n, p.b));
    Tensor mdO = params.tma_do.get_tma_tensor(make_shape(p.t, Int<kHeadDimV>{}, p.n, p.b));
    Tensor gK = local_tile(mK(_, _, kv_head, batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(n_block, _0{}));
    Tensor gV = local_tile(mV(_, _, kv_head, batch), Shape<Int<kBlockN>, Int<kHeadDimV>>{},
                           make_coord(n_block, _0{}));
    auto [tKgK, tKsK] = tma_views(params.tma_k, sK, gK);
    auto [tVgV, tVsV] = tma_views(params.tma_v, sV, gV);

    pipe_kv.producer_acquire(state_kv);
    copy(params.tma_k.with(*pipe_kv.producer_get_barrier(state_kv)), tKgK, tKsK);
    copy(params.tma_v.with(*pipe_kv.producer_get_barrier(state_kv)), tVgV, tVsV);
    ++state_kv;

    const int group = p.n / p.kh;
    for (BwdBlockWalk<Descending> walk(group, mask.m_block_min, mask.m_block_max); walk.valid(); walk.next()) {
      const int head = kv_head * group + walk.g, m_block = walk.m;
      Tensor gQ = local_tile(mQ(_, _, head, batch), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}));
      Tensor gdO = local_tile(mdO(_, _, head, batch), Shape<Int<kBlockM>, Int<kHeadDimV>>{}, make_coord(m_block, _0{}));
      auto [tQgQ, tQsQ] = tma_views(params.tma_q, sQ, gQ);
      auto [tdOgdO, tdOsdO] = tma_views(params.tma_do, sdO, gdO);
      pipe_qdo.producer_acquire(state);
      copy(params.tma_q.with(*pipe_qdo.producer_get_barrier(state)), tQgQ, tQsQ(_, state.index()));
      copy(params.tma_do.with(*pipe_qdo.producer_get_barrier(state)), tdOgdO, tdOsdO(_, state.index()));
      const int64_t row = (int64_t(batch) * p.n + head) * p.t_pad + m_block * kBlockM;
      SM90_BULK_COPY_G2S::copy(p.lse_log2 + row, pipe_qdo.producer_get_barrier(state),
                               smem.lse.data() + state.index() * kBlockM, Traits::kBytesRowStats);
      SM90_BULK_COPY_G2S::copy(p.delta + row, pipe_qdo.producer_get_barrier(state),
                               smem.delta.data() + state.index() * kBlockM, Traits::kBytesRowStats);
      ++state;
    }
  }
};

}  // namespace jax_fa3

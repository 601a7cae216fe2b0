// Producer: one elected thread of the producer warpgroup issues every TMA
// load. Q is loaded once per tile into its pipeline (with O staged in Q's
// buffer, its "empty" barrier is released only after the epilogue has stored O);
// K and V stream through kStages-deep rings, K and V on separate barriers so
// the S GEMM can start while V is still in flight.
#pragma once

#include <cute/tensor.hpp>
#include "traits.h"
#include "../common/mask.h"
#include "../common/utils.h"

namespace jax_fa3 {

template <class Traits, class KernelParams>
struct ProducerLoad {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;

  const KernelParams& params;
  typename Traits::SharedStorage& smem;

  // Global (TMA) and shared-memory views of one tile's Q (into Q stage
  // q_stage) and of its head's K/V blocks.
  CUTE_DEVICE auto views(const WorkTile& tile, int q_stage) const {
    const FwdParams& p = params.fwd;
    Tensor sQ = smem_q<Traits>(smem, q_stage);
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
    Tensor mQ = params.tma_q.get_tma_tensor(make_shape(p.t, Int<kHeadDim>{}, p.n, p.b));
    Tensor mK = params.tma_k.get_tma_tensor(make_shape(p.s, Int<kHeadDim>{}, p.kh, p.b));
    Tensor mV = params.tma_v.get_tma_tensor(make_shape(p.s, Int<kHeadDim>{}, p.kh, p.b));
    const int kv_head = tile.head / (p.n / p.kh);  // GQA/MQA: index map, no copy
    Tensor gQ = local_tile(mQ(_, _, tile.head, tile.batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                           make_coord(tile.m_block, _0{}));
    Tensor gK = local_tile(mK(_, _, kv_head, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(_, _0{}));  // (BN, D, n_blocks)
    Tensor gV = local_tile(mV(_, _, kv_head, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(_, _0{}));
    auto [tQgQ, tQsQ] = tma_views(params.tma_q, sQ, gQ);
    auto [tKgK, tKsK] = tma_views(params.tma_k, sK, gK);
    auto [tVgV, tVsV] = tma_views(params.tma_v, sV, gV);
    return cute::make_tuple(tQgQ, tQsQ, tKgK, tKsK, tVgV, tVsV);
  }

  template <class Views, class PipelineQ, class StateQ>
  CUTE_DEVICE void load_q(const Views& v, PipelineQ& pipe_q, StateQ& state_q) const {
    pipe_q.producer_acquire(state_q);
    auto sQ = get<1>(v);  // a non-const view: copy() writes through its destination
    copy(params.tma_q.with(*pipe_q.producer_get_barrier(state_q)), get<0>(v), sQ);
    ++state_q;
  }

  // One K/V block into the next ring stage (K and V on separate barriers).
  template <class Views, class PipelineKV, class StateKV>
  CUTE_DEVICE void load_kv(const Views& v, int n_block, PipelineKV& pipe_k, PipelineKV& pipe_v,
                           StateKV& state_kv) const {
    pipe_k.producer_acquire(state_kv);
    copy(params.tma_k.with(*pipe_k.producer_get_barrier(state_kv)),
         get<2>(v)(_, n_block), get<3>(v)(_, state_kv.index()));
    pipe_v.producer_acquire(state_kv);
    copy(params.tma_v.with(*pipe_v.producer_get_barrier(state_kv)),
         get<4>(v)(_, n_block), get<5>(v)(_, state_kv.index()));
    ++state_kv;
  }

  // A whole tile, K/V blocks high to low (the order the consumers visit them).
  template <class PipelineQ, class PipelineKV, class StateQ, class StateKV>
  CUTE_DEVICE void load_tile(const WorkTile& tile, const QueryBlockMask<kBlockM, kBlockN>& mask,
                             PipelineQ& pipe_q, StateQ& state_q,
                             PipelineKV& pipe_k, PipelineKV& pipe_v, StateKV& state_kv) const {
    auto v = views(tile, state_q.index());
    load_q(v, pipe_q, state_q);
    for (int n_block = mask.n_block_max - 1; n_block >= mask.n_block_min; --n_block) {
      load_kv(v, n_block, pipe_k, pipe_v, state_kv);
    }
  }
};

}  // namespace jax_fa3

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
  static constexpr int kHeadDimV = Traits::kHeadDimV;

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
    const int batch = data_batch(p, tile.batch);
    Tensor gQ = local_tile(mQ(_, _, tile.head, batch), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                           make_coord(tile.m_block, _0{}));
    auto [tQgQ, tQsQ] = tma_views(params.tma_q, sQ, gQ);
    return cute::make_tuple(tQgQ, tQsQ, kv_views<kHeadDim>(params.tma_k, sK, tile, batch),
                            kv_views<kHeadDimV>(params.tma_v, sV, tile, batch));
  }

  // TMA views of the K (D = kHeadDim) or V (kHeadDimV) blocks of one cache
  // batch (or page) `where`: (global (.., n_blocks), shared (.., stages)).
  template <int D, class Tma, class TS>
  CUTE_DEVICE auto kv_views(const Tma& tma, const TS& s, const WorkTile& tile, int where) const {
    const FwdParams& p = params.fwd;
    const KvExtent kv = KvExtent::of(p);
    Tensor m = tma.get_tma_tensor(make_shape(kv.rows, Int<D>{}, p.kh, kv.batches));
    const int kv_head = tile.head / (p.n / p.kh);  // GQA/MQA: index map, no copy
    Tensor g = local_tile(m(_, _, kv_head, where), Shape<Int<kBlockN>, Int<D>>{},
                          make_coord(_, _0{}));  // (BN, D, n_blocks)
    return tma_views(tma, s, g);
  }

  template <class Views, class PipelineQ, class StateQ>
  CUTE_DEVICE void load_q(const Views& v, PipelineQ& pipe_q, StateQ& state_q) const {
    pipe_q.producer_acquire(state_q);
    auto sQ = get<1>(v);  // a non-const view: copy() writes through its destination
    copy(params.tma_q.with(*pipe_q.producer_get_barrier(state_q)), get<0>(v), sQ);
    ++state_q;
  }

  // One K/V block into the next ring stage (K and V on separate barriers).
  template <class KViews, class VViews, class PipelineKV, class StateKV>
  CUTE_DEVICE void load_kv(const KViews& k, const VViews& v, int n_block, PipelineKV& pipe_k, PipelineKV& pipe_v,
                           StateKV& state_kv) const {
    pipe_k.producer_acquire(state_kv);
    copy(params.tma_k.with(*pipe_k.producer_get_barrier(state_kv)),
         get<0>(k)(_, n_block), get<1>(k)(_, state_kv.index()));
    pipe_v.producer_acquire(state_kv);
    copy(params.tma_v.with(*pipe_v.producer_get_barrier(state_kv)),
         get<0>(v)(_, n_block), get<1>(v)(_, state_kv.index()));
    ++state_kv;
  }

  // A whole tile, K/V blocks high to low (the order the consumers visit them).
  template <class PipelineQ, class PipelineKV, class StateQ, class StateKV>
  CUTE_DEVICE void load_tile(const WorkTile& tile, const QueryBlockMask<kBlockM, kBlockN>& mask,
                             PipelineQ& pipe_q, StateQ& state_q,
                             PipelineKV& pipe_k, PipelineKV& pipe_v, StateKV& state_kv) const {
    auto v = views(tile, state_q.index());
    load_q(v, pipe_q, state_q);
    const PagedKV& pages = params.fwd.pages;
    if (!Traits::kPagedKV || pages.table == nullptr) {
      for (int n_block = mask.n_block_max - 1; n_block >= mask.n_block_min; --n_block) {
        load_kv(get<2>(v), get<3>(v), n_block, pipe_k, pipe_v, state_kv);
      }
      return;
    }
    if constexpr (Traits::kPagedKV) { load_pages(tile, mask, pipe_k, pipe_v, state_kv); }
  }

  // A paged cache: each block is loaded through the views of its page.
  template <class PipelineKV, class StateKV>
  CUTE_DEVICE void load_pages(const WorkTile& tile, const QueryBlockMask<kBlockM, kBlockN>& mask,
                              PipelineKV& pipe_k, PipelineKV& pipe_v, StateKV& state_kv) const {
    const PagedKV& pages = params.fwd.pages;
    const int per_page = pages.page_size / kBlockN;
    const int32_t* row = pages.table + int64_t(data_batch(params.fwd, tile.batch)) * pages.pages_per_row;
    for (int n_block = mask.n_block_max - 1; n_block >= mask.n_block_min; --n_block) {
      const int page = min(max(__ldg(row + n_block / per_page), 0), pages.num_pages - 1);
      const int blk = n_block % per_page;
      pipe_k.producer_acquire(state_kv);
      {
        Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
        auto k = kv_views<kHeadDim>(params.tma_k, sK, tile, page);
        copy(params.tma_k.with(*pipe_k.producer_get_barrier(state_kv)), get<0>(k)(_, blk),
             get<1>(k)(_, state_kv.index()));
      }
      pipe_v.producer_acquire(state_kv);
      {
        Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutV{});
        auto v = kv_views<kHeadDimV>(params.tma_v, sV, tile, page);
        copy(params.tma_v.with(*pipe_v.producer_get_barrier(state_kv)), get<0>(v)(_, blk),
             get<1>(v)(_, state_kv.index()));
      }
      ++state_kv;
    }
  }
};

}  // namespace jax_fa3

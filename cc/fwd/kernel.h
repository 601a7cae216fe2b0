// The warp-specialized forward kernel: composes producer, consumer mainloop,
// softmax and epilogue over the tiles the scheduler hands out, and the host
// launcher that builds TMA descriptors. Include from exactly one generated .cu
// per (dtype, head dim) instantiation.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "../common/kernel_common.h"
#include "params.h"
#include "traits.h"
#include "tile_scheduler.h"
#include "../common/mask.h"
#include "producer.h"
#include "mainloop.h"
#include "epilogue.h"

namespace jax_fa3 {

template <class Traits>
struct FwdKernelParams {
  FwdParams fwd;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmaO tma_o;
};

// The key blocks a tile visits (producer and consumers build the same view).
template <class Traits>
CUTE_DEVICE QueryBlockMask<Traits::kBlockM, Traits::kBlockN> tile_mask(const FwdParams& p, const WorkTile& tile) {
  auto mask = QueryBlockMask<Traits::kBlockM, Traits::kBlockN>::template of<Traits::kPairRule, Traits::kKvCache>(
      p, tile.m_block, data_batch(p, tile.batch), tile.head);
  if (p.num_splits > 1) { mask.take_split(tile.batch % p.num_splits, p.num_splits); }
  return mask;
}

template <class Traits, class Scheduler>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
fwd_kernel(CUTE_GRID_CONSTANT const FwdKernelParams<Traits> params) {
#if defined(__CUDA_ARCH__) && !defined(CUTLASS_ARCH_MMA_SM90A_ENABLED)
  __trap();  // built without sm_90a: wgmma/setmaxnreg unavailable
#else
  using Params = FwdKernelParams<Traits>;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelineKV = typename Traits::PipelineKV;
  using Mainloop = ConsumerMainloop<Traits>;
  constexpr int kBlockM = Traits::kBlockM;

  extern __shared__ char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const FwdParams& p = params.fwd;

  const WarpRoles roles = WarpRoles::make();
  const bool is_producer = roles.is_producer;
  if (roles.tma_thread) { prefetch_tma_descriptors(params.tma_q, params.tma_k, params.tma_v, params.tma_o); }

  // Pipelines: the TMA thread produces; all consumer threads arrive on the
  // "empty" barriers.
  const auto pq = tma_pipeline_params<PipelineQ>(roles, Traits::kTmaBytesQ, Traits::kNumMmaThreads);
  const auto pk = tma_pipeline_params<PipelineKV>(roles, Traits::kTmaBytesK, Traits::kNumMmaThreads);
  const auto pv = tma_pipeline_params<PipelineKV>(roles, Traits::kTmaBytesV, Traits::kNumMmaThreads);
  PipelineQ pipe_q(smem.pipe_q, pq, Shape<_1, _1, _1>{});
  PipelineKV pipe_k(smem.pipe_k, pk, Shape<_1, _1, _1>{});
  PipelineKV pipe_v(smem.pipe_v, pv, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier init visible to all

  Scheduler scheduler(p, kBlockM);

  if (is_producer) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (roles.tma_thread) {
      ProducerLoad<Traits, Params> producer{params, smem};
      auto state_q = cutlass::make_producer_start_state<PipelineQ>();
      auto state_kv = cutlass::make_producer_start_state<PipelineKV>();
      for (WorkTile tile = scheduler.first(); tile.valid; tile = scheduler.next(tile)) {
        producer.load_tile(tile, tile_mask<Traits>(p, tile), pipe_q, state_q, pipe_k, pipe_v, state_kv);
      }
      // Do not retire while loads this thread issued could still be landing.
      pipe_k.producer_tail(state_kv);
      pipe_v.producer_tail(state_kv);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int mma_tid = threadIdx.x - cutlass::NumThreadsPerWarpGroup;
    Mainloop mainloop;
    typename Mainloop::PingPong pingpong{mma_tid / cutlass::NumThreadsPerWarpGroup};
    pingpong.init();
    auto state_q = typename PipelineQ::PipelineState{};
    auto state_kv = typename PipelineKV::PipelineState{};
    // With a softcap the scores become x = tanh(q.k * scale / cap) and
    // softmax works on cap * x; otherwise x = q.k and softmax works on scale * x.
    const bool softcap = p.softcap > 0.f;
    const float raw_to_x = softcap ? p.scale / p.softcap : 1.f;
    const float scale_log2 = (softcap ? p.softcap : p.scale) * 1.44269504088896340736f;
    const float bias_to_x = 1.f / (softcap ? p.softcap : p.scale);
    for (WorkTile tile = scheduler.first(); tile.valid; tile = scheduler.next(tile)) {
      const auto mask = tile_mask<Traits>(p, tile);
      const int q_len = mask.rule.q_len;
      Tensor acc_o = partition_fragment_C(mainloop.mma_pv, Shape<Int<kBlockM>, Int<Traits::kHeadDimV>>{});
      clear(acc_o);
      typename Mainloop::Softmax softmax(scale_log2);
      // Wait for Q even when the tile is empty, so no TMA write to its buffer
      // is still in flight when the pipeline slot is handed back.
      pipe_q.consumer_wait(state_q);
      // With O in its own buffer, Q's slot goes back as soon as the last S
      // GEMM retired: the next tile's Q then lands under this tile's tail.
      bool q_released = false;
      auto release_q = [&] {
        if constexpr (Traits::kSeparateO) {
          pipe_q.consumer_release(state_q);
          ++state_q;
          q_released = true;
        }
      };
      auto pairs = [&p, batch = tile.batch, head = tile.head] {
        return PairRuleView::queries<Traits::kPairRule>(p, data_batch(p, batch), head);
      };
      // Tiles without the pair rule (the d64 192-row tile) take no bias either.
      auto bias = [&p, batch = tile.batch, head = tile.head] {
        using Bias = BiasTile<typename Traits::Element>;
        if constexpr (Traits::kPairRule) { return Bias::of(p, data_batch(p, batch), head); } else { return Bias{}; }
      };
      mainloop.run(smem, state_q.index(), mma_tid, pingpong, mask, pairs, bias, softcap, raw_to_x, bias_to_x, pipe_k,
                   pipe_v, state_kv, softmax, acc_o, release_q);
      if (Traits::kSeparateO && !q_released) { release_q(); }  // an empty tile
      float lse[Mainloop::kRows];
      softmax.finalize(acc_o, lse, p.sinks ? p.sinks[tile.head] * 1.44269504088896340736f : -INFINITY);
      Epilogue<Traits, Params>::store(params, smem, mma_tid, tile, q_len, acc_o, lse);
      if constexpr (!Traits::kSeparateO) {  // O was staged in Q's buffer and has been stored
        pipe_q.consumer_release(state_q);
        ++state_q;
      }
    }
    Epilogue<Traits, Params>::drain(mma_tid);
  }
#endif
}

}  // namespace jax_fa3

namespace jax_fa3 {

// Host launcher for one instantiation. Tile: FwdTileConfig's, or a FwdTile
// the handler picks per problem (the d64 192-row tile).
template <class Element, int HeadDim, class Tile = FwdTileConfig<HeadDim>>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
  using Traits = FwdTraits<Element, HeadDim, Tile>;
  using Scheduler = PersistentTileScheduler;
  if (!Traits::kPairRule && (p.pair.q_spans != nullptr || p.bias.ptr != nullptr)) {
    return cudaErrorInvalidValue;  // never ignore the rule or the bias
  }
  if (p.bias.ptr != nullptr && (p.bottom_right || p.num_splits != 1 || p.heads_major || p.bias.row_stride % 2)) {
    return cudaErrorInvalidValue;  // a bias indexes plain query rows, in column pairs
  }
  if (!Traits::kKvCache && (p.bottom_right || p.pages.table != nullptr)) { return cudaErrorInvalidValue; }
  if (p.pages.table != nullptr && (p.pages.page_size % Traits::kBlockN != 0 || p.pages.num_pages < 1)) {
    return cudaErrorInvalidValue;  // a key block must not straddle pages
  }
  if ((p.dv > 0 ? p.dv : p.d) != Traits::kHeadDimV) { return cudaErrorInvalidValue; }
  auto layout = btnh_layout<HeadDim>;
  auto layout_v = btnh_layout<Traits::kHeadDimV>;
  auto layout_q = p.heads_major ? bhtd_layout<HeadDim> : layout;
  auto layout_o = p.heads_major ? bhtd_layout<Traits::kHeadDimV> : layout_v;
  const KvExtent kv = KvExtent::of(p);
  FwdKernelParams<Traits> kp{
      p,
      Traits::make_tma_q(static_cast<const Element*>(p.q), layout_q(p.t, p.n, p.b)),
      Traits::make_tma_k(static_cast<const Element*>(p.k), layout(kv.rows, p.kh, kv.batches)),
      Traits::make_tma_v(static_cast<const Element*>(p.v), layout_v(kv.rows, p.kh, kv.batches)),
      Traits::make_tma_o(static_cast<Element*>(p.o), layout_o(p.t, p.n, p.b * p.num_splits)),
  };
  return launch_kernel(fwd_kernel<Traits, Scheduler>, Scheduler::grid(p, Traits::kBlockM), Traits::kNumThreads,
                       Traits::kSmemBytes, stream, kp);
}

}  // namespace jax_fa3

// The warp-specialized backward kernel (persistent CTAs that each take tiles
// of one (key block, KV head, batch), or a share of one: tile_scheduler.h,
// until none is left) and the host launcher that
// runs preprocess -> main -> postprocess on XLA's stream. Include from exactly
// one generated .cu per (dtype, head dim).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "../common/kernel_common.h"
#include "params.h"
#include "traits.h"
#include "../common/mask.h"
#include "tile_scheduler.h"
#include "producer.h"
#include "mainloop.h"
#include "epilogue.h"
#include "dq_writer.h"
#include "pre_post.h"

namespace jax_fa3 {

template <class Traits>
struct BwdKernelParams {
  BwdParams bwd;
  typename Traits::TmaQ tma_q;
  typename Traits::TmadO tma_do;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmadK tma_dk;
  typename Traits::TmadV tma_dv;
  BwdTileOrder tiles;
};

// Deterministic (== params.bwd.deterministic) is a kernel parameter: it picks
// the dQ protocol (the semaphore turns, mainloop.h and dq_writer.h), and as a run-time
// branch there it cost the default path spills and half its gain.
template <class Traits, bool Deterministic>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
bwd_kernel(CUTE_GRID_CONSTANT const BwdKernelParams<Traits> params) {
#if defined(__CUDA_ARCH__) && !defined(CUTLASS_ARCH_MMA_SM90A_ENABLED)
  __trap();  // built without sm_90a: wgmma/setmaxnreg unavailable
#else
  using Params = BwdKernelParams<Traits>;
  using PipelineQdO = typename Traits::PipelineQdO;
  using PipelineKV = typename Traits::PipelineKV;
  using Mainloop = BwdMainloop<Traits>;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr bool kDqWriter = Traits::kDqWriter;

  extern __shared__ char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const BwdParams& p = params.bwd;

  const WarpRoles roles = WarpRoles::make();
  const bool is_producer = roles.is_producer;
  const bool is_leader = roles.tma_thread;
  if (is_leader) {
    prefetch_tma_descriptors(params.tma_q, params.tma_do, params.tma_k, params.tma_v, params.tma_dk, params.tma_dv);
  }

  const auto pq = tma_pipeline_params<PipelineQdO>(roles, Traits::kTmaBytesQdO, Traits::kNumMmaThreads);
  const auto pkv = tma_pipeline_params<PipelineKV>(roles, Traits::kTmaBytesKV, Traits::kNumMmaThreads);
  PipelineQdO pipe_qdo(smem.pipe_qdo, pq, Shape<_1, _1, _1>{});
  PipelineKV pipe_kv(smem.pipe_kv, pkv, Shape<_1, _1, _1>{});

  // Built separately on each side of the register split: a value computed
  // before it and live into both sides gets a stack slot (the producer has
  // 24 registers), which the consumer loop then reloads every block.
  auto make_mask = [&](const BwdTile& tile) {
    auto mask = KeyBlockMask<kBlockM, kBlockN>::of(p, tile.n_block, tile.batch, tile.kv_head, /*narrow=*/!Deterministic);
    if (tile.pieces > 1) { mask.take_share(tile.piece, tile.pieces); }
    return mask;
  };

  // Persistent CTAs: tile blockIdx.x first, then the next unclaimed index of
  // the dispatch order (a global counter) until it runs out. The producer
  // claims a tile as soon as it has issued the previous one's loads and hands
  // it over through two shared-memory slots (Traits::PipelineTile's barriers),
  // so the next tile's K, V, Q and dO load while the consumers finish a tile
  // and run its epilogue (otherwise every tile paid the K/V load, pipeline
  // ramp and epilogue in series). Both sides drive the slot and K/V barriers
  // from tile counts.
  using PipelineTile = typename Traits::PipelineTile;
  typename PipelineTile::Params pt;
  pt.role = is_producer ? PipelineTile::ThreadCategory::Producer : PipelineTile::ThreadCategory::Consumer;
  pt.producer_arv_count = 1;
  pt.consumer_arv_count = Traits::kNumMmaThreads;
  PipelineTile pipe_tile(smem.pipe_tile, pt);  // initializes the slot barriers
  if constexpr (kDqWriter) {
    typename Traits::PipelineDq::Params pd;
    pd.producer_arv_count = Traits::kNumMmaThreads;  // every consumer thread stages a part
    pd.consumer_arv_count = 1;                       // the writer's elected lane
    typename Traits::PipelineDq pipe_dq(smem.pipe_dq, pd);  // initializes its barriers
  }
  __syncthreads();  // barrier init visible to all
  auto& tile_full = smem.pipe_tile.full_barrier_;
  auto& tile_empty = smem.pipe_tile.empty_barrier_;

  if (is_producer) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (is_leader) {
      const int num_tiles = params.tiles.num_ctas();
      int* tile_counter = p.dkv_split != nullptr ? reinterpret_cast<int*>(p.dkv_split) + kBwdTileCounter : nullptr;
      auto state_kv = cutlass::make_producer_start_state<PipelineKV>();
      auto state = cutlass::make_producer_start_state<PipelineQdO>();
      int bid = blockIdx.x;
      for (int it = 0;; ++it) {
        tile_empty[it & 1].wait(((it >> 1) & 1) ^ 1);  // a producer's first pass finds the slot free
        smem.tile_id[it & 1] = bid;
        tile_full[it & 1].arrive();
        if (bid >= num_tiles) { break; }
        const BwdTile tile = params.tiles(bid);
        const auto mask = make_mask(tile);
        if (mask.m_block_max > mask.m_block_min) {
          BwdProducer<Traits, Params>{params, smem}.template run<!Deterministic>(
              tile.n_block, tile.kv_head, tile.batch, mask, pipe_kv, state_kv, pipe_qdo, state);
        }
        bid = tile_counter != nullptr ? int(gridDim.x) + atomicAdd(tile_counter, 1) : num_tiles;
      }
      // Do not retire while loads this thread issued could still be landing.
      pipe_qdo.producer_tail(state);
      pipe_kv.producer_tail(state_kv);
    } else if constexpr (kDqWriter) {
      if (roles.warp_in_group == 1) { BwdDqWriter<Traits, Deterministic>::run(p, smem); }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    // One tile loop per softcap setting (uniform per launch), each holding one
    // mainloop instantiation.
    auto tile_loop = [&](auto softcap) {
      const int mma_tid = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;
      Mainloop mainloop;
      auto state = typename PipelineQdO::PipelineState{};
      int kv_tiles = 0;  // tiles that loaded K and V: the phase of their barrier
      for (int it = 0;; ++it) {
        tile_full[it & 1].wait((it >> 1) & 1);
        const int bid = smem.tile_id[it & 1];
        if (bid >= params.tiles.num_ctas()) { break; }
        const BwdTile tile = params.tiles(bid);
        const int n_block = tile.n_block, kv_head = tile.kv_head, batch = tile.batch;
        const auto mask = make_mask(tile);
        Tensor acc_dk = partition_fragment_C(mainloop.mma_kv, typename Traits::TileKV{});
        Tensor acc_dv = partition_fragment_C(mainloop.mma_dv, typename Traits::TileV{});
        clear(acc_dk);
        clear(acc_dv);
        if (mask.m_block_max > mask.m_block_min) {
          smem.pipe_kv.full_barrier_[0].wait(kv_tiles & 1);
          // The previous tile's dK/dV stores have read the dQ staging buffer
          // before this tile's first dQ staging (the staging barriers wait on
          // thread 0); by now they have had the K/V load's latency to finish.
          if (mma_tid == 0) { tma_store_wait<0>(); }
          mainloop.template run<decltype(softcap)::value, Deterministic>(p, smem, mma_tid, mask, n_block, kv_head,
                                                                          batch, pipe_qdo, state, acc_dk, acc_dv);
          smem.pipe_kv.empty_barrier_[0].arrive();  // every GEMM reading K and V has retired
          ++kv_tiles;
        }
        // A split key block's shares add up their dK/dV; all but the last to
        // finish are done then. The share is looked up again from the tile
        // index in shared memory (this stage is released only below): kept
        // live across the mainloop, it cost registers there (more spills).
        const float* sums = nullptr;
        bool stored_by_other = false;
        if constexpr (Traits::kSplitTail) {
          const BwdTile share = params.tiles(smem.tile_id[it & 1]);
          if (share.pieces > 1) {
            sums = BwdEpilogue<Traits, Params>::combine_split(p, smem, mma_tid, share.slot, share.pieces, acc_dk,
                                                              acc_dv);
            stored_by_other = sums == nullptr;
          }
        }
        // A key block no query sees still writes its (zero) gradients.
        if (!stored_by_other) {
          if constexpr (kDqWriter) { mainloop.dq_writer.drain(smem); }  // dK/dV stage in the dQ buffers
          BwdEpilogue<Traits, Params>::store(params, smem, mma_tid, n_block, kv_head, batch, acc_dk, acc_dv, sums);
        }
        tile_empty[it & 1].arrive();
      }
      if constexpr (kDqWriter) { mainloop.dq_writer.stop(smem, mma_tid); }
    };
    if (p.softcap > 0.f) { tile_loop(cute::true_type{}); } else { tile_loop(cute::false_type{}); }
    // Shared memory must stay valid until the last stores and dQ bulk
    // reduces have read it.
    if (threadIdx.x == cutlass::NumThreadsPerWarpGroup) { tma_store_wait<0>(); }
  }
#endif
}

// Host launcher for one instantiation (HeadDimV: V's, O's and dV's head dim).
template <class Element, int HeadDim, int HeadDimV = HeadDim>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
  using Traits = BwdTraits<Element, HeadDim, HeadDimV>;
  auto layout = btnh_layout<HeadDim>;
  auto layout_v = btnh_layout<HeadDimV>;
  constexpr int kPreRows = PreprocessMap<Element, HeadDimV>::kRowsPerBlock;
  // The pre- and postprocess grids put heads and batch on gridDim.y / z.
  if (p.n > 65535 || p.b > 65535) { return cudaErrorInvalidConfiguration; }
  const dim3 rows_grid((p.t_pad + kPreRows - 1) / kPreRows, p.n, p.b);
  bwd_preprocess<Element, HeadDim, HeadDimV><<<rows_grid, kBwdPreWarps * 32, 0, stream>>>(p);
  // The main kernel relies on what the preprocess writes (its tile counter,
  // the zeroed dQ accumulator): never launch it after a failed preprocess.
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) { return err; }
  err = cudaMemsetAsync(p.semaphore, 0,
                                    sizeof(int32_t) * size_t(p.b) * p.n * (p.t_pad / kBwdBlockM), stream);
  if (err != cudaSuccess) { return err; }
  if (p.bias.grad != nullptr) {  // the tiles no query block visits keep these zeros
    const size_t bytes = p.bias.grad_f32 ? sizeof(float) : sizeof(Element);
    err = cudaMemsetAsync(p.bias.grad, 0, bytes * size_t(p.b) * p.n * p.t * p.bias.row_stride, stream);
    if (err != cudaSuccess) { return err; }
  }
  constexpr int64_t kSplitSlotFloats = 2 * int64_t(Traits::kBlockN) * HeadDim;
  int max_slots = 0;
  if (Traits::kSplitTail && p.dkv_split != nullptr) {
    const int64_t slots = (p.dkv_split_floats - kBwdMaxSplitUnits) / kSplitSlotFloats;
    max_slots = int(slots < kBwdTileCounter ? slots : kBwdTileCounter);
  }
  const BwdTileOrder tiles = BwdTileOrder::planned(p, Traits::kBlockM, Traits::kBlockN, max_slots);
  if (tiles.num_split() > 0) {  // zero the counters and the fp32 sums the shares add into
    err = cudaMemsetAsync(p.dkv_split, 0, sizeof(float) * (kBwdMaxSplitUnits + tiles.num_split() * kSplitSlotFloats),
                          stream);
    if (err != cudaSuccess) { return err; }
  }

  BwdKernelParams<Traits> kp{
      p,
      Traits::make_tma_q(static_cast<const Element*>(p.q), layout(p.t, p.n, p.b)),
      Traits::make_tma_do(static_cast<const Element*>(p.dout), layout_v(p.t, p.n, p.b)),
      Traits::make_tma_k(static_cast<const Element*>(p.k), layout(p.s, p.kh, p.b)),
      Traits::make_tma_v(static_cast<const Element*>(p.v), layout_v(p.s, p.kh, p.b)),
      Traits::make_tma_dk(static_cast<Element*>(p.dk), layout(p.s, p.kh, p.b)),
      Traits::make_tma_dv(static_cast<Element*>(p.dv), layout_v(p.s, p.kh, p.b)),
      tiles,
  };
  // One persistent CTA per SM (the register split below takes a whole SM's
  // register file), or one per tile where there are fewer.
  static_assert(2 * (Traits::kConsumerRegs * Traits::kNumMmaThreads +
                     Traits::kProducerRegs * cutlass::NumThreadsPerWarpGroup) > 64 * 1024,
                "a second CTA could share an SM: size the persistent grid by occupancy");
  const int num_tiles = kp.tiles.num_ctas();
  const int grid = p.num_sms > 0 && p.dkv_split != nullptr ? min(num_tiles, p.num_sms) : num_tiles;
  err = launch_kernel(p.deterministic ? bwd_kernel<Traits, true> : bwd_kernel<Traits, false>, dim3(grid),
                      Traits::kNumThreads, Traits::kSmemBytes, stream, kp);
  if (err != cudaSuccess) { return err; }

  const dim3 out_grid((p.t + Traits::kBlockM - 1) / Traits::kBlockM, p.n, p.b);
  bwd_postprocess<Traits><<<out_grid, Traits::kNumMmaThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_fa3

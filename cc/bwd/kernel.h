// The warp-specialized backward kernel (one CTA per (key block, KV head,
// batch), or per share of one: tile_scheduler.h) and the host launcher that
// runs preprocess -> main -> postprocess on XLA's stream. Include from exactly
// one generated .cu per (dtype, head dim).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "params.h"
#include "traits.h"
#include "mask.h"
#include "tile_scheduler.h"
#include "producer.h"
#include "mainloop.h"
#include "epilogue.h"
#include "pre_post.h"

namespace jax_fa3 {

template <class Traits>
struct BwdKernelParams {
  BwdParams bwd;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_do;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
  typename Traits::TmadKV tma_dk;
  typename Traits::TmadKV tma_dv;
  BwdTileOrder tiles;
};

// Deterministic (== params.bwd.deterministic) is a kernel parameter: it picks
// the dQ protocol in the mainloop (BwdTraits::kDeferDqIssue), and as a run-time
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

  extern __shared__ char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const BwdParams& p = params.bwd;

  const int warp_group = cutlass::canonical_warp_group_idx();
  const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
  const bool is_producer = warp_group == 0;
  const bool lane_leader = cute::elect_one_sync();
  const bool is_leader = is_producer && warp_in_group == 0 && lane_leader;

  if (is_leader) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_dk.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_dv.get_tma_descriptor());
  }

  typename PipelineQdO::Params pq;
  pq.transaction_bytes = Traits::kTmaBytesQdO;
  pq.role = is_producer ? PipelineQdO::ThreadCategory::Producer : PipelineQdO::ThreadCategory::Consumer;
  pq.is_leader = is_leader;
  pq.num_consumers = Traits::kNumMmaThreads;
  typename PipelineKV::Params pkv;
  pkv.transaction_bytes = Traits::kTmaBytesKV;
  pkv.role = is_producer ? PipelineKV::ThreadCategory::Producer : PipelineKV::ThreadCategory::Consumer;
  pkv.is_leader = is_leader;
  pkv.num_consumers = Traits::kNumMmaThreads;
  PipelineQdO pipe_qdo(smem.pipe_qdo, pq, Shape<_1, _1, _1>{});
  PipelineKV pipe_kv(smem.pipe_kv, pkv, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier init visible to all

  // Built separately on each side of the register split: a value computed
  // before it and live into both sides gets a stack slot (the producer has
  // 24 registers), which the consumer loop then reloads every block.
  auto make_mask = [&](const BwdTile& tile) {
    KeyBlockMask<kBlockM, kBlockN> mask(tile.n_block, min(p.q_lens[tile.batch], p.t),
                                        min(p.kv_lens[tile.batch], p.s), p.window_left, p.window_right);
    if (tile.pieces > 1) { mask.take_share(tile.piece, tile.pieces); }
    return mask;
  };

  if (is_producer) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (is_leader) {
      const BwdTile tile = params.tiles(blockIdx.x);
      const auto mask = make_mask(tile);
      if (mask.m_block_max > mask.m_block_min) {
        BwdProducer<Traits, Params>{params, smem}.run(tile.n_block, tile.kv_head, tile.batch, mask, pipe_kv,
                                                      pipe_qdo);
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int mma_tid = threadIdx.x - cutlass::NumThreadsPerWarpGroup;
    const BwdTile tile = params.tiles(blockIdx.x);
    const int n_block = tile.n_block, kv_head = tile.kv_head, batch = tile.batch;
    const auto mask = make_mask(tile);
    const bool has_work = mask.m_block_max > mask.m_block_min;
    Mainloop mainloop;
    Tensor acc_dk = partition_fragment_C(mainloop.mma_kv, typename Traits::TileKV{});
    Tensor acc_dv = partition_fragment_C(mainloop.mma_kv, typename Traits::TileKV{});
    clear(acc_dk);
    clear(acc_dv);
    if (has_work) {
      auto state_kv = typename PipelineKV::PipelineState{};
      pipe_kv.consumer_wait(state_kv);
      auto state = typename PipelineQdO::PipelineState{};
      const int group = p.n / p.kh;
      auto heads = [&](auto softcap) {
        for (int g = 0; g < group; ++g) {
          mainloop.template run_head<decltype(softcap)::value, Deterministic>(
              p, smem, mma_tid, mask, n_block, kv_head * group + g, batch, pipe_qdo, state, acc_dk, acc_dv);
        }
      };
      if (p.softcap > 0.f) { heads(cute::true_type{}); } else { heads(cute::false_type{}); }
    }
    // A split key block's shares add up their dK/dV; all but the last to
    // finish are done then (once their last dQ bulk reduce has read smem).
    // The share is looked up again from a fresh read of the CTA index: kept
    // live across the mainloop, it cost registers there (more spills).
    const float* sums = nullptr;
    if constexpr (Traits::kSplitTail) {
      uint32_t bid;
      asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bid));
      const BwdTile share = params.tiles(int(bid));
      if (share.pieces > 1) {
        sums = BwdEpilogue<Traits, Params>::combine_split(p, smem, mma_tid, share.slot, share.pieces, acc_dk, acc_dv);
        if (sums == nullptr) {
          if (mma_tid == 0) { tma_store_wait<0>(); }
          return;
        }
      }
    }
    // A key block no query sees still writes its (zero) gradients. The store
    // also waits for the last dQ bulk reduce to have read shared memory.
    BwdEpilogue<Traits, Params>::store(params, smem, mma_tid, n_block, kv_head, batch, acc_dk, acc_dv, sums);
  }
#endif
}

// Host launcher for one instantiation.
template <class Element, int HeadDim>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
  using Traits = BwdTraits<Element, HeadDim>;
  using LayoutSeq = typename Traits::LayoutSeq;
  auto layout = [](int seq, int heads, int batch) {
    return LayoutSeq(make_shape(seq, Int<HeadDim>{}, heads, batch),
                     make_stride(int64_t(heads) * HeadDim, _1{}, int64_t(HeadDim),
                                 int64_t(seq) * heads * HeadDim));
  };
  constexpr int kPreRows = PreprocessMap<Element, HeadDim>::kRowsPerBlock;
  const dim3 rows_grid((p.t_pad + kPreRows - 1) / kPreRows, p.n, p.b);
  bwd_preprocess<Element, HeadDim><<<rows_grid, kBwdPreWarps * 32, 0, stream>>>(p);
  cudaError_t err = cudaMemsetAsync(p.semaphore, 0,
                                    sizeof(int32_t) * size_t(p.b) * p.n * (p.t_pad / kBwdBlockM), stream);
  if (err != cudaSuccess) { return err; }
  BwdTileOrder tiles = BwdTileOrder::make(p, Traits::kBlockN);
  constexpr int64_t kSplitSlotFloats = 2 * int64_t(Traits::kBlockN) * HeadDim;
  if (Traits::kSplitTail && p.split_tail && !p.deterministic && p.dkv_split != nullptr) {
    const int64_t slots = (p.dkv_split_floats - kBwdMaxSplitUnits) / kSplitSlotFloats;
    tiles.plan_split(p.num_sms, (p.t + Traits::kBlockM - 1) / Traits::kBlockM * (p.n / p.kh),
                     int(slots < kBwdMaxSplitUnits ? slots : kBwdMaxSplitUnits));
  }
  if (tiles.num_split() > 0) {  // zero the counters and the fp32 sums the shares add into
    err = cudaMemsetAsync(p.dkv_split, 0, sizeof(float) * (kBwdMaxSplitUnits + tiles.num_split() * kSplitSlotFloats),
                          stream);
    if (err != cudaSuccess) { return err; }
  }

  BwdKernelParams<Traits> kp{
      p,
      Traits::make_tma_q(static_cast<const Element*>(p.q), layout(p.t, p.n, p.b)),
      Traits::make_tma_q(static_cast<const Element*>(p.dout), layout(p.t, p.n, p.b)),
      Traits::make_tma_kv(static_cast<const Element*>(p.k), layout(p.s, p.kh, p.b)),
      Traits::make_tma_kv(static_cast<const Element*>(p.v), layout(p.s, p.kh, p.b)),
      Traits::make_tma_dkv(static_cast<Element*>(p.dk), layout(p.s, p.kh, p.b)),
      Traits::make_tma_dkv(static_cast<Element*>(p.dv), layout(p.s, p.kh, p.b)),
      tiles,
  };
  auto kernel = p.deterministic ? bwd_kernel<Traits, true> : bwd_kernel<Traits, false>;
  constexpr int smem_bytes = Traits::kSmemBytes;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) { return err; }
  kernel<<<kp.tiles.num_ctas(), Traits::kNumThreads, smem_bytes, stream>>>(kp);
  err = cudaGetLastError();
  if (err != cudaSuccess) { return err; }

  const dim3 out_grid((p.t + Traits::kBlockM - 1) / Traits::kBlockM, p.n, p.b);
  bwd_postprocess<Traits><<<out_grid, Traits::kNumMmaThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_fa3

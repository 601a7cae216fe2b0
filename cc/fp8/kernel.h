// The warp-specialized FP8 forward kernel and its host launcher. Roles:
//   producer warpgroup, warp 0: one thread issues the TMA loads of Q, K, V
//                               (fwd/producer.h, unchanged);
//   producer warpgroup, warps 1-3: transpose each V tile into V^T (transpose.h),
//                               into a V^T ring deeper than the K/V ring
//                               (idle when V^T comes from global memory:
//                               Traits::kVtInGmem);
//   consumer warpgroups 1, 2: QGMMAs, softmax, epilogue (mainloop.h).
// Include from exactly one generated .cu per (output dtype, head dim, V layout).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "../common/kernel_common.h"
#include "params.h"
#include "traits.h"
#include "transpose.h"
#include "mainloop.h"
#include "epilogue.h"
#include "../fwd/tile_scheduler.h"
#include "../common/mask.h"
#include "../fwd/producer.h"

namespace jax_fa3 {

template <class Traits>
struct Fp8KernelParams {
  FwdParams fwd;  // named as fwd/producer.h expects
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmaO tma_o;
  const float* q_scale;
  const float* k_scale;
  const float* v_scale;
};

template <bool First, class A, class B>
CUTE_DEVICE auto& pick_ref(A& a, B& b) {
  if constexpr (First) { return a; } else { return b; }
}

template <class Traits, class Scheduler>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
fp8_fwd_kernel(CUTE_GRID_CONSTANT const Fp8KernelParams<Traits> params) {
#if defined(__CUDA_ARCH__) && !defined(CUTLASS_ARCH_MMA_SM90A_ENABLED)
  __trap();
#else
  using Params = Fp8KernelParams<Traits>;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelineKV = typename Traits::PipelineKV;
  using PipelineVt = typename Traits::PipelineVt;
  using Mainloop = Fp8ConsumerMainloop<Traits>;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;

  extern __shared__ char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  const FwdParams& p = params.fwd;

  const WarpRoles roles = WarpRoles::make();
  const int warp_in_group = roles.warp_in_group;
  const bool is_producer = roles.is_producer;
  const bool is_transposer = !Traits::kVtInGmem && is_producer && warp_in_group > 0;
  const bool is_tma_thread = roles.tma_thread;
  if (is_tma_thread) { prefetch_tma_descriptors(params.tma_q, params.tma_k, params.tma_v, params.tma_o); }

  // Q and K: TMA thread -> consumers. V: TMA thread -> transposers.
  // V^T: transposers -> consumers. kVtInGmem: V^T, TMA thread -> consumers.
  using Role = typename PipelineKV::ThreadCategory;
  const auto pq = tma_pipeline_params<PipelineQ>(roles, Traits::kTmaBytesQ, Traits::kNumMmaThreads);
  const auto pk = tma_pipeline_params<PipelineKV>(roles, Traits::kTmaBytesKV, Traits::kNumMmaThreads);
  typename PipelineKV::Params pv = pk;
  if constexpr (!Traits::kVtInGmem) {
    pv.role = is_transposer ? Role::Consumer : (is_producer ? Role::Producer : Role::NonParticipant);
    pv.num_consumers = Traits::kNumTransposeThreads;
  }
  // The V^T ring exists only where the transposers fill it.
  auto make_pipe_vt = [&] {
    if constexpr (Traits::kVtInGmem) {
      return cute::tuple<>{};
    } else {
      typename PipelineVt::Params pvt;
      pvt.role = is_transposer ? PipelineVt::ThreadCategory::Producer
                               : (is_producer ? PipelineVt::ThreadCategory::NonParticipant
                                              : PipelineVt::ThreadCategory::Consumer);
      pvt.producer_arv_count = Traits::kNumTransposeThreads;
      pvt.consumer_arv_count = Traits::kNumMmaThreads;
      return PipelineVt(smem.pipe_vt, pvt);
    }
  };

  PipelineQ pipe_q(smem.pipe_q, pq, Shape<_1, _1, _1>{});
  PipelineKV pipe_k(smem.pipe_k, pk, Shape<_1, _1, _1>{});
  PipelineKV pipe_v(smem.pipe_v, pv, Shape<_1, _1, _1>{});
  auto pipe_vt = make_pipe_vt();
  __syncthreads();  // barrier init visible to all

  Scheduler scheduler(p, kBlockM);

  if (is_producer) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (is_tma_thread) {
      ProducerLoad<Traits, Params> producer{params, smem};
      auto state_q = cutlass::make_producer_start_state<PipelineQ>();
      auto state_kv = cutlass::make_producer_start_state<PipelineKV>();
      for (WorkTile tile = scheduler.first(); tile.valid; tile = scheduler.next(tile)) {
        const auto mask = QueryBlockMask<kBlockM, kBlockN>::of(p, tile.m_block, tile.batch, tile.head);
        producer.load_tile(tile, mask, pipe_q, state_q, pipe_k, pipe_v, state_kv);
      }
      pipe_k.producer_tail(state_kv);
      pipe_v.producer_tail(state_kv);
    } else if constexpr (!Traits::kVtInGmem) {
      if (!is_transposer) { return; }
      using Transposer = VTransposer<Traits>;
      // Per-lane address parts once per kernel; warp_in_group is warp-uniform
      // (shuffle-broadcast), so the column-block loop runs on uniform registers.
      const typename Transposer::Lane lane = Transposer::lane_offsets(threadIdx.x % cutlass::NumThreadsPerWarp);
      const int t_warp = warp_in_group - 1;
      auto state_v = typename PipelineKV::PipelineState{};
      auto state_vt = cutlass::make_producer_start_state<PipelineVt>();
      // The V tiles of all this CTA's work, counted first: the transpose loop
      // then keeps no scheduler or mask state in the producer's registers.
      int num_v_tiles = 0;
      for (WorkTile tile = scheduler.first(); tile.valid; tile = scheduler.next(tile)) {
        const auto mask = QueryBlockMask<kBlockM, kBlockN>::of(p, tile.m_block, tile.batch, tile.head);
        num_v_tiles += max(mask.n_block_max - mask.n_block_min, 0);
      }
      int share = t_warp;  // rotates over the tiles (transpose.h)
      for (int i = 0; i < num_v_tiles; ++i) {
        pipe_v.consumer_wait(state_v);
        pipe_vt.producer_acquire(state_vt);
        Transposer::transpose(smem, lane, share, state_v.index(), state_vt.index());
        share = share == Transposer::kWarps - 1 ? 0 : share + 1;
        pipe_vt.producer_commit(state_vt);
        pipe_v.consumer_release(state_v);
        ++state_v;
        ++state_vt;
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int mma_tid = threadIdx.x - cutlass::NumThreadsPerWarpGroup;
    Mainloop mainloop;
    typename Mainloop::PingPong pingpong{mma_tid / cutlass::NumThreadsPerWarpGroup};
    pingpong.init();
    auto state_q = typename PipelineQ::PipelineState{};
    auto state_kv = typename PipelineKV::PipelineState{};
    // Where V^T tiles come from: the transposers' ring (its own depth), or
    // with kVtInGmem the TMA-filled V ring, walked with its own state (V^T
    // stages are released at other times than K stages).
    auto& pipe_vsrc = pick_ref<Traits::kVtInGmem>(pipe_v, pipe_vt);
    auto state_vt = typename std::remove_reference_t<decltype(pipe_vsrc)>::PipelineState{};
    // Q scales come per kFp8BlockM rows; this warpgroup's 64 rows lie in one.
    const int num_qs = (p.t + kFp8BlockM - 1) / kFp8BlockM;
    constexpr int kRowsPerWG = Traits::kRowsPerWG;
    const int wg = mma_tid / cutlass::NumThreadsPerWarpGroup;
    const int num_n = (p.s + kBlockN - 1) / kBlockN;
    const float scale_log2 = p.scale * 1.44269504088896340736f;
    for (WorkTile tile = scheduler.first(); tile.valid; tile = scheduler.next(tile)) {
      const int q_len = min(p.q_lens[tile.batch], p.t);
      const int kv_head = tile.head / (p.n / p.kh);
      const float q_scale = params.q_scale[(int64_t(tile.batch) * p.n + tile.head) * num_qs +
                                           min((tile.m_block * kBlockM + wg * kRowsPerWG) / kFp8BlockM, num_qs - 1)];
      const int64_t kv_row = (int64_t(tile.batch) * p.kh + kv_head) * num_n;
      const auto mask = QueryBlockMask<kBlockM, kBlockN>::of(p, tile.m_block, tile.batch, tile.head);
      Tensor acc_o = partition_fragment_C(mainloop.mma_pv, Shape<Int<kBlockM>, Int<Traits::kHeadDim>>{});
      clear(acc_o);
      typename Mainloop::Softmax softmax;
      pipe_q.consumer_wait(state_q);
      // With 192-row tiles the warpgroup's own rows decide its reference V
      // scale (mainloop.h): a causal tile's last blocks are masked for its
      // first warpgroup, and a reference taken over them would put every
      // P_j it sees through a ratio vs_j / vs_ref < 1 before the e4m3 cast
      // (with amax V scales, not powers of two, that changes the rounding of
      // a causal problem's first rows). 128-row tiles keep the tile's range
      // (the same without a left window, and cheaper).
      int ref_lo = mask.n_block_min, ref_hi = mask.n_block_max;
      if constexpr (kBlockM > kFp8BlockM) {
        const auto wg_mask =
            QueryBlockMask<kRowsPerWG, kBlockN>::of(p, tile.m_block * (kBlockM / kRowsPerWG) + wg, tile.batch, tile.head);
        if (!wg_mask.empty()) { ref_lo = wg_mask.n_block_min; ref_hi = wg_mask.n_block_max; }  // else rows past q_len
      }
      auto pairs = [&p, batch = tile.batch, head = tile.head] { return PairRuleView::queries(p, batch, head); };
      const float v_scale = mainloop.run(smem, mma_tid, pingpong, mask, pairs, ref_lo, ref_hi,
                                         scale_log2 * q_scale,
                                         params.k_scale + kv_row, params.v_scale + kv_row,
                                         pipe_k, state_kv, pipe_vsrc, state_vt, softmax, acc_o);
      pipe_q.consumer_release(state_q);  // O has its own buffer: Q is dead
      ++state_q;
      float lse[Mainloop::kRows];
      softmax.finalize(acc_o, v_scale, lse);
      Fp8Epilogue<Traits, Params>::store(params, smem, mma_tid, tile, q_len, acc_o, lse);
    }
    Fp8Epilogue<Traits, Params>::drain(mma_tid);
  }
#endif
}

// Host launcher for one instantiation (persistent scheduler).
template <class ElementO, int HeadDim, bool VtInGmem = false>
cudaError_t launch_fp8_fwd(const Fp8FwdParams& fp, cudaStream_t stream) {
  using Traits = Fp8FwdTraits<ElementO, HeadDim, VtInGmem>;
  if (fp.v_transposed != VtInGmem) { return cudaErrorInvalidValue; }  // the handler picks by layout
  using Scheduler = PersistentTileScheduler;
  using Element = typename Traits::Element;
  const FwdParams& p = fp.base;
  auto layout = btnh_layout<HeadDim>;
  auto make_tma_v = [&](const Element* ptr) {
    if constexpr (VtInGmem) {
      // The extent is the padded length: in a partial last block, positions
      // past s hold keys below s (vt_key_of), which TMA must not zero-fill.
      const int64_t s_pad = fp8_vt_seq(p.s);
      return Traits::make_tma_v(ptr, typename Traits::LayoutV(
          make_shape(int32_t(s_pad), Int<HeadDim>{}, p.kh, p.b),
          make_stride(_1{}, s_pad, s_pad * HeadDim, s_pad * HeadDim * p.kh)));
    } else {
      return Traits::make_tma_v(ptr, layout(p.s, p.kh, p.b));
    }
  };
  Fp8KernelParams<Traits> kp{
      p,
      Traits::make_tma_q(static_cast<const Element*>(p.q), layout(p.t, p.n, p.b)),
      Traits::make_tma_kv(static_cast<const Element*>(p.k), layout(p.s, p.kh, p.b)),
      make_tma_v(static_cast<const Element*>(p.v)),
      Traits::make_tma_o(static_cast<ElementO*>(p.o), layout(p.t, p.n, p.b)),
      fp.q_scale, fp.k_scale, fp.v_scale,
  };
  return launch_kernel(fp8_fwd_kernel<Traits, Scheduler>, Scheduler::grid(p, Traits::kBlockM), Traits::kNumThreads,
                       Traits::kSmemBytes, stream, kp);
}

}  // namespace jax_fa3

// Consumer mainloop: per K/V block, S = Q K^T (SS WGMMA), mask where the block
// straddles a boundary, online softmax in FP32, O += P V (RS WGMMA with P
// still in registers). Each consumer warpgroup owns 64 of the tile's rows.
//
// The loop is software-pipelined (intra-warpgroup overlap, FA3 paper, Sec. 3.2):
// iteration j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} back to back, waits
// only for S_j, runs softmax on it while the P.V GEMM is still in flight, and
// rescales O once that GEMM has retired. With kPingPong the two warpgroups
// also take turns issuing their GEMMs (pingpong.h).
#pragma once

#include <cute/tensor.hpp>
#include "traits.h"
#include "../common/bias.h"
#include "../common/mask.h"
#include "pingpong.h"
#include "softmax.h"
#include "../common/utils.h"

namespace jax_fa3 {

template <class Traits>
struct ConsumerMainloop {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;

  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;

  // Rows of the S fragment owned by one thread.
  static constexpr int kRows = decltype(size<0>(as_rowcol(partition_fragment_C(
      typename Traits::TiledMmaQK{}, TileS{}))))::value;
  using Softmax = OnlineSoftmax<kRows>;
  using PingPong = WarpGroupPingPong<Traits::kPingPong, Traits::kNumMmaThreads>;

  // Scores -> softmax input: softcap, bias and boundary masking. pairs()
  // gives the tile's PairRuleView (common/mask.h), bias() its BiasTile
  // (common/bias.h).
  template <class TS, class TC, class Pairs, class Bias>
  CUTE_DEVICE static void prepare_scores(TS& tSrS, TC const& cS, const QueryBlockMask<kBlockM, kBlockN>& mask,
                                         Pairs&& pairs, Bias&& bias, int n_block, bool softcap, float raw_to_x,
                                         float bias_to_x) {
    if (softcap) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tSrS); ++i) { tSrS(i) = tanhf(tSrS(i) * raw_to_x); }
    }
    const BiasTile<Element> b = bias();
    if (b.active()) { b.add_pairs(tSrS, cS, mask.m_start, n_block * kBlockN, bias_to_x); }
    if (mask.needs_mask(n_block)) { mask.apply(tSrS, cS, n_block, pairs()); }
  }

  // Runs the tile's K/V blocks; acc_o ends unnormalized in softmax's frame.
  // on_q_dead() runs once the last S GEMM has retired (not on an empty tile):
  // the caller may release Q there, so the producer loads the next tile's Q
  // under this tile's last P.V GEMM and epilogue instead of after them.
  template <class Pairs, class Bias, class PipelineKV, class StateKV, class TO, class OnQDead>
  CUTE_DEVICE void run(typename Traits::SharedStorage& smem, int q_stage, int mma_tid, const PingPong& pingpong,
                       const QueryBlockMask<kBlockM, kBlockN>& mask, Pairs&& pairs, Bias&& bias, bool softcap,
                       float raw_to_x, float bias_to_x, PipelineKV& pipe_k, PipelineKV& pipe_v, StateKV& state_kv,
                       Softmax& softmax, TO& acc_o, OnQDead&& on_q_dead) {
    if (mask.empty()) { return; }
    // A warpgroup whose 64 rows all lie past q_len (a decode tile holds a few
    // packed rows) only keeps the ring and the turns in step: its GEMMs
    // would leave the tensor cores busy for rows the epilogue zeroes.
    if (mask.m_start + pingpong.wg * Traits::kRowsPerWG >= mask.rule.q_len) {
      idle(pingpong, mask, pipe_k, pipe_v, state_kv, on_q_dead);
      return;
    }
    Tensor sQ = smem_q<Traits>(smem, q_stage);
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});

    auto thr_qk = mma_qk.get_thread_slice(mma_tid);
    auto thr_pv = mma_pv.get_thread_slice(mma_tid);
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // smem descriptors
    Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, D, N, stage)
    Tensor cS = thr_qk.partition_C(make_identity_tensor(TileS{}));

    Tensor tSrS = partition_fragment_C(mma_qk, TileS{});
    // P in the A-operand register layout of the P.V GEMM.
    Tensor tOrP = make_tensor<Element>(acc_to_a_layout(tSrS.layout()));
    float correction[kRows];

    // First block: S only.
    int n_block = mask.n_block_max - 1;
    pipe_k.consumer_wait(state_kv);
    pingpong.wait_turn();
    warpgroup_gemm</*ZeroInit=*/true, /*WaitDepth=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, state_kv.index()), tSrS);
    pingpong.pass_turn();
    warpgroup_wait<0>();
    pipe_k.consumer_release(state_kv);
    prepare_scores(tSrS, cS, mask, pairs, bias, n_block, softcap, raw_to_x, bias_to_x);
    softmax.max_and_exp(tSrS, correction);  // acc_o is still zero: no rescale
    convert_into(tSrS, tOrP);

    StateKV state_v = state_kv;  // stage holding the V that matches P
    ++state_kv;
    for (--n_block; n_block >= mask.n_block_min; --n_block) {
      pipe_k.consumer_wait(state_kv);
      pingpong.wait_turn();
      warpgroup_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, state_kv.index()), tSrS);
      pipe_v.consumer_wait(state_v);
      warpgroup_gemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, state_v.index()), acc_o);
      pingpong.pass_turn();
        warpgroup_wait<1>();  // S_j done; P_{j-1} V_{j-1} may still run
      pipe_k.consumer_release(state_kv);
      prepare_scores(tSrS, cS, mask, pairs, bias, n_block, softcap, raw_to_x, bias_to_x);
      softmax.max_and_exp(tSrS, correction);
      warpgroup_wait<0>();  // P.V retired: O and the P registers are free
      pipe_v.consumer_release(state_v);
      Softmax::rescale(acc_o, correction);
      convert_into(tSrS, tOrP);
      state_v = state_kv;
      ++state_kv;
    }
    on_q_dead();
    pipe_v.consumer_wait(state_v);
    pingpong.wait_turn();
    warpgroup_gemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, state_v.index()), acc_o);
    pingpong.pass_turn();
    warpgroup_wait<0>();
    pipe_v.consumer_release(state_v);
  }

  // run()'s waits, releases and turns without its GEMMs: one turn per block
  // plus the last P.V's. Every wait stays: a release ahead of the other
  // warpgroups' would count toward an earlier phase of the stage.
  template <class PipelineKV, class StateKV, class OnQDead>
  CUTE_DEVICE static void idle(const PingPong& pingpong, const QueryBlockMask<kBlockM, kBlockN>& mask,
                               PipelineKV& pipe_k, PipelineKV& pipe_v, StateKV& state_kv, OnQDead&& on_q_dead) {
    #pragma unroll 1
    for (int n_block = mask.n_block_max - 1; n_block >= mask.n_block_min; --n_block) {
      pipe_k.consumer_wait(state_kv);
      pingpong.wait_turn();
      pingpong.pass_turn();
      pipe_k.consumer_release(state_kv);
      pipe_v.consumer_wait(state_kv);
      pipe_v.consumer_release(state_kv);
      ++state_kv;
    }
    on_q_dead();
    pingpong.wait_turn();
    pingpong.pass_turn();
  }
};

}  // namespace jax_fa3

// Compile-time shape of one backward instantiation: tiles, shared-memory
// layouts, the four tiled WGMMAs and the TMA atoms.
//
// A CTA owns one block of kBlockN keys (two consumer warpgroups, 64 key rows
// each) and walks the query blocks of kBlockM rows that see it. Working on the
// transposed products keeps P and dS in registers as WGMMA A operands:
//   S^T  = K Q^T   (SS)      dP^T = V dO^T (SS)       [kBlockN x kBlockM]
//   dV  += P^T dO  (RS, dO read MN-major)             [kBlockN x d]
//   dK  += dS^T Q  (RS, Q read MN-major)              [kBlockN x d]
//   dQ   = dS K    (SS, dS staged in smem, K read MN-major; the two warpgroups
//                   split d, or d64's 128 query rows) [kBlockM x d]
// Large head dims (kStagePdS, see BwdTileConfig) stage P as well and run dV/dK
// as SS GEMMs with the warpgroups splitting d; dQ may go in column chunks.
// V, dO and dV may have a head dim Hv of their own (latent attention's
// 192/128): dP^T reduces over Hv and dV is Hv wide; the tile is Q/K's.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

#include "../common/kernel_common.h"
#include "../common/traits_common.h"

#include "params.h"

namespace jax_fa3 {

using namespace cute;

// Tile configuration per head dim. Two consumer warpgroups either way.
//  - kStagePdS = false (d <= 128): kBlockN = 128, the warpgroups split the key
//    rows; each thread keeps dK and dV (2 x d/2 fp32) and S^T/dP^T in
//    registers, and P^T/dS^T feed the dV/dK GEMMs straight from registers.
//  - kStagePdS = true (d >= 192): kBlockN = 64, the warpgroups split the head
//    dim of dK and dV (2 x d/4 registers) and the query columns of S^T/dP^T;
//    since a warpgroup's dV/dK slice needs all of P^T/dS^T, both go through
//    shared memory (SS GEMMs). d256 has room for one Q/dO stage only.
// d64 walks 128-row query blocks (64 elsewhere): its GEMMs per block are small
// next to the fixed per-block work (barriers, dQ staging and bulk reduce), and
// S^T/dP^T of 64 x 128 per warpgroup still fit in registers.
template <int HeadDim> struct BwdTileConfig;
template <> struct BwdTileConfig<64>  { static constexpr int kBlockM = 2 * kBwdBlockM, kBlockN = 128, kStages = 2; static constexpr bool kStagePdS = false; static constexpr int kDqChunks = 1; };
template <> struct BwdTileConfig<96>  { static constexpr int kBlockM = kBwdBlockM, kBlockN = 128, kStages = 2; static constexpr bool kStagePdS = false; static constexpr int kDqChunks = 1; };
template <> struct BwdTileConfig<128> { static constexpr int kBlockM = kBwdBlockM, kBlockN = 128, kStages = 2; static constexpr bool kStagePdS = false; static constexpr int kDqChunks = 1; };
template <> struct BwdTileConfig<192> { static constexpr int kBlockM = kBwdBlockM, kBlockN = 64,  kStages = 2; static constexpr bool kStagePdS = true; static constexpr int kDqChunks = 1; };
template <> struct BwdTileConfig<256> { static constexpr int kBlockM = kBwdBlockM, kBlockN = 64,  kStages = 1; static constexpr bool kStagePdS = true; static constexpr int kDqChunks = 2; };

template <class Element_, int HeadDim, int HeadDimV = HeadDim>
struct BwdTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kHeadDimV = HeadDimV;
  // dK and dV are staged one after the other in the dQ buffer (epilogue.h).
  static_assert(kHeadDimV <= kHeadDim && kHeadDimV % 16 == 0, "Hv <= H, whole WGMMA k-steps");
  static constexpr int kBlockM = BwdTileConfig<HeadDim>::kBlockM;
  static constexpr int kBlockN = BwdTileConfig<HeadDim>::kBlockN;
  static constexpr int kStages = BwdTileConfig<HeadDim>::kStages;
  static constexpr bool kStagePdS = BwdTileConfig<HeadDim>::kStagePdS;
  static constexpr int kDqChunks = BwdTileConfig<HeadDim>::kDqChunks;
  // Split key blocks of the last wave (tile_scheduler.h). Not at d64: the
  // combine code after the mainloop made ptxas spill inside the mainloop,
  // which slowed every launch, split or not.
  static constexpr bool kSplitTail = HeadDim != 64;
  // Deterministic mode keeps one semaphore per kBwdBlockM rows (sized by the
  // caller); a larger block uses the first t_pad / kBlockM of them.
  static_assert(kBlockM % kBwdBlockM == 0, "semaphore granularity is kBwdBlockM");
  static_assert(kBwdRowPad % kBlockM == 0);

  static constexpr int kNumMmaWarpGroups = 2;
  static_assert(kStagePdS || kBlockN == 64 * kNumMmaWarpGroups);
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  // (168 - 24) * 128 registers freed by the producer = (240 - 168) * 256 taken.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  using TileSdP = Shape<Int<kBlockN>, Int<kBlockM>>;   // S^T, dP^T
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;   // dK
  using TileV = Shape<Int<kBlockN>, Int<kHeadDimV>>;   // dV
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;    // dQ
  using SmemLayoutdQ = Layout<TileQ, Stride<Int<kHeadDim>, _1>>;

  // Register path: warpgroups split the key rows (M) of S^T, dP^T, dK, dV.
  // Staged path: they split the query columns (N) of S^T, dP^T and the head
  // dim (N) of dK, dV. dQ: see kDqSplitRows.
  using AtomLayoutM = Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>;
  using AtomLayoutN = Layout<Shape<_1, Int<kNumMmaWarpGroups>, _1>>;
  using AtomLayoutSdP = std::conditional_t<kStagePdS, AtomLayoutN, AtomLayoutM>;
  using AtomLayoutKV = std::conditional_t<kStagePdS, AtomLayoutN, AtomLayoutM>;
  // dQ: where the query block has a 64-row tile per warpgroup (d64's 128-row
  // blocks) they split its rows, else its head dim. Splitting rows keeps the
  // WGMMA at N = d (n64 at d64, not n32: half the instructions) and each
  // warpgroup reads only its own half of dS from shared memory.
  static constexpr bool kDqSplitRows = kBlockM == 64 * kNumMmaWarpGroups;
  using AtomLayoutQ = std::conditional_t<kDqSplitRows, AtomLayoutM, AtomLayoutN>;
  static constexpr int kDqAtomN = kHeadDim / kDqChunks / (kDqSplitRows ? 1 : kNumMmaWarpGroups);
  static constexpr int kSdPAtomN = kStagePdS ? kBlockM / kNumMmaWarpGroups : kBlockM;
  static constexpr int kKVAtomN = kStagePdS ? kHeadDim / kNumMmaWarpGroups : kHeadDim;
  static constexpr int kdVAtomN = kStagePdS ? kHeadDimV / kNumMmaWarpGroups : kHeadDimV;

  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kSdPAtomN>, Int<kHeadDim>>>(),
      AtomLayoutSdP{}));
  // dK += dS^T Q and dV += P^T dO: one GEMM shape, N = the warpgroup's share of H or Hv.
  template <int AtomN>
  using TiledMmaKVn = decltype(make_tiled_mma(
      std::conditional_t<kStagePdS,
          decltype(GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<AtomN>, Int<kBlockM>>,
                                        GMMA::Major::MN, GMMA::Major::MN>()),
          decltype(GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<_64, Int<AtomN>, Int<kBlockM>>,
                                        GMMA::Major::K, GMMA::Major::MN>())>{},
      AtomLayoutKV{}));
  using TiledMmaKV = TiledMmaKVn<kKVAtomN>;
  using TiledMmadV = TiledMmaKVn<kdVAtomN>;
  using TiledMmaQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum,
                           Shape<_64, Int<kDqAtomN>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayoutQ{}));

  // Q and dO: (kBlockM, H or Hv, stage), head dim contiguous (as TMA writes
  // them). Read MN-major (Q^T, dO^T) by the dK/dV GEMMs: on the staged path
  // each warpgroup's columns must be whole swizzle atoms (d192: SW64).
  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
      GMMA::Major::K, Element, Int<kBlockM>, Int<kKVAtomN>>());
  using SmemAtomdO = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
      GMMA::Major::K, Element, Int<kBlockM>, Int<kdVAtomN>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutdO = decltype(tile_to_shape(SmemAtomdO{}, Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kStages>>{}));
  // (d, m, stage) -> Q(m, d, stage): the MN-major B operand of dK += dS^T Q (dO^T likewise for dV).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // K and V: (kBlockN, d), loaded once per CTA. Read MN-major by the dQ GEMM,
  // each warpgroup's d/2 columns must be whole swizzle atoms: d = 96 (48 per
  // warpgroup) takes the 16-element SW32 atom instead of the selector's SW64.
  using SmemAtomK = std::conditional_t<
      (kHeadDim / kNumMmaWarpGroups) % 32 != 0, GMMA::Layout_K_SW32_Atom<Element>,
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<
          GMMA::Major::K, Element, Int<kBlockN>, Int<kKVAtomN / kDqChunks>>())>;
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V is only read K-major (the A operand of dP^T = V dO^T): any swizzle.
  using SmemLayoutV = std::conditional_t<kHeadDimV == kHeadDim, SmemLayoutK,
                                         SmemTileKMajor<Element, kBlockN, kHeadDimV>>;
  // (d, n) -> K(n, d): the MN-major B operand of dQ = dS K.
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // dS: (m, n), K-major A operand of dQ = dS K; written through the
  // transposed view (n, m) that matches the dP^T accumulator, which is also
  // the MN-major A operand of the staged path's dK GEMM (and, for P, dV's).
  using SmemLayoutdS = SmemTileKMajor<Element, kBlockM, kBlockN>;
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Step<_2, _1>{})));

  // dQ staging buffers: two on the register path (d <= 128); the staged path (d >= 192) has no room for a second.
  static constexpr int kDqBufs = kStagePdS ? 1 : 2;
  // Register path (not d64, whose own FREE barrier just before staging is
  // faster): a warp of the producer warpgroup adds the staged dQ blocks into
  // the accumulator (dq_writer.h), so the consumers neither wait for one
  // another to issue the reduce nor for its reads (nor, in deterministic
  // mode, for the block's turn).
  static constexpr bool kDqWriter = !kStagePdS && HeadDim != 64;
  static_assert(!kDqWriter || kDqBufs == 2, "the writer alternates two staging buffers");
  // Rebuild every per-thread index of the mainloop (fragment coordinates,
  // stmatrix and dQ staging offsets) each query block from an opaque thread
  // index (BwdMainloop). Only at d64, whose two 128-row S/dP tiles leave no
  // registers to hold them across the loop (they were spilled and reloaded
  // every block). Its softcap loop still spills (the tanh slope needs x and P
  // at once), and exempting it slowed the plain loop. At d128/d256 the
  // recomputation costs more than it saves.
  static constexpr bool kFreshThreadIndex = HeadDim == 64;

  using PipelineQdO = cutlass::PipelineTmaAsync<kStages>;  // Q and dO share a stage barrier
  using PipelineKV = cutlass::PipelineTmaAsync<1>;
  // Persistent CTAs (kernel.h): the producer hands each next tile index to
  // the consumers through shared memory, one tile ahead.
  using PipelineTile = cutlass::PipelineAsync<2>;
  using PipelineDq = cutlass::PipelineAsync<2>;  // dQ staging buffers -> the writer warp (dq_writer.h)

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdO>, 1024> dout;
    // Base-2 LSE and delta of the query block, per stage (bulk-copied with Q/dO).
    cute::array_aligned<float, kBlockM * kStages, 128> lse;
    cute::array_aligned<float, kBlockM * kStages, 128> delta;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdS>, 1024> ds;
    // P, laid out like dS (staged path only).
    cute::array_aligned<Element, kStagePdS ? cute::cosize_v<SmemLayoutdS> : 1, kStagePdS ? 1024 : 16> p;
    // This key block's share of dQ for one query block, in the order of one
    // block of the dQ accumulator, so a single bulk reduce-add moves it.
    // Double-buffered where it fits: the next block's staging need not wait
    // for the previous reduce to finish reading. After the mainloop it stages
    // dK and dV for their TMA stores (epilogue.h; the same bytes at every head
    // dim), so the next tile's K and V can land meanwhile.
    cute::array_aligned<float, kDqBufs * kBlockM * kHeadDim, 1024> dq;
    typename PipelineQdO::SharedStorage pipe_qdo;
    typename PipelineKV::SharedStorage pipe_kv;
    typename PipelineTile::SharedStorage pipe_tile;
    typename PipelineDq::SharedStorage pipe_dq;
    int tile_id[2];  // per PipelineTile stage
    int64_t dq_target[2];  // per dQ staging buffer: its accumulator block, < 0 stops the writer (dq_writer.h)
    int dq_turn[2];        // deterministic: the semaphore value at which the block may add
    int split_last;  // split key blocks: this share finished last (epilogue.h)
  };
  static constexpr int kdKVStageElems = cute::cosize_v<SmemLayoutK>;  // dK, then dV, in SharedStorage::dq
  static_assert((kdKVStageElems + cute::cosize_v<SmemLayoutV>) * sizeof(Element) <=
                kDqBufs * kBlockM * kHeadDim * sizeof(float));
  static_assert(kdKVStageElems * sizeof(Element) % 1024 == 0, "dV's stage keeps the swizzle alignment");
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile configuration exceeds shared memory");

  static constexpr uint32_t kBytesRowStats = kBlockM * sizeof(float);  // one of lse / delta
  static constexpr uint32_t kTmaBytesQdO = kBlockM * (kHeadDim + kHeadDimV) * sizeof(Element) + 2 * kBytesRowStats;
  static constexpr uint32_t kTmaBytesKV = kBlockN * (kHeadDim + kHeadDimV) * sizeof(Element);

  // Global tensors as TMA sees them (common/kernel_common.h): Q, K, dQ, dK
  // are H wide, V, O, dO, dV Hv wide.
  using LayoutSeq = SeqLayout<kHeadDim>;
  using LayoutSeqV = SeqLayout<kHeadDimV>;

  static auto make_tma_q(const Element* ptr, LayoutSeq layout) {
    return make_tile_tma<kBlockM, kHeadDim>(SM90_TMA_LOAD{}, ptr, layout, take<0, 2>(SmemLayoutQ{}));
  }
  static auto make_tma_do(const Element* ptr, LayoutSeqV layout) {
    return make_tile_tma<kBlockM, kHeadDimV>(SM90_TMA_LOAD{}, ptr, layout, take<0, 2>(SmemLayoutdO{}));
  }
  static auto make_tma_k(const Element* ptr, LayoutSeq layout) {
    return make_tile_tma<kBlockN, kHeadDim>(SM90_TMA_LOAD{}, ptr, layout, SmemLayoutK{});
  }
  static auto make_tma_v(const Element* ptr, LayoutSeqV layout) {
    return make_tile_tma<kBlockN, kHeadDimV>(SM90_TMA_LOAD{}, ptr, layout, SmemLayoutV{});
  }
  // dK and dV leave through TMA stores of tiles staged like K and V (epilogue.h).
  static auto make_tma_dk(Element* ptr, LayoutSeq layout) {
    return make_tile_tma<kBlockN, kHeadDim>(SM90_TMA_STORE{}, ptr, layout, SmemLayoutK{});
  }
  static auto make_tma_dv(Element* ptr, LayoutSeqV layout) {
    return make_tile_tma<kBlockN, kHeadDimV>(SM90_TMA_STORE{}, ptr, layout, SmemLayoutV{});
  }
  using TmaQ = decltype(make_tma_q(nullptr, LayoutSeq{}));
  using TmadO = decltype(make_tma_do(nullptr, LayoutSeqV{}));
  using TmaK = decltype(make_tma_k(nullptr, LayoutSeq{}));
  using TmaV = decltype(make_tma_v(nullptr, LayoutSeqV{}));
  using TmadK = decltype(make_tma_dk(nullptr, LayoutSeq{}));
  using TmadV = decltype(make_tma_dv(nullptr, LayoutSeqV{}));
};

}  // namespace jax_fa3

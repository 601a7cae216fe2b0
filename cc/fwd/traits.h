// Compile-time shape of one forward instantiation: tile sizes, shared-memory
// layouts, the two tiled WGMMAs and the TMA atom types. Everything a kernel
// piece needs to agree on lives here, so the pieces stay independent.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "../common/kernel_common.h"
#include "../common/traits_common.h"

namespace jax_fa3 {

using namespace cute;

// Tile sizes per head dim. kBlockN shrinks as the head dim grows so that Q plus
// `kStages` K and V tiles still fit in the 227 KB of shared memory of one CTA.
// d64 blocks are short, so a deeper K/V ring hides more load latency (4 stages).
// The mainloop keeps S_{j+1} and P_j live together (intra-warpgroup overlap);
// at d256 (a 128-register O accumulator) that spills ~200 bytes and is still
// the faster schedule.
template <int HeadDim> struct FwdTileConfig;
// kPairRule: the tile takes segment ids, masks and a bias (every default tile does).
// HeadDimV: V's (and O's) head dim where it differs from Q/K's (0: the same).
template <int BlockM, int BlockN, int Stages, bool PairRule = true, int HeadDimV = 0>
struct FwdTile {
  static constexpr int kBlockM = BlockM, kBlockN = BlockN, kStages = Stages;
  static constexpr bool kPairRule = PairRule;
  static constexpr int kHeadDimV = HeadDimV;
};
template <int HeadDim> struct FwdTileConfig;
template <> struct FwdTileConfig<64>  : FwdTile<128, 128, 4> {};
template <> struct FwdTileConfig<96>  : FwdTile<128, 128, 2> {};
template <> struct FwdTileConfig<128> : FwdTile<128, 128, 2> {};
template <> struct FwdTileConfig<192> : FwdTile<128, 80, 2> {};
template <> struct FwdTileConfig<256> : FwdTile<128, 80, 2> {};
// Other tiles are variants the handler picks per problem (fwd_handler.cc,
// pick_variant): d64's 192-row tile (three consumer warpgroups) wins on long
// sequences and loses on short causal ones. It takes no segment ids: at its
// register budget their two live bounds made ptxas spill mainloop values.
// The value-head-dim variants ("dv128" for 192/128 latent attention, "dv64"
// for 128/64) keep 128-key blocks: the P.V GEMM and V ring are narrower than
// Q.K^T's, and at 192/128 O is staged in Q's buffer to fit two stages.
template <int HeadDim, int HeadDimV> struct FwdTileConfigV;
template <> struct FwdTileConfigV<192, 128> : FwdTile<128, 128, 2, true, 128> {};
template <> struct FwdTileConfigV<128, 64> : FwdTile<128, 128, 2, true, 64> {};

template <class Element_, int HeadDim, class Tile = FwdTileConfig<HeadDim>>
struct FwdTraits {
  using Element = Element_;
  // The consumer warpgroups take turns issuing their GEMMs (pingpong.h).
  static constexpr bool kPingPong = true;
  using ElementAccum = float;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kHeadDimV = Tile::kHeadDimV > 0 ? Tile::kHeadDimV : HeadDim;
  static_assert(kHeadDimV <= kHeadDim, "O is staged in Q's buffer where it has no own: Hv <= H");
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;
  static constexpr bool kPairRule = Tile::kPairRule;

  // One producer warpgroup (only one warp of it issues TMA) and kBlockM / 64
  // consumer warpgroups, each owning 64 rows of the Q tile.
  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
  // Serves KV caches too (row positions, paged K/V loads: FwdParams::bottom_right,
  // pages); the 192-row tile is the handler's pick for long training shapes only.
  static constexpr bool kKvCache = kNumMmaWarpGroups < 3;
  static constexpr bool kPagedKV = kKvCache;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  // setmaxnreg budgets. The CTA starts at 168 regs/thread (65536 / 384); the
  // pool freed by the producer (168 - P) * 128 must cover the consumers' raise
  // (C - 168) * 256. P = 40, all that C = 232 leaves, keeps the producer's TMA
  // loops (paged ones too) nearly spill-free; head dims >= 192 (a 64 x d fp32 O
  // accumulator of 96+ registers) take P = 24, C = 240 and accept producer
  // spills (one thread, off the tensor cores' path) to relieve the consumers.
  // Three consumer warpgroups (512 threads, 128 regs each at launch) take
  // P = 24, C = 160: 24 * 128 + 160 * 384 <= 65536.
  static constexpr int kProducerRegs = (kNumMmaWarpGroups == 3 || HeadDim >= 192) ? 24 : 40;
  static constexpr int kConsumerRegs = kNumMmaWarpGroups == 3 ? 160 : HeadDim >= 192 ? 240 : 232;
  // setmaxnreg only moves registers inside the CTA's pool (launch-bound
  // registers x threads): a larger total makes the consumers' increase wait
  // forever (the first FP8 kernel hung this way).
  static constexpr int kLaunchRegs = (65536 / (kNumMmaThreads + cutlass::NumThreadsPerWarpGroup)) / 8 * 8;
  static_assert(kProducerRegs * cutlass::NumThreadsPerWarpGroup + kConsumerRegs * kNumMmaThreads <=
                    kLaunchRegs * (kNumMmaThreads + cutlass::NumThreadsPerWarpGroup),
                "setmaxnreg budgets exceed the CTA's register pool");

  // S = Q K^T (SS) and O += P V with P in registers (RS); V is read through
  // a transposed (MN-major) view of the same shared-memory tile TMA wrote.
  using TiledMmaQK = FwdTiledMmaQK<Element, kNumMmaWarpGroups, kBlockN, kHeadDim>;
  using TiledMmaPV = FwdTiledMmaPV<Element, kNumMmaWarpGroups, kBlockN, kHeadDimV, GMMA::Major::MN>;

  using SmemLayoutQ = SmemTileKMajor<Element, kBlockM, kHeadDim>;
  using SmemLayoutK = SmemRingKMajor<Element, kBlockN, kHeadDim, kStages>;
  using SmemLayoutV = SmemRingKMajor<Element, kBlockN, kHeadDimV, kStages>;
  // (d, n, stage) -> V(n, d, stage): same bytes, viewed as the MN-major B operand.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{},
      make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{},
                          Step<_2, _1, _3>{})));
  // The output tile is staged in shared memory and leaves through a TMA
  // store. It gets its own buffer when that fits, so Q can be released (and
  // the next tile's Q loaded) as soon as the last S GEMM retires; otherwise
  // (d >= 192) it reuses Q's buffer after that GEMM.
  using SmemLayoutO = SmemTileKMajor<Element, kBlockM, kHeadDimV>;
  static constexpr int kSmemBytesNoO =
      int(sizeof(Element)) * (cosize_v<SmemLayoutQ> + cosize_v<SmemLayoutK> + cosize_v<SmemLayoutV>) + 1024;
  static constexpr bool kSeparateO =
      kSmemBytesNoO + int(sizeof(Element)) * cosize_v<SmemLayoutO> <= 227 * 1024;
  // Q is double-buffered where it fits next to a separate O: the producer
  // then loads the next tile's Q while this tile runs, instead of after this
  // tile's last S GEMM released the only buffer (a Q load's latency is about
  // one d64 K/V block of work, paid at every tile start).
  static constexpr int kQStages =
      (kSeparateO && kSmemBytesNoO + int(sizeof(Element)) * (cosize_v<SmemLayoutQ> + cosize_v<SmemLayoutO>) <=
                         226 * 1024) ? 2 : 1;

  using PipelineQ = cutlass::PipelineTmaAsync<kQStages>;
  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    cute::array_aligned<Element, kQStages * cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, kSeparateO ? cute::cosize_v<SmemLayoutO> : 1, 1024> o;
    typename PipelineQ::SharedStorage pipe_q;
    typename PipelineKV::SharedStorage pipe_k;
    typename PipelineKV::SharedStorage pipe_v;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile configuration exceeds shared memory");

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesV = kBlockN * kHeadDimV * sizeof(Element);

  // Global tensors as TMA sees them (common/kernel_common.h).
  using LayoutSeq = SeqLayout<kHeadDim>;
  using LayoutSeqV = SeqLayout<kHeadDimV>;  // V and O

  static auto make_tma_q(const Element* ptr, LayoutSeq layout) {
    return make_tile_tma<kBlockM, kHeadDim>(SM90_TMA_LOAD{}, ptr, layout, SmemLayoutQ{});
  }
  static auto make_tma_k(const Element* ptr, LayoutSeq layout) {
    return make_tile_tma<kBlockN, kHeadDim>(SM90_TMA_LOAD{}, ptr, layout, take<0, 2>(SmemLayoutK{}));
  }
  static auto make_tma_v(const Element* ptr, LayoutSeqV layout) {
    return make_tile_tma<kBlockN, kHeadDimV>(SM90_TMA_LOAD{}, ptr, layout, take<0, 2>(SmemLayoutV{}));
  }
  // Each consumer warpgroup stores its own 64 rows of O (epilogue.h): the
  // store box is one warpgroup's slice of the O tile, same swizzle and strides.
  using ElementO = Element;  // epilogue.h (the FP8 kernel's O type differs from its operands')
  static constexpr int kRowsPerWG = 64;
  using SmemLayoutOWG = decltype(get<0>(zipped_divide(SmemLayoutO{}, Shape<Int<kRowsPerWG>, Int<kHeadDimV>>{})));
  static auto make_tma_o(Element* ptr, LayoutSeqV layout) {
    return make_tile_tma<kRowsPerWG, kHeadDimV>(SM90_TMA_STORE{}, ptr, layout, SmemLayoutOWG{});
  }
  using TmaQ = decltype(make_tma_q(nullptr, LayoutSeq{}));
  using TmaK = decltype(make_tma_k(nullptr, LayoutSeq{}));
  using TmaV = decltype(make_tma_v(nullptr, LayoutSeqV{}));
  using TmaO = decltype(make_tma_o(nullptr, LayoutSeqV{}));
};

// Stage `stage` of a forward kernel's Q buffer: SharedStorage::q holds the
// Q stages (Traits::PipelineQ's) back to back, one SmemLayoutQ each.
template <class Traits>
CUTE_DEVICE auto smem_q(typename Traits::SharedStorage& smem, int stage) {
  using LayoutQ = typename Traits::SmemLayoutQ;
  return make_tensor(make_smem_ptr(smem.q.data() + stage * cosize_v<LayoutQ>), LayoutQ{});
}

}  // namespace jax_fa3

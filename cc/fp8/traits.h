// Compile-time shape of one FP8 forward instantiation. Differences from the
// 16-bit FwdTraits: e4m3 operands (QGMMA, FP32 accumulation), a second V
// buffer holding each V tile transposed (FP8 WGMMA reads B only K-major), a
// pipeline between the transposing warps and the consumers, and an output
// element type distinct from the operand type.
//
// VtInGmem: V arrives already transposed (the V^T layout of params.h, written
// by the quantize pre-pass at no extra HBM traffic). TMA then loads V^T tiles
// straight into the V ring, the consumers read them there, and the
// transposer warps and the V^T ring do not exist; the freed shared memory
// deepens the K/V ring.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "../common/kernel_common.h"
#include "../common/traits_common.h"

#include "params.h"

namespace jax_fa3 {

using namespace cute;

template <class ElementO_, int HeadDim, bool VtInGmem = false>
struct Fp8FwdTraits {
  static constexpr bool kVtInGmem = VtInGmem;
  static constexpr bool kPagedKV = false;  // contiguous K/V only (fwd/producer.h)
  using Element = cutlass::float_e4m3_t;
  using ElementO = ElementO_;
  using ElementAccum = float;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kHeadDimV = HeadDim;  // the shared producer reads V with it
  // Query rows per tile: kFp8BlockM (the Q scale block), or 192 at d64: three
  // consumer warpgroups of 64 rows, each reading the Q scale of the 128-row
  // block its rows lie in. At d64 a warpgroup's softmax of a 128-key block
  // outlasts its two GEMMs, so two warpgroups left the tensor cores idle. d128
  // cannot follow: at 160 registers its O + S + P make ptxas serialize the
  // QGMMAs (C7512).
  static constexpr int kBlockM = HeadDim == 64 ? 192 : kFp8BlockM;
  static_assert(kBlockM % 64 == 0 && kFp8BlockM % 64 == 0, "a warpgroup's rows share one Q scale");
  // 128-key blocks at every head dim. With 64-key blocks d256 paid the O
  // rescale every block (the V block scale changes the factor) and a
  // ping-pong hand-off for half the GEMM work.
  static constexpr int kBlockN = kFp8BlockN;
  // O leaves through shared memory (each consumer warpgroup storing its 64
  // rows with one TMA store, fwd/epilogue.h) wherever the staging fits: d64 /
  // d128, and d256 with V^T from global memory, which gives up its third K/V
  // stage for it. The transposing d256 kernel has no room next to its V^T
  // ring and stores O from registers.
  static constexpr bool kStageO = HeadDim < 256 || VtInGmem;
  // Intra-warpgroup overlap (P.V of block j-1 running under the softmax of
  // block j) needs a second P buffer and S live next to it. At d256 O alone
  // is 128 of the 240 registers: one P buffer, and the P.V GEMM is waited for
  // before packing the next P.
  static constexpr bool kIntraWgOverlap = HeadDim < 256;
  // K and V (as TMA writes it) rings: a third stage where shared memory
  // allows (d64 / d128), two more without the V^T ring (kVtInGmem).
  static constexpr int kStages = HeadDim >= 256 ? 2 : (VtInGmem ? 4 : 3);
  // V^T ring, as deep (<= 4) as shared memory holds: with 2 stages the
  // transpose of V_{j+2} waited for P.V_j to retire, i.e. sat on the
  // consumers' critical path.
  static constexpr int kVtStageBytes = kBlockN * HeadDim;  // e4m3
  static constexpr int kSmemBytesFixed = kBlockM * HeadDim + 2 * kStages * kVtStageBytes +
                                         (kStageO ? kBlockM * HeadDim * int(sizeof(ElementO)) : 0);
  // kVtInGmem: V^T tiles sit in the V ring (kStages deep).
  static constexpr int kStagesVt = VtInGmem ? kStages
                                 : kSmemBytesFixed + 4 * kVtStageBytes + 1024 <= 227 * 1024 ? 4
                                 : kSmemBytesFixed + 3 * kVtStageBytes + 1024 <= 227 * 1024 ? 3 : 2;
  // Ping-pong pays at d64 / d128, where the GEMMs are short next to the
  // softmax; at d256 the two warpgroups run better unsynchronized.
  static constexpr bool kPingPong = HeadDim < 256;
  static_assert(kBlockN % 32 == 0, "P.V consumes P in k32 slices");

  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kNumThreads = kNumMmaThreads + cutlass::NumThreadsPerWarpGroup;
  // Warps 1..3 of the producer warpgroup transpose V (warp 0 issues TMA).
  static constexpr int kNumTransposeThreads = 3 * 32;
  // setmaxnreg budgets. setmaxnreg only moves registers inside the CTA's
  // launch pool (65536 / threads, rounded down to a multiple of 8): a larger
  // total makes the consumers' increase wait forever (a GPU hang). Two
  // consumer warpgroups: P + 2 C <= 504, 24 / 240 as in the 16-bit forward.
  // Three (d64's 192-row tile, a pool of 128 per thread): P + 3 C <= 512,
  // 32 / 160 (a 24-register producer spilled more).
  static constexpr int kProducerRegs = kNumMmaWarpGroups == 3 ? 32 : 24;
  static constexpr int kConsumerRegs = kNumMmaWarpGroups == 3 ? 160 : 240;
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0, "setmaxnreg takes multiples of 8");
  static_assert(kProducerRegs * cutlass::NumThreadsPerWarpGroup + kConsumerRegs * kNumMmaThreads <=
                    (65536 / kNumThreads) / 8 * 8 * kNumThreads,
                "setmaxnreg budgets exceed the CTA's launch register pool: the kernel would hang");

  // S = Q K^T: SS QGMMA, both K-major. FP32 accumulation on purpose: e4m3
  // operands scaled to +-448 give products up to 2e5 > 65504 (F16's range),
  // and an 11-bit mantissa over d terms adds ~sqrt(d) * 2^-11 relative score
  // error before exp().
  using TiledMmaQK = FwdTiledMmaQK<Element, kNumMmaWarpGroups, kBlockN, kHeadDim>;
  // O += P V: P from registers, V^T K-major (the transposed copy).
  using TiledMmaPV = FwdTiledMmaPV<Element, kNumMmaWarpGroups, kBlockN, kHeadDim, GMMA::Major::K>;

  using SmemLayoutQ = SmemTileKMajor<Element, kBlockM, kHeadDim>;
  using SmemLayoutK = SmemRingKMajor<Element, kBlockN, kHeadDim, kStages>;
  // V^T: (d, n), n contiguous, with the n order permuted (see mainloop.h).
  using SmemLayoutVt = SmemRingKMajor<Element, kHeadDim, kBlockN, kStagesVt>;
  // The V ring as TMA writes it, (n, d, stage): V itself (d contiguous), or
  // with kVtInGmem the V^T tiles seen through an (n, d) view (n contiguous),
  // so the producer's (n, d) tiling serves both.
  using SmemLayoutV = std::conditional_t<VtInGmem,
      decltype(composition(SmemLayoutVt{}, make_ordered_layout(
          Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}, Step<_2, _1, _3>{}))),
      SmemLayoutK>;

  using SmemLayoutO = SmemTileKMajor<ElementO, kBlockM, kHeadDim>;

  using PipelineQ = cutlass::PipelineTmaAsync<1>;
  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;
  using PipelineVt = cutlass::PipelineAsync<kStagesVt>;

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> v;
    cute::array_aligned<Element, VtInGmem ? 1 : cute::cosize_v<SmemLayoutVt>, VtInGmem ? 16 : 1024> vt;
    cute::array_aligned<ElementO, kStageO ? cute::cosize_v<SmemLayoutO> : 1, kStageO ? 1024 : 16> o;
    typename PipelineQ::SharedStorage pipe_q;
    typename PipelineKV::SharedStorage pipe_k;
    typename PipelineKV::SharedStorage pipe_v;
    std::conditional_t<VtInGmem, char, typename PipelineVt::SharedStorage> pipe_vt;  // V^T ring: transposers only
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile configuration exceeds shared memory");

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  // Global tensors as TMA sees them (common/kernel_common.h).
  using LayoutSeq = SeqLayout<kHeadDim>;
  using ShapeSeq = Shape<int32_t, Int<kHeadDim>, int32_t, int32_t>;

  static auto make_tma_q(const Element* ptr, LayoutSeq layout) {
    return make_tile_tma<kBlockM, kHeadDim>(SM90_TMA_LOAD{}, ptr, layout, SmemLayoutQ{});
  }
  static auto make_tma_kv(const Element* ptr, LayoutSeq layout) {
    return make_tile_tma<kBlockN, kHeadDim>(SM90_TMA_LOAD{}, ptr, layout, take<0, 2>(SmemLayoutK{}));
  }
  // V: the (n, d) tiles of V, or with kVtInGmem of V^T in global memory,
  // (s, d, kh, b) with stride (1, fp8_vt_seq(s), d * fp8_vt_seq(s), ...).
  using StrideVt = Stride<_1, int64_t, int64_t, int64_t>;
  using LayoutV = std::conditional_t<VtInGmem, Layout<ShapeSeq, StrideVt>, LayoutSeq>;
  static auto make_tma_v(const Element* ptr, LayoutV layout) {
    return make_tile_tma<kBlockN, kHeadDim>(SM90_TMA_LOAD{}, ptr, layout, take<0, 2>(SmemLayoutV{}));
  }
  // Where the consumers read V^T tiles.
  CUTE_HOST_DEVICE static Element* vt_data(SharedStorage& smem) {
    if constexpr (VtInGmem) { return smem.v.data(); } else { return smem.vt.data(); }
  }
  // Where O is staged, each consumer warpgroup stores its 64 rows on its own
  // (fwd/epilogue.h), so TMA stores 64-row boxes.
  static constexpr bool kSeparateO = kStageO;
  static constexpr int kRowsPerWG = 64;
  using SmemLayoutOWG = decltype(get<0>(zipped_divide(SmemLayoutO{}, Shape<Int<kRowsPerWG>, Int<kHeadDim>>{})));
  static auto make_tma_o(ElementO* ptr, LayoutSeq layout) {
    return make_tile_tma<kRowsPerWG, kHeadDim>(SM90_TMA_STORE{}, ptr, layout, SmemLayoutOWG{});
  }
  using TmaQ = decltype(make_tma_q(nullptr, LayoutSeq{}));
  using TmaKV = decltype(make_tma_kv(nullptr, LayoutSeq{}));
  using TmaV = decltype(make_tma_v(nullptr, LayoutV{}));
  using TmaO = decltype(make_tma_o(nullptr, LayoutSeq{}));
};

}  // namespace jax_fa3

// Building blocks the traits of the three kernel families (fwd/, fp8/, bwd/)
// compose: K-major shared-memory tiles as WGMMA and TMA read them, the
// forward family's two tiled GEMMs, and the TMA atom of one tile of a
// (seq, d, head, batch) tensor. Each traits struct keeps its own member names
// (SmemLayoutQ, TiledMmaQK, ...) so kernel code reads the same everywhere.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

namespace jax_fa3 {

using namespace cute;

// The widest swizzle atom for a K-major (rows, cols) tile of Element.
template <class Element, int Rows, int Cols>
using SmemAtomKMajor = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
    GMMA::Major::K, Element, Int<Rows>, Int<Cols>>());
// A K-major (rows, cols) tile in shared memory, and a ring of `Stages` of them.
template <class Element, int Rows, int Cols>
using SmemTileKMajor = decltype(tile_to_shape(SmemAtomKMajor<Element, Rows, Cols>{}, Shape<Int<Rows>, Int<Cols>>{}));
template <class Element, int Rows, int Cols, int Stages>
using SmemRingKMajor = decltype(tile_to_shape(
    SmemAtomKMajor<Element, Rows, Cols>{}, Shape<Int<Rows>, Int<Cols>, Int<Stages>>{}));

// The forward family's GEMMs (fwd/ and fp8/): one 64-row WGMMA atom per
// consumer warpgroup, FP32 accumulation.
// S = Q K^T: both operands K-major in shared memory (SS).
template <class Element, int NumWarpGroups, int BlockN, int HeadDim>
using FwdTiledMmaQK = decltype(make_tiled_mma(
    GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<BlockN>, Int<HeadDim>>>(),
    Layout<Shape<Int<NumWarpGroups>, _1, _1>>{}));
// O += P V: P from registers (RS), V read with major-ness MajorV (MN for the
// 16-bit kernel's transposed view of V, K for FP8's transposed copy).
template <class Element, int NumWarpGroups, int BlockN, int HeadDim, GMMA::Major MajorV>
using FwdTiledMmaPV = decltype(make_tiled_mma(
    GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<HeadDim>, Int<BlockN>>, GMMA::Major::K, MajorV>(),
    Layout<Shape<Int<NumWarpGroups>, _1, _1>>{}));

// The TMA atom that moves one (Rows, Cols) box between the global tensor
// `layout` at `ptr` and a shared-memory tile laid out as `smem`. CopyOp is
// SM90_TMA_LOAD or SM90_TMA_STORE.
template <int Rows, int Cols, class CopyOp, class T, class GLayout, class SLayout>
auto make_tile_tma(CopyOp op, T* ptr, GLayout layout, SLayout smem) {
  return make_tma_copy(op, make_tensor(make_gmem_ptr(ptr), layout), smem, Shape<Int<Rows>, Int<Cols>>{}, _1{});
}

}  // namespace jax_fa3

// Small device helpers shared by every kernel family: register-layout views of
// WGMMA accumulators, a warpgroup GEMM wrapper, fragment conversion.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace jax_fa3 {

using namespace cute;

// WGMMA accumulator layout ((2, 2, N/8), MMA_M, MMA_N) viewed as
// (rows, cols) = ((2, MMA_M), (2, N/8, MMA_N)): each thread owns two rows
// (r and r + 8) per 64-row atom and pairs of adjacent columns.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol_layout(Layout acc) {
  static_assert(rank(acc) == 3);
  auto v = get<0>(acc);
  return make_layout(make_layout(get<1>(v), get<1>(acc)),
                     make_layout(get<0>(v), get<2>(v), get<2>(acc)));
}

template <class Tensor>
CUTE_HOST_DEVICE auto as_rowcol(Tensor&& t) {
  return make_tensor(t.data(), acc_rowcol_layout(t.layout()));
}

// The same registers re-read as the A operand of a 16-bit RS WGMMA:
// ((2, 2, N/8), M, 1) -> ((2, 2, 2), M, N/16). The per-thread element order of
// the m64nN accumulator and of the m64k16 A fragment coincide, so P needs no
// data movement between the two GEMMs, only a conversion to 16 bits.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_to_a_layout(Layout acc) {
  auto v = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(v), get<1>(v), get<0>(get<2>(v))),
                     get<1>(acc),
                     coalesce(make_layout(get<1>(get<2>(v)), get<2>(acc))));
}

// Elementwise numeric conversion of a register fragment into an existing one
// (vectorized cvt.rn.bf16x2 / f16x2 for float -> 16-bit). Writing in place
// lets P keep its registers across loop iterations while it feeds async WGMMAs.
template <class EngineS, class LayoutS, class EngineD, class LayoutD>
CUTE_DEVICE void convert_into(Tensor<EngineS, LayoutS> const& src, Tensor<EngineD, LayoutD>& dst) {
  using From = typename EngineS::value_type;
  using To = typename EngineD::value_type;
  constexpr int N = decltype(size(src))::value;
  static_assert(N == decltype(size(dst))::value);
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, N>*>(src.data()));
}

// The same into a fresh fragment of the source's layout.
template <class To, class Engine, class Layout>
CUTE_DEVICE auto convert_fragment(Tensor<Engine, Layout> const& src) {
  Tensor dst = make_tensor<To>(src.layout());
  convert_into(src, dst);
  return dst;
}

// One warpgroup-wide GEMM over the whole K extent of the fragments.
// ZeroInit overwrites C; WaitDepth >= 0 waits until at most that many WGMMA
// batches of this warpgroup are still in flight (0: this one is done).
template <bool ZeroInit, int WaitDepth, class TiledMma, class TA, class TB, class TC>
CUTE_DEVICE void warpgroup_gemm(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  // SS GEMMs pass A as smem descriptors, RS GEMMs as a register fragment.
  constexpr bool kARegisters = !std::is_same_v<typename TA::iterator, GMMA::DescriptorIterator>;
  if constexpr (kARegisters) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (ZeroInit) { tiled_mma.accumulate_ = GMMA::ScaleOut::Zero; }
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < size<2>(tCrA); ++kb) {
    cute::gemm(tiled_mma, tCrA(_, _, kb), tCrB(_, _, kb), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (WaitDepth >= 0) { warpgroup_wait<WaitDepth>(); }
  warpgroup_fence_operand(tCrC);
  if constexpr (kARegisters) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
}

// Reductions over the 4 threads of a quad, which together own one row of an
// accumulator fragment.
CUTE_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
CUTE_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// The end of one row's online softmax: `sum` of exp2(score - m) over its
// visible keys, `m` their max and `sink` an extra logit with value 0 that
// joins the denominator (all base 2; sink -inf: none). Writes the natural-log
// LSE (+inf for a row with neither, so the backward's exp(s - lse) is 0
// there) and returns the factor that normalizes the row's output.
CUTE_DEVICE float finish_row(float sum, float m, float sink, float& lse) {
  const bool keys = sum > 0.f;
  m = keys ? m : -INFINITY;
  const float top = fmaxf(m, sink);
  if (top == -INFINITY) {
    lse = INFINITY;
    return 0.f;
  }
  const float keep = keys ? exp2f(m - top) : 0.f;
  const float total = sum * keep + exp2f(sink - top);
  lse = (top + __log2f(total)) * 0.69314718055994530942f;
  return keep / total;
}

}  // namespace jax_fa3

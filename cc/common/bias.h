// The additive bias (params.h, BiasParams) as the consumers see it: one
// (batch, head) slice, read straight into registers in the accumulator's
// element order once a block's S has retired, added before the mask (which
// overrides it). The backward writes dS, the gradient, from its registers.
// Loading under the S GEMM instead kept the values live across it: ptxas then
// spilled the mainloops of every call, bias or not.
//
// Scores are kept in "x" units (fwd/softmax.h), so the bias enters as
// bias * to_x with to_x = 1 / scale (1 / softcap with a softcap).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include "../fwd/params.h"
#include "utils.h"

namespace jax_fa3 {

template <class Element>
CUTE_DEVICE float bias_to_float(uint16_t bits) {
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) {
    return __uint_as_float(uint32_t(bits) << 16);
  } else {
    return __half2float(__ushort_as_half(bits));
  }
}

template <class Element>
struct BiasTile {
  static_assert(sizeof(Element) == 2, "the 16-bit kernels' bias");
  const uint16_t* base = nullptr;  // the slice [t, row_stride]; null: no bias
  void* grad = nullptr;            // the gradient's slice, or null
  bool grad_f32 = false;           // grad holds float (else Element)
  int64_t row_stride = 0;
  int rows = 0, cols = 0;  // t, s

  // The slice of (batch, head); FwdParams- or BwdParams-like p. The empty asm
  // keeps the slice's address out of the block loops (built per block).
  template <class Params>
  CUTE_DEVICE static BiasTile of(const Params& p, int batch, int head) {
    const BiasParams& b = p.bias;
    if (b.ptr == nullptr) { return {}; }
    asm volatile("" : "+r"(batch), "+r"(head));
    BiasTile tile;
    tile.base = static_cast<const uint16_t*>(b.ptr) + batch * b.stride_b + head * b.stride_n;
    if (b.grad != nullptr) {
      const int64_t at = (int64_t(batch) * p.n + head) * p.t * b.row_stride;
      tile.grad = b.grad_f32 ? static_cast<void*>(static_cast<float*>(b.grad) + at)
                             : static_cast<void*>(static_cast<Element*>(b.grad) + at);
      tile.grad_f32 = b.grad_f32;
    }
    tile.row_stride = b.row_stride;
    tile.rows = p.t;
    tile.cols = p.s;
    return tile;
  }
  CUTE_DEVICE bool active() const { return base != nullptr; }

  // Forward S tile (rows = queries, cols = keys) at (row0, col0): a lane
  // holds its columns in adjacent pairs (2 j, 2 j + 1 of the row-col view),
  // one 32-bit load each. Rows past t read row t - 1 (the epilogue drops
  // them), columns past s the padded row's end (the mask hides them).
  template <class TS, class TC>
  CUTE_DEVICE void add_pairs(TS& scores, TC const& coords, int row0, int col0, float to_x) const {
    Tensor s = as_rowcol(scores);
    Tensor c = as_rowcol(coords);
    constexpr int kCols = decltype(size<1>(c))::value;
    static_assert(kCols % 2 == 0);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(c); ++r) {
      const uint16_t* row = base + min(row0 + get<0>(c(r, 0)), rows - 1) * row_stride;
      CUTLASS_PRAGMA_UNROLL
      for (int col = 0; col < kCols; col += 2) {
        const int j = min(col0 + get<1>(c(r, col)), int(row_stride) - 2);
        const uint32_t w = __ldg(reinterpret_cast<const uint32_t*>(row + j));
        s(r, col) = fmaf(bias_to_float<Element>(uint16_t(w & 0xffffu)), to_x, s(r, col));
        s(r, col + 1) = fmaf(bias_to_float<Element>(uint16_t(w >> 16)), to_x, s(r, col + 1));
      }
    }
  }

  // Backward S^T tile (rows = keys, cols = queries): the bias at (key,
  // query), clamped into the padded slice (such keys and queries are masked).
  CUTE_DEVICE float at(int key, int query) const {
    key = min(key, int(row_stride) - 1);
    query = min(query, rows - 1);
    return bias_to_float<Element>(__ldg(base + int64_t(query) * row_stride + key));
  }
  // One query (a column of the lane's fragment) at a time: the empty asm
  // keeps ptxas from hoisting every load to the front, where their
  // registers made the backward spill.
  template <class TS, class TC>
  CUTE_DEVICE void add_transposed(TS& scores, TC const& coords, int key0, int query0, float to_x) const {
    Tensor s = as_rowcol(scores);
    Tensor c = as_rowcol(coords);
    CUTLASS_PRAGMA_UNROLL
    for (int col = 0; col < size<1>(s); ++col) {
      const uint16_t* row = base + int64_t(min(query0 + get<1>(c(0, col)), rows - 1)) * row_stride;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < size<0>(s); ++r) {
        const int key = min(key0 + get<0>(c(r, col)), int(row_stride) - 1);
        s(r, col) = fmaf(bias_to_float<Element>(__ldg(row + key)), to_x, s(r, col));
      }
      asm volatile("" ::: "memory");
    }
  }
  // dS^T element (key, query) -> grad[query, key], inside [t, s] only.
  CUTE_DEVICE void store_grad(int key, int query, float ds) const {
    if (key < cols && query < rows) { put(int64_t(query) * row_stride + key, ds); }
  }
  CUTE_DEVICE void put(int64_t i, float ds) const {
    if (grad_f32) {
      static_cast<float*>(grad)[i] = ds;
    } else {
      static_cast<Element*>(grad)[i] = Element(ds);
    }
  }
  template <class TS, class TC>
  CUTE_DEVICE void store_grad_transposed(TS const& ds_frag, TC const& coords, int key0, int query0) const {
    Tensor ds = as_rowcol(ds_frag);
    Tensor c = as_rowcol(coords);
    CUTLASS_PRAGMA_UNROLL
    for (int col = 0; col < size<1>(ds); ++col) {
      const int query = query0 + get<1>(c(0, col));
      if (query >= rows) { continue; }
      const int64_t row = int64_t(query) * row_stride;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < size<0>(ds); ++r) {
        const int key = key0 + get<0>(c(r, col));
        if (key < cols) { put(row + key, ds(r, col)); }
      }
    }
  }
};

}  // namespace jax_fa3

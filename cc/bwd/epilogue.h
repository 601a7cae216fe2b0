// Epilogue of the main backward kernel: dK (times the softmax scale) and dV
// go from the fp32 accumulators straight to global memory in the input dtype.
// GQA needs no reduction here: the CTA already summed over the query heads
// of its KV head. Key rows past the sequence are not written; rows past
// kv_len hold zeros (no query saw them).
#pragma once

#include <cute/tensor.hpp>
#include "traits.h"
#include "../fwd/utils.h"

namespace jax_fa3 {

template <class Traits>
struct BwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;

  template <class TKV>
  CUTE_DEVICE static void store(const BwdParams& p, int mma_tid, int n_block, int kv_head, int batch,
                                TKV const& acc_dk, TKV const& acc_dv) {
    typename Traits::TiledMmaKV mma_kv;
    auto thr_kv = mma_kv.get_thread_slice(mma_tid);
    Tensor c = as_rowcol(thr_kv.partition_C(make_identity_tensor(typename Traits::TileKV{})));
    Tensor dk = as_rowcol(acc_dk);
    Tensor dv = as_rowcol(acc_dv);
    Element* dk_out = static_cast<Element*>(p.dk);
    Element* dv_out = static_cast<Element*>(p.dv);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(dk); ++r) {
      const int row = n_block * kBlockN + get<0>(c(r, 0));
      if (row >= p.s) { continue; }
      const int64_t base = ((int64_t(batch) * p.s + row) * p.kh + kv_head) * kHeadDim;
      CUTLASS_PRAGMA_UNROLL
      for (int col = 0; col < size<1>(dk); ++col) {
        const int d = get<1>(c(r, col));
        dk_out[base + d] = Element(dk(r, col) * p.scale);
        dv_out[base + d] = Element(dv(r, col));
      }
    }
  }
};

}  // namespace jax_fa3

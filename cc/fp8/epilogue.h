// FP8 epilogue. Where O is staged in shared memory (kStageO: all but the
// transposing d256 kernel) it is the 16-bit forward's (fwd/epilogue.h): O in
// its own buffer (the output dtype, not the e4m3 operand type), each consumer
// warpgroup storing its 64 rows with its own barrier and TMA store. In the
// transposing d256 kernel O's 64 KB of staging would not fit next to the K/V
// and V^T rings, so it goes from registers straight to global in 4-byte pairs
// (below).
#pragma once

#include <cute/tensor.hpp>
#include "traits.h"
#include "../fwd/tile_scheduler.h"
#include "../common/utils.h"
#include "../fwd/epilogue.h"

namespace jax_fa3 {

template <class Traits, class KernelParams>
struct Fp8Epilogue {
  using ElementO = typename Traits::ElementO;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using Staged = Epilogue<Traits, KernelParams>;

  CUTE_DEVICE static void drain(int mma_tid) {
    if constexpr (Traits::kStageO) { Staged::drain(mma_tid); }
  }

  template <int kRows, class TO>
  CUTE_DEVICE static void store(const KernelParams& params, typename Traits::SharedStorage& smem,
                                int mma_tid, const WorkTile& tile, int q_len,
                                TO& acc_o, const float (&lse)[kRows]) {
    if constexpr (Traits::kStageO) {
      Staged::store(params, smem, mma_tid, tile, q_len, acc_o, lse);
    } else {
      store_from_registers(params, mma_tid, tile, q_len, acc_o, lse);
    }
  }

  template <int kRows, class TO>
  CUTE_DEVICE static void store_from_registers(const KernelParams& params, int mma_tid, const WorkTile& tile,
                                               int q_len, TO& acc_o, const float (&lse)[kRows]) {
    const FwdParams& p = params.fwd;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(mma_tid);
    Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cO_rc = as_rowcol(cO);
    const int m_start = tile.m_block * kBlockM;
    Staged::zero_padded_rows(acc_o, cO_rc, m_start, q_len);

    Tensor rO = convert_fragment<ElementO>(acc_o);
    // The accumulator gives each thread column pairs (2t, 2t + 1) of every
    // 8-column group: one 4-byte store per pair, rows past the sequence end
    // skipped.
    Tensor rO_rc = as_rowcol(rO);
    static_assert(decltype(size<1>(rO_rc))::value % 2 == 0);
    ElementO* o_head = static_cast<ElementO*>(p.o) + (int64_t(tile.batch) * p.t * p.n + tile.head) * kHeadDim;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(rO_rc); ++r) {
      const int row = m_start + get<0>(cO_rc(r, 0));
      if (row < p.t) {
        ElementO* o_row = o_head + int64_t(row) * p.n * kHeadDim;
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(rO_rc); c += 2) {
          cutlass::AlignedArray<ElementO, 2> pair;
          pair[0] = rO_rc(r, c);
          pair[1] = rO_rc(r, c + 1);
          *reinterpret_cast<cutlass::AlignedArray<ElementO, 2>*>(o_row + get<1>(cO_rc(r, c))) = pair;
        }
      }
    }

    Staged::store_lse(p, tile, cO_rc, m_start, q_len, lse);
  }
};

}  // namespace jax_fa3

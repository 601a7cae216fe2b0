// Epilogue: normalized O (padded query rows zeroed) goes registers -> shared
// memory -> global through TMA stores, which also clip rows past the sequence
// end. LSE goes straight from registers.
//
// Each consumer warpgroup stores its own 64 rows with its own barrier and
// TMA store: a CTA-wide barrier here made the warpgroup that finished first
// wait out the other's last P.V GEMM, and the tensor cores idled across every
// tile boundary (at d64 about 1.5 K/V blocks' worth of time per tile).
// The FP8 kernel stores O this way too where it stages O (fp8/epilogue.h);
// O's type is Traits::ElementO (the operand type in the 16-bit kernel).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include "../common/barriers.h"
#include "traits.h"
#include "../common/utils.h"

namespace jax_fa3 {

template <class Traits, class KernelParams>
struct Epilogue {
  using ElementO = typename Traits::ElementO;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDimV;  // O's
  static constexpr int kRowsPerWG = Traits::kRowsPerWG;
  static constexpr int kWGThreads = cutlass::NumThreadsPerWarpGroup;
  // One named barrier per consumer warpgroup (common/barriers.h).
  static_assert(kBarrierStoreO + Traits::kNumMmaWarpGroups <= kNumUserBarriers, "user named barriers are 0..7");

  // Before the CTA retires: each warpgroup's last TMA store must have read shared memory.
  CUTE_DEVICE static void drain(int mma_tid) {
    if (mma_tid % kWGThreads == 0) { tma_store_wait<0>(); }
  }

  // Rows past q_len leave as zeros.
  template <class TO, class TC>
  CUTE_DEVICE static void zero_padded_rows(TO& acc_o, TC const& cO_rc, int m_start, int q_len) {
    Tensor o_rc = as_rowcol(acc_o);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < size<0>(o_rc); ++r) {
      if (m_start + get<0>(cO_rc(r, 0)) >= q_len) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < size<1>(o_rc); ++c) { o_rc(r, c) = 0.f; }
      }
    }
  }

  // One thread of each quad writes the LSE of its rows; past q_len a row sees
  // no key: +inf, or the sink's logit (the softmax over the sink alone).
  template <int kRows, class TC>
  CUTE_DEVICE static void store_lse(const FwdParams& p, const WorkTile& tile, TC const& cO_rc, int m_start,
                                    int q_len, const float (&lse)[kRows]) {
    if (get<1>(cO_rc(0, 0)) == 0) {
      float* lse_ptr = p.lse + (int64_t(tile.batch) * p.n + tile.head) * p.t;
      const float past = p.sinks ? p.sinks[tile.head] : INFINITY;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        int row = m_start + get<0>(cO_rc(r, 0));
        if (row < p.t) { lse_ptr[row] = row < q_len ? lse[r] : past; }
      }
    }
  }

  template <int kRows, class TO>
  CUTE_DEVICE static void store(const KernelParams& params, typename Traits::SharedStorage& smem,
                                int mma_tid, const WorkTile& tile, int q_len,
                                TO& acc_o, const float (&lse)[kRows]) {
    const FwdParams& p = params.fwd;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(mma_tid);
    Tensor cO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cO_rc = as_rowcol(cO);
    const int m_start = tile.m_block * kBlockM;
    zero_padded_rows(acc_o, cO_rc, m_start, q_len);

    Tensor rO = convert_fragment<ElementO>(acc_o);
    ElementO* o_buffer;
    if constexpr (Traits::kSeparateO) { o_buffer = smem.o.data(); } else { o_buffer = smem.q.data(); }
    Tensor sO = make_tensor(make_smem_ptr(o_buffer), typename Traits::SmemLayoutO{});
    // A thread's fragment lies in its own warpgroup's 64 rows of the tile
    // (and, with O in Q's buffer, in the Q rows only its warpgroup's S GEMMs read).
    const int wg = mma_tid / kWGThreads;
    const bool issuer = mma_tid % kWGThreads == 0;
    if constexpr (Traits::kSeparateO) {
      // This warpgroup's store of the previous tile may still be reading its rows.
      if (issuer) { tma_store_wait<0>(); }
      cutlass::arch::NamedBarrier::sync(kWGThreads, kBarrierStoreO + wg);
    }
    Tensor tOsO = thr_pv.partition_C(sO);
    copy(rO, tOsO);
    // Generic-proxy writes must be visible to the TMA engine (async proxy).
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(kWGThreads, kBarrierStoreO + wg);

    if (issuer) {
      Tensor mO = params.tma_o.get_tma_tensor(make_shape(p.t, Int<kHeadDim>{}, p.n, p.b * p.num_splits));
      Tensor gO = local_tile(mO(_, _, tile.head, tile.batch), Shape<Int<kRowsPerWG>, Int<kHeadDim>>{},
                             make_coord(tile.m_block * (kBlockM / kRowsPerWG) + wg, _0{}));
      Tensor sOw = local_tile(sO, Shape<Int<kRowsPerWG>, Int<kHeadDim>>{}, make_coord(wg, _0{}));
      tma_store_tile(params.tma_o, sOw, gO);
      tma_store_arrive();
      // An O staged in Q's buffer must be read out before Q is released.
      if constexpr (!Traits::kSeparateO) { tma_store_wait<0>(); }
    }

    store_lse(p, tile, cO_rc, m_start, q_len, lse);
  }
};

}  // namespace jax_fa3

// The dQ writer: one warp of the producer warpgroup adds each staged dQ block
// (SharedStorage::dq, two buffers) into the fp32 dQ accumulator with a bulk
// reduce-add, so the consumers neither wait for one another to issue it nor
// for its reads. The buffers are a two-stage mbarrier pipeline
// (Traits::PipelineDq): a consumer thread waits on a buffer's EMPTY barrier
// by itself (no named barrier ties the two warpgroups together), stages its
// part, and arrives on FULL; the writer waits on FULL, reads the block's
// accumulator index from dq_target, issues the reduce and arrives on EMPTY
// once the reduce has read the buffer. A negative index stops the writer.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include "../common/utils.h"
#include "params.h"

namespace jax_fa3 {

// Deterministic dQ: key block j adds to query block m only when the
// semaphore of m reaches its turn (KeyBlockMask::dq_turn), so the fp32 sum
// is formed in one fixed order.
CUTE_DEVICE void dq_spin_until(const int* sem, int turn) {
  int v;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(sem) : "memory");
    if (v == turn) { break; }
    __nanosleep(40);
  }
}

// Adds one staged fp32 dQ block (`bytes` from shared memory) into its
// accumulator block with a bulk reduce-add, issued by one thread. Deterministic:
// only at the block's turn, and complete before the turn is handed on.
template <bool Deterministic>
CUTE_DEVICE void dq_bulk_add(int* sem, int turn, float* dst, const float* src, int bytes) {
  if constexpr (Deterministic) {
    dq_spin_until(sem, turn);
    asm volatile("fence.proxy.async.global;" ::: "memory");  // acquire -> async-proxy adds
  }
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(dst), "r"(cute::cast_smem_ptr_to_uint(src)), "r"(bytes) : "memory");
  tma_store_arrive();
  if constexpr (Deterministic) {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    asm volatile("fence.proxy.async.global;" ::: "memory");
    __threadfence();
    atomicAdd(sem, 1);
  }
}

template <class Traits, bool Deterministic>
struct BwdDqWriter {
  static constexpr int kBlockElems = Traits::kBlockM * Traits::kHeadDim;
  static_assert(Traits::kDqBufs == 2, "the handoff alternates two buffers");

  // Run by one whole warp of the producer warpgroup.
  CUTE_DEVICE static void run(const BwdParams& p, typename Traits::SharedStorage& smem) {
    const bool leader = cute::elect_one_sync();
    for (int k = 0;; ++k) {
      const int buf = k & 1;
      smem.pipe_dq.full_barrier_[buf].wait((k >> 1) & 1);
      const int64_t target = smem.dq_target[buf];
      if (target < 0) { break; }
      if (leader) {
        dq_bulk_add<Deterministic>(p.semaphore + target, smem.dq_turn[buf], p.dq_accum + target * kBlockElems,
                                   smem.dq.data() + buf * kBlockElems, int(kBlockElems * sizeof(float)));
        if constexpr (!Deterministic) { tma_store_wait<0>(); }  // read out of shared memory
        smem.pipe_dq.empty_barrier_[buf].arrive();
      }
      __syncwarp();
    }
  }
};

// The consumers' side, kept across tiles: `count` blocks handed over so far
// (block k uses buffer k & 1, in phase (k >> 1) & 1 of its barriers).
template <class Traits>
struct BwdDqHandoff {
  int count = 0;
  CUTE_DEVICE int buf() const { return count & 1; }
  // Wait until the writer has read the last block staged in the buffer of block k.
  CUTE_DEVICE static void wait_empty(typename Traits::SharedStorage& smem, int k) {
    smem.pipe_dq.empty_barrier_[k & 1].wait(((k >> 1) & 1) ^ 1);
  }
  CUTE_DEVICE void acquire(typename Traits::SharedStorage& smem) const { wait_empty(smem, count); }
  // After every thread's staging writes into buf().
  CUTE_DEVICE void commit(typename Traits::SharedStorage& smem, int mma_tid, int64_t target, int turn = 0) {
    if (mma_tid == 0) {
      smem.dq_target[buf()] = target;
      smem.dq_turn[buf()] = turn;
    }
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> the bulk reduce's reads
    smem.pipe_dq.full_barrier_[buf()].arrive();
    ++count;
  }
  // Both buffers read out (the epilogue stages dK/dV in them).
  CUTE_DEVICE void drain(typename Traits::SharedStorage& smem) const {
    wait_empty(smem, count);
    wait_empty(smem, count + 1);
  }
  // After the last tile.
  CUTE_DEVICE void stop(typename Traits::SharedStorage& smem, int mma_tid) {
    acquire(smem);
    commit(smem, mma_tid, -1);
  }
};

}  // namespace jax_fa3

// Pieces every warp-specialized kernel family repeats: the global tensor
// layout TMA sees, the producer/consumer role split and pipeline set-up of the
// prologue, and the host-side launch with dynamic shared memory.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

namespace jax_fa3 {

using namespace cute;

// A BTNH tensor [batch, seq, heads, d] (XLA's row-major layout) as TMA sees
// it: (seq, d, head, batch), head dim contiguous.
template <int HeadDim>
using SeqLayout = Layout<Shape<int32_t, Int<HeadDim>, int32_t, int32_t>, Stride<int64_t, _1, int64_t, int64_t>>;

template <int HeadDim>
SeqLayout<HeadDim> btnh_layout(int seq, int heads, int batch) {
  return SeqLayout<HeadDim>(make_shape(seq, Int<HeadDim>{}, heads, batch),
                            make_stride(int64_t(heads) * HeadDim, _1{}, int64_t(HeadDim),
                                        int64_t(seq) * heads * HeadDim));
}

// The same tensor stored heads-major, [batch, heads, seq, d] (a decode step's
// [B, 1, K * G, d] queries seen as G rows of each of K heads).
template <int HeadDim>
SeqLayout<HeadDim> bhtd_layout(int seq, int heads, int batch) {
  return SeqLayout<HeadDim>(make_shape(seq, Int<HeadDim>{}, heads, batch),
                            make_stride(int64_t(HeadDim), _1{}, int64_t(seq) * HeadDim,
                                        int64_t(seq) * heads * HeadDim));
}

// The K/V tensors' (rows, batches) as TMA sees them: (s, b), or a paged
// cache's (page_size, num_pages) (FwdParams::pages).
struct KvExtent {
  int rows, batches;
  template <class Params>
  CUTE_HOST_DEVICE static KvExtent of(const Params& p) {
    return p.pages.table != nullptr ? KvExtent{p.pages.page_size, p.pages.num_pages} : KvExtent{p.s, p.b};
  }
};

// Thread roles of a kernel with one producer warpgroup (warpgroup 0) and
// consumer warpgroups after it; one elected thread of the producer's first
// warp issues the TMA loads.
struct WarpRoles {
  int warp_group, warp_in_group;
  bool is_producer, tma_thread;

  CUTE_DEVICE static WarpRoles make() {
    WarpRoles r;
    r.warp_group = cutlass::canonical_warp_group_idx();
    r.warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
    r.is_producer = r.warp_group == 0;
    const bool lane_leader = cute::elect_one_sync();
    r.tma_thread = r.is_producer && r.warp_in_group == 0 && lane_leader;
    return r;
  }
};

// Parameters of a TMA-fed pipeline: the producer warpgroup produces (its TMA
// thread arms the transaction bytes), every consumer thread releases.
template <class Pipeline>
CUTE_DEVICE typename Pipeline::Params tma_pipeline_params(const WarpRoles& roles, uint32_t transaction_bytes,
                                                          int num_consumers) {
  typename Pipeline::Params params;
  params.transaction_bytes = transaction_bytes;
  params.role = roles.is_producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  params.is_leader = roles.tma_thread;
  params.num_consumers = num_consumers;
  return params;
}

template <class... Tma>
CUTE_DEVICE void prefetch_tma_descriptors(const Tma&... tma) {
  (cute::prefetch_tma_descriptor(tma.get_tma_descriptor()), ...);
}

// TMA views of a shared-memory tile and its global counterpart for a CTA of
// its own (no multicast): (global, shared), the first two modes of each
// grouped into the TMA box.
template <class Tma, class TS, class TG>
CUTE_DEVICE auto tma_views(const Tma& tma, TS const& s, TG const& g) {
  return tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
}

// Stores one shared-memory tile through TMA (the caller commits and waits).
template <class Tma, class TS, class TG>
CUTE_DEVICE void tma_store_tile(const Tma& tma, TS const& s, TG const& g) {
  auto [tg, ts] = tma_views(tma, s, g);
  copy(tma, ts, tg);
}

// Sets the kernel's dynamic shared memory and launches it. The attribute is
// set per launch, not once per process: it is per device, and one process may
// drive several GPUs (a host-side call of about a microsecond).
template <class KernelParams>
cudaError_t launch_kernel(void (*kernel)(KernelParams), dim3 grid, int threads, int smem_bytes,
                          cudaStream_t stream, const KernelParams& params) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) { return err; }
  kernel<<<grid, threads, smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace jax_fa3

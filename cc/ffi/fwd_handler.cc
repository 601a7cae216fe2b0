// XLA FFI handler for the forward pass: validates what the kernel relies on,
// fills FwdParams and dispatches to the compiled instantiation. Thin on
// purpose: shape policy lives in Python, kernels live in cc/fwd.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include <cuda_runtime_api.h>
#include "xla/ffi/api/ffi.h"

#include "common.h"

#include "../fwd/kv_append.h"
#include "../fwd/params.h"

namespace jax_fa3 {
namespace {

constexpr const char* kWho = "jax_fa3_fwd";

const FwdKernelEntry* find_kernel(DType dtype, int d, const char* variant) {
  return find_entry(kFwdKernels, kNumFwdKernels, [&](const FwdKernelEntry& e) {
    return e.dtype == dtype && e.head_dim == d && std::strcmp(e.variant, variant) == 0;
  });
}

// Tile choice per problem: d64's 192-row tile (three consumer warpgroups) is
// faster on unmasked problems from 1k queries and on causal ones from 4k;
// below that its padding of short causal problems costs more than it gains
// (benchmarks/RESULTS.md). It takes no pair rule or bias (fwd/traits.h). A value
// head dim unlike Q/K's has its own tiles: "dv<Hv>".
std::string pick_variant(const FwdParams& p, DType dtype) {
  if (p.dv != p.d) { return "dv" + std::to_string(p.dv); }
  if (p.d == 64 && p.pair.q_spans == nullptr && p.bias.ptr == nullptr && find_kernel(dtype, 64, "m192") != nullptr) {
    const bool unmasked = p.window_left < 0 && p.window_right < 0;
    const bool causal_like = p.window_right >= 0 && p.window_left < 0;
    if ((unmasked && p.t >= 1024) || (causal_like && p.t >= 4096)) { return "m192"; }
  }
  return "default";
}

// What is wrong with q, k, v, out (rank 4, one 16-bit dtype), or nullptr.
const char* bad_operands(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                         const ffi::AnyBuffer& o, DType* dtype) {
  if (!all_rank4(q, k, v)) { return "q, k, v must be rank 4"; }
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      o.element_type() != q.element_type()) {
    return "q, k, v, out must share one dtype";
  }
  if (!to_dtype(q.element_type(), dtype)) { return "dtype must be bfloat16 or float16"; }
  return nullptr;
}

ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens, Ids q_ids, Ids kv_ids,
                   Ids q_spans, Ids kv_spans, ffi::AnyBuffer bias, ffi::Buffer<ffi::F32> sinks,
                   ffi::Result<ffi::AnyBuffer> o,
                   ffi::Result<ffi::Buffer<ffi::F32>> lse,
                   float scale, float softcap, int32_t window_left, int32_t window_right) {
  DType dtype;
  if (const char* why = bad_operands(q, k, v, *o, &dtype)) { return invalid(kWho, why); }
  FwdParams p;
  set_dims(p, q, k);
  auto vd = v.dimensions(), od = o->dimensions();
  p.dv = int(vd[3]);
  if (!k_matches_q(p, k) || vd[0] != p.b || vd[1] != p.s || vd[2] != p.kh || od.size() != 4 || od[0] != p.b ||
      od[1] != p.t || od[2] != p.n || od[3] != p.dv) {
    return invalid(kWho, "inconsistent q/k/v/out shapes");
  }
  if (!dims_are(*lse, {p.b, p.n, p.t})) { return invalid(kWho, "lse must be [B, N, T]"); }
  if (!lens_match(q_lens, kv_lens, p.b)) { return invalid(kWho, "seq-length arrays must have shape [B]"); }
  if (!set_pair_rule(p, q_ids, kv_ids, q_spans, kv_spans)) { return invalid(kWho, "pair-rule operand shapes"); }
  if (!set_bias(p, bias, q.element_type())) { return invalid(kWho, "bias must be [1|B, 1|N, T, S rounded up to even] in q's dtype"); }
  if (sinks.element_count() != 0 && sinks.element_count() != size_t(p.n)) {
    return invalid(kWho, "sinks must have shape [N] or [0]");
  }
  p.sinks = sinks.element_count() != 0 ? sinks.typed_data() : nullptr;
  if (p.b == 0 || p.t == 0 || p.n == 0) { return ffi::Error::Success(); }  // nothing to write
  p.q = q.untyped_data(); p.k = k.untyped_data(); p.v = v.untyped_data();
  p.o = o->untyped_data(); p.lse = lse->typed_data();
  p.q_lens = q_lens.typed_data(); p.kv_lens = kv_lens.typed_data();
  p.scale = scale; p.softcap = softcap;
  p.window_left = clamp_window(window_left, p.t);
  p.window_right = clamp_window(window_right, p.s);
  p.num_sms = sm_count();

  const std::string variant = pick_variant(p, dtype);
  const FwdKernelEntry* e = find_kernel(dtype, p.d, variant.c_str());
  if (e == nullptr) {
    return invalid(kWho, "head dim " + std::to_string(p.d) + ", variant '" + variant +
                         "' with this dtype was not compiled (JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES)");
  }
  return launch_status(kWho, e->launch(p, stream));
}

// The KV-cache forward (jax_fa3/kvcache.py): the forward kernels on a
// contiguous [B, S, K, H] or paged [pages, page_size, K, H] cache, every query
// row valid and aligned bottom-right (row i at position kv_len[b] - T / q_pack
// + i / q_pack; kv_lens as the caller holds them, clamped in the kernel, so a
// decode step is this call alone), split-KV into num_splits parts whose
// O [B, splits, T, N, H] and LSE [B, splits, N, T] the caller merges.
// heads_major: q is [B, N, T, H] and O [B, splits, N, T, H] instead.
ffi::Error KvcacheFwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> kv_lens,
                          ffi::Buffer<ffi::S32> page_table,
                          ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale,
                          float softcap, int32_t window_left, int32_t window_right, int32_t q_pack,
                          int32_t num_splits, int32_t heads_major, int32_t new_rows) {
  constexpr const char* who = "jax_fa3_kvcache_fwd";
  DType dtype;
  if (const char* why = bad_operands(q, k, v, *o, &dtype)) { return invalid(who, why); }
  FwdParams p;
  set_dims(p, q, k);
  p.heads_major = heads_major != 0;
  if (p.heads_major) { std::swap(p.t, p.n); }
  auto kd = k.dimensions(), vd = v.dimensions(), pd = page_table.dimensions();
  const bool paged = page_table.element_count() != 0;
  if (!std::equal(kd.begin(), kd.end(), vd.begin()) || kd[3] != p.d || p.kh == 0 || p.n % p.kh != 0) {
    return invalid(who, "inconsistent q/cache shapes");
  }
  if (paged) {
    if (pd.size() != 2 || pd[0] != p.b || kd[0] < 1) { return invalid(who, "page_table must be [B, pages_per_row]"); }
    if (pd[1] * kd[1] > INT32_MAX) { return invalid(who, "pages_per_row * page_size must fit int32"); }
    p.pages = {page_table.typed_data(), int(pd[1]), int(kd[1]), int(kd[0])};
    p.s = int(pd[1] * kd[1]);  // a row's capacity
  } else if (kd[0] != p.b) {
    return invalid(who, "a contiguous cache must have q's batch");
  }
  if (kv_lens.element_count() != size_t(p.b)) {
    return invalid(who, "kv_lens must have shape [B]");
  }
  if (q_pack < 1 || (q_pack & (q_pack - 1)) != 0 || num_splits < 1 || new_rows < 0) {
    return invalid(who, "q_pack must be a power of two, num_splits >= 1, new_rows >= 0");
  }
  auto od = o->dimensions();
  const int64_t o_dim2 = p.heads_major ? p.n : p.t, o_dim3 = p.heads_major ? p.t : p.n;
  if (od.size() != 5 || od[0] != p.b || od[1] != num_splits || od[2] != o_dim2 || od[3] != o_dim3 ||
      od[4] != p.d) {
    return invalid(who, "out must be [B, num_splits, T, N, H] ([B, num_splits, N, T, H] heads-major)");
  }
  if (!dims_are(*lse, {p.b, num_splits, p.n, p.t})) { return invalid(who, "lse must be [B, num_splits, N, T]"); }
  if (p.b == 0 || p.t == 0 || p.n == 0) { return ffi::Error::Success(); }
  p.q = q.untyped_data(); p.k = k.untyped_data(); p.v = v.untyped_data();
  p.o = o->untyped_data(); p.lse = lse->typed_data();
  p.kv_lens = kv_lens.typed_data();  // every query row is valid (q_lens null)
  p.bottom_right = true;
  p.kv_len_add = new_rows;
  p.dv = p.d;
  while ((1 << p.q_pack_log2) < q_pack) { ++p.q_pack_log2; }
  p.num_splits = num_splits;
  p.scale = scale; p.softcap = softcap;
  // Positions lie in [-t, s + t] (offsets in [-t, s]): a side that long is unbounded.
  p.window_left = clamp_window(window_left, p.s + p.t);
  p.window_right = clamp_window(window_right, p.s + p.t);
  p.num_sms = sm_count();
  const FwdKernelEntry* e = find_kernel(dtype, p.d, "default");
  if (e == nullptr) {
    return invalid(who, "head dim " + std::to_string(p.d) + " with this dtype was not compiled");
  }
  return launch_status(who, e->launch(p, stream));
}

// k_new / v_new [B, Tq, K, H] into the caches at clamp(seqlens, 0, capacity)
// + i (kv_append.h); the results alias the cache operands (donated caches are
// updated in place, no copy).
ffi::Error KvcacheAppendImpl(cudaStream_t stream, ffi::AnyBuffer k_new, ffi::AnyBuffer v_new,
                             ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> seqlens,
                             ffi::Buffer<ffi::S32> page_table, ffi::Result<ffi::AnyBuffer> k_out,
                             ffi::Result<ffi::AnyBuffer> v_out) {
  constexpr const char* who = "jax_fa3_kvcache_append";
  if (!all_rank4(k_cache, v_cache, k_new) || v_new.dimensions().size() != 4) {
    return invalid(who, "caches and new rows must be rank 4");
  }
  auto kd = k_cache.dimensions(), vd = v_cache.dimensions(), nd = k_new.dimensions(), vnd = v_new.dimensions();
  const auto et = k_cache.element_type();
  if (v_cache.element_type() != et || k_new.element_type() != et || v_new.element_type() != et ||
      !std::equal(kd.begin(), kd.end(), vd.begin()) || !std::equal(nd.begin(), nd.end(), vnd.begin()) ||
      nd[2] != kd[2] || nd[3] != kd[3]) {
    return invalid(who, "caches [., ., K, H] and new rows [B, Tq, K, H] must agree in K, H and dtype");
  }
  KvAppendParams p;
  p.b = int(nd[0]); p.tq = int(nd[1]); p.kh = int(nd[2]);
  p.row_bytes = int(nd[3] * (k_cache.size_bytes() / std::max<size_t>(k_cache.element_count(), 1)));
  const bool paged = page_table.element_count() != 0;
  auto pd = page_table.dimensions();
  if (paged) {
    if (pd.size() != 2 || pd[0] != p.b) { return invalid(who, "page_table must be [B, pages_per_row]"); }
    if (pd[1] * kd[1] > INT32_MAX) { return invalid(who, "pages_per_row * page_size must fit int32"); }
    p.pages = {page_table.typed_data(), int(pd[1]), int(kd[1]), int(kd[0])};
    p.capacity = int(pd[1] * kd[1]);
  } else {
    if (kd[0] != p.b) { return invalid(who, "a contiguous cache must have the new rows' batch"); }
    p.capacity = int(kd[1]);
  }
  if (seqlens.element_count() != size_t(p.b)) { return invalid(who, "seqlens must have shape [B]"); }
  if (p.row_bytes % 16 != 0) { return invalid(who, "a cache row must be a multiple of 16 bytes"); }
  if (k_out->untyped_data() != k_cache.untyped_data() || v_out->untyped_data() != v_cache.untyped_data()) {
    return invalid(who, "the results must alias the caches");
  }
  p.k_new = k_new.untyped_data(); p.v_new = v_new.untyped_data();
  p.k_cache = k_out->untyped_data(); p.v_cache = v_out->untyped_data();
  p.seqlens = seqlens.typed_data();
  return launch_status(who, launch_kv_append(p, stream));
}

}  // namespace
}  // namespace jax_fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3KvcacheAppend, jax_fa3::KvcacheAppendImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()         // k_new [B, Tq, K, H]
        .Arg<ffi::AnyBuffer>()         // v_new
        .Arg<ffi::AnyBuffer>()         // k_cache
        .Arg<ffi::AnyBuffer>()         // v_cache
        .Arg<ffi::Buffer<ffi::S32>>()  // seqlens [B], before the append
        .Arg<ffi::Buffer<ffi::S32>>()  // page_table [B, pages_per_row] or empty
        .Ret<ffi::AnyBuffer>()         // k_cache, aliased
        .Ret<ffi::AnyBuffer>(),        // v_cache, aliased
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3KvcacheFwd, jax_fa3::KvcacheFwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()         // q [B, T, N, H]
        .Arg<ffi::AnyBuffer>()         // k_cache
        .Arg<ffi::AnyBuffer>()         // v_cache
        .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens [B], clamped in the kernel
        .Arg<ffi::Buffer<ffi::S32>>()  // page_table [B, pages_per_row] or empty
        .Ret<ffi::AnyBuffer>()         // out [B, num_splits, T, N, H]
        .Ret<ffi::Buffer<ffi::F32>>()  // lse [B, num_splits, N, T]
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right")
        .Attr<int32_t>("q_pack")
        .Attr<int32_t>("num_splits")
        .Attr<int32_t>("heads_major")
        .Attr<int32_t>("new_rows"),  // appended ahead of the call: kv_len = min(clamped kv_lens + new_rows, S)
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3Fwd, jax_fa3::FwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()         // q
        .Arg<ffi::AnyBuffer>()         // k
        .Arg<ffi::AnyBuffer>()         // v
        .Arg<ffi::Buffer<ffi::S32>>()  // q_lens
        .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
        .Arg<ffi::Buffer<ffi::S32>>()  // q segment ids [B, T] or empty
        .Arg<ffi::Buffer<ffi::S32>>()  // kv segment ids [B, S] or empty
        .Arg<ffi::Buffer<ffi::S32>>()  // q spans or empty
        .Arg<ffi::Buffer<ffi::S32>>()  // kv spans or empty
        .Arg<ffi::AnyBuffer>()         // bias [1|B, 1|N, T, S rounded up to even] or empty
        .Arg<ffi::Buffer<ffi::F32>>()  // sinks [N] or empty
        .Ret<ffi::AnyBuffer>()         // out
        .Ret<ffi::Buffer<ffi::F32>>()  // lse
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right"),
    {ffi::Traits::kCmdBufferCompatible});

// C entry points for the Python binding (kept free of Python so the heavy
// library is built once and shared by every interpreter version).
JAX_FA3_EXPORT void* jax_fa3_fwd_handler() { return reinterpret_cast<void*>(JaxFa3Fwd); }
JAX_FA3_EXPORT void* jax_fa3_kvcache_fwd_handler() { return reinterpret_cast<void*>(JaxFa3KvcacheFwd); }
JAX_FA3_EXPORT void* jax_fa3_kvcache_append_handler() { return reinterpret_cast<void*>(JaxFa3KvcacheAppend); }
JAX_FA3_EXPORT int jax_fa3_num_fwd_kernels() { return jax_fa3::kNumFwdKernels; }
// Reports only default-variant kernels: those are what Python may dispatch to.
JAX_FA3_EXPORT int jax_fa3_fwd_kernel_config(int i, int* dtype, int* head_dim) {
  *dtype = int(jax_fa3::kFwdKernels[i].dtype);
  *head_dim = jax_fa3::kFwdKernels[i].head_dim;
  return std::strcmp(jax_fa3::kFwdKernels[i].variant, "default") == 0;
}
// The value head dim of entry i's "dv<Hv>" variant (Hv != the head dim), else 0.
JAX_FA3_EXPORT int jax_fa3_fwd_kernel_value_dim(int i) {
  const char* v = jax_fa3::kFwdKernels[i].variant;
  return std::strncmp(v, "dv", 2) == 0 ? std::atoi(v + 2) : 0;
}
// Direct launch without XLA (cc/tools/fwd_check.cc: compute-sanitizer runs).
// Returns 0, a cudaError_t, or -1 when (dtype, head dim, variant) is not compiled.
// variant "auto" takes the handler's choice (pick_variant).
JAX_FA3_EXPORT int jax_fa3_fwd_launch(const jax_fa3::FwdParams* p, int dtype, const char* variant,
                                      cudaStream_t stream) {
  jax_fa3::FwdParams params = *p;
  if (params.num_sms == 0) { params.num_sms = jax_fa3::sm_count(); }
  const auto dt = jax_fa3::DType(dtype);
  if (params.dv == 0) { params.dv = params.d; }
  const std::string picked = std::strcmp(variant, "auto") == 0 ? jax_fa3::pick_variant(params, dt) : variant;
  const jax_fa3::FwdKernelEntry* e = jax_fa3::find_kernel(dt, params.d, picked.c_str());
  return e ? int(e->launch(params, stream)) : -1;
}
// The append without XLA (cc/tools/fwd_check.cc). Returns 0 or a cudaError_t.
JAX_FA3_EXPORT int jax_fa3_kv_append_launch(const jax_fa3::KvAppendParams* p, cudaStream_t stream) {
  return int(jax_fa3::launch_kv_append(*p, stream));
}

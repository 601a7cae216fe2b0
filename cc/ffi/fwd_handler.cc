// XLA FFI handler for the forward pass: validates what the kernel relies on,
// fills FwdParams and dispatches to the compiled instantiation. Thin on
// purpose: shape policy lives in Python, kernels live in cc/fwd.
#include <cstdint>
#include <cstring>
#include <string>

#include <cuda_runtime_api.h>
#include "xla/ffi/api/ffi.h"

#include "common.h"

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
// (benchmarks/RESULTS.md). It takes no segment ids (fwd/traits.h).
const char* pick_variant(const FwdParams& p, DType dtype) {
  if (p.d == 64 && p.pair.q_spans == nullptr && find_kernel(dtype, 64, "m192") != nullptr) {
    const bool unmasked = p.window_left < 0 && p.window_right < 0;
    const bool causal_like = p.window_right >= 0 && p.window_left < 0;
    if ((unmasked && p.t >= 1024) || (causal_like && p.t >= 4096)) { return "m192"; }
  }
  return "default";
}

ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens, Ids q_ids, Ids kv_ids,
                   Ids q_spans, Ids kv_spans, ffi::Buffer<ffi::F32> sinks, ffi::Result<ffi::AnyBuffer> o,
                   ffi::Result<ffi::Buffer<ffi::F32>> lse,
                   float scale, float softcap, int32_t window_left, int32_t window_right) {
  if (!all_rank4(q, k, v)) { return invalid(kWho, "q, k, v must be rank 4 [B, T, N, H]"); }
  DType dtype;
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      o->element_type() != q.element_type()) {
    return invalid(kWho, "q, k, v, out must share one dtype");
  }
  if (!to_dtype(q.element_type(), &dtype)) { return invalid(kWho, "dtype must be bfloat16 or float16"); }
  FwdParams p;
  set_dims(p, q, k);
  auto vd = v.dimensions();
  if (!k_matches_q(p, k) || vd[0] != p.b || vd[1] != p.s || vd[2] != p.kh || vd[3] != p.d) {
    return invalid(kWho, "inconsistent q/k/v shapes");
  }
  if (!lens_match(q_lens, kv_lens, p.b)) { return invalid(kWho, "seq-length arrays must have shape [B]"); }
  if (!set_pair_rule(p, q_ids, kv_ids, q_spans, kv_spans)) { return invalid(kWho, "pair-rule operand shapes"); }
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

  const char* variant = pick_variant(p, dtype);
  const FwdKernelEntry* e = find_kernel(dtype, p.d, variant);
  if (e == nullptr) {
    return invalid(kWho, "head dim " + std::to_string(p.d) + ", variant '" + variant +
                         "' with this dtype was not compiled (JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES)");
  }
  return launch_status(kWho, e->launch(p, stream));
}

}  // namespace
}  // namespace jax_fa3

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
JAX_FA3_EXPORT int jax_fa3_num_fwd_kernels() { return jax_fa3::kNumFwdKernels; }
// Reports only default-variant kernels: those are what Python may dispatch to.
JAX_FA3_EXPORT int jax_fa3_fwd_kernel_config(int i, int* dtype, int* head_dim) {
  *dtype = int(jax_fa3::kFwdKernels[i].dtype);
  *head_dim = jax_fa3::kFwdKernels[i].head_dim;
  return std::strcmp(jax_fa3::kFwdKernels[i].variant, "default") == 0;
}
// Direct launch without XLA (cc/tools/fwd_check.cc: compute-sanitizer runs).
// Returns 0, a cudaError_t, or -1 when (dtype, head dim, variant) is not compiled.
// variant "auto" takes the handler's choice (pick_variant).
JAX_FA3_EXPORT int jax_fa3_fwd_launch(const jax_fa3::FwdParams* p, int dtype, const char* variant,
                                      cudaStream_t stream) {
  jax_fa3::FwdParams params = *p;
  if (params.num_sms == 0) { params.num_sms = jax_fa3::sm_count(); }
  const auto dt = jax_fa3::DType(dtype);
  if (std::strcmp(variant, "auto") == 0) { variant = jax_fa3::pick_variant(params, dt); }
  const jax_fa3::FwdKernelEntry* e = jax_fa3::find_kernel(dt, params.d, variant);
  return e ? int(e->launch(params, stream)) : -1;
}

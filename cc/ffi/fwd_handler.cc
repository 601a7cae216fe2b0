// XLA FFI handler for the forward pass: validates what the kernel relies on,
// fills FwdParams and dispatches to the compiled instantiation. Thin on
// purpose: shape policy lives in Python, kernels live in cc/fwd.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include <cuda_runtime_api.h>
#include "xla/ffi/api/ffi.h"

#include "fwd_knobs.h"
#include "sm_count.h"

#include "../fwd/params.h"

namespace ffi = xla::ffi;

namespace jax_fa3 {
namespace {

// JAX_FA3_FWD_VARIANT forces a compiled variant by name (ablation runs);
// otherwise pick_variant chooses.
const char* forced_variant() {
  static const char* variant = [] {
    const char* v = std::getenv("JAX_FA3_FWD_VARIANT");
    return (v && *v) ? v : nullptr;
  }();
  return variant;
}

const FwdKernelEntry* find_kernel(DType dtype, int d, const char* variant) {
  for (int i = 0; i < kNumFwdKernels; ++i) {
    const FwdKernelEntry& e = kFwdKernels[i];
    if (e.dtype == dtype && e.head_dim == d && std::strcmp(e.variant, variant) == 0) { return &e; }
  }
  return nullptr;
}

// Tile choice per problem, from the H200 measurements in benchmarks/RESULTS.md:
// d64's 192-row tile (three consumer warpgroups) runs 5-16% faster than the
// 128-row one on unmasked problems from 1k queries and on causal ones from 4k,
// but pads short causal problems (at 1k causal: 250 vs 291 TFLOP/s).
const char* pick_variant(const FwdParams& p, DType dtype) {
  if (const char* v = forced_variant()) { return v; }
  if (p.d == 64 && find_kernel(dtype, 64, "m192") != nullptr) {
    const bool unmasked = p.window_left < 0 && p.window_right < 0;
    const bool causal_like = p.window_right >= 0 && p.window_left < 0;
    if ((unmasked && p.t >= 1024) || (causal_like && p.t >= 4096)) { return "m192"; }
  }
  return "default";
}

ffi::Error FwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                   ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                   float scale, float softcap, int32_t window_left, int32_t window_right) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument("jax_fa3_fwd: q, k, v must be rank 4 [B, T, N, H]");
  }
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type() ||
      o->element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("jax_fa3_fwd: q, k, v, out must share one dtype");
  }
  DType dtype;
  switch (q.element_type()) {
    case ffi::DataType::BF16: dtype = DType::kBF16; break;
    case ffi::DataType::F16: dtype = DType::kFP16; break;
    default: return ffi::Error::InvalidArgument("jax_fa3_fwd: dtype must be bfloat16 or float16");
  }
  FwdParams p;
  p.b = int(qd[0]); p.t = int(qd[1]); p.n = int(qd[2]); p.d = int(qd[3]);
  p.s = int(kd[1]); p.kh = int(kd[2]);
  if (kd[0] != p.b || vd[0] != p.b || kd[3] != p.d || vd[3] != p.d || vd[1] != p.s ||
      vd[2] != p.kh || p.kh == 0 || p.n % p.kh != 0) {
    return ffi::Error::InvalidArgument("jax_fa3_fwd: inconsistent q/k/v shapes");
  }
  if (q_lens.element_count() != size_t(p.b) || kv_lens.element_count() != size_t(p.b)) {
    return ffi::Error::InvalidArgument("jax_fa3_fwd: seq-length arrays must have shape [B]");
  }
  if (p.b == 0 || p.t == 0 || p.n == 0) { return ffi::Error::Success(); }  // nothing to write
  p.q = q.untyped_data(); p.k = k.untyped_data(); p.v = v.untyped_data();
  p.o = o->untyped_data(); p.lse = lse->typed_data();
  p.q_lens = q_lens.typed_data(); p.kv_lens = kv_lens.typed_data();
  p.scale = scale; p.softcap = softcap;
  // A window side at least as long as the sequences constrains nothing: drop
  // it so that index arithmetic in the kernel cannot overflow.
  p.window_left = (window_left < 0 || window_left >= p.t) ? -1 : window_left;
  p.window_right = (window_right < 0 || window_right >= p.s) ? -1 : window_right;
  p.num_sms = sm_count();
  apply_env_knobs(p);

  const char* variant = pick_variant(p, dtype);
  if (const FwdKernelEntry* e = find_kernel(dtype, p.d, variant)) {
    cudaError_t err = e->launch(p, stream);
    if (err != cudaSuccess) {
      return ffi::Error::Internal(std::string("jax_fa3_fwd: launch failed: ") + cudaGetErrorString(err));
    }
    return ffi::Error::Success();
  }
  return ffi::Error::InvalidArgument("jax_fa3_fwd: head dim " + std::to_string(p.d) + ", variant '" +
                                     variant + "' with this dtype was not compiled "
                                     "(JAX_FA3_HEAD_DIMS / JAX_FA3_DTYPES / JAX_FA3_ABLATION)");
}

}  // namespace
}  // namespace jax_fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3Fwd, jax_fa3::FwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::S32>>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::Buffer<ffi::F32>>()
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right"),
    {ffi::Traits::kCmdBufferCompatible});

// C entry points for the Python binding (kept free of Python so the heavy
// library is built once and shared by every interpreter version).
extern "C" {
__attribute__((visibility("default"))) void* jax_fa3_fwd_handler() {
  return reinterpret_cast<void*>(JaxFa3Fwd);
}
__attribute__((visibility("default"))) int jax_fa3_num_fwd_kernels() { return jax_fa3::kNumFwdKernels; }
// Direct launch without XLA (cc/tools/fwd_check.cc: compute-sanitizer runs).
// Returns 0, a cudaError_t, or -1 when (dtype, head dim, variant) is not compiled.
// variant "auto" takes the handler's choice (pick_variant).
__attribute__((visibility("default"))) int jax_fa3_fwd_launch(const jax_fa3::FwdParams* p, int dtype,
                                                              const char* variant, cudaStream_t stream) {
  jax_fa3::FwdParams params = *p;
  if (params.num_sms == 0) { params.num_sms = jax_fa3::sm_count(); }
  jax_fa3::apply_env_knobs(params);
  const auto dt = jax_fa3::DType(dtype);
  if (std::strcmp(variant, "auto") == 0) { variant = jax_fa3::pick_variant(params, dt); }
  const jax_fa3::FwdKernelEntry* e = jax_fa3::find_kernel(dt, params.d, variant);
  return e ? int(e->launch(params, stream)) : -1;
}
// Reports only default-variant kernels: those are what Python may dispatch to.
__attribute__((visibility("default"))) int jax_fa3_fwd_kernel_config(int i, int* dtype, int* head_dim) {
  *dtype = int(jax_fa3::kFwdKernels[i].dtype);
  *head_dim = jax_fa3::kFwdKernels[i].head_dim;
  return std::strcmp(jax_fa3::kFwdKernels[i].variant, "default") == 0;
}
}

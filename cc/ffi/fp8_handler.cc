// XLA FFI handlers for FP8 attention: the fused quantize pre-pass
// (jax_fa3_fp8_quantize) and the FP8 forward (jax_fa3_fp8_fwd). Thin: they
// check what the kernels rely on and fill the parameter structs; block sizes
// and scale shapes are decided in Python (jax_fa3/fp8.py) and checked here.
#include <cstdint>
#include <cstring>
#include <string>

#include <cuda_runtime_api.h>
#include "xla/ffi/api/ffi.h"

#include "fwd_knobs.h"
#include "sm_count.h"

#include "../fp8/params.h"
#include "../fp8/quantize.h"

namespace ffi = xla::ffi;

namespace jax_fa3 {
namespace {

bool to_dtype(ffi::DataType t, DType* out) {
  if (t == ffi::DataType::BF16) { *out = DType::kBF16; return true; }
  if (t == ffi::DataType::F16) { *out = DType::kFP16; return true; }
  return false;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Buffer<ffi::F32> signs, ffi::Buffer<ffi::F32> fixed_scales,
                        ffi::Result<ffi::AnyBuffer> q8, ffi::Result<ffi::AnyBuffer> k8,
                        ffi::Result<ffi::AnyBuffer> v8, ffi::Result<ffi::Buffer<ffi::F32>> qs,
                        ffi::Result<ffi::Buffer<ffi::F32>> ks, ffi::Result<ffi::Buffer<ffi::F32>> vs,
                        int32_t block_q, int32_t block_kv, int32_t hadamard, int32_t v_transposed) {
  const char* who = "jax_fa3_fp8_quantize: ";
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument(std::string(who) + "q, k, v must be rank 4");
  }
  QuantParams p;
  if (!to_dtype(q.element_type(), &p.dtype) || k.element_type() != q.element_type() ||
      v.element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument(std::string(who) + "q, k, v must share bfloat16 or float16");
  }
  for (auto* r : {&q8, &k8, &v8}) {
    if ((*r)->element_type() != ffi::DataType::F8E4M3FN) {
      return ffi::Error::InvalidArgument(std::string(who) + "outputs must be float8_e4m3fn");
    }
  }
  p.b = int(qd[0]); p.d = int(qd[3]);
  if (kd[0] != p.b || vd[0] != p.b || kd[3] != p.d || vd[3] != p.d || kd[1] != vd[1] || kd[2] != vd[2]) {
    return ffi::Error::InvalidArgument(std::string(who) + "inconsistent q/k/v shapes");
  }
  if (signs.element_count() != size_t(p.d)) {
    return ffi::Error::InvalidArgument(std::string(who) + "signs must have shape [head_dim]");
  }
  const bool per_tensor = fixed_scales.element_count() == 3;
  if (!per_tensor && fixed_scales.element_count() != 0) {
    return ffi::Error::InvalidArgument(std::string(who) + "fixed scales: shape [0] or [3]");
  }
  const ffi::AnyBuffer* ins[3] = {&q, &k, &v};
  ffi::Result<ffi::AnyBuffer>* outs[3] = {&q8, &k8, &v8};
  ffi::Result<ffi::Buffer<ffi::F32>>* scales[3] = {&qs, &ks, &vs};
  if (v_transposed != 0 && block_kv != fp8_block_n(p.d)) {
    return ffi::Error::InvalidArgument(std::string(who) + "V^T output needs block_kv = the kernel's key block");
  }
  for (int i = 0; i < 3; ++i) {
    auto dims = ins[i]->dimensions(), out = (*outs[i])->dimensions();
    // e4m3 of the input's shape; V^T [B, K, H, fp8_vt_seq(S)] (params.h) when v_transposed.
    const bool vt = i == 2 && v_transposed != 0;
    const bool out_ok = out.size() == 4 &&
        (vt ? out[0] == dims[0] && out[1] == dims[2] && out[2] == dims[3] && out[3] == fp8_vt_seq(dims[1], p.d)
            : out[0] == dims[0] && out[1] == dims[1] && out[2] == dims[2] && out[3] == dims[3]);
    if (!out_ok) { return ffi::Error::InvalidArgument(std::string(who) + "e4m3 output has the wrong shape"); }
    QuantTensor& t = p.t[i];
    t.x = ins[i]->untyped_data();
    t.out = (*outs[i])->untyped_data();
    t.scales = (*scales[i])->typed_data();
    t.seq = int(dims[1]);
    t.heads = int(dims[2]);
    t.block_rows = i == 0 ? block_q : block_kv;
    t.hadamard = hadamard != 0 && i < 2;  // V: block scales only
    t.pow2 = i == 2;  // V: power-of-two scales (the kernel folds their ratios into P)
    t.transpose = vt;
    t.fixed_scale = per_tensor ? fixed_scales.typed_data() + i : nullptr;
    if (t.block_rows <= 0 ||
        (*scales[i])->element_count() != size_t(p.b * t.heads * ceil_div(t.seq, t.block_rows))) {
      return ffi::Error::InvalidArgument(std::string(who) + "scale output has the wrong size");
    }
  }
  p.num_tensors = 3;
  p.signs = signs.typed_data();
  cudaError_t err = launch_fp8_quantize(p, stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(who) + "launch failed: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace

// The instantiation for this output dtype, head dim and V layout.
const Fp8FwdKernelEntry* find_kernel(DType out_dtype, const Fp8FwdParams& fp) {
  const char* variant = fp.v_transposed ? "vt" : "default";
  for (int i = 0; i < kNumFp8FwdKernels; ++i) {
    const Fp8FwdKernelEntry& e = kFp8FwdKernels[i];
    if (e.out_dtype == out_dtype && e.head_dim == fp.base.d && std::strcmp(e.variant, variant) == 0) { return &e; }
  }
  return nullptr;
}

namespace {

ffi::Error Fp8FwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::F32> q_scale, ffi::Buffer<ffi::F32> k_scale,
                      ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> q_lens,
                      ffi::Buffer<ffi::S32> kv_lens, ffi::Result<ffi::AnyBuffer> o,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, int32_t window_left,
                      int32_t window_right, int32_t v_transposed) {
  const char* who = "jax_fa3_fp8_fwd: ";
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument(std::string(who) + "q, k, v must be rank 4 [B, T, N, H]");
  }
  if (q.element_type() != ffi::DataType::F8E4M3FN || k.element_type() != q.element_type() ||
      v.element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument(std::string(who) + "q, k, v must be float8_e4m3fn");
  }
  DType out_dtype;
  if (!to_dtype(o->element_type(), &out_dtype)) {
    return ffi::Error::InvalidArgument(std::string(who) + "output must be bfloat16 or float16");
  }
  Fp8FwdParams fp;
  FwdParams& p = fp.base;
  p.b = int(qd[0]); p.t = int(qd[1]); p.n = int(qd[2]); p.d = int(qd[3]);
  p.s = int(kd[1]); p.kh = int(kd[2]);
  fp.v_transposed = v_transposed != 0;
  // V: [B, S, K, H], or V^T [B, K, H, fp8_vt_seq(S)] (params.h).
  const bool v_ok = fp.v_transposed
      ? vd[0] == p.b && vd[1] == p.kh && vd[2] == p.d && vd[3] == fp8_vt_seq(p.s, p.d)
      : vd[0] == p.b && vd[1] == p.s && vd[2] == p.kh && vd[3] == p.d;
  if (kd[0] != p.b || kd[3] != p.d || !v_ok || p.kh == 0 || p.n % p.kh != 0) {
    return ffi::Error::InvalidArgument(std::string(who) + "inconsistent q/k/v shapes");
  }
  if (q_lens.element_count() != size_t(p.b) || kv_lens.element_count() != size_t(p.b)) {
    return ffi::Error::InvalidArgument(std::string(who) + "seq-length arrays must have shape [B]");
  }
  const int64_t block_n = fp8_block_n(p.d);
  if (q_scale.element_count() != size_t(int64_t(p.b) * p.n * ceil_div(p.t, kFp8BlockM)) ||
      k_scale.element_count() != size_t(int64_t(p.b) * p.kh * ceil_div(p.s, block_n)) ||
      v_scale.element_count() != k_scale.element_count()) {
    return ffi::Error::InvalidArgument(std::string(who) + "scale shapes do not match the kernel's blocks");
  }
  if (p.b == 0 || p.t == 0 || p.n == 0) { return ffi::Error::Success(); }
  p.q = q.untyped_data(); p.k = k.untyped_data(); p.v = v.untyped_data();
  p.o = o->untyped_data(); p.lse = lse->typed_data();
  p.q_lens = q_lens.typed_data(); p.kv_lens = kv_lens.typed_data();
  p.scale = scale;
  p.window_left = (window_left < 0 || window_left >= p.t) ? -1 : window_left;
  p.window_right = (window_right < 0 || window_right >= p.s) ? -1 : window_right;
  p.num_sms = sm_count();
  apply_env_knobs(p);  // JAX_FA3_CAUSAL_ORDER / _PINGPONG, as for the 16-bit forward
  fp.q_scale = q_scale.typed_data();
  fp.k_scale = k_scale.typed_data();
  fp.v_scale = v_scale.typed_data();
  const Fp8FwdKernelEntry* e = find_kernel(out_dtype, fp);
  if (e == nullptr) {
    return ffi::Error::InvalidArgument(std::string(who) + "head dim " + std::to_string(p.d) +
                                       " with this output dtype and V layout was not compiled");
  }
  cudaError_t err = e->launch(fp, stream);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(who) + "launch failed: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3Fp8Quantize, jax_fa3::QuantizeImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>()
        .Ret<ffi::Buffer<ffi::F32>>()
        .Attr<int32_t>("block_q")
        .Attr<int32_t>("block_kv")
        .Attr<int32_t>("hadamard")
        .Attr<int32_t>("v_transposed"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3Fp8Fwd, jax_fa3::Fp8FwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::AnyBuffer>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::S32>>()
        .Arg<ffi::Buffer<ffi::S32>>()
        .Ret<ffi::AnyBuffer>()
        .Ret<ffi::Buffer<ffi::F32>>()
        .Attr<float>("scale")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right")
        .Attr<int32_t>("v_transposed"),
    {ffi::Traits::kCmdBufferCompatible});

extern "C" {
__attribute__((visibility("default"))) void* jax_fa3_fp8_quantize_handler() {
  return reinterpret_cast<void*>(JaxFa3Fp8Quantize);
}
__attribute__((visibility("default"))) void* jax_fa3_fp8_fwd_handler() {
  return reinterpret_cast<void*>(JaxFa3Fp8Fwd);
}
__attribute__((visibility("default"))) int jax_fa3_num_fp8_fwd_kernels() { return jax_fa3::kNumFp8FwdKernels; }
__attribute__((visibility("default"))) void jax_fa3_fp8_fwd_kernel_config(int i, int* out_dtype, int* head_dim) {
  *out_dtype = int(jax_fa3::kFp8FwdKernels[i].out_dtype);
  *head_dim = jax_fa3::kFp8FwdKernels[i].head_dim;
}
}

// XLA-free entry points for cc/tools/fp8_check.cc (compute-sanitizer, ncu).
extern "C" {
// Returns a cudaError_t, or -1 when no kernel for (out_dtype, head dim) was compiled.
__attribute__((visibility("default"))) int jax_fa3_fp8_fwd_launch(const jax_fa3::Fp8FwdParams* p,
                                                                  int out_dtype, cudaStream_t stream) {
  jax_fa3::Fp8FwdParams params = *p;
  if (params.base.num_sms == 0) { params.base.num_sms = jax_fa3::sm_count(); }
  jax_fa3::apply_env_knobs(params.base);
  const jax_fa3::Fp8FwdKernelEntry* e = jax_fa3::find_kernel(jax_fa3::DType(out_dtype), params);
  return e == nullptr ? -1 : int(e->launch(params, stream));
}
__attribute__((visibility("default"))) int jax_fa3_fp8_quantize_launch(const jax_fa3::QuantParams* p,
                                                                       cudaStream_t stream) {
  return int(jax_fa3::launch_fp8_quantize(*p, stream));
}
}

// XLA FFI handlers for FP8 attention: the fused quantize pre-pass
// (jax_fa3_fp8_quantize) and the FP8 forward (jax_fa3_fp8_fwd). Thin: they
// check what the kernels rely on and fill the parameter structs; block sizes
// and scale shapes are decided in Python (jax_fa3/fp8.py) and checked here.
#include <cstdint>
#include <cstring>
#include <string>

#include <cuda_runtime_api.h>
#include "xla/ffi/api/ffi.h"

#include "common.h"

#include "../fp8/params.h"
#include "../fp8/quantize.h"

namespace jax_fa3 {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                        ffi::Buffer<ffi::F32> signs, ffi::Buffer<ffi::F32> fixed_scales,
                        ffi::Result<ffi::AnyBuffer> q8, ffi::Result<ffi::AnyBuffer> k8,
                        ffi::Result<ffi::AnyBuffer> v8, ffi::Result<ffi::Buffer<ffi::F32>> qs,
                        ffi::Result<ffi::Buffer<ffi::F32>> ks, ffi::Result<ffi::Buffer<ffi::F32>> vs,
                        int32_t block_q, int32_t block_kv, int32_t hadamard, int32_t v_transposed) {
  constexpr const char* kWho = "jax_fa3_fp8_quantize";
  if (!all_rank4(q, k, v)) { return invalid(kWho, "q, k, v must be rank 4"); }
  QuantParams p;
  if (!to_dtype(q.element_type(), &p.dtype) || k.element_type() != q.element_type() ||
      v.element_type() != q.element_type()) {
    return invalid(kWho, "q, k, v must share bfloat16 or float16");
  }
  for (auto* r : {&q8, &k8, &v8}) {
    if ((*r)->element_type() != ffi::DataType::F8E4M3FN) { return invalid(kWho, "outputs must be float8_e4m3fn"); }
  }
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  p.b = int(qd[0]); p.d = int(qd[3]);
  if (kd[0] != p.b || vd[0] != p.b || kd[3] != p.d || vd[3] != p.d || kd[1] != vd[1] || kd[2] != vd[2]) {
    return invalid(kWho, "inconsistent q/k/v shapes");
  }
  if (signs.element_count() != size_t(p.d)) { return invalid(kWho, "signs must have shape [head_dim]"); }
  const bool per_tensor = fixed_scales.element_count() == 3;
  if (!per_tensor && fixed_scales.element_count() != 0) { return invalid(kWho, "fixed scales: shape [0] or [3]"); }
  if (v_transposed != 0 && block_kv != kFp8BlockN) {
    return invalid(kWho, "V^T output needs block_kv = the kernel's key block");
  }
  const ffi::AnyBuffer* ins[3] = {&q, &k, &v};
  ffi::Result<ffi::AnyBuffer>* outs[3] = {&q8, &k8, &v8};
  ffi::Result<ffi::Buffer<ffi::F32>>* scales[3] = {&qs, &ks, &vs};
  for (int i = 0; i < 3; ++i) {
    auto dims = ins[i]->dimensions(), out = (*outs[i])->dimensions();
    // e4m3 of the input's shape; V^T [B, K, H, fp8_vt_seq(S)] (params.h) when v_transposed.
    const bool vt = i == 2 && v_transposed != 0;
    const bool out_ok = out.size() == 4 &&
        (vt ? out[0] == dims[0] && out[1] == dims[2] && out[2] == dims[3] && out[3] == fp8_vt_seq(dims[1])
            : out[0] == dims[0] && out[1] == dims[1] && out[2] == dims[2] && out[3] == dims[3]);
    if (!out_ok) { return invalid(kWho, "e4m3 output has the wrong shape"); }
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
      return invalid(kWho, "scale output has the wrong size");
    }
  }
  p.num_tensors = 3;
  p.signs = signs.typed_data();
  return launch_status(kWho, launch_fp8_quantize(p, stream));
}

// The instantiation for this output dtype, head dim and V layout.
const Fp8FwdKernelEntry* find_kernel(DType out_dtype, const Fp8FwdParams& fp) {
  const char* variant = fp.v_transposed ? "vt" : "default";
  return find_entry(kFp8FwdKernels, kNumFp8FwdKernels, [&](const Fp8FwdKernelEntry& e) {
    return e.out_dtype == out_dtype && e.head_dim == fp.base.d && std::strcmp(e.variant, variant) == 0;
  });
}

ffi::Error Fp8FwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::F32> q_scale, ffi::Buffer<ffi::F32> k_scale,
                      ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> q_lens,
                      ffi::Buffer<ffi::S32> kv_lens, Ids q_ids, Ids kv_ids, Ids q_spans, Ids kv_spans,
                      ffi::Result<ffi::AnyBuffer> o,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse, float scale, int32_t window_left,
                      int32_t window_right, int32_t v_transposed) {
  constexpr const char* kWho = "jax_fa3_fp8_fwd";
  if (!all_rank4(q, k, v)) { return invalid(kWho, "q, k, v must be rank 4 [B, T, N, H]"); }
  if (q.element_type() != ffi::DataType::F8E4M3FN || k.element_type() != q.element_type() ||
      v.element_type() != q.element_type()) {
    return invalid(kWho, "q, k, v must be float8_e4m3fn");
  }
  DType out_dtype;
  if (!to_dtype(o->element_type(), &out_dtype)) { return invalid(kWho, "output must be bfloat16 or float16"); }
  Fp8FwdParams fp;
  FwdParams& p = fp.base;
  set_dims(p, q, k);
  fp.v_transposed = v_transposed != 0;
  // V: [B, S, K, H], or V^T [B, K, H, fp8_vt_seq(S)] (params.h).
  auto vd = v.dimensions();
  const bool v_ok = fp.v_transposed
      ? vd[0] == p.b && vd[1] == p.kh && vd[2] == p.d && vd[3] == fp8_vt_seq(p.s)
      : vd[0] == p.b && vd[1] == p.s && vd[2] == p.kh && vd[3] == p.d;
  if (!k_matches_q(p, k) || !v_ok) { return invalid(kWho, "inconsistent q/k/v shapes"); }
  auto od = o->dimensions();
  if (od.size() != 4 || od[0] != p.b || od[1] != p.t || od[2] != p.n || od[3] != p.d ||
      !dims_are(*lse, {p.b, p.n, p.t})) {
    return invalid(kWho, "out must be [B, T, N, H] and lse [B, N, T]");
  }
  if (!lens_match(q_lens, kv_lens, p.b)) { return invalid(kWho, "seq-length arrays must have shape [B]"); }
  if (!set_pair_rule(p, q_ids, kv_ids, q_spans, kv_spans)) { return invalid(kWho, "pair-rule operand shapes"); }
  const int64_t block_n = kFp8BlockN;
  if (q_scale.element_count() != size_t(int64_t(p.b) * p.n * ceil_div(p.t, kFp8BlockM)) ||
      k_scale.element_count() != size_t(int64_t(p.b) * p.kh * ceil_div(p.s, block_n)) ||
      v_scale.element_count() != k_scale.element_count()) {
    return invalid(kWho, "scale shapes do not match the kernel's blocks");
  }
  if (p.b == 0 || p.t == 0 || p.n == 0) { return ffi::Error::Success(); }
  p.q = q.untyped_data(); p.k = k.untyped_data(); p.v = v.untyped_data();
  p.o = o->untyped_data(); p.lse = lse->typed_data();
  p.q_lens = q_lens.typed_data(); p.kv_lens = kv_lens.typed_data();
  p.scale = scale;
  p.window_left = clamp_window(window_left, p.t);
  p.window_right = clamp_window(window_right, p.s);
  p.num_sms = sm_count();
  fp.q_scale = q_scale.typed_data();
  fp.k_scale = k_scale.typed_data();
  fp.v_scale = v_scale.typed_data();
  const Fp8FwdKernelEntry* e = find_kernel(out_dtype, fp);
  if (e == nullptr) {
    return invalid(kWho, "head dim " + std::to_string(p.d) +
                         " with this output dtype and V layout was not compiled");
  }
  return launch_status(kWho, e->launch(fp, stream));
}

}  // namespace
}  // namespace jax_fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3Fp8Quantize, jax_fa3::QuantizeImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()         // q
        .Arg<ffi::AnyBuffer>()         // k
        .Arg<ffi::AnyBuffer>()         // v
        .Arg<ffi::Buffer<ffi::F32>>()  // Hadamard signs [head_dim]
        .Arg<ffi::Buffer<ffi::F32>>()  // fixed per-tensor scales [3], or [0]
        .Ret<ffi::AnyBuffer>()         // q e4m3
        .Ret<ffi::AnyBuffer>()         // k e4m3
        .Ret<ffi::AnyBuffer>()         // v e4m3 (or V^T)
        .Ret<ffi::Buffer<ffi::F32>>()  // q scales
        .Ret<ffi::Buffer<ffi::F32>>()  // k scales
        .Ret<ffi::Buffer<ffi::F32>>()  // v scales
        .Attr<int32_t>("block_q")
        .Attr<int32_t>("block_kv")
        .Attr<int32_t>("hadamard")
        .Attr<int32_t>("v_transposed"),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3Fp8Fwd, jax_fa3::Fp8FwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()         // q e4m3
        .Arg<ffi::AnyBuffer>()         // k e4m3
        .Arg<ffi::AnyBuffer>()         // v e4m3 (or V^T)
        .Arg<ffi::Buffer<ffi::F32>>()  // q scales
        .Arg<ffi::Buffer<ffi::F32>>()  // k scales
        .Arg<ffi::Buffer<ffi::F32>>()  // v scales
        .Arg<ffi::Buffer<ffi::S32>>()  // q_lens
        .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
        .Arg<ffi::Buffer<ffi::S32>>()  // q segment ids [B, T] or empty
        .Arg<ffi::Buffer<ffi::S32>>()  // kv segment ids [B, S] or empty
        .Arg<ffi::Buffer<ffi::S32>>()  // q spans or empty
        .Arg<ffi::Buffer<ffi::S32>>()  // kv spans or empty
        .Ret<ffi::AnyBuffer>()         // out
        .Ret<ffi::Buffer<ffi::F32>>()  // lse
        .Attr<float>("scale")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right")
        .Attr<int32_t>("v_transposed"),
    {ffi::Traits::kCmdBufferCompatible});

JAX_FA3_EXPORT void* jax_fa3_fp8_quantize_handler() { return reinterpret_cast<void*>(JaxFa3Fp8Quantize); }
JAX_FA3_EXPORT void* jax_fa3_fp8_fwd_handler() { return reinterpret_cast<void*>(JaxFa3Fp8Fwd); }
JAX_FA3_EXPORT int jax_fa3_num_fp8_fwd_kernels() { return jax_fa3::kNumFp8FwdKernels; }
JAX_FA3_EXPORT void jax_fa3_fp8_fwd_kernel_config(int i, int* out_dtype, int* head_dim) {
  *out_dtype = int(jax_fa3::kFp8FwdKernels[i].out_dtype);
  *head_dim = jax_fa3::kFp8FwdKernels[i].head_dim;
}
// XLA-free entry points for cc/tools/fp8_check.cc (compute-sanitizer, ncu).
// Returns a cudaError_t, or -1 when no kernel for (out_dtype, head dim, V layout) was compiled.
JAX_FA3_EXPORT int jax_fa3_fp8_fwd_launch(const jax_fa3::Fp8FwdParams* p, int out_dtype, cudaStream_t stream) {
  jax_fa3::Fp8FwdParams params = *p;
  if (params.base.num_sms == 0) { params.base.num_sms = jax_fa3::sm_count(); }
  const jax_fa3::Fp8FwdKernelEntry* e = jax_fa3::find_kernel(jax_fa3::DType(out_dtype), params);
  return e == nullptr ? -1 : int(e->launch(params, stream));
}
JAX_FA3_EXPORT int jax_fa3_fp8_quantize_launch(const jax_fa3::QuantParams* p, cudaStream_t stream) {
  return int(jax_fa3::launch_fp8_quantize(*p, stream));
}

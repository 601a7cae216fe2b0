// XLA FFI handler for the backward pass: checks what the kernels rely on,
// fills BwdParams and dispatches to the compiled (dtype, head dim). The fp32
// scratch (dQ accumulator, delta, base-2 LSE, deterministic-mode semaphores,
// split key blocks' sums) arrives as extra custom-call outputs that the
// lowering discards, so XLA owns every byte the kernels touch and nothing is
// allocated here.
#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>
#include "xla/ffi/api/ffi.h"

#include "common.h"

#include "../bwd/params.h"

namespace jax_fa3 {
namespace {

constexpr const char* kWho = "jax_fa3_bwd";

const BwdKernelEntry* find_kernel(DType dtype, int head_dim, int head_dim_v) {
  return find_entry(kBwdKernels, kNumBwdKernels, [&](const BwdKernelEntry& e) {
    return e.dtype == dtype && e.head_dim == head_dim && e.head_dim_v == head_dim_v;
  });
}

// Query rows of the fp32 scratch (BwdParams::t_pad).
int padded_rows(int t) { return (t + kBwdRowPad - 1) / kBwdRowPad * kBwdRowPad; }

// Equal dimensions but for the last (the head dim), which is b's `last`.
template <class A, class B>
bool same_dims_but_last(const A& a, const B& b, int64_t last) {
  if (a.size() != b.size() || a.size() == 0 || b[b.size() - 1] != last) { return false; }
  for (size_t i = 0; i + 1 < a.size(); ++i) {
    if (a[i] != b[i]) { return false; }
  }
  return true;
}

ffi::Error BwdImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                   ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                   ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens, Ids q_ids, Ids kv_ids,
                   Ids q_spans, Ids kv_spans, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> dq,
                   ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                   ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
                   ffi::Result<ffi::Buffer<ffi::F32>> delta, ffi::Result<ffi::Buffer<ffi::F32>> lse_log2,
                   ffi::Result<ffi::Buffer<ffi::S32>> semaphore, ffi::Result<ffi::Buffer<ffi::F32>> dkv_split,
                   float scale, float softcap,
                   int32_t window_left, int32_t window_right, int32_t deterministic) {
  if (!all_rank4(q, k, v)) { return invalid(kWho, "q, k, v must be rank 4 [B, T, N, H]"); }
  const auto et = q.element_type();
  if (k.element_type() != et || v.element_type() != et || o.element_type() != et ||
      dout.element_type() != et || dq->element_type() != et || dk->element_type() != et ||
      dv->element_type() != et) {
    return invalid(kWho, "q, k, v, out, dout and the gradients must share one dtype");
  }
  DType dtype;
  if (!to_dtype(et, &dtype)) { return invalid(kWho, "dtype must be bfloat16 or float16"); }
  BwdParams p;
  set_dims(p, q, k);
  p.t_pad = padded_rows(p.t);
  const size_t rows = size_t(p.b) * p.n * p.t_pad;
  p.d_v = int(v.dimensions()[3]);
  if (!k_matches_q(p, k) || !same_dims_but_last(k.dimensions(), v.dimensions(), p.d_v) ||
      !same_dims_but_last(q.dimensions(), o.dimensions(), p.d_v) ||
      !same_dims_but_last(q.dimensions(), dout.dimensions(), p.d_v) ||
      !same_dims_but_last(k.dimensions(), dk->dimensions(), p.d) ||
      !same_dims_but_last(k.dimensions(), dv->dimensions(), p.d_v) ||
      !same_dims_but_last(q.dimensions(), dq->dimensions(), p.d) ||
      lse.element_count() != size_t(p.b) * p.n * p.t) {
    return invalid(kWho, "inconsistent q/k/v/out/lse/dout/gradient shapes");
  }
  if (!lens_match(q_lens, kv_lens, p.b)) { return invalid(kWho, "seq-length arrays must have shape [B]"); }
  if (p.b > 65535 || p.n > 65535) {  // a CUDA grid's y / z limit (a vmap folds its axis into B)
    return invalid(kWho, "the backward kernels take at most 65535 batch rows and heads per call");
  }
  if (!set_pair_rule(p, q_ids, kv_ids, q_spans, kv_spans)) { return invalid(kWho, "pair-rule operand shapes"); }
  if (!set_bias(p, bias, et, &*dbias)) {
    return invalid(kWho, "bias must be [1|B, 1|N, T, S rounded up to even] in q's dtype, dbias [B, N, T, that] in it or float32");
  }
  if (dq_accum->element_count() != rows * p.d || delta->element_count() != rows ||
      lse_log2->element_count() != rows || semaphore->element_count() != rows / kBwdBlockM ||
      int64_t(dkv_split->element_count()) != bwd_split_scratch_floats(p.b, p.s, p.kh, p.d)) {
    return invalid(kWho, "scratch outputs have the wrong size");
  }
  if (p.b == 0 || p.n == 0 || p.d == 0) { return ffi::Error::Success(); }
  if (p.t == 0 || p.s == 0) {  // no scores: every gradient is zero
    for (auto* r : {&dq, &dk, &dv, &dbias}) {
      if ((*r)->size_bytes() == 0) { continue; }
      cudaError_t err = cudaMemsetAsync((*r)->untyped_data(), 0, (*r)->size_bytes(), stream);
      if (err != cudaSuccess) { return ffi::Error::Internal(cudaGetErrorString(err)); }
    }
    return ffi::Error::Success();
  }
  p.q = q.untyped_data(); p.k = k.untyped_data(); p.v = v.untyped_data();
  p.o = o.untyped_data(); p.dout = dout.untyped_data(); p.lse = lse.typed_data();
  p.q_lens = q_lens.typed_data(); p.kv_lens = kv_lens.typed_data();
  p.dq = dq->untyped_data(); p.dk = dk->untyped_data(); p.dv = dv->untyped_data();
  p.dq_accum = dq_accum->typed_data(); p.delta = delta->typed_data();
  p.lse_log2 = lse_log2->typed_data(); p.semaphore = semaphore->typed_data();
  p.dkv_split = dkv_split->typed_data(); p.dkv_split_floats = int64_t(dkv_split->element_count());
  p.scale = scale; p.softcap = softcap;
  p.window_left = clamp_window(window_left, p.t);
  p.window_right = clamp_window(window_right, p.s);
  p.deterministic = deterministic != 0;
  p.num_sms = sm_count();

  const BwdKernelEntry* e = find_kernel(dtype, p.d, p.d_v);
  if (e == nullptr) {
    return invalid(kWho, "no backward kernel was compiled for head dims " + std::to_string(p.d) + "/" +
                         std::to_string(p.d_v) + " with this dtype");
  }
  return launch_status(kWho, e->launch(p, stream));
}

}  // namespace
}  // namespace jax_fa3

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFa3Bwd, jax_fa3::BwdImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::AnyBuffer>()           // q
        .Arg<ffi::AnyBuffer>()           // k
        .Arg<ffi::AnyBuffer>()           // v
        .Arg<ffi::AnyBuffer>()           // out
        .Arg<ffi::Buffer<ffi::F32>>()    // lse
        .Arg<ffi::AnyBuffer>()           // dout
        .Arg<ffi::Buffer<ffi::S32>>()    // q_lens
        .Arg<ffi::Buffer<ffi::S32>>()    // kv_lens
        .Arg<ffi::Buffer<ffi::S32>>()    // q segment ids [B, T] or empty
        .Arg<ffi::Buffer<ffi::S32>>()    // kv segment ids [B, S] or empty
        .Arg<ffi::Buffer<ffi::S32>>()    // q spans or empty
        .Arg<ffi::Buffer<ffi::S32>>()    // kv spans or empty
        .Arg<ffi::AnyBuffer>()           // bias [1|B, 1|N, T, S rounded up to even] or empty
        .Ret<ffi::AnyBuffer>()           // dq
        .Ret<ffi::AnyBuffer>()           // dk
        .Ret<ffi::AnyBuffer>()           // dv
        .Ret<ffi::AnyBuffer>()           // dbias [B, N, T, S rounded up to even] (q's dtype or f32), or empty
        .Ret<ffi::Buffer<ffi::F32>>()    // scratch: dq_accum
        .Ret<ffi::Buffer<ffi::F32>>()    // scratch: delta
        .Ret<ffi::Buffer<ffi::F32>>()    // scratch: lse_log2
        .Ret<ffi::Buffer<ffi::S32>>()    // scratch: semaphores
        .Ret<ffi::Buffer<ffi::F32>>()    // scratch: split key blocks' counters and sums
        .Attr<float>("scale")
        .Attr<float>("softcap")
        .Attr<int32_t>("window_left")
        .Attr<int32_t>("window_right")
        .Attr<int32_t>("deterministic"),
    {ffi::Traits::kCmdBufferCompatible});

JAX_FA3_EXPORT void* jax_fa3_bwd_handler() { return reinterpret_cast<void*>(JaxFa3Bwd); }
JAX_FA3_EXPORT int jax_fa3_num_bwd_kernels() { return jax_fa3::kNumBwdKernels; }
// Entry i's (dtype, head dim); returns V's head dim.
JAX_FA3_EXPORT int jax_fa3_bwd_kernel_config(int i, int* dtype, int* head_dim) {
  *dtype = int(jax_fa3::kBwdKernels[i].dtype);
  *head_dim = jax_fa3::kBwdKernels[i].head_dim;
  return jax_fa3::kBwdKernels[i].head_dim_v;
}
// Direct launch without XLA (cc/tools/bwd_check.cc: compute-sanitizer runs).
// p: a non-empty problem (the handler's zero-size shortcuts are not repeated)
// with every pointer set, scratch included (sizes as in BwdParams; the
// launcher initializes all of it); d_v = 0 means V's head dim is d. Returns 0,
// a cudaError_t, or -1 when (dtype, head dims) is not compiled.
JAX_FA3_EXPORT int jax_fa3_bwd_launch(const jax_fa3::BwdParams* p, int dtype, cudaStream_t stream) {
  jax_fa3::BwdParams params = *p;
  if (params.d_v == 0) { params.d_v = params.d; }
  const jax_fa3::BwdKernelEntry* e = jax_fa3::find_kernel(jax_fa3::DType(dtype), params.d, params.d_v);
  if (e == nullptr) { return -1; }
  // The scratch is indexed with t_pad: a caller's mismatch would be an
  // out-of-bounds access the sanitizer blames on the kernel.
  if (params.t_pad != jax_fa3::padded_rows(params.t)) { return int(cudaErrorInvalidValue); }
  if (params.num_sms == 0) { params.num_sms = jax_fa3::sm_count(); }
  return int(e->launch(params, stream));
}

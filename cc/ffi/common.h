// Host helpers shared by the FFI handlers (fwd_handler.cc, bwd_handler.cc,
// fp8_handler.cc): dtype mapping, the shape checks every attention call
// makes, kernel-table lookup, error values and the device's SM count.
// Host code only; it sees the plain-data params headers, never CuTe.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include "xla/ffi/api/ffi.h"

#include "../fwd/params.h"  // DType

namespace ffi = xla::ffi;

namespace jax_fa3 {

// bfloat16 / float16 -> DType; false for every other element type.
inline bool to_dtype(ffi::DataType t, DType* out) {
  if (t == ffi::DataType::BF16) { *out = DType::kBF16; return true; }
  if (t == ffi::DataType::F16) { *out = DType::kFP16; return true; }
  return false;
}

// `who` names the custom call ("jax_fa3_fwd"), so a Python traceback says
// which kernel refused the call.
inline ffi::Error invalid(const char* who, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(who) + ": " + what);
}

inline ffi::Error launch_status(const char* who, cudaError_t err) {
  if (err == cudaSuccess) { return ffi::Error::Success(); }
  return ffi::Error::Internal(std::string(who) + ": launch failed: " + cudaGetErrorString(err));
}

inline bool all_rank4(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v) {
  return q.dimensions().size() == 4 && k.dimensions().size() == 4 && v.dimensions().size() == 4;
}

// q_lens / kv_lens hold one length per batch entry.
inline bool lens_match(const ffi::Buffer<ffi::S32>& q_lens, const ffi::Buffer<ffi::S32>& kv_lens, int b) {
  return q_lens.element_count() == size_t(b) && kv_lens.element_count() == size_t(b);
}

using Ids = ffi::Buffer<ffi::S32>;

// The pair-rule operands (params.h, PairRuleParams), all four empty (none), or
//  - segment ids: q_ids [B, T], kv_ids [B, S], spans [B, Gt, 4], [B, Gs, 4];
//  - a mask: its bits (params.h) mask [MB, MN, T, 4, mask_chunks(S)] and
//    mask_t [MB, MN, S, 4, mask_chunks(T)] (int32 words), spans
//    [MB, MN, Gt, 4] and [MB, MK, Gs, 4], MB in {1, B}, MN in {1, N},
//    MK = 1 or K (MN = N);
// with G = ceil(len / 16). Call after set_dims. False when the shapes do not fit.
template <class Params>
bool set_pair_rule(Params& p, const Ids& a, const Ids& b, const Ids& q_spans, const Ids& kv_spans) {
  p.pair = PairRuleParams{};
  if (a.element_count() == 0 && b.element_count() == 0 && q_spans.element_count() == 0 &&
      kv_spans.element_count() == 0) {
    return true;
  }
  auto granules = [](int len) { return int64_t(len + kSpanGranule - 1) / kSpanGranule; };
  auto dims = [](const Ids& x) { auto d = x.dimensions(); return std::vector<int64_t>(d.begin(), d.end()); };
  using D = std::vector<int64_t>;
  if (dims(a).size() == 2) {
    if (dims(a) != D{p.b, p.t} || dims(b) != D{p.b, p.s} || dims(q_spans) != D{p.b, granules(p.t), 4} ||
        dims(kv_spans) != D{p.b, granules(p.s), 4}) {
      return false;
    }
    p.pair.q_ids = a.typed_data();
    p.pair.kv_ids = b.typed_data();
    p.pair.mask_b = p.b;
  } else {
    const D da = dims(a), dk = dims(kv_spans);
    if (da.size() != 5 || dk.size() != 4) return false;
    const int64_t mb = da[0], mn = da[1], mk = dk[1];
    const bool ok_b = mb == 1 || mb == p.b, ok_n = mn == 1 || mn == p.n;
    const bool ok_k = mk == 1 || (mn == p.n && mk == p.kh);
    if (!ok_b || !ok_n || !ok_k || da != D{mb, mn, p.t, 4, mask_chunks(p.s)} ||
        dims(b) != D{mb, mn, p.s, 4, mask_chunks(p.t)} || dims(q_spans) != D{mb, mn, granules(p.t), 4} ||
        dk != D{mb, mk, granules(p.s), 4}) {
      return false;
    }
    p.pair.mask = reinterpret_cast<const uint32_t*>(a.typed_data());
    p.pair.mask_t = reinterpret_cast<const uint32_t*>(b.typed_data());
    p.pair.mask_b = int(mb); p.pair.mask_n = int(mn); p.pair.mask_kh = int(mk);
  }
  p.pair.q_spans = q_spans.typed_data();
  p.pair.kv_spans = kv_spans.typed_data();
  return true;
}

// The bias operand (params.h, BiasParams): empty (none), or [BB, BN, T, SP]
// in q's dtype with BB in {1, B}, BN in {1, N} and SP = S rounded up to even;
// grad (the backward's) [B, N, T, SP] in that dtype or float32, or null. Call after
// set_dims. False when the shapes or dtypes do not fit.
template <class Params>
bool set_bias(Params& p, const ffi::AnyBuffer& bias, ffi::DataType dtype, ffi::AnyBuffer* grad = nullptr) {
  p.bias = BiasParams{};
  if (bias.element_count() == 0 && bias.dimensions().size() != 4) { return grad == nullptr || grad->element_count() == 0; }
  auto d = bias.dimensions();
  const int64_t sp = (int64_t(p.s) + 1) / 2 * 2;
  if (d.size() != 4 || bias.element_type() != dtype || (d[0] != 1 && d[0] != p.b) || (d[1] != 1 && d[1] != p.n) ||
      d[2] != p.t || d[3] != sp) {
    return false;
  }
  p.bias.ptr = bias.untyped_data();
  p.bias.row_stride = sp;
  p.bias.stride_n = d[1] > 1 ? int64_t(p.t) * sp : 0;
  p.bias.stride_b = d[0] > 1 ? d[1] * int64_t(p.t) * sp : 0;
  if (grad != nullptr) {
    auto g = grad->dimensions();
    const bool f32 = grad->element_type() == ffi::DataType::F32;
    if (g.size() != 4 || (grad->element_type() != dtype && !f32) || g[0] != p.b || g[1] != p.n || g[2] != p.t || g[3] != sp) {
      return false;
    }
    p.bias.grad = grad->untyped_data();
    p.bias.grad_f32 = f32;
  }
  return true;
}

// b, t, n, d from q [B, T, N, H] and s, kh from k [B, S, K, H]; FwdParams and
// BwdParams name them alike. Callers check rank 4 first.
template <class Params>
void set_dims(Params& p, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k) {
  auto qd = q.dimensions(), kd = k.dimensions();
  p.b = int(qd[0]); p.t = int(qd[1]); p.n = int(qd[2]); p.d = int(qd[3]);
  p.s = int(kd[1]); p.kh = int(kd[2]);
}

// lse has exactly the dims `want` (the kernels write [.., N, T] rows of it).
inline bool dims_are(const ffi::Buffer<ffi::F32>& x, std::initializer_list<int64_t> want) {
  auto d = x.dimensions();
  return d.size() == want.size() && std::equal(want.begin(), want.end(), d.begin());
}

// k agrees with q on batch and head dim, and its K heads divide q's N (GQA).
template <class Params>
bool k_matches_q(const Params& p, const ffi::AnyBuffer& k) {
  auto kd = k.dimensions();
  return kd[0] == p.b && kd[3] == p.d && p.kh != 0 && p.n % p.kh == 0;
}

// A window side at least as long as the sequence constrains nothing: it
// becomes -1 (unbounded), so index arithmetic in the kernels cannot overflow.
inline int clamp_window(int32_t side, int len) { return (side < 0 || side >= len) ? -1 : side; }

// The first row of a generated kernel table (CMakeLists.txt) that `match`
// accepts, or nullptr when that kernel was not compiled.
template <class Entry, class Match>
const Entry* find_entry(const Entry* table, int count, Match match) {
  for (int i = 0; i < count; ++i) {
    if (match(table[i])) { return &table[i]; }
  }
  return nullptr;
}

// Multiprocessor count of the current device, cached per device (a process
// may drive several GPUs of different kinds).
inline int sm_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> counts[kMaxDevices] = {};
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev < 0 || dev >= kMaxDevices) { dev = 0; }
  int n = counts[dev].load(std::memory_order_relaxed);
  if (n == 0) {
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    counts[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

}  // namespace jax_fa3

// The C entry points (handler pointers, table listings, XLA-free launches)
// that the Python binding and cc/tools resolve by name.
#define JAX_FA3_EXPORT extern "C" __attribute__((visibility("default")))

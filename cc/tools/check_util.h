// Helpers shared by the XLA-free drivers in cc/tools (fwd_check, fp8_check,
// bwd_check): CUDA error exits, host 16-bit float codecs, seeded N(0,1)
// fills, a launch watchdog and argument parsing. Host-only: the drivers are
// plain C++ translation units linked against the kernel library.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <cuda_runtime_api.h>

#define CHECK_CUDA(x)                                                                   \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                     \
    }                                                                                   \
  } while (0)

namespace check_util {

// 16-bit float codecs (round to nearest even), so the host needs no CUDA types.
inline uint16_t to_bf16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
inline float from_bf16(uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t to_fp16(float f) {
  // Inputs are N(0,1): normal range only, no overflow handling needed.
  uint32_t u; std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  int exp = int((u >> 23) & 0xFF) - 127 + 15;
  uint32_t mant = u & 0x7FFFFFu;
  if (exp <= 0) return uint16_t(sign);  // flush tiny values
  uint32_t r = (uint32_t(exp) << 10) | (mant >> 13);
  uint32_t rem = mant & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return uint16_t(sign | r);
}
inline float from_fp16(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
  uint32_t u;
  if (exp == 0) {
    float f = std::ldexp(float(mant), -24);
    return sign ? -f : f;
  } else if (exp == 31) {
    u = sign | 0x7F800000u | (mant << 13);
  } else {
    u = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float f; std::memcpy(&f, &u, 4); return f;
}
inline uint16_t to_half(float f, bool bf16) { return bf16 ? to_bf16(f) : to_fp16(f); }
inline float from_half(uint16_t h, bool bf16) { return bf16 ? from_bf16(h) : from_fp16(h); }

// One generator and one distribution per case: std::normal_distribution keeps
// the second value of each pair it draws, so sharing the object (not just the
// engine) across fills is what makes a seed reproduce the same inputs.
struct NormalRng {
  std::mt19937 gen;
  std::normal_distribution<float> dist;
  explicit NormalRng(uint32_t seed) : gen(seed) {}
  float operator()() { return dist(gen); }
};

// N(0,1) samples rounded to bf16 or fp16.
inline void fill_normal(std::vector<uint16_t>& v, NormalRng& rng, bool bf16) {
  for (auto& x : v) x = to_half(rng(), bf16);
}

// Timing inputs: the device buffers dst (n 16-bit elements each) get N(0,1)
// samples from one random stream, buffer i read at offset 997 i. The offsets
// are not multiples of any head dim, so products of rows of different
// buffers pair distinct samples (as independent inputs would), at
// 1 / dst.size() of the host RNG time. Random rather than constant data
// matters: an H200's power, so its clock under the 700 W cap, depends on it.
inline void fill_device_normal(std::initializer_list<void*> dst, size_t n, NormalRng& rng, bool bf16) {
  const size_t shift = 997;
  std::vector<uint16_t> host(n + shift * (dst.size() - 1));
  fill_normal(host, rng, bf16);
  size_t i = 0;
  for (void* p : dst) {
    CHECK_CUDA(cudaMemcpy(p, host.data() + shift * i++, n * 2, cudaMemcpyHostToDevice));
  }
}

// Per-batch query / key lengths of a check case: the full lengths, or (lens)
// batch-dependent shorter ones, so padding rows and columns are exercised.
inline void case_lengths(int b, int t, int s, bool lens, std::vector<int32_t>& qlen,
                         std::vector<int32_t>& kvlen) {
  qlen.assign(b, t);
  kvlen.assign(b, s);
  if (!lens) return;
  for (int i = 0; i < b; ++i) { qlen[i] = (t * (i + 1)) / (b + 1); kvlen[i] = s - 7 * i; }
}

// Waits for the legacy default stream like cudaDeviceSynchronize, but gives up
// after limit_s: a hung kernel then ends the process with a clear line instead
// of a silent timeout (std::_Exit skips the CUDA teardown, which would wait).
// `tag` prefixes the lines ("[fp8_check]"). Returns the wait in ms.
inline double wait_or_die(const char* tag, const char* what, double limit_s) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(nullptr);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      std::printf("%s ERROR in %s: %s\n", tag, what, cudaGetErrorString(e));
      std::fflush(stdout);
      std::_Exit(2);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > limit_s) {
      std::printf("%s HANG in %s: not finished after %.0f s\n", tag, what, s);
      std::fflush(stdout);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// "64,128,256" -> {64, 128, 256} (argv is left untouched).
inline std::vector<int> parse_int_list(const char* s) {
  std::vector<int> out;
  std::string item;
  for (const char* c = s;; ++c) {
    if (*c == ',' || *c == '\0') {
      if (!item.empty()) out.push_back(std::atoi(item.c_str()));
      item.clear();
      if (*c == '\0') break;
    } else {
      item += *c;
    }
  }
  return out;
}

// The --time argument of every driver: "B,T,N,D,CAUSAL".
struct TimeSpec { int b = 0, t = 0, n = 0, d = 0, causal = 0; };
inline bool parse_time_spec(const char* s, TimeSpec& ts) {
  return std::sscanf(s, "%d,%d,%d,%d,%d", &ts.b, &ts.t, &ts.n, &ts.d, &ts.causal) == 5;
}

// Segment ids of a case: `docs` contiguous documents spread evenly over the
// queries and over the keys, or (scattered) ids drawn at random from
// [0, docs), and the spans the kernels read (cc/fwd/params.h), computed by
// brute force as jax_fa3/pair_rule.py defines them. docs = 0: none.
// as_mask: the kernels get the same rule as a boolean mask [b, 1, t, s]
// (equal ids) and its transpose, as bits (cc/fwd/params.h), instead of the ids.
struct Segments {
  std::vector<int32_t> q_ids, kv_ids, q_spans, kv_spans;
  std::vector<uint32_t> mask, mask_t;
  int b = 0, t = 0, s = 0;
  int32_t* dev[4] = {nullptr, nullptr, nullptr, nullptr};
  uint32_t* dev_mask[2] = {nullptr, nullptr};

  Segments(int b_, int t_, int s_, int docs, bool scattered, uint32_t seed, bool as_mask = false)
      : b(b_), t(t_), s(s_) {
    if (docs <= 0) return;
    std::mt19937 gen(seed);
    for (int x = 0; x < b; ++x) {
      for (int i = 0; i < t; ++i) q_ids.push_back(scattered ? int(gen() % docs) : int(int64_t(i) * docs / t));
      for (int j = 0; j < s; ++j) kv_ids.push_back(scattered ? int(gen() % docs) : int(int64_t(j) * docs / s));
    }
    q_spans = spans(q_ids, kv_ids, t, s);
    kv_spans = spans(kv_ids, q_ids, s, t);
    const std::vector<int32_t>* host[4] = {&q_ids, &kv_ids, &q_spans, &kv_spans};
    for (int a = 0; a < 4; ++a) {
      CHECK_CUDA(cudaMalloc((void**)&dev[a], host[a]->size() * 4));
      CHECK_CUDA(cudaMemcpy(dev[a], host[a]->data(), host[a]->size() * 4, cudaMemcpyHostToDevice));
    }
    if (!as_mask) return;
    const int ch = (s + 127) / 128 + 1, ch_t = (t + 127) / 128 + 1;  // mask_chunks
    mask.assign(size_t(b) * t * 4 * ch, 0);
    mask_t.assign(size_t(b) * s * 4 * ch_t, 0);
    // Column col of a row: word [row, (col % 8) / 2, col / 128], bit 2 ((col % 128) / 8) + col % 2.
    auto set_bit = [](std::vector<uint32_t>& m, size_t row, int chunks, int col) {
      m[(row * 4 + (col % 8) / 2) * chunks + col / 128] |= 1u << (2 * ((col % 128) / 8) + col % 2);
    };
    for (int x = 0; x < b; ++x)
      for (int i = 0; i < t; ++i)
        for (int j = 0; j < s; ++j)
          if (same(x, i, j)) {
            set_bit(mask, size_t(x) * t + i, ch, j);
            set_bit(mask_t, size_t(x) * s + j, ch_t, i);
          }
    const std::vector<uint32_t>* hm[2] = {&mask, &mask_t};
    for (int a = 0; a < 2; ++a) {
      CHECK_CUDA(cudaMalloc((void**)&dev_mask[a], hm[a]->size() * 4));
      CHECK_CUDA(cudaMemcpy(dev_mask[a], hm[a]->data(), hm[a]->size() * 4, cudaMemcpyHostToDevice));
    }
  }
  ~Segments() {
    for (int32_t* d : dev) cudaFree(d);
    for (uint32_t* d : dev_mask) cudaFree(d);
  }
  Segments(const Segments&) = delete;
  Segments& operator=(const Segments&) = delete;

  bool on() const { return !q_ids.empty(); }
  // Query i and key j of batch row x have equal ids (always, without ids).
  bool same(int x, int i, int j) const { return !on() || q_ids[size_t(x) * t + i] == kv_ids[size_t(x) * s + j]; }
  template <class PairRuleParams>
  void attach(PairRuleParams& sp) const {
    if (!on()) return;
    sp.q_spans = dev[2]; sp.kv_spans = dev[3]; sp.mask_b = b;
    if (dev_mask[0] != nullptr) {
      sp.mask = dev_mask[0]; sp.mask_t = dev_mask[1];
    } else {
      sp.q_ids = dev[0]; sp.kv_ids = dev[1];
    }
  }

  // Per granule of 16 positions of side a: {lo, hi, full_lo, full_hi} in side b.
  std::vector<int32_t> spans(const std::vector<int32_t>& a, const std::vector<int32_t>& other, int la, int lb) const {
    const int G = 16, big = 1 << 30, ng = (la + G - 1) / G;
    std::vector<int32_t> out;
    for (int x = 0; x < b; ++x)
      for (int g = 0; g < ng; ++g) {
        int lo = big, hi = -big, flo = -big, fhi = big;
        for (int i = g * G; i < std::min(la, (g + 1) * G); ++i) {
          int first = -1, last = -1, count = 0;
          for (int j = 0; j < lb; ++j)
            if (other[size_t(x) * lb + j] == a[size_t(x) * la + i]) { if (first < 0) first = j; last = j; ++count; }
          if (count) { lo = std::min(lo, first); hi = std::max(hi, last + 1); }
          const bool run = count > 0 && last - first + 1 == count;
          flo = std::max(flo, run ? first : big);
          fhi = std::min(fhi, run ? last + 1 : -big);
        }
        out.insert(out.end(), {lo, hi, flo, fhi});
      }
    return out;
  }
};

// An additive bias of a case (kind 1: [1, n, t, s], 2: [b, 1, t, s], 0: none)
// in the kernels' dtype, rows padded to even (the forward reads column
// pairs); nan_pad poisons the pad column. with_grad: a [b, n, t, row]
// gradient buffer, fp32 for kind 1 (the caller sums it), else 16-bit.
struct Bias {
  int kind = 0, b = 0, n = 0, t = 0;
  int64_t row = 0;
  std::vector<uint16_t> host;
  void *dev = nullptr, *grad = nullptr;
  Bias(int kind_, int b_, int n_, int t_, int s, NormalRng& rng, bool bf16, bool nan_pad, bool with_grad)
      : kind(kind_), b(b_), n(n_), t(t_), row(s + (s & 1)) {
    if (!kind) return;
    host.resize(size_t(kind == 2 ? b : 1) * (kind == 1 ? n : 1) * t * row);
    fill_normal(host, rng, bf16);
    for (size_t r = 0; nan_pad && row != s && r < host.size() / row; ++r) host[r * row + s] = 0xFFFF;
    CHECK_CUDA(cudaMalloc(&dev, host.size() * 2));
    CHECK_CUDA(cudaMemcpy(dev, host.data(), host.size() * 2, cudaMemcpyHostToDevice));
    if (with_grad) CHECK_CUDA(cudaMalloc(&grad, grad_elems() * grad_bytes()));
  }
  ~Bias() { cudaFree(dev); cudaFree(grad); }
  Bias(const Bias&) = delete;
  Bias& operator=(const Bias&) = delete;
  size_t grad_elems() const { return size_t(b) * n * t * row; }
  int grad_bytes() const { return kind == 1 ? 4 : 2; }
  size_t at(int bb, int h, int i, int j) const {
    return ((size_t(kind == 2 ? bb : 0) * (kind == 1 ? n : 1) + (kind == 1 ? h : 0)) * t + i) * row + j;
  }
  template <class P> void attach(P& p) const {
    if (!kind) return;
    p.bias.ptr = dev;
    p.bias.row_stride = row;
    p.bias.stride_n = kind == 1 ? int64_t(t) * row : 0;
    p.bias.stride_b = kind == 2 ? int64_t(t) * row : 0;
  }
};

}  // namespace check_util

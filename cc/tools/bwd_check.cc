// Standalone backward check: runs the compiled forward (for out and lse) and
// then the backward on small random problems WITHOUT XLA, and compares dQ,
// dK, dV against a float64 host reference. It exists for compute-sanitizer
// (memcheck/racecheck/synccheck take seconds here, not an XLA compile per
// shape) and as a smoke test that needs only the CUDA driver.
//   jax_fa3_bwd_check [--dtype bf16|fp16] [--hdims 64,128,256] [--dv Hv] [--case NAME] [--watchdog SEC]
//                     [--pieces N] [--sms N]
// prints "PASS|FAIL <case> max_err=... tol=..." per case; exit status 0 iff all pass.
// --pieces: split every key block of a splitting launch into N shares.
// --sms: plan the dispatch for an N-SM GPU, so that the small cases span
// several waves (and split the key blocks at the end of the grid).
// --dv: V's (and O's, dO's, dV's) head dim for every --hdims entry, e.g. 128
// with --hdims 192 for the latent-attention tiles; default: the same as d.
//   jax_fa3_bwd_check --time B,T,N,D,CAUSAL [--dv Hv] [--iters 20] [--deterministic 1] [--softcap 30]
//                     [--kv-heads KH] [--chunks 0,1,4] [--pieces 0,1,4] [--repeats R]
// times the backward launches alone (one forward call supplies out and lse)
// with CUDA events (no check): a target for `ncu -k regex:bwd_kernel`.
// --kv-heads: K/V heads (GQA; default N). --chunks / --pieces: dispatch
// overrides to time (BwdParams::tile_chunk / tile_pieces, 0: the launcher's
// choice), every pair, interleaved over --repeats rounds on the same inputs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "../bwd/params.h"
#include "check_util.h"

extern "C" int jax_fa3_fwd_launch(const jax_fa3::FwdParams* p, int dtype, const char* variant,
                                  cudaStream_t stream);
extern "C" int jax_fa3_bwd_launch(const jax_fa3::BwdParams* p, int dtype, cudaStream_t stream);

namespace {

using check_util::case_lengths;
using check_util::fill_normal;
using check_util::from_half;
using check_util::NormalRng;

constexpr const char* kTag = "[bwd_check]";
double g_watchdog_s = 60;  // a deterministic-mode semaphore bug hangs rather than fails
int g_tile_pieces = 0;     // --pieces N on the checks: every split key block in N shares
int g_sms = 0;             // --sms N on the checks: BwdParams::num_sms (0: the GPU's)

struct Case {
  const char* name;
  int b, t, s, n, kh;
  bool causal;
  int left = -1, right = -1;  // window (right is 0 when causal)
  float softcap = 0.f;
  bool lens = false;           // q_lens / kv_lens shorter than t / s
  bool deterministic = false;  // also: two runs must be bit-identical
  int docs = 0;                // segment ids: documents per row (0: none)
  bool scattered = false;      // ids at random instead of contiguous documents
  bool as_mask = false;        // the same rule given as a boolean mask
  // An additive bias with its gradient: 1 = [1, n, t, s] (gradient in fp32,
  // as the caller sums it), 2 = [b, 1, t, s] (gradient in the inputs' dtype).
  int bias = 0;
};

// Device memory of one problem: inputs, forward outputs, gradients, scratch.
// d: Q's and K's head dim; d_v: V's, O's, dO's and dV's (as in BwdParams).
struct Buffers {
  int b, t, s, n, kh, d, d_v, t_pad;
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *dout = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float *lse = nullptr, *dq_accum = nullptr, *delta = nullptr, *lse_log2 = nullptr, *split = nullptr;
  int32_t *sem = nullptr, *ql = nullptr, *kl = nullptr;
  size_t nq() const { return size_t(b) * t * n * d; }
  size_t nk() const { return size_t(b) * s * kh * d; }
  size_t nv() const { return size_t(b) * s * kh * d_v; }
  size_t no() const { return size_t(b) * t * n * d_v; }
  size_t rows() const { return size_t(b) * n * t_pad; }
  size_t sems() const { return rows() / jax_fa3::kBwdBlockM; }
  size_t splits() const { return size_t(jax_fa3::bwd_split_scratch_floats(b, s, kh, d)); }
};

Buffers alloc(int b, int t, int s, int n, int kh, int d, int dv) {
  Buffers m{b, t, s, n, kh, d, dv, (t + jax_fa3::kBwdRowPad - 1) / jax_fa3::kBwdRowPad * jax_fa3::kBwdRowPad};
  for (void** p : {&m.q, &m.dq}) CHECK_CUDA(cudaMalloc(p, m.nq() * 2));
  for (void** p : {&m.k, &m.dk}) CHECK_CUDA(cudaMalloc(p, m.nk() * 2));
  for (void** p : {&m.v, &m.dv}) CHECK_CUDA(cudaMalloc(p, m.nv() * 2));
  for (void** p : {&m.o, &m.dout}) CHECK_CUDA(cudaMalloc(p, m.no() * 2));
  CHECK_CUDA(cudaMalloc((void**)&m.lse, size_t(b) * n * t * 4));
  CHECK_CUDA(cudaMalloc((void**)&m.dq_accum, m.rows() * d * 4));
  CHECK_CUDA(cudaMalloc((void**)&m.delta, m.rows() * 4));
  CHECK_CUDA(cudaMalloc((void**)&m.lse_log2, m.rows() * 4));
  CHECK_CUDA(cudaMalloc((void**)&m.sem, m.sems() * 4));
  CHECK_CUDA(cudaMalloc((void**)&m.split, m.splits() * 4));
  CHECK_CUDA(cudaMalloc((void**)&m.ql, b * 4));
  CHECK_CUDA(cudaMalloc((void**)&m.kl, b * 4));
  return m;
}

void release(Buffers& m) {
  for (void* p : {m.q, m.k, m.v, m.o, m.dout, m.dq, m.dk, m.dv, (void*)m.lse, (void*)m.dq_accum,
                  (void*)m.delta, (void*)m.lse_log2, (void*)m.sem, (void*)m.split, (void*)m.ql, (void*)m.kl}) {
    cudaFree(p);
  }
}

// 0xFF bytes: NaN in bf16, fp16 and fp32, -1 as a semaphore. Every gradient
// element must be written, and the scratch must not need the caller's
// initialization (XLA hands it over uninitialized).
void poison_outputs(const Buffers& m) {
  CHECK_CUDA(cudaMemset(m.dq, 0xFF, m.nq() * 2));
  CHECK_CUDA(cudaMemset(m.dk, 0xFF, m.nk() * 2));
  CHECK_CUDA(cudaMemset(m.dv, 0xFF, m.nv() * 2));
  CHECK_CUDA(cudaMemset(m.dq_accum, 0xFF, m.rows() * m.d * 4));
  CHECK_CUDA(cudaMemset(m.delta, 0xFF, m.rows() * 4));
  CHECK_CUDA(cudaMemset(m.lse_log2, 0xFF, m.rows() * 4));
  CHECK_CUDA(cudaMemset(m.sem, 0xFF, m.sems() * 4));
  CHECK_CUDA(cudaMemset(m.split, 0xFF, m.splits() * 4));
}

jax_fa3::FwdParams fwd_params(const Buffers& m, float softcap, int left, int right,
                              const check_util::Segments& seg) {
  jax_fa3::FwdParams p;
  seg.attach(p.pair);
  p.q = m.q; p.k = m.k; p.v = m.v; p.o = m.o; p.lse = m.lse; p.q_lens = m.ql; p.kv_lens = m.kl;
  p.b = m.b; p.t = m.t; p.s = m.s; p.n = m.n; p.kh = m.kh; p.d = m.d; p.dv = m.d_v;
  p.scale = 1.f / std::sqrt(float(m.d)); p.softcap = softcap;
  p.window_left = left; p.window_right = right;
  return p;
}

jax_fa3::BwdParams bwd_params(const Buffers& m, float softcap, int left, int right, bool deterministic,
                              const check_util::Segments& seg) {
  jax_fa3::BwdParams p;
  seg.attach(p.pair);
  p.q = m.q; p.k = m.k; p.v = m.v; p.o = m.o; p.dout = m.dout; p.lse = m.lse;
  p.q_lens = m.ql; p.kv_lens = m.kl;
  p.dq = m.dq; p.dk = m.dk; p.dv = m.dv;
  p.dq_accum = m.dq_accum; p.delta = m.delta; p.lse_log2 = m.lse_log2; p.semaphore = m.sem;
  p.dkv_split = m.split; p.dkv_split_floats = int64_t(m.splits());
  p.b = m.b; p.t = m.t; p.s = m.s; p.n = m.n; p.kh = m.kh; p.d = m.d; p.d_v = m.d_v; p.t_pad = m.t_pad;
  p.scale = 1.f / std::sqrt(float(m.d)); p.softcap = softcap;
  p.window_left = left; p.window_right = right;
  p.deterministic = deterministic;
  p.tile_pieces = g_tile_pieces;
  p.num_sms = g_sms;
  return p;
}

struct Grads { std::vector<double> dq, dk, dv, dbias; };

// float64 gradients of sum(dO * attention(q, k, v)) from the same (rounded)
// inputs the kernel sees; q, k, dQ, dK have head dim d, v, dO, dV have dv.
// Per query row i and visible key j:
//   x = scale q.k, s = cap tanh(x / cap) (or x), P = softmax_j(s),
//   O = P V, dV += P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO * O)),
//   dX = dS (1 - tanh^2(x / cap)) (or dS), dQ = scale dX K, dK += scale dX^T Q.
// K/V heads sum over their query-head group (GQA). A row that sees no key
// contributes nothing and keeps dQ = 0 (the kernel's lse = +inf convention).
Grads reference(const Case& c, int d, int dv, int right, const std::vector<double>& q, const std::vector<double>& k,
                const std::vector<double>& v, const std::vector<double>& dout,
                const std::vector<int32_t>& qlen, const std::vector<int32_t>& kvlen,
                const check_util::Segments& seg, const check_util::Bias& bias, bool bf16) {
  const size_t nq = size_t(c.b) * c.t * c.n * d, nk = size_t(c.b) * c.s * c.kh * d;
  const size_t nv = size_t(c.b) * c.s * c.kh * dv;
  Grads g{std::vector<double>(nq), std::vector<double>(nk), std::vector<double>(nv),
          std::vector<double>(bias.kind ? bias.grad_elems() : 0)};
  const double scale = 1.0 / std::sqrt(double(d)), cap = c.softcap;
  const int group = c.n / c.kh;
  std::vector<double> x(c.s), p(c.s), o(dv);
  for (int b = 0; b < c.b; ++b)
    for (int h = 0; h < c.n; ++h)
      for (int i = 0; i < std::min(c.t, int(qlen[b])); ++i) {
        // Visible keys are one contiguous range [lo, hi).
        const int lo = c.left >= 0 ? std::max(0, i - c.left) : 0;
        const int hi = std::min(std::min(c.s, int(kvlen[b])), right >= 0 ? i + right + 1 : c.s);
        if (hi <= lo) continue;
        const size_t qo = ((size_t(b) * c.t + i) * c.n + h) * d;  // q, dQ
        const size_t oo = ((size_t(b) * c.t + i) * c.n + h) * dv;  // O, dO
        auto kv_off = [&](int j, int w) { return ((size_t(b) * c.s + j) * c.kh + h / group) * w; };
        double mx = -INFINITY;
        for (int j = lo; j < hi; ++j) {
          double acc = 0;
          for (int e = 0; e < d; ++e) acc += q[qo + e] * k[kv_off(j, d) + e];
          x[j] = acc * scale;
          p[j] = cap > 0 ? cap * std::tanh(x[j] / cap) : x[j];  // the score s
          if (bias.kind) p[j] += from_half(bias.host[bias.at(b, h, i, j)], bf16);
          if (!seg.same(b, i, j)) p[j] = -INFINITY;  // another segment: P = 0
          mx = std::max(mx, p[j]);
        }
        if (std::isinf(mx)) continue;  // no visible key
        double sum = 0;
        for (int j = lo; j < hi; ++j) { p[j] = std::exp(p[j] - mx); sum += p[j]; }
        std::fill(o.begin(), o.end(), 0.0);
        for (int j = lo; j < hi; ++j) {
          p[j] /= sum;
          for (int e = 0; e < dv; ++e) o[e] += p[j] * v[kv_off(j, dv) + e];
        }
        double delta = 0;
        for (int e = 0; e < dv; ++e) delta += dout[oo + e] * o[e];
        for (int j = lo; j < hi; ++j) {
          const size_t ko = kv_off(j, d), vo = kv_off(j, dv);
          double dp = 0;
          for (int e = 0; e < dv; ++e) dp += dout[oo + e] * v[vo + e];
          double dx = p[j] * (dp - delta);
          if (bias.kind) g.dbias[((size_t(b) * c.n + h) * c.t + i) * bias.row + j] = dx;  // dS
          if (cap > 0) { const double th = std::tanh(x[j] / cap); dx *= 1 - th * th; }
          for (int e = 0; e < d; ++e) {
            g.dq[qo + e] += scale * dx * k[ko + e];
            g.dk[ko + e] += scale * dx * q[qo + e];
          }
          for (int e = 0; e < dv; ++e) g.dv[vo + e] += p[j] * dout[oo + e];
        }
      }
  return g;
}

// Worst |got - ref| and max |ref| of one gradient; nonfinite: a NaN/Inf (or a poisoned element).
struct Err { double max_err = 0, max_ref = 0; bool nonfinite = false; };

Err compare(const std::vector<uint16_t>& got, const std::vector<double>& ref, bool bf16) {
  Err e;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double x = from_half(got[i], bf16);
    if (!std::isfinite(x)) { e.nonfinite = true; continue; }
    e.max_err = std::max(e.max_err, std::fabs(x - ref[i]));
    e.max_ref = std::max(e.max_ref, std::fabs(ref[i]));
  }
  return e;
}

enum class Outcome { kPass, kFail, kNotCompiled };

// "d128", or "d192 dv128" when V's head dim differs.
std::string dims_name(int d, int dv) {
  return "d" + std::to_string(d) + (dv != d ? " dv" + std::to_string(dv) : "");
}

Outcome run_case(const Case& c, int d, int dv, bool bf16, uint32_t seed) {
  const int dt = bf16 ? 0 : 1;
  const int right = c.causal ? 0 : c.right;
  Buffers m = alloc(c.b, c.t, c.s, c.n, c.kh, d, dv);
  NormalRng rng(seed);
  std::vector<uint16_t> hq(m.nq()), hk(m.nk()), hv(m.nv()), hdo(m.no());
  fill_normal(hq, rng, bf16);
  fill_normal(hk, rng, bf16);
  fill_normal(hv, rng, bf16);
  fill_normal(hdo, rng, bf16);
  std::vector<int32_t> qlen, kvlen;
  case_lengths(c.b, c.t, c.s, c.lens, qlen, kvlen);
  CHECK_CUDA(cudaMemcpy(m.q, hq.data(), m.nq() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(m.k, hk.data(), m.nk() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(m.v, hv.data(), m.nv() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(m.dout, hdo.data(), m.no() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(m.ql, qlen.data(), c.b * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(m.kl, kvlen.data(), c.b * 4, cudaMemcpyHostToDevice));

  const std::string dims = dims_name(d, dv);
  char what[200];
  std::snprintf(what, sizeof what, "%s %s %s", bf16 ? "bf16" : "fp16", dims.c_str(), c.name);
  const check_util::Segments seg(c.b, c.t, c.s, c.docs, c.scattered, seed + 1, c.as_mask);
  const check_util::Bias bias(c.bias, c.b, c.n, c.t, c.s, rng, bf16, /*nan_pad=*/false, /*with_grad=*/true);
  jax_fa3::FwdParams fp = fwd_params(m, c.softcap, c.left, right, seg);
  bias.attach(fp);
  // A value head dim unlike d has its own forward tiles: the handler's pick.
  int err = jax_fa3_fwd_launch(&fp, dt, dv != d ? "auto" : "default", nullptr);
  if (err == -1) { release(m); return Outcome::kNotCompiled; }
  CHECK_CUDA(cudaError_t(err));
  check_util::wait_or_die(kTag, (std::string("forward ") + what).c_str(), g_watchdog_s);

  jax_fa3::BwdParams bp = bwd_params(m, c.softcap, c.left, right, c.deterministic, seg);
  bias.attach(bp);
  bp.bias.grad = bias.grad;
  bp.bias.grad_f32 = bias.kind == 1;
  std::vector<uint16_t> got[2][3];  // [run][dq, dk, dv]
  std::vector<uint8_t> got_dbias(bias.kind ? bias.grad_elems() * bias.grad_bytes() : 0);
  const int runs = c.deterministic ? 2 : 1;
  for (int r = 0; r < runs; ++r) {
    poison_outputs(m);
    if (bias.kind) CHECK_CUDA(cudaMemset(bias.grad, 0xFF, got_dbias.size()));
    err = jax_fa3_bwd_launch(&bp, dt, nullptr);
    if (err == -1) { release(m); return Outcome::kNotCompiled; }
    CHECK_CUDA(cudaError_t(err));
    check_util::wait_or_die(kTag, (std::string("backward ") + what).c_str(), g_watchdog_s);
    got[r][0].resize(m.nq()); got[r][1].resize(m.nk()); got[r][2].resize(m.nv());
    CHECK_CUDA(cudaMemcpy(got[r][0].data(), m.dq, m.nq() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(got[r][1].data(), m.dk, m.nk() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(got[r][2].data(), m.dv, m.nv() * 2, cudaMemcpyDeviceToHost));
    if (bias.kind) CHECK_CUDA(cudaMemcpy(got_dbias.data(), bias.grad, got_dbias.size(), cudaMemcpyDeviceToHost));
  }
  release(m);
  const bool repro = runs == 1 || (got[0][0] == got[1][0] && got[0][1] == got[1][1] && got[0][2] == got[1][2]);

  auto decode = [&](const std::vector<uint16_t>& h) {
    std::vector<double> out(h.size());
    for (size_t i = 0; i < h.size(); ++i) out[i] = from_half(h[i], bf16);
    return out;
  };
  const Grads ref = reference(c, d, dv, right, decode(hq), decode(hk), decode(hv), decode(hdo), qlen, kvlen, seg, bias, bf16);
  const std::vector<double>* refs[3] = {&ref.dq, &ref.dk, &ref.dv};
  // Tolerance per gradient: max|d - ref| <= rtol * max|ref| + atol. The kernel
  // rounds P and dS to the input dtype before the dV/dK/dQ GEMMs, reads O
  // rounded (delta) and rounds its outputs: relative errors of 2^-9 (bf16) or
  // 2^-11 (fp16) per term, summed in fp32 with random signs, so the error
  // scales with the gradient's size and stays within a few such units of
  // max|ref|. rtol = 2e-2 / 1e-2 (~10 / ~20 units) avoids false alarms; a wrong
  // mask, block, head or scale is an O(1) relative error. atol: gradients ~ 0.
  const double rtol = bf16 ? 2e-2 : 1e-2, atol = 1e-3;
  bool ok = repro;
  bool nonfinite = false;
  double errs[3], tols[3];
  for (int x = 0; x < 3; ++x) {
    const Err e = compare(got[0][x], *refs[x], bf16);
    errs[x] = e.max_err;
    tols[x] = rtol * e.max_ref + atol;
    nonfinite |= e.nonfinite;
    ok &= !e.nonfinite && e.max_err <= tols[x];
  }
  char dbias_note[80] = "";
  if (bias.kind) {  // dS over the visible pairs; padding columns and rows past q_len hold 0
    Err e;
    for (size_t x = 0; x < ref.dbias.size(); ++x) {
      double g;
      if (bias.kind == 1) { float f; std::memcpy(&f, &got_dbias[x * 4], 4); g = f; }
      else { uint16_t h; std::memcpy(&h, &got_dbias[x * 2], 2); g = from_half(h, bf16); }
      if (!std::isfinite(g)) { e.nonfinite = true; continue; }
      e.max_err = std::max(e.max_err, std::fabs(g - ref.dbias[x]));
      e.max_ref = std::max(e.max_ref, std::fabs(ref.dbias[x]));
    }
    const double tol = rtol * e.max_ref + atol;
    nonfinite |= e.nonfinite;
    ok &= !e.nonfinite && e.max_err <= tol;
    std::snprintf(dbias_note, sizeof dbias_note, " dbias=%.2e tol=%.2e", e.max_err, tol);
  }
  std::printf("%s %s %s %-20s max_err=%.2e/%.2e/%.2e tol=%.2e/%.2e/%.2e (dq/dk/dv)%s%s%s\n", ok ? "PASS" : "FAIL",
              bf16 ? "bf16" : "fp16", dims.c_str(), c.name, errs[0], errs[1], errs[2], tols[0], tols[1], tols[2],
              dbias_note, nonfinite ? " nonfinite" : "", repro ? "" : " not-bit-reproducible");
  std::fflush(stdout);
  return ok ? Outcome::kPass : Outcome::kFail;
}

// Backward launches alone on one shape (s = t; kh = n unless --kv-heads); one forward call makes out and lse.
int time_shape(const check_util::TimeSpec& ts, int dv, bool bf16, bool deterministic, float softcap, int iters,
               int kv_heads, const std::vector<int>& chunks, const std::vector<int>& pieces, int repeats) {
  const int b = ts.b, t = ts.t, n = ts.n, d = ts.d, right = ts.causal ? 0 : -1;
  const int kh = kv_heads > 0 ? kv_heads : n;
  if (n % kh != 0) {
    std::fprintf(stderr, "--kv-heads must divide N\n");
    return 2;
  }
  Buffers m = alloc(b, t, t, n, kh, d, dv);
  NormalRng rng(7);
  // Q and dO span the query heads, K and V the K/V heads (fewer with GQA).
  if (dv == d) {
    check_util::fill_device_normal({m.q, m.dout}, m.nq(), rng, bf16);
    check_util::fill_device_normal({m.k, m.v}, m.nk(), rng, bf16);
  } else {
    for (auto [ptr, count] : {std::pair{m.q, m.nq()}, {m.dout, m.no()}, {m.k, m.nk()}, {m.v, m.nv()}}) {
      check_util::fill_device_normal({ptr}, count, rng, bf16);
    }
  }
  std::vector<int32_t> lens(b, t);
  CHECK_CUDA(cudaMemcpy(m.ql, lens.data(), b * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(m.kl, lens.data(), b * 4, cudaMemcpyHostToDevice));
  const int dt = bf16 ? 0 : 1;
  const check_util::Segments no_seg(b, t, t, 0, false, 0);
  const jax_fa3::FwdParams fp = fwd_params(m, softcap, -1, right, no_seg);
  jax_fa3::BwdParams bp = bwd_params(m, softcap, -1, right, deterministic, no_seg);
  int err = jax_fa3_fwd_launch(&fp, dt, dv != d ? "auto" : "default", nullptr);
  if (err == 0) {
    check_util::wait_or_die(kTag, "forward (timing)", g_watchdog_s);
    for (int w = 0; w < 3 && err == 0; ++w) {
      err = jax_fa3_bwd_launch(&bp, dt, nullptr);
      if (err == 0) check_util::wait_or_die(kTag, "backward warm-up (timing)", g_watchdog_s);
    }
  }
  if (err != 0) {
    std::fprintf(stderr, "%s\n", err == -1 ? "not compiled" : cudaGetErrorString(cudaError_t(err)));
    release(m);
    return 2;
  }
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0)); CHECK_CUDA(cudaEventCreate(&e1));
  // 5 GEMMs: S, dK, dQ contract or span d, dP and dV span dv (2.5x the
  // forward's S, O when dv == d).
  const double flops = 2.0 * b * n * double(t) * t * (3.0 * d + 2.0 * dv) / (ts.causal ? 2 : 1);
  // Each round starts one setting later, so none always runs first (coolest)
  // or last in a round.
  std::vector<std::pair<int, int>> settings;
  for (int chunk : chunks) for (int piece : pieces) settings.emplace_back(chunk, piece);
  for (int rep = 0; rep < repeats; ++rep) {
    for (size_t k = 0; k < settings.size(); ++k) {
      const auto [chunk, piece] = settings[(k + rep) % settings.size()];
      bp.tile_chunk = chunk;
      bp.tile_pieces = piece;
      CHECK_CUDA(cudaEventRecord(e0));
      for (int it = 0; it < iters; ++it) CHECK_CUDA(cudaError_t(jax_fa3_bwd_launch(&bp, dt, nullptr)));
      CHECK_CUDA(cudaEventRecord(e1));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      ms /= iters;
      std::printf("bwd %s b%d t%d n%d kh%d %s causal=%d det=%d softcap=%g chunk=%d pieces=%d rep=%d: %.4f ms  %.1f TFLOP/s\n",
                  bf16 ? "bf16" : "fp16", b, t, n, kh, dims_name(d, dv).c_str(), ts.causal,
                  int(deterministic), softcap, chunk, piece, rep, ms, flops / ms * 1e-9);
    }
  }
  cudaEventDestroy(e0); cudaEventDestroy(e1);
  release(m);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dtype = "bf16", time_spec, only;
  int iters = 20, dv_arg = 0, kv_heads = 0, repeats = 1;
  std::vector<int> chunks = {0}, pieces = {0};
  bool deterministic = false;
  float softcap = 0.f;
  std::vector<int> hdims = {64, 128, 256};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--dtype") dtype = argv[i + 1];
    else if (a == "--hdims") hdims = check_util::parse_int_list(argv[i + 1]);
    else if (a == "--case") only = argv[i + 1];
    else if (a == "--watchdog") g_watchdog_s = std::atof(argv[i + 1]);
    else if (a == "--time") time_spec = argv[i + 1];
    else if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else if (a == "--deterministic") deterministic = std::atoi(argv[i + 1]) != 0;
    else if (a == "--softcap") softcap = float(std::atof(argv[i + 1]));
    else if (a == "--dv") dv_arg = std::atoi(argv[i + 1]);
    else if (a == "--kv-heads") kv_heads = std::atoi(argv[i + 1]);
    else if (a == "--chunks") chunks = check_util::parse_int_list(argv[i + 1]);
    else if (a == "--pieces") pieces = check_util::parse_int_list(argv[i + 1]);
    else if (a == "--sms") g_sms = std::atoi(argv[i + 1]);
    else if (a == "--repeats") repeats = std::atoi(argv[i + 1]);
    else { std::fprintf(stderr, "unknown flag %s\n", a.c_str()); return 2; }
  }
  if (argc % 2 == 0) { std::fprintf(stderr, "flags come in pairs: --flag value\n"); return 2; }
  if (dtype != "bf16" && dtype != "fp16") { std::fprintf(stderr, "--dtype bf16|fp16\n"); return 2; }
  const bool bf16 = dtype == "bf16";
  if (!time_spec.empty()) {
    check_util::TimeSpec ts;
    if (!check_util::parse_time_spec(time_spec.c_str(), ts)) {
      std::fprintf(stderr, "--time wants B,T,N,D,CAUSAL\n");
      return 2;
    }
    return time_shape(ts, dv_arg > 0 ? dv_arg : ts.d, bf16, deterministic, softcap, std::max(iters, 1), kv_heads, chunks,
                      pieces, std::max(repeats, 1));
  }
  g_tile_pieces = pieces.front();
  // Odd lengths, T != S, GQA, causal, windows (one with rows that see no key),
  // softcap, seq lengths, deterministic dQ, split key blocks; several key and
  // query blocks each.
  const std::vector<Case> cases = {
      {"odd", 1, 77, 77, 2, 2, false},
      {"odd_causal", 1, 77, 77, 2, 2, true},
      {"t130_s200", 1, 130, 200, 2, 2, false},
      {"t130_s200_causal", 1, 130, 200, 2, 2, true},
      {"gqa", 2, 150, 150, 6, 2, false},
      {"gqa_causal", 1, 200, 260, 6, 2, true},
      {"window", 2, 300, 300, 2, 1, false, 40, 17},
      {"window_causal", 1, 300, 300, 2, 2, true, 50},
      {"no_key_rows", 1, 200, 96, 2, 1, false, 5, 0},  // rows i > 100 see no key: dq = 0
      // cap 3: scores ~N(0, 1) reach the curved part of tanh, so the chain rule matters.
      {"softcap", 1, 160, 190, 2, 2, false, -1, -1, 3.f},
      {"softcap_causal_gqa", 1, 130, 200, 6, 2, true, -1, -1, 3.f},
      {"lens_causal", 3, 190, 230, 2, 2, true, -1, -1, 0.f, true},
      {"lens_gqa", 3, 190, 230, 6, 2, false, -1, -1, 0.f, true},
      {"det", 2, 257, 300, 4, 2, false, -1, -1, 0.f, false, true},
      {"det_causal_gqa", 1, 300, 300, 6, 2, true, -1, -1, 0.f, false, true},
      {"det_window_lens", 2, 260, 280, 4, 2, false, 70, 30, 0.f, true, true},
      // Causal deterministic dQ runs its turns from the diagonal down (dq_turn).
      {"det_causal_lens", 3, 190, 330, 2, 2, true, -1, -1, 0.f, true, true},
      // Fewer key blocks than SMs: split into 4 and 2-3 shares (tile_scheduler.h).
      {"split", 1, 1000, 1000, 2, 2, false},
      {"split_window_lens_gqa", 2, 600, 700, 4, 2, false, 200, 90, 0.f, true},
      // Segment ids: packed documents (query blocks skipped per key block),
      // T != S with lengths, scattered ids (id-by-id masks), deterministic
      // (no skipping: every key block takes its dQ turn), split key blocks.
      {"seg_causal", 1, 700, 700, 2, 2, true, -1, -1, 0.f, false, false, 9},
      {"seg_cross_lens_gqa", 2, 333, 517, 6, 2, false, -1, -1, 0.f, true, false, 5},
      {"seg_scattered", 2, 300, 300, 2, 2, true, -1, -1, 0.f, false, false, 3, true},
      {"seg_det_causal", 2, 520, 520, 4, 2, true, -1, -1, 0.f, false, true, 6},
      {"seg_det_window", 1, 400, 400, 2, 1, false, 60, 20, 0.f, false, true, 4},
      {"seg_split", 1, 1000, 1000, 2, 2, false, -1, -1, 0.f, false, false, 7},
      {"mask_cross_lens_gqa", 2, 333, 517, 6, 2, false, -1, -1, 0.f, true, false, 5, false, true},
      {"mask_scattered_causal", 2, 300, 300, 2, 2, true, -1, -1, 0.f, false, false, 3, true, true},
      {"mask_det_causal", 2, 520, 520, 4, 2, true, -1, -1, 0.f, false, true, 6, false, true},
      // A bias and its gradient: per head (fp32 gradient) and per batch row,
      // with lengths, odd S, GQA, softcap, documents, a mask, deterministic dQ.
      {"bias_causal_lens_gqa", 2, 190, 231, 6, 2, true, -1, -1, 0.f, true, false, 0, false, false, 1},
      {"bias_window", 2, 300, 301, 2, 1, false, 40, 17, 0.f, false, false, 0, false, false, 2},
      {"bias_softcap", 1, 160, 190, 2, 2, false, -1, -1, 3.f, false, false, 0, false, false, 1},
      {"bias_seg_causal", 1, 700, 700, 2, 2, true, -1, -1, 0.f, false, false, 9, false, false, 2},
      {"bias_mask_det", 2, 300, 300, 2, 2, true, -1, -1, 0.f, false, true, 3, true, true, 1},
  };
  int passed = 0, failed = 0;
  for (int d : hdims) {
    const int dv = dv_arg > 0 ? dv_arg : d;
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      if (!only.empty() && only != cases[ci].name) continue;
      const Outcome r = run_case(cases[ci], d, dv, bf16, uint32_t(1000 * d + 100 * !bf16 + ci));
      if (r == Outcome::kNotCompiled) {
        std::printf("%s %s: not compiled, skipped\n", dtype.c_str(), dims_name(d, dv).c_str());
        break;
      }
      (r == Outcome::kPass ? passed : failed) += 1;
    }
  }
  if (failed) std::printf("FAILED: %d of %d cases\n", failed, passed + failed);
  else std::printf("PASSED: %d cases\n", passed);
  return failed ? 1 : 0;
}

// Standalone forward check: runs the compiled forward kernels on small random
// problems WITHOUT XLA and compares against a float64 host reference. It exists
// for compute-sanitizer (memcheck/racecheck/synccheck), where an XLA process
// spends minutes compiling, and as a smoke test that needs only the CUDA driver.
//   jax_fa3_fwd_check [--dtype bf16|fp16] [--hdims 64,128,256] [--variant default|m192|auto]
//   [--only all|kv] [--dv Hv]
// (m192: d64's 192-row tile; auto: the handler's choice per problem; kv: the
// KV-cache cases alone, for the sanitizers; --dv: V's head dim, e.g. 128 with
// --hdims 192 for the latent-attention tiles).
// Exit status 0 iff every case matches, is NaN-free and bit-reproducible.
//   jax_fa3_fwd_check --time B,T,N,D,CAUSAL [--window-left L] [--iters 20]
// times one shape with CUDA events (no check): a target for `ncu`.
//   jax_fa3_fwd_check --time-decode B,L,K,D,G [--splits S] [--variant V]
// times one decode step (a group of G query heads packed as rows of each of K
// kv heads, against a contiguous cache of L keys), reporting K/V GB/s.
// --sms N (with --time / --time-decode) sizes the persistent grid as if the GPU
// had N SMs.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "../fwd/kv_append.h"
#include "../fwd/params.h"
#include "check_util.h"

extern "C" int jax_fa3_fwd_launch(const jax_fa3::FwdParams* p, int dtype, const char* variant,
                                  cudaStream_t stream);
extern "C" int jax_fa3_kv_append_launch(const jax_fa3::KvAppendParams* p, cudaStream_t stream);

namespace {

using check_util::case_lengths;
using check_util::fill_normal;
using check_util::NormalRng;

struct Case {
  int b, t, s, n, kh;
  bool causal;
  int left = -1, right = -1;
  float softcap = 0.f;
  bool lens = false;  // use q_lens / kv_lens shorter than t / s
  int docs = 0;            // segment ids: documents per row (0: none)
  bool scattered = false;  // ids at random instead of contiguous documents
  bool as_mask = false;    // the same rule given as a boolean mask
  bool sinks = false;      // a per-head sink logit joins every row's softmax
  // KV-cache calls (kv_pack > 0, a power of two): rows at positions
  // kv_len - t / kv_pack + i / kv_pack (bottom-right, kv_pack rows per position), split-KV into kv_splits parts merged
  // here, a paged cache of kv_page-key pages (0: contiguous) behind a shuffled table
  // whose unused pages hold NaN.
  int kv_pack = 0, kv_splits = 1, kv_page = 0;
  bool heads_major = false;  // Q and O stored [b, n, t, d] (FwdParams::heads_major)
  // The t / kv_pack query positions' keys and values are appended to the
  // cache first (kv_append.h) and attended to (FwdParams::kv_len_add); the
  // cache must then equal the host's, bit for bit, everywhere.
  bool append = false;
  int bias = 0;  // an additive bias: 1 = [1, n, t, s], 2 = [b, 1, t, s] (odd s: its pad column holds NaN)
};

Case bias_case(Case c, int bias) {
  c.bias = bias;
  return c;
}

Case kv_case(int b, int t, int s, int kh, bool causal, int pack, int splits, int page, int left = -1, int n = 0,
             bool heads_major = false, bool append = false) {
  Case c{b, t, s, n ? n : kh, kh, causal, left};
  c.lens = true;
  c.kv_pack = pack; c.kv_splits = splits; c.kv_page = page;
  c.heads_major = heads_major;
  c.append = append;
  return c;
}

// Sink logits around the scores' range, one far above it (the sink dominates).
float sink_of(int h) { return h == 1 ? 6.f : 0.7f * h - 1.f; }

struct Result { double max_err_o, max_err_lse; bool nan, repro, skipped = false; };

Result run_case(const Case& c, int d, int dv, bool bf16, const char* variant, uint32_t seed) {
  const bool kv = c.kv_pack > 0, paged = kv && c.kv_page > 0;
  const int ns = kv ? c.kv_splits : 1;
  const int ppr = paged ? (c.s + c.kv_page - 1) / c.kv_page : 0, num_pages = paged ? c.b * ppr + 2 : 0;
  const size_t nq = size_t(c.b) * c.t * c.n * d, no = size_t(c.b) * c.t * c.n * dv;
  const size_t rows = paged ? size_t(num_pages) * c.kv_page : size_t(c.b) * c.s;
  const size_t nk = rows * c.kh * d, nv = rows * c.kh * dv;
  const size_t nlse = size_t(c.b) * c.n * c.t;
  NormalRng rng(seed);
  auto dec = [&](uint16_t h) { return check_util::from_half(h, bf16); };
  std::vector<uint16_t> hq(nq), hk(nk), hv(nv);
  fill_normal(hq, rng, bf16);
  fill_normal(hk, rng, bf16);
  fill_normal(hv, rng, bf16);
  std::vector<int32_t> qlen, kvlen, table, offset(c.b, 0);
  case_lengths(c.b, c.t, c.s, c.lens, qlen, kvlen);
  // The kernel gets kvlen_in; a KV cache's lengths reach it unclamped (the
  // kernel clamps them to [0, capacity]): ragged cases add one past the
  // capacity (contiguous: a paged row's capacity holds poisoned slots) and one
  // below 0.
  std::vector<int32_t> kvlen_in = kvlen;
  // An append case hands the kernels the lengths before the append (so the
  // rows land below s) and attends to the min(clamped + new, s) after it.
  const int added = kv && c.append ? c.t / c.kv_pack : 0;
  if (kv) {
    for (int b = 0; b < c.b; ++b) { kvlen_in[b] = std::max(kvlen_in[b] - added, 0); }
    if (c.lens && c.b > 1) {
      kvlen_in[c.b - 1] = -3;
      if (!paged) { kvlen_in[0] = c.s + 50; }
    }
    for (int b = 0; b < c.b; ++b) {
      kvlen[b] = std::min(std::min(std::max(kvlen_in[b], 0), c.s) + added, c.s);
      qlen[b] = c.t;
      offset[b] = kvlen[b] - c.t / c.kv_pack;
    }
  }
  if (paged) {  // a shuffled table over all but two pages; those two hold NaN
    table.resize(size_t(c.b) * ppr);
    for (int i = 0; i < int(table.size()); ++i) table[i] = i;
    for (int i = int(table.size()) - 1; i > 0; --i) std::swap(table[i], table[rng.gen() % (i + 1)]);
    for (int pg = 0; pg < num_pages; ++pg) {
      if (std::find(table.begin(), table.end(), pg) != table.end()) continue;
      const size_t span = size_t(c.kv_page) * c.kh * d, span_v = size_t(c.kv_page) * c.kh * dv;
      std::fill(hk.begin() + pg * span, hk.begin() + (pg + 1) * span, uint16_t(0xFFFF));
      std::fill(hv.begin() + pg * span_v, hv.begin() + (pg + 1) * span_v, uint16_t(0xFFFF));
    }
  }
  auto kv_at = [&](int b, int j, int h, int w) -> size_t {  // offset of key j, kv head h (rows of w)
    if (!paged) return ((size_t(b) * c.s + j) * c.kh + h) * w;
    const size_t page = size_t(table[size_t(b) * ppr + j / c.kv_page]);
    return ((page * c.kv_page + j % c.kv_page) * c.kh + h) * w;
  };

  void *dq, *dk, *dV, *dout; float *dlse, *dsinks = nullptr; int32_t *dql, *dkl, *dtab = nullptr;
  std::vector<float> hsinks(c.n);
  for (int h = 0; h < c.n; ++h) hsinks[h] = sink_of(h);
  if (c.sinks) {
    CHECK_CUDA(cudaMalloc((void**)&dsinks, c.n * 4));
    CHECK_CUDA(cudaMemcpy(dsinks, hsinks.data(), c.n * 4, cudaMemcpyHostToDevice));
  }
  CHECK_CUDA(cudaMalloc(&dq, nq * 2)); CHECK_CUDA(cudaMalloc(&dk, nk * 2));
  CHECK_CUDA(cudaMalloc(&dV, nv * 2)); CHECK_CUDA(cudaMalloc(&dout, no * ns * 2));
  CHECK_CUDA(cudaMalloc((void**)&dlse, nlse * ns * 4));
  CHECK_CUDA(cudaMalloc((void**)&dql, c.b * 4)); CHECK_CUDA(cudaMalloc((void**)&dkl, c.b * 4));
  if (c.heads_major) {  // the kernel reads [b, n, t, d]; hq stays [b, t, n, d] for the reference
    std::vector<uint16_t> hm(nq);
    for (int b = 0; b < c.b; ++b)
      for (int i = 0; i < c.t; ++i)
        for (int h = 0; h < c.n; ++h)
          std::memcpy(&hm[((size_t(b) * c.n + h) * c.t + i) * d], &hq[((size_t(b) * c.t + i) * c.n + h) * d], d * 2);
    CHECK_CUDA(cudaMemcpy(dq, hm.data(), nq * 2, cudaMemcpyHostToDevice));
  } else {
    CHECK_CUDA(cudaMemcpy(dq, hq.data(), nq * 2, cudaMemcpyHostToDevice));
  }
  CHECK_CUDA(cudaMemcpy(dk, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dV, hv.data(), nv * 2, cudaMemcpyHostToDevice));
  // Append: the device gets the cache as it was and the new rows; the host
  // writes them into hk / hv (what the device cache must become).
  void *dkn = nullptr, *dvn = nullptr;
  if (added > 0) {
    const size_t nn = size_t(c.b) * added * c.kh * d;
    std::vector<uint16_t> hkn(nn), hvn(nn);
    fill_normal(hkn, rng, bf16);
    fill_normal(hvn, rng, bf16);
    CHECK_CUDA(cudaMalloc(&dkn, nn * 2)); CHECK_CUDA(cudaMalloc(&dvn, nn * 2));
    CHECK_CUDA(cudaMemcpy(dkn, hkn.data(), nn * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dvn, hvn.data(), nn * 2, cudaMemcpyHostToDevice));
    const int cap = paged ? ppr * c.kv_page : c.s;
    for (int b = 0; b < c.b; ++b)
      for (int i = 0; i < added; ++i) {
        const int pos = std::min(std::max(kvlen_in[b], 0), cap) + i;
        if (pos >= cap) continue;  // dropped
        for (int h = 0; h < c.kh; ++h) {
          const size_t src = ((size_t(b) * added + i) * c.kh + h) * d;
          std::memcpy(&hk[kv_at(b, pos, h, d)], &hkn[src], d * 2);
          std::memcpy(&hv[kv_at(b, pos, h, dv)], &hvn[src], dv * 2);
        }
      }
  }
  CHECK_CUDA(cudaMemcpy(dql, qlen.data(), c.b * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dkl, kvlen_in.data(), c.b * 4, cudaMemcpyHostToDevice));
  if (paged) {
    CHECK_CUDA(cudaMalloc((void**)&dtab, table.size() * 4));
    CHECK_CUDA(cudaMemcpy(dtab, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  }
  const check_util::Bias bias(c.bias, c.b, c.n, c.t, c.s, rng, bf16, /*nan_pad=*/true, /*with_grad=*/false);
  auto free_all = [&] {
    cudaFree(dq); cudaFree(dk); cudaFree(dV); cudaFree(dout); cudaFree(dlse); cudaFree(dql); cudaFree(dkl);
    cudaFree(dsinks); cudaFree(dtab); cudaFree(dkn); cudaFree(dvn);
  };

  jax_fa3::FwdParams p;
  p.q = dq; p.k = dk; p.v = dV; p.o = dout; p.lse = dlse; p.q_lens = dql; p.kv_lens = dkl;
  p.sinks = dsinks;
  p.b = c.b; p.t = c.t; p.s = paged ? ppr * c.kv_page : c.s; p.n = c.n; p.kh = c.kh; p.d = d; p.dv = dv;
  p.scale = 1.f / std::sqrt(float(d)); p.softcap = c.softcap;
  p.window_left = c.left; p.window_right = c.causal ? 0 : c.right;
  p.bottom_right = kv; p.num_splits = ns; p.kv_len_add = added;
  if (kv) { p.q_lens = nullptr; }  // as the KV-cache handler: every row valid
  p.heads_major = c.heads_major;
  while (kv && (1 << p.q_pack_log2) < c.kv_pack) { ++p.q_pack_log2; }
  if (paged) { p.pages = {dtab, ppr, c.kv_page, num_pages}; }
  const check_util::Segments seg(c.b, c.t, c.s, c.docs, c.scattered, seed + 1, c.as_mask);
  seg.attach(p.pair);
  bias.attach(p);

  bool cache_ok = true;
  if (added > 0) {
    jax_fa3::KvAppendParams ap;
    ap.k_new = dkn; ap.v_new = dvn; ap.k_cache = dk; ap.v_cache = dV; ap.seqlens = dkl;
    if (paged) { ap.pages = p.pages; }
    ap.b = c.b; ap.tq = added; ap.kh = c.kh; ap.row_bytes = d * 2; ap.capacity = p.s;
    const int err = jax_fa3_kv_append_launch(&ap, nullptr);
    if (err != 0) { std::fprintf(stderr, "append failed: %d\n", err); std::exit(2); }
    std::vector<uint16_t> gk(nk), gv(nv);
    CHECK_CUDA(cudaMemcpy(gk.data(), dk, nk * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(gv.data(), dV, nv * 2, cudaMemcpyDeviceToHost));
    cache_ok = gk == hk && gv == hv;  // the new rows where they belong, nothing else touched
    if (!cache_ok) std::printf("  appended cache differs from the host's\n");
  }
  std::vector<uint16_t> out[2];
  std::vector<float> lse[2];
  for (int rep = 0; rep < 2; ++rep) {
    // Poison: every output element must be written by the kernel.
    CHECK_CUDA(cudaMemset(dout, 0xFF, no * ns * 2));
    CHECK_CUDA(cudaMemset(dlse, 0xFF, nlse * ns * 4));
    int err = jax_fa3_fwd_launch(&p, bf16 ? 0 : 1, variant, nullptr);
    if (err == -1) {  // this (dtype, head dim, variant) is not compiled
      free_all();
      Result skip{0, 0, false, true};
      skip.skipped = true;
      return skip;
    }
    if (err != 0) { std::fprintf(stderr, "launch failed: %d\n", err); std::exit(2); }
    CHECK_CUDA(cudaDeviceSynchronize());
    out[rep].resize(no * ns); lse[rep].resize(nlse * ns);
    CHECK_CUDA(cudaMemcpy(out[rep].data(), dout, no * ns * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(lse[rep].data(), dlse, lse[rep].size() * 4, cudaMemcpyDeviceToHost));
  }
  free_all();

  Result r{0, 0, false, out[0] == out[1] && std::memcmp(lse[0].data(), lse[1].data(), lse[0].size() * 4) == 0};
  if (!cache_ok) r.max_err_o = INFINITY;
  // The parts of a split call merged by their LSE (+inf: a part without keys).
  std::vector<double> got_o(no, 0.0), got_lse(nlse, INFINITY);
  for (int b = 0; b < c.b; ++b)
    for (int h = 0; h < c.n; ++h)
      for (int i = 0; i < c.t; ++i) {
        auto lse_of = [&](int z) { return double(lse[0][((size_t(b) * ns + z) * c.n + h) * c.t + i]); };
        auto o_of = [&](int z, int x) {
          const size_t bz = size_t(b) * ns + z;
          return double(dec(out[0][(c.heads_major ? (bz * c.n + h) * c.t + i : (bz * c.t + i) * c.n + h) * dv + x]));
        };
        double m = -INFINITY;
        for (int z = 0; z < ns; ++z) {
          const double l = lse_of(z);
          if (std::isnan(l)) r.nan = true;
          if (!std::isinf(l)) m = std::max(m, l);
        }
        double total = 0;
        for (int z = 0; z < ns; ++z) total += std::isinf(lse_of(z)) ? 0.0 : std::exp(lse_of(z) - m);
        const size_t li = (size_t(b) * c.n + h) * c.t + i;
        if (total > 0) got_lse[li] = m + std::log(total);
        else if (ns == 1) got_lse[li] = lse_of(0);
        for (int x = 0; x < dv; ++x) {
          double o = 0;
          for (int z = 0; z < ns; ++z) {
            const double oz = o_of(z, x);
            if (std::isnan(oz)) r.nan = true;
            o += total > 0 && !std::isinf(lse_of(z)) ? std::exp(lse_of(z) - m) / total * oz : (ns == 1 ? oz : 0.0);
          }
          got_o[(size_t(b) * c.t + i) * c.n * dv + size_t(h) * dv + x] = o;
        }
      }
  const int group = c.n / c.kh;
  std::vector<double> sc(c.s);
  for (int b = 0; b < c.b; ++b)
    for (int h = 0; h < c.n; ++h)
      for (int i = 0; i < c.t; ++i) {
        const uint16_t* qi = &hq[((size_t(b) * c.t + i) * c.n + h) * d];
        const int pos = kv ? offset[b] + i / c.kv_pack : i;
        double mx = -INFINITY;
        for (int j = 0; j < c.s; ++j) {
          bool vis = i < qlen[b] && j < kvlen[b] && (c.left < 0 || j >= pos - c.left) &&
                     (p.window_right < 0 || j <= pos + p.window_right) && seg.same(b, i, j);
          if (!vis) { sc[j] = -INFINITY; continue; }
          const uint16_t* kj = &hk[kv_at(b, j, h / group, d)];
          double acc = 0;
          for (int x = 0; x < d; ++x) acc += double(dec(qi[x])) * dec(kj[x]);
          acc *= p.scale;
          if (c.softcap > 0) acc = c.softcap * std::tanh(acc / c.softcap);
          if (c.bias) acc += dec(bias.host[bias.at(b, h, i, j)]);
          sc[j] = acc; mx = std::max(mx, acc);
        }
        const double sink = c.sinks ? double(hsinks[h]) : -INFINITY;
        mx = std::max(mx, sink);
        double sum = std::isinf(sink) ? 0.0 : std::exp(sink - mx);  // the sink's value is 0
        for (int j = 0; j < c.s; ++j) { sc[j] = std::isinf(sc[j]) ? 0.0 : std::exp(sc[j] - mx); sum += sc[j]; }
        const size_t lse_idx = (size_t(b) * c.n + h) * c.t + i;
        double ref_lse = sum > 0 ? mx + std::log(sum) : INFINITY;
        const double gl = got_lse[lse_idx];
        if (std::isnan(gl)) r.nan = true;
        if (sum > 0) r.max_err_lse = std::max(r.max_err_lse, std::fabs(gl - ref_lse));
        else if (!(std::isinf(gl) && gl > 0)) r.max_err_lse = INFINITY;
        for (int x = 0; x < dv; ++x) {
          double o = 0;
          if (sum > 0)
            for (int j = 0; j < c.s; ++j)
              if (sc[j] != 0) o += sc[j] * dec(hv[kv_at(b, j, h / group, dv) + x]);
          o = sum > 0 ? o / sum : 0.0;  // rows with no visible key (or past q_len) are 0
          const double got = got_o[(size_t(b) * c.t + i) * c.n * dv + size_t(h) * dv + x];
          if (std::isnan(got)) r.nan = true;
          r.max_err_o = std::max(r.max_err_o, std::fabs(got - o));
        }
      }
  return r;
}

}  // namespace

static int sms_override = 0;  // --sms

// Mean milliseconds of `iters` back-to-back launches after 3 warm-up ones
// (CUDA events); -1 when a launch fails.
float time_launches(jax_fa3::FwdParams p, bool bf16, const char* variant, int iters) {
  if (sms_override > 0) { p.num_sms = sms_override; }
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0)); CHECK_CUDA(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) jax_fa3_fwd_launch(&p, bf16 ? 0 : 1, variant, nullptr);
  CHECK_CUDA(cudaEventRecord(e0));
  for (int i = 0; i < iters; ++i) {
    int err = jax_fa3_fwd_launch(&p, bf16 ? 0 : 1, variant, nullptr);
    if (err != 0) { std::fprintf(stderr, "launch failed: %d\n", err); return -1.f; }
  }
  CHECK_CUDA(cudaEventRecord(e1));
  CHECK_CUDA(cudaEventSynchronize(e1));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  return ms / iters;
}

// Times the kernel alone on one shape (inputs: a fixed bit pattern, never zeros).
int time_shape(const std::string& spec, bool bf16, const char* variant, int iters, int dv_arg, int window_left) {
  check_util::TimeSpec ts;
  if (!check_util::parse_time_spec(spec.c_str(), ts)) {
    std::fprintf(stderr, "--time wants B,T,N,D,CAUSAL\n");
    return 2;
  }
  const int b = ts.b, t = ts.t, n = ts.n, d = ts.d, causal = ts.causal, dv = dv_arg > 0 ? dv_arg : d;
  const size_t elems = size_t(b) * t * n * d;  // >= V's and O's (dv <= d)
  if (dv != d && std::strcmp(variant, "default") == 0) { variant = "auto"; }  // the value-head-dim tiles
  std::vector<uint16_t> host(elems);
  NormalRng rng(7);
  fill_normal(host, rng, bf16);
  void *q, *k, *v, *o; float* lse; int32_t* lens;
  CHECK_CUDA(cudaMalloc(&q, elems * 2)); CHECK_CUDA(cudaMalloc(&k, elems * 2));
  CHECK_CUDA(cudaMalloc(&v, elems * 2)); CHECK_CUDA(cudaMalloc(&o, elems * 2));
  CHECK_CUDA(cudaMalloc((void**)&lse, size_t(b) * n * t * 4));
  CHECK_CUDA(cudaMalloc((void**)&lens, b * 4));
  for (void* x : {q, k, v}) CHECK_CUDA(cudaMemcpy(x, host.data(), elems * 2, cudaMemcpyHostToDevice));
  std::vector<int32_t> hl(b, t);
  CHECK_CUDA(cudaMemcpy(lens, hl.data(), b * 4, cudaMemcpyHostToDevice));
  jax_fa3::FwdParams p;
  p.q = q; p.k = k; p.v = v; p.o = o; p.lse = lse; p.q_lens = lens; p.kv_lens = lens;
  p.b = b; p.t = t; p.s = t; p.n = n; p.kh = n; p.d = d; p.dv = dv;
  p.scale = 1.f / std::sqrt(float(d)); p.window_right = causal ? 0 : -1;
  p.window_left = window_left;
  const float ms = time_launches(p, bf16, variant, iters);
  if (ms < 0) { return 2; }
  double pairs = 0;  // visible (query, key) pairs
  for (int i = 0; i < t; ++i) {
    const int lo = window_left >= 0 ? std::max(0, i - window_left) : 0, hi = causal ? i + 1 : t;
    pairs += hi - lo;
  }
  const double flops = 2.0 * b * n * pairs * (d + dv);
  std::printf("fwd %s b%d t%d n%d d%d dv%d causal=%d window_left=%d variant=%s: %.4f ms  %.1f TFLOP/s\n",
              bf16 ? "bf16" : "fp16", b, t, n, d, dv, causal, window_left, variant, ms, flops / ms * 1e-9);
  return 0;
}

// A decode step as jax_fa3/kvcache.py issues it: q [B, G, K, D] (G packed
// rows per kv head), cache [B, L, K, D], split into `splits` parts.
int time_decode(const std::string& spec, bool bf16, const char* variant, int iters, int splits) {
  int b, l, kh, d, g;
  if (std::sscanf(spec.c_str(), "%d,%d,%d,%d,%d", &b, &l, &kh, &d, &g) != 5 || g < 1 || (g & (g - 1)) != 0) {
    std::fprintf(stderr, "--time-decode wants B,L,K,D,G (G a power of two)\n");
    return 2;
  }
  const size_t nq = size_t(b) * g * kh * d, nk = size_t(b) * l * kh * d;
  std::vector<uint16_t> host(nk);
  NormalRng rng(7);
  fill_normal(host, rng, bf16);
  void *q, *k, *v, *o; float* lse; int32_t* kl;
  CHECK_CUDA(cudaMalloc(&q, nq * 2)); CHECK_CUDA(cudaMalloc(&k, nk * 2)); CHECK_CUDA(cudaMalloc(&v, nk * 2));
  CHECK_CUDA(cudaMalloc(&o, nq * splits * 2));
  CHECK_CUDA(cudaMalloc((void**)&lse, nq / d * splits * 4));
  for (void* x : {k, v}) CHECK_CUDA(cudaMemcpy(x, host.data(), nk * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(q, host.data(), nq * 2, cudaMemcpyHostToDevice));
  std::vector<int32_t> hk(b, l);
  CHECK_CUDA(cudaMalloc((void**)&kl, b * 4));
  CHECK_CUDA(cudaMemcpy(kl, hk.data(), b * 4, cudaMemcpyHostToDevice));
  jax_fa3::FwdParams p;
  p.q = q; p.k = k; p.v = v; p.o = o; p.lse = lse; p.q_lens = nullptr; p.kv_lens = kl; p.bottom_right = true;
  p.b = b; p.t = g; p.s = l; p.n = kh; p.kh = kh; p.d = d; p.dv = d;
  while ((1 << p.q_pack_log2) < g) { ++p.q_pack_log2; }
  p.num_splits = splits;
  p.heads_major = true;  // as jax_fa3/kvcache.py passes a decode step's queries
  p.scale = 1.f / std::sqrt(float(d)); p.window_right = 0;
  const float ms = time_launches(p, bf16, variant, iters);
  if (ms < 0) { return 2; }
  std::printf("decode %s b%d l%d kh%d d%d g%d splits=%d variant=%s: %.4f ms  %.0f GB/s\n", bf16 ? "bf16" : "fp16",
              b, l, kh, d, g, splits, variant, ms, 2.0 * nk * 2 / ms * 1e-6);
  for (void* x : {q, k, v, o}) cudaFree(x);
  cudaFree(lse); cudaFree(kl);
  return 0;
}

int main(int argc, char** argv) {
  std::string dtype = "bf16", variant = "default", time_spec, decode_spec, only = "all";
  int dv_arg = 0, splits = 1, window_left = -1;
  int iters = 20;
  std::vector<int> hdims = {64, 128, 256};
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--dtype") dtype = argv[i + 1];
    else if (a == "--variant") variant = argv[i + 1];
    else if (a == "--time") time_spec = argv[i + 1];
    else if (a == "--time-decode") decode_spec = argv[i + 1];
    else if (a == "--splits") splits = std::atoi(argv[i + 1]);
    else if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else if (a == "--sms") sms_override = std::atoi(argv[i + 1]);
    else if (a == "--hdims") hdims = check_util::parse_int_list(argv[i + 1]);
    else if (a == "--only") only = argv[i + 1];
    else if (a == "--dv") dv_arg = std::atoi(argv[i + 1]);
    else if (a == "--window-left") window_left = std::atoi(argv[i + 1]);
    else { std::fprintf(stderr, "unknown flag %s\n", a.c_str()); return 2; }
  }
  if (!decode_spec.empty()) return time_decode(decode_spec, dtype == "bf16", variant.c_str(), iters, splits);
  if (!time_spec.empty()) return time_shape(time_spec, dtype == "bf16", variant.c_str(), iters, dv_arg, window_left);
  // Odd lengths, T != S, fewer K/V tiles than stages, several ring wrap-arounds,
  // GQA, windows, softcap, seq lengths, decode (T = 1).
  const std::vector<Case> cases = {
      {1, 128, 128, 2, 2, false}, {1, 128, 128, 2, 2, true},
      {2, 77, 133, 4, 2, false},  {2, 77, 133, 4, 2, true},
      {1, 200, 61, 2, 1, true},   {1, 1, 300, 3, 1, false},
      {1, 513, 700, 2, 2, false}, {1, 513, 700, 2, 2, true},
      {2, 300, 300, 2, 1, false, 40, 17},
      {1, 257, 255, 2, 2, false, -1, -1, 30.f},
      {3, 190, 230, 2, 2, true, -1, -1, 0.f, true},
      // Segment ids: packed documents, T != S, windows, lengths, scattered ids.
      {1, 700, 700, 2, 2, true, -1, -1, 0.f, false, 9},
      {2, 333, 517, 4, 2, false, -1, -1, 0.f, true, 5},
      {1, 600, 600, 2, 1, false, 100, 30, 0.f, false, 4},
      {2, 300, 300, 2, 2, true, -1, -1, 0.f, false, 3, true},
      // The same rules as boolean masks.
      {2, 333, 517, 4, 2, false, -1, -1, 0.f, true, 5, false, true},
      {2, 300, 300, 2, 2, true, -1, -1, 0.f, false, 3, true, true},
      // Sinks: with causal + GQA, softcap + lengths (rows that see no key), documents.
      {2, 77, 133, 4, 2, true, -1, -1, 0.f, false, 0, false, false, true},
      {3, 190, 230, 2, 2, false, -1, -1, 30.f, true, 0, false, false, true},
      {1, 600, 600, 2, 1, true, -1, -1, 0.f, false, 4, false, false, true},
      // KV caches: decode (a GQA group of 4 or 8 as rows), verification (Tq = 5
      // of a group of 4: 20 rows), a chunk; contiguous and paged, split-KV,
      // ragged lengths (incl. rows shorter than the chunk), a window, an unpacked group.
      kv_case(3, 4, 700, 2, true, 4, 1, 0), kv_case(3, 8, 700, 2, true, 8, 3, 0),
      kv_case(2, 20, 1100, 2, true, 4, 4, 256), kv_case(2, 4, 900, 1, false, 4, 2, 640),
      kv_case(2, 160, 600, 2, true, 2, 2, 640), kv_case(2, 20, 1000, 2, true, 4, 3, 0, 300),
      kv_case(2, 3, 700, 2, true, 1, 2, 256, -1, 6),  // a group of 6 is not packed: heads map to kv heads
      // Heads-major Q/O (a decode step's queries as they lie in [B, 1, N, H]).
      kv_case(3, 4, 700, 2, true, 4, 1, 0, -1, 0, true), kv_case(2, 8, 1100, 2, true, 8, 3, 256, -1, 0, true),
      // Appending the new keys first: decode (contiguous, split), verification (paged, heads-major), a chunk.
      kv_case(3, 8, 700, 2, true, 8, 3, 0, -1, 0, false, true),
      kv_case(2, 20, 1100, 2, true, 4, 2, 256, -1, 0, true, true),
      kv_case(2, 160, 600, 2, true, 2, 1, 640, -1, 0, false, true),
      // A bias per head or per batch row: causal GQA with lengths, odd S, softcap, documents, a mask.
      bias_case({2, 190, 231, 4, 2, true, -1, -1, 0.f, true}, 1),
      bias_case({2, 300, 301, 2, 2, false, 40, 17}, 2),
      bias_case({1, 257, 255, 2, 2, false, -1, -1, 30.f}, 1),
      bias_case({1, 700, 700, 2, 2, true, -1, -1, 0.f, false, 9}, 2),
      bias_case({2, 300, 300, 2, 2, true, -1, -1, 0.f, false, 3, true, true}, 1),
  };
  const bool bf16 = dtype == "bf16";
  const double tol_o = bf16 ? 2e-2 : 4e-3;
  int failures = 0;
  for (int d : hdims) {
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const Case& c = cases[ci];
      if ((c.docs > 0 || c.bias) && std::strcmp(variant.c_str(), "m192") == 0) continue;  // takes no pair rule, no bias
      if (c.kv_page % (d >= 192 ? 80 : 128) != 0) continue;  // a page holds whole key blocks (fwd/traits.h)
      if (c.kv_pack && std::strcmp(variant.c_str(), "m192") == 0) continue;  // training shapes only
      if (only == "kv" && !c.kv_pack) continue;
      const int dv = dv_arg > 0 ? dv_arg : d;
      if (dv != d && c.kv_pack) continue;  // KV caches share one head dim
      // A value head dim unlike d has its own tiles: the handler's pick.
      const char* var = dv != d && variant == "default" ? "auto" : variant.c_str();
      Result r = run_case(c, d, dv, bf16, var, uint32_t(1000 * d + ci));
      if (r.skipped) {
        std::printf("%s d%d: not compiled, skipped\n", dtype.c_str(), d);
        break;
      }
      bool ok = !r.nan && r.repro && r.max_err_o <= tol_o && r.max_err_lse <= 1e-3;
      failures += !ok;
      std::printf("%s d%-3d dv%-3d b%d t%-4d s%-4d n%d/%d causal=%d win=(%d,%d) cap=%g lens=%d docs=%d%s%s  "
                  "%s%s max|dO|=%.2e max|dLSE|=%.2e nan=%d repro=%d  %s\n",
                  dtype.c_str(), d, dv, c.b, c.t, c.s, c.n, c.kh, c.causal, c.left, c.right, c.softcap,
                  c.lens, c.docs, c.scattered ? "s" : (c.as_mask ? "m" : ""), c.sinks ? " sinks" : "",
                  c.kv_pack ? (" kv pack=" + std::to_string(c.kv_pack) + " splits=" + std::to_string(c.kv_splits) +
                               " page=" + std::to_string(c.kv_page) + (c.append ? " append" : "")).c_str() : "",
                  c.bias ? (c.bias == 1 ? " bias[1,n]" : " bias[b,1]") : "", r.max_err_o, r.max_err_lse, r.nan, r.repro, ok ? "ok" : "FAIL");
    }
  }
  std::printf("%s: %d failures\n", failures ? "FAILED" : "PASSED", failures);
  return failures ? 1 : 0;
}

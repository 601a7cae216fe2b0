// Host-side check of the backward's key-block dispatch (cc/bwd/tile_scheduler.h)
// and the forward's tile order (cc/fwd/tile_scheduler.h), built and run by
// tests/test_host_checks.py with nvcc (no GPU needed). For each backward
// problem, order and SM count it prints one line: order, pieces (split key
// blocks at the end of the grid, 1 = none), ok (every (key block, KV head, batch)
// exactly once, or a split one as each of its shares once, with its own slot),
// monotone (the order's promise holds). Forward lines start with "fwd"; "split"
// lines give a causal grid's split plan and its simulated finish.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>
#include "bwd/tile_scheduler.h"
#include "fwd/tile_scheduler.h"

using jax_fa3::BwdParams;
using jax_fa3::BwdTileOrder;
using jax_fa3::FwdParams;
using jax_fa3::PersistentTileScheduler;
using jax_fa3::WorkTile;

// The most tiles one CTA of a `grid`-CTA launch walks.
int max_tiles(PersistentTileScheduler sched, int grid) {
  int most = 0;
  for (int cta = 0; cta < grid; ++cta) {
    int count = 0;
    for (WorkTile w = sched.start(cta); w.valid; w = sched.step(w, grid)) { ++count; }
    most = std::max(most, count);
  }
  return most;
}

// Every CTA of the forward grid walks its tiles; each (m block, head, batch)
// must come exactly once. With segment ids (one tile per CTA) the grid is the
// tile list and m descends within each group of kHeadGroup (head, batch) rows.
// Modes 4 and 5 are windows: banded (300, 0) and (100, 50).
int check_fwd() {
  int failures = 0;
  const int32_t dummy_ids = 0;
  for (int t : {1, 127, 128, 1000, 4096}) for (int n : {1, 3, 8, 20}) for (int b : {1, 2}) {
    for (int mode = 0; mode < 6; ++mode) {
      FwdParams p;
      p.t = p.s = t; p.n = p.kh = n; p.b = b; p.num_sms = 132;
      p.window_left = mode == 4 ? 300 : mode == 5 ? 100 : -1;
      p.window_right = mode == 4 ? 0 : mode == 5 ? 50 : mode % 2 ? 0 : -1;  // modes 0-3: non-causal / causal
      if (mode == 2 || mode == 3) { p.pair.q_ids = &dummy_ids; }  // segment ids
      const int grid = int(PersistentTileScheduler::grid(p, 128).x);
      PersistentTileScheduler sched(p, 128);
      const int num_m = (t + 127) / 128;
      std::vector<int> seen(size_t(num_m) * n * b, 0);
      const bool ids = mode == 2 || mode == 3;
      bool ok = grid > 0 && (!ids || grid == int(seen.size()));
      bool monotone = true;
      std::vector<int> prev_m(size_t(n) * b, num_m);
      int prev_group = 0;
      for (int cta = 0; cta < grid; ++cta) {
        for (WorkTile w = sched.start(cta); w.valid; w = sched.step(w, grid)) {
          if (w.m_block < 0 || w.m_block >= num_m || w.head < 0 || w.head >= n || w.batch < 0 || w.batch >= b) {
            ok = false;
            break;
          }
          const int hb = w.batch * n + w.head;
          seen[size_t(hb) * num_m + w.m_block] += 1;
          if (ids) {  // groups in order; m high to low within each row
            const int group = hb / PersistentTileScheduler::kHeadGroup;
            monotone &= w.m_block < prev_m[hb] && group >= prev_group;
            prev_m[hb] = w.m_block;
            prev_group = group;
          }
        }
      }
      for (int c : seen) { ok &= c == 1; }
      // A persistent grid no larger than the SMs, whose busiest CTA takes no
      // more tiles than under one CTA per SM (the grid only drops idle tails).
      if (!ids) {
        const int one_per_sm = std::min(PersistentTileScheduler::num_units_of(p, 128), p.num_sms);
        ok &= grid <= p.num_sms && max_tiles(sched, grid) <= max_tiles(sched, one_per_sm);
      }
      std::printf("fwd t=%d n=%d b=%d window=(%d,%d) ids=%d grid=%d ok=%d monotone=%d\n", t, n, b, p.window_left,
                  p.window_right, int(ids), grid, int(ok), int(monotone));
      failures += !(ok && monotone);
    }
  }
  return failures;
}

// Banded windows on long rows: the key blocks each CTA of the forward grid
// visits (128-row tiles, 128-key blocks). A fixed stride that is a multiple of
// the row's tile count once gave a CTA the same m in every row (all short or
// all long tiles: up to 1.9x the mean). "fwdbal <shape> ratio=<max/mean>".
int check_fwd_balance() {
  struct Shape { int b, t, n, left, right; };
  const Shape shapes[] = {{1, 16384, 16, 4096, 0}, {2, 8192, 16, 4096, 0}, {8, 2048, 16, 1024, 0},
                          {1, 16384, 16, 1024, 1024}, {2, 8192, 32, 2048, 0}, {1, 32768, 8, 4096, 0},
                          {1, 16384, 16, 4096, -1}, {16, 1024, 16, 256, 0}, {3, 5000, 12, 1000, 0}};
  int failures = 0;
  for (const Shape& sh : shapes) {
    FwdParams p;
    p.t = p.s = sh.t; p.n = p.kh = sh.n; p.b = sh.b; p.num_sms = 132;
    p.window_left = sh.left; p.window_right = sh.right;
    const int grid = int(PersistentTileScheduler::grid(p, 128).x);
    PersistentTileScheduler sched(p, 128);
    std::vector<long> work(grid, 0);
    long total = 0;
    for (int cta = 0; cta < grid; ++cta) {
      for (WorkTile w = sched.start(cta); w.valid; w = sched.step(w, grid)) {
        const int r0 = w.m_block * 128, r1 = std::min(sh.t, r0 + 128);
        const int lo = sh.left >= 0 ? std::max(0, r0 - sh.left) : 0;
        const int hi = sh.right >= 0 ? std::min(sh.t, r1 + sh.right) : sh.t;
        work[cta] += (hi + 127) / 128 - lo / 128;
      }
      total += work[cta];
    }
    const double ratio = double(*std::max_element(work.begin(), work.end())) * grid / double(total);
    const bool ok = ratio <= 1.08;
    std::printf("fwdbal b%d_t%d_n%d_w%d_%d ratio=%.3f ok=%d\n", sh.b, sh.t, sh.n, sh.left, sh.right, ratio, int(ok));
    failures += !ok;
  }
  return failures;
}

// The finish of `o` under the kernel's greedy dispatch (BwdTileOrder::dispatch,
// the split planner's own model) over an even split of the same work (end:
// the finish itself, in query blocks).
double simulate(const BwdTileOrder& o, const BwdParams& p, int block_m, int block_n, int sms, double* end_out = nullptr) {
  std::vector<int> blocks(o.num_n);
  for (int n = 0; n < o.num_n; ++n) { blocks[n] = BwdTileOrder::query_blocks(p, block_m, block_n, n); }
  double total = 0;
  for (int bid = 0; bid < o.num_ctas(); ++bid) {
    const jax_fa3::BwdTile t = o(bid);
    total += BwdTileOrder::work(p, blocks[t.n_block], t.piece, t.pieces);
  }
  std::vector<double> at(sms, 0.0);
  const double end = o.dispatch(p, blocks, 0, o.num_ctas(), at);
  if (end_out != nullptr) { *end_out = end; }
  return end * sms / total;
}

// The query blocks of one backward tile (BwdBlockWalk): each (query head,
// query block) exactly once; descending: blocks from the last, the group's
// heads in turn within each; ascending: one head after another, each
// ascending (the deterministic dQ turns). One "walk" line per order.
template <bool Descending>
int check_walk() {
  int bad = 0, cases = 0;
  for (int group : {1, 2, 8}) for (int lo : {0, 3}) for (int hi : {3, 4, 11}) {
    std::vector<int> seen(size_t(group) * 11, 0);
    int prev_g = -1, prev_m = -1, steps = 0;
    for (jax_fa3::BwdBlockWalk<Descending> w(group, lo, hi); w.valid(); w.next(), ++steps) {
      if (w.g < 0 || w.g >= group || w.m < lo || w.m >= hi || steps > group * 11) { ++bad; break; }
      ++seen[size_t(w.g) * 11 + w.m];
      if (prev_g >= 0) {
        const bool in_order = Descending ? (w.m == prev_m ? w.g == prev_g + 1 : w.m == prev_m - 1 && w.g == 0)
                                         : (w.g == prev_g ? w.m == prev_m + 1 : w.g == prev_g + 1 && w.m == lo);
        bad += !in_order;
      }
      prev_g = w.g;
      prev_m = w.m;
    }
    for (int g = 0; g < group; ++g) for (int m = 0; m < 11; ++m) { bad += seen[size_t(g) * 11 + m] != (m >= lo && m < hi); }
    ++cases;
  }
  std::printf("walk descending=%d cases=%d ok=%d\n", int(Descending), cases, int(bad == 0));
  return bad != 0;
}

int main() {
  int failures = check_fwd() + check_fwd_balance() + check_walk<true>() + check_walk<false>();
  const int seqs[] = {1, 127, 128, 1000, 4096, 8192, 16384, 40000};
  const int heads[][2] = {{1, 1}, {4, 1}, {4, 4}, {2, 3}};
  for (int s : seqs) {
    for (const auto& hb : heads) {
      for (int mode = 0; mode < 3; ++mode) for (int sms : {0, 132, 7}) for (int chunk : {0, 5, 128}) {
        BwdParams p;
        p.s = s; p.t = s; p.kh = hb[0]; p.b = hb[1]; p.n = hb[0];
        p.d = 256; p.num_sms = sms;  // long sequences take wider chunks (chunk_for)
        p.window_left = -1;
        p.window_right = mode == 0 ? -1 : 0;  // non-causal / causal
        p.deterministic = mode == 2;
        BwdTileOrder order = BwdTileOrder::make(p, 128);
        if (chunk > 0 && order.order == BwdTileOrder::kLongestFirst) { order.chunk = chunk; }  // 0: chunk_for's width
        const int max_slots = 100;
        order.plan_split(p, 64, 128, max_slots);
        std::vector<int> seen(size_t(order.num_n) * order.num_hb, 0);
        std::vector<int> slot_of(seen.size(), -1);
        bool ok = order.num_split() <= max_slots && (order.pieces == 1) == (order.num_split() == 0) &&
                  (!p.deterministic || order.pieces == 1);
        bool monotone = true;
        int prev_chunk = 0;
        std::vector<int> prev_n(order.num_hb, -1);
        for (int bid = 0; bid < order.num_ctas(); ++bid) {
          const auto t = order(bid);
          const int hbi = t.batch * p.kh + t.kv_head;
          if (t.n_block < 0 || t.n_block >= order.num_n || hbi < 0 || hbi >= order.num_hb) { monotone = false; continue; }
          const size_t u = size_t(hbi) * order.num_n + t.n_block;
          seen[u] += t.pieces == 1 ? order.pieces : 1;  // a whole block counts as all shares
          if (t.pieces > 1) {  // shares of one block are adjacent, in order, with one slot
            ok &= t.pieces == order.pieces && t.piece == (seen[u] - 1) && t.slot >= 0 && t.slot < order.num_split();
            ok &= slot_of[u] < 0 ? true : slot_of[u] == t.slot;
            slot_of[u] = t.slot;
            if (t.piece > 0) { continue; }
          }
          if (order.order == BwdTileOrder::kLongestFirst) {
            const int c = t.n_block / order.chunk;  // chunks never go back
            monotone &= c >= prev_chunk;
            prev_chunk = c;
          } else if (order.order == BwdTileOrder::kDescending) {
            monotone &= prev_n[hbi] < 0 || t.n_block < prev_n[hbi];
          } else {
            monotone &= prev_n[hbi] < 0 || t.n_block > prev_n[hbi];
          }
          prev_n[hbi] = t.n_block;
        }
        for (int c : seen) { ok &= c == order.pieces; }
        std::printf("s=%d kh=%d b=%d sms=%d chunk=%d order=%d pieces=%d ok=%d monotone=%d\n", s, p.kh, p.b, sms, order.chunk, order.order,
                    order.pieces, int(ok), int(monotone));
        failures += !(ok && monotone);
      }
    }
  }
  // The default chunk width on the benchmark's shapes (16k tokens, hidden
  // 2048, 132 SMs, causal) and on a GQA one: "rule <name> chunk=<width>".
  struct RuleCase { const char* name; int b, t, n, kh, d, block_n; };
  const RuleCase rules[] = {
      {"d128_8k", 2, 8192, 16, 16, 128, 128},  {"d128_16k", 1, 16384, 16, 16, 128, 128},
      {"d256_4k", 4, 4096, 8, 8, 256, 64},     {"d256_8k", 2, 8192, 8, 8, 256, 64},
      {"d64_16k", 1, 16384, 32, 32, 64, 128},  {"gqa16_4_d128_8k", 2, 8192, 16, 4, 128, 128},
      {"d128_4k", 4, 4096, 16, 16, 128, 128},  {"d64_4k", 4, 4096, 32, 32, 64, 128},
      {"gqa64_8_d128_2k", 4, 2048, 64, 8, 128, 128},
  };
  // Causal grids: the split plan, and the simulated finish with and without
  // it. One wave (GQA under tensor parallelism: 8/1 per GPU), several waves
  // whose chunk spans whole heads (large GQA groups: the grid ends with the
  // last heads' longest key blocks), and grids with little to gain.
  struct SplitCase { const char* name; int b, t, n, kh; };
  const SplitCase splits[] = {{"gqa8_1_8k_b1", 1, 8192, 8, 1},   {"gqa8_1_8k_b2", 2, 8192, 8, 1},
                              {"gqa4_1_4k_b2", 2, 4096, 4, 1},   {"gqa16_2_8k_b1", 1, 8192, 16, 2},
                              {"mha8_1k_b1", 1, 1024, 8, 8},     {"waves_gqa64_8_2k_b4", 4, 2048, 64, 8},
                              {"waves_gqa16_4_8k_b2", 2, 8192, 16, 4}, {"waves_gqa32_8_8k_b2", 2, 8192, 32, 8},
                              {"waves_mha16_16k_b1", 1, 16384, 16, 16}, {"waves_mha32_32k_b1", 1, 32768, 32, 32},
                              {"waves_mha16_2k_b8", 8, 2048, 16, 16}};
  for (const SplitCase& c : splits) {
    BwdParams p;
    p.b = c.b; p.t = p.s = c.t; p.n = c.n; p.kh = c.kh; p.d = 128; p.num_sms = 132;
    p.window_left = -1; p.window_right = 0;
    BwdTileOrder o = BwdTileOrder::make(p, 128);
    const BwdTileOrder whole = o;
    o.plan_split(p, 64, 128, 159);
    double end = 0, end_whole = 0;
    simulate(o, p, 64, 128, 132, &end);
    simulate(whole, p, 64, 128, 132, &end_whole);
    std::printf("split %s units=%d pieces=%d split=%d sim=%.3f speedup=%.2f\n", c.name, o.num_units(), o.pieces,
                o.num_split(), simulate(o, p, 64, 128, 132), end_whole / end);
    // The same grid with packed documents: only one wave splits.
    const int32_t ids = 0;
    p.pair.q_ids = &ids;
    BwdTileOrder packed = BwdTileOrder::make(p, 128);
    packed.plan_split(p, 64, 128, 159);
    std::printf("split_packed %s units=%d pieces=%d\n", c.name, packed.num_units(), packed.pieces);
  }
  for (const RuleCase& r : rules) {
    BwdParams p;
    p.b = r.b; p.t = p.s = r.t; p.n = r.n; p.kh = r.kh; p.d = r.d; p.num_sms = 132;
    p.window_left = -1; p.window_right = 0;
    std::printf("rule %s chunk=%d\n", r.name, BwdTileOrder::make(p, r.block_n).chunk);
    // The same with packed documents (segment ids): the narrow chunk.
    const int32_t ids = 0;
    p.pair.q_ids = &ids;
    std::printf("rule %s_packed chunk=%d\n", r.name, BwdTileOrder::make(p, r.block_n).chunk);
  }
  std::printf("failures=%d\n", failures);
  return failures != 0;
}

// Host-side check of the backward's key-block dispatch (cc/bwd/tile_scheduler.h),
// built and run by tests/test_host_checks.py with nvcc (no GPU needed). For each
// problem and order it prints one line: order, ok (every (key block, KV head,
// batch) exactly once), monotone (the order's promise holds).
#include <cstdio>
#include <vector>
#include "bwd/tile_scheduler.h"

using jax_fa3::BwdParams;
using jax_fa3::BwdTileOrder;

int main() {
  const int seqs[] = {1, 127, 128, 1000, 4096, 8192, 16384, 40000};
  const int heads[][2] = {{1, 1}, {4, 1}, {4, 4}, {2, 3}};
  int failures = 0;
  for (int s : seqs) {
    for (const auto& hb : heads) {
      for (int mode = 0; mode < 3; ++mode) {
        BwdParams p;
        p.s = s; p.t = s; p.kh = hb[0]; p.b = hb[1]; p.n = hb[0];
        p.window_left = -1;
        p.window_right = mode == 0 ? -1 : 0;  // non-causal / causal
        p.deterministic = mode == 2;
        const BwdTileOrder order = BwdTileOrder::make(p, 128, false);
        std::vector<int> seen(size_t(order.num_n) * order.num_hb, 0);
        bool monotone = true;
        int prev_chunk = 0;
        std::vector<int> prev_n(order.num_hb, -1);
        for (int bid = 0; bid < order.num_ctas(); ++bid) {
          const auto t = order(bid);
          const int hbi = t.batch * p.kh + t.kv_head;
          if (t.n_block < 0 || t.n_block >= order.num_n || hbi < 0 || hbi >= order.num_hb) { monotone = false; continue; }
          ++seen[size_t(hbi) * order.num_n + t.n_block];
          if (order.order == BwdTileOrder::kLongestFirst) {
            const int chunk = t.n_block / BwdTileOrder::kChunk;  // chunks never go back
            monotone &= chunk >= prev_chunk;
            prev_chunk = chunk;
          } else if (order.order == BwdTileOrder::kDescending) {
            monotone &= prev_n[hbi] < 0 || t.n_block < prev_n[hbi];
          } else {
            monotone &= prev_n[hbi] < 0 || t.n_block > prev_n[hbi];
          }
          prev_n[hbi] = t.n_block;
        }
        bool ok = true;
        for (int c : seen) { ok &= c == 1; }
        std::printf("s=%d kh=%d b=%d order=%d ok=%d monotone=%d\n", s, p.kh, p.b, order.order, int(ok), int(monotone));
        failures += !(ok && monotone);
      }
    }
  }
  std::printf("failures=%d\n", failures);
  return failures != 0;
}

// Host-only check of the V transposer's address arithmetic (transpose.h):
// runs VTransposer::transpose_blocks for every warp and lane over a byte
// array laid out like shared memory, from a V tile written through the CuTe
// layout, and checks every byte of V^T (CuTe layout) against V(vt_key_of(p), d),
// for every V / V^T stage pair, and counts the shared-memory wavefronts per
// warp instruction of the transposer's loads and stores. No GPU needed (tests/test_host_checks.py
// builds and runs it when nvcc is present):
//   nvcc -std=c++17 --expt-relaxed-constexpr -I cc -I <cutlass>/include \
//        cc/tools/fp8_transpose_check.cu -o /tmp/transpose_check && /tmp/transpose_check
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fp8/traits.h"
#include "fp8/transpose.h"

namespace {

// Wavefronts of 32-bit shared accesses: per warp instruction (the i-th access
// of every lane), the largest number of distinct words any of the 32 banks
// serves (lanes reading one word share it).
void count_wavefronts(const std::vector<std::vector<uint32_t>>& per_lane, long& instr, long& waves) {
  const size_t n = per_lane[0].size();
  for (const auto& l : per_lane) {
    if (l.size() != n) { std::printf("  lanes issue different numbers of accesses\n"); std::exit(1); }
  }
  for (size_t i = 0; i < n; ++i) {
    std::vector<std::vector<uint32_t>> bank(32);
    for (const auto& l : per_lane) {
      const uint32_t word = l[i] / 4;
      auto& b = bank[word % 32];
      if (std::find(b.begin(), b.end(), word) == b.end()) b.push_back(word);
    }
    size_t w = 1;
    for (const auto& b : bank) w = std::max(w, b.size());
    ++instr;
    waves += long(w);
  }
}

template <int D>
bool check() {
  using Traits = jax_fa3::Fp8FwdTraits<cutlass::bfloat16_t, D>;
  using T = jax_fa3::VTransposer<Traits>;
  const typename Traits::SmemLayoutV lv{};
  const typename Traits::SmemLayoutVt lvt{};
  constexpr int kN = Traits::kBlockN;
  // A shared window like the kernel's: 1024-aligned, not at address 0.
  const uint32_t kBase = 0x400 + 7 * 1024;
  const uint32_t v_addr = kBase, vt_addr = kBase + uint32_t(cute::cosize_v<typename Traits::SmemLayoutV>);
  std::vector<uint8_t> mem(vt_addr - kBase + cute::cosize_v<typename Traits::SmemLayoutVt>, 0);
  auto at = [&](uint32_t a) -> uint8_t* { return &mem[a - kBase]; };
  auto load = [&](uint32_t a) {
    if (a % 4 || a < v_addr || a + 4 > vt_addr) { std::printf("  d%d: load out of V: %u\n", D, a); std::exit(1); }
    uint32_t v; std::memcpy(&v, at(a), 4); return v;
  };
  auto store = [&](uint32_t a, uint32_t v) {
    if (a % 4 || a < vt_addr || a + 4 > kBase + mem.size()) { std::printf("  d%d: store out of V^T: %u\n", D, a); std::exit(1); }
    std::memcpy(at(a), &v, 4);
  };
  auto value = [](int key, int d, int stage, int salt) { return uint8_t((key * 37 + d * 11 + stage * 101 + salt) * 0x9d >> 3); };
  long bad = 0;
  long lds_instr = 0, lds_wave = 0, sts_instr = 0, sts_wave = 0;
  for (int salt = 0; salt < 2; ++salt) {
    for (int sv = 0; sv < Traits::kStages; ++sv) {
      for (int svt = 0; svt < Traits::kStagesVt; ++svt) {
        std::fill(mem.begin(), mem.end(), 0);
        for (int key = 0; key < kN; ++key)
          for (int d = 0; d < D; ++d) *at(v_addr + uint32_t(lv(key, d, sv))) = value(key, d, sv, salt);
        // Poison V^T: every byte must be overwritten.
        for (int d = 0; d < D; ++d)
          for (int p = 0; p < kN; ++p) *at(vt_addr + uint32_t(lvt(d, p, svt))) = uint8_t(~value(jax_fa3::vt_key_of(p), d, sv, salt));
        for (int warp = 0; warp < T::kWarps; ++warp) {
          // Per lane, the addresses of its loads / stores in program order: the
          // i-th of every lane is one warp instruction (for the conflict count).
          std::vector<std::vector<uint32_t>> lds(32), sts(32);
          for (int lane = 0; lane < 32; ++lane)
            T::transpose_blocks(T::lane_offsets(lane), warp, v_addr + T::v_stage_off(sv),
                                vt_addr + T::vt_stage_off(svt),
                                [&](uint32_t a) { lds[lane].push_back(a); return load(a); },
                                [&](uint32_t a, uint32_t v) { sts[lane].push_back(a); store(a, v); });
          count_wavefronts(lds, lds_instr, lds_wave);
          count_wavefronts(sts, sts_instr, sts_wave);
        }
        for (int d = 0; d < D; ++d)
          for (int p = 0; p < kN; ++p) {
            const uint8_t got = *at(vt_addr + uint32_t(lvt(d, p, svt)));
            const uint8_t want = value(jax_fa3::vt_key_of(p), d, sv, salt);
            if (got != want && bad++ < 5) std::printf("  d%d stage %d/%d: V^T(%d, %d) = %u, want %u\n", D, sv, svt, d, p, got, want);
          }
      }
    }
  }
  // Shared-memory wavefronts per warp instruction: 1.00 is conflict-free.
  std::printf("d%d (kBlockN %d, V stages %d, V^T stages %d, smem %d B, wavefronts per LDS %.2f STS %.2f): %s\n",
              D, kN, Traits::kStages, Traits::kStagesVt, Traits::kSmemBytes,
              double(lds_wave) / double(lds_instr), double(sts_wave) / double(sts_instr), bad ? "FAIL" : "ok");
  return bad == 0;
}

}  // namespace

int main() {
  bool ok = check<64>() & check<128>() & check<256>();
  std::printf(ok ? "PASSED\n" : "FAILED\n");
  return ok ? 0 : 1;
}

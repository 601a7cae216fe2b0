// Host-only check of the V transposer (transpose.h): runs
// VTransposer::transpose_units for every warp, share and lane over a byte
// array laid out like shared memory, from a V tile written through the CuTe
// layout, with the warp-collective LDSM.x4.trans / STSM.x4 emulated per warp
// instruction, and checks every byte of V^T (CuTe layout) against
// V(vt_key_of(p), d) for every V / V^T stage pair; it also counts the
// shared-memory wavefronts per 128 bytes of those instructions. No GPU
// needed (tests/test_host_checks.py builds and runs it when nvcc is present):
//   nvcc -std=c++17 --expt-relaxed-constexpr -I cc -I <cutlass>/include \
//        cc/tools/fp8_transpose_check.cu -o /tmp/transpose_check && /tmp/transpose_check
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fp8/traits.h"
#include "fp8/transpose.h"

namespace {

using Regs = std::array<uint32_t, 4>;
using Addrs = std::array<uint32_t, 32>;  // one warp instruction: every lane's row address

// Wavefronts of one x4 matrix instruction: each matrix (8 rows of 16 bytes,
// rows from lanes 8m..8m+7) is one 128-byte access; per matrix the largest
// number of distinct 4-byte words any bank serves.
long wavefronts(const Addrs& a) {
  long waves = 0;
  for (int m = 0; m < 4; ++m) {
    std::vector<std::vector<uint32_t>> bank(32);
    for (int r = 0; r < 8; ++r)
      for (int w = 0; w < 4; ++w) {
        const uint32_t word = a[8 * m + r] / 4 + w;
        auto& b = bank[word % 32];
        if (std::find(b.begin(), b.end(), word) == b.end()) b.push_back(word);
      }
    size_t worst = 1;
    for (const auto& b : bank) worst = std::max(worst, b.size());
    waves += long(worst);
  }
  return waves;
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
  // A row of 16 bytes, inside V (loads) or V^T (stores), 16-byte aligned.
  auto row_ok = [&](uint32_t a, uint32_t lo, uint32_t hi) { return a % 16 == 0 && a >= lo && a + 16 <= hi; };
  auto value = [](int key, int d, int stage, int salt) { return uint8_t((key * 37 + d * 11 + stage * 101 + salt) * 0x9d >> 3); };
  long bad = 0, instr = 0, ld_waves = 0, st_waves = 0;
  for (int salt = 0; salt < 2; ++salt) {
    for (int sv = 0; sv < Traits::kStages; ++sv) {
      for (int svt = 0; svt < Traits::kStagesVt; ++svt) {
        std::fill(mem.begin(), mem.end(), 0);
        for (int key = 0; key < kN; ++key)
          for (int d = 0; d < D; ++d) *at(v_addr + uint32_t(lv(key, d, sv))) = value(key, d, sv, salt);
        // Poison V^T: every byte must be overwritten.
        for (int d = 0; d < D; ++d)
          for (int p = 0; p < kN; ++p) *at(vt_addr + uint32_t(lvt(d, p, svt))) = uint8_t(~value(jax_fa3::vt_key_of(p), d, sv, salt));
        // Each share is one warp's part of a tile (the kernel rotates shares
        // over the warps); together they must write all of V^T.
        for (int share = 0; share < T::kWarps; ++share) {
          // Pass 1: every lane's load addresses, in program order (the i-th
          // load of every lane is one warp instruction).
          std::vector<Addrs> lds;
          for (int lane = 0; lane < 32; ++lane) {
            int i = 0;
            T::transpose_units(T::lane_offsets(lane), share, v_addr + T::v_stage_off(sv),
                               vt_addr + T::vt_stage_off(svt),
                               [&](uint32_t a, uint32_t (&r)[4]) {
                                 if (lane == 0) lds.emplace_back();
                                 lds[i++][lane] = a;
                                 r[0] = r[1] = r[2] = r[3] = 0;
                               },
                               [](uint32_t, const uint32_t (&)[4]) {});
          }
          // The loads, as ldmatrix.trans hands them out: lane t gets from
          // matrix m the b16 elements (2 (t % 4), t / 4) and (2 (t % 4) + 1,
          // t / 4), i.e. bytes [row 2q][2c], [2q][2c+1], [2q+1][2c], [2q+1][2c+1].
          std::vector<std::array<Regs, 32>> got(lds.size());
          for (size_t i = 0; i < lds.size(); ++i) {
            for (int l = 0; l < 32; ++l) {
              if (!row_ok(lds[i][l], v_addr, vt_addr)) { std::printf("  d%d: LDSM row out of V: %u\n", D, lds[i][l]); std::exit(1); }
            }
            for (int t = 0; t < 32; ++t)
              for (int m = 0; m < 4; ++m) {
                const int q = t % 4, c = t / 4;
                const uint8_t* r0 = at(lds[i][8 * m + 2 * q]);
                const uint8_t* r1 = at(lds[i][8 * m + 2 * q + 1]);
                got[i][t][m] = uint32_t(r0[2 * c]) | uint32_t(r0[2 * c + 1]) << 8 | uint32_t(r1[2 * c]) << 16 |
                               uint32_t(r1[2 * c + 1]) << 24;
              }
            ld_waves += wavefronts(lds[i]);
            ++instr;
          }
          // Pass 2: the same program fed those registers; its stores recorded.
          std::vector<Addrs> sts;
          std::vector<std::array<Regs, 32>> put;
          for (int lane = 0; lane < 32; ++lane) {
            int i = 0, j = 0;
            T::transpose_units(T::lane_offsets(lane), share, v_addr + T::v_stage_off(sv),
                               vt_addr + T::vt_stage_off(svt),
                               [&](uint32_t, uint32_t (&r)[4]) { for (int m = 0; m < 4; ++m) r[m] = got[i][lane][m]; ++i; },
                               [&](uint32_t a, const uint32_t (&r)[4]) {
                                 if (lane == 0) { sts.emplace_back(); put.emplace_back(); }
                                 sts[j][lane] = a;
                                 for (int m = 0; m < 4; ++m) put[j][lane][m] = r[m];
                                 ++j;
                               });
          }
          // stmatrix: lane t's register m goes to row t / 4 of matrix m, bytes 4 (t % 4)..+3.
          for (size_t j = 0; j < sts.size(); ++j) {
            for (int l = 0; l < 32; ++l) {
              if (!row_ok(sts[j][l], vt_addr, kBase + uint32_t(mem.size()))) { std::printf("  d%d: STSM row out of V^T: %u\n", D, sts[j][l]); std::exit(1); }
            }
            for (int t = 0; t < 32; ++t)
              for (int m = 0; m < 4; ++m) std::memcpy(at(sts[j][8 * m + t / 4] + 4 * (t % 4)), &put[j][t][m], 4);
            st_waves += wavefronts(sts[j]);
          }
        }
        for (int d = 0; d < D; ++d)
          for (int p = 0; p < kN; ++p) {
            const uint8_t g = *at(vt_addr + uint32_t(lvt(d, p, svt)));
            const uint8_t want = value(jax_fa3::vt_key_of(p), d, sv, salt);
            if (g != want && bad++ < 5) std::printf("  d%d stage %d/%d: V^T(%d, %d) = %u, want %u\n", D, sv, svt, d, p, g, want);
          }
      }
    }
  }
  // Wavefronts per 128 bytes (one matrix): 1.00 is conflict-free.
  std::printf("d%d (kBlockN %d, V stages %d, V^T stages %d, smem %d B, wavefronts per 128 B: LDSM %.2f STSM %.2f): %s\n",
              D, kN, Traits::kStages, Traits::kStagesVt, Traits::kSmemBytes,
              double(ld_waves) / double(4 * instr), double(st_waves) / double(4 * instr), bad ? "FAIL" : "ok");
  return bad == 0;
}

}  // namespace

int main() {
  bool ok = check<64>() & check<128>() & check<256>();
  std::printf(ok ? "PASSED\n" : "FAILED\n");
  return ok ? 0 : 1;
}

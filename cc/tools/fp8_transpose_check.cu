// Host-only check of the V transposer's address arithmetic (transpose.h):
// runs VTransposer::transpose_blocks for every warp and lane over a byte
// array laid out like shared memory, from a V tile written through the CuTe
// layout, and checks every byte of V^T (CuTe layout) against V(vt_key_of(p), d),
// for every V / V^T stage pair. No GPU needed (tests/test_host_checks.py
// builds and runs it when nvcc is present):
//   nvcc -std=c++17 --expt-relaxed-constexpr -I cc -I <cutlass>/include \
//        cc/tools/fp8_transpose_check.cu -o /tmp/transpose_check && /tmp/transpose_check
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "fp8/traits.h"
#include "fp8/transpose.h"

namespace {

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
  for (int salt = 0; salt < 2; ++salt) {
    for (int sv = 0; sv < Traits::kStages; ++sv) {
      for (int svt = 0; svt < Traits::kStagesVt; ++svt) {
        std::fill(mem.begin(), mem.end(), 0);
        for (int key = 0; key < kN; ++key)
          for (int d = 0; d < D; ++d) *at(v_addr + uint32_t(lv(key, d, sv))) = value(key, d, sv, salt);
        // Poison V^T: every byte must be overwritten.
        for (int d = 0; d < D; ++d)
          for (int p = 0; p < kN; ++p) *at(vt_addr + uint32_t(lvt(d, p, svt))) = uint8_t(~value(jax_fa3::vt_key_of(p), d, sv, salt));
        for (int warp = 0; warp < T::kWarps; ++warp)
          for (int lane = 0; lane < 32; ++lane)
            T::transpose_blocks(T::lane_offsets(lane), warp, v_addr + T::v_stage_off(sv),
                                vt_addr + T::vt_stage_off(svt), load, store);
        for (int d = 0; d < D; ++d)
          for (int p = 0; p < kN; ++p) {
            const uint8_t got = *at(vt_addr + uint32_t(lvt(d, p, svt)));
            const uint8_t want = value(jax_fa3::vt_key_of(p), d, sv, salt);
            if (got != want && bad++ < 5) std::printf("  d%d stage %d/%d: V^T(%d, %d) = %u, want %u\n", D, sv, svt, d, p, got, want);
          }
      }
    }
  }
  std::printf("d%d (kBlockN %d, V stages %d, V^T stages %d, smem %d B): %s\n", D, kN, Traits::kStages,
              Traits::kStagesVt, Traits::kSmemBytes, bad ? "FAIL" : "ok");
  return bad == 0;
}

}  // namespace

int main() {
  bool ok = check<64>() & check<128>() & check<256>();
  std::printf(ok ? "PASSED\n" : "FAILED\n");
  return ok ? 0 : 1;
}

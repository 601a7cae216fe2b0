// Host-side check of the mask-bit addressing (cc/common/mask.h,
// mask_bits_at; layout in cc/fwd/params.h), built and run by
// tests/test_host_checks.py with nvcc (no GPU needed). For every kernel
// family's score tile (forward S, FP8 S, backward S^T) it packs a random mask
// as jax_fa3/pair_rule.py does, then reads every lane's fragment through the
// kernels' addressing and compares with the mask at the element's (row, col).
// One line per tile: "<name> ok" or the first mismatch; then "failures=N".
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "bwd/traits.h"
#include "fp8/traits.h"
#include "fwd/traits.h"
#include "common/mask.h"
#include "common/utils.h"

using namespace cute;

template <class TiledMma, class Tile, int kBlockCols>
int check(const char* name, int threads) {
  constexpr int rows = 2 * size<0>(Tile{}) + 5, cols = 3 * kBlockCols + 7;
  const int chunks = int(jax_fa3::mask_chunks(cols));
  std::mt19937 gen(7);
  std::vector<uint8_t> mask(size_t(rows) * cols);
  std::vector<uint32_t> bits(size_t(rows) * 4 * chunks, 0);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) {
      const uint8_t m = gen() % 2;
      mask[size_t(i) * cols + j] = m;
      // Column 128 c + 8 j + 2 t + e: bit 2 j + e of word [row, t, c] (pair_rule._pack_bits).
      if (m) bits[(size_t(i) * 4 + (j % 8) / 2) * chunks + j / 128] |= 1u << (2 * ((j % 128) / 8) + j % 2);
    }
  TiledMma mma;
  for (int tid = 0; tid < threads; ++tid) {
    Tensor c = jax_fa3::as_rowcol(mma.get_thread_slice(tid).partition_C(make_identity_tensor(Tile{})));
    for (int row0 = 0; row0 + size<0>(Tile{}) <= rows; row0 += size<0>(Tile{}))
      for (int col0 = 0; col0 < cols; col0 += kBlockCols)
        for (int r = 0; r < size<0>(c); ++r) {
          const auto at = jax_fa3::mask_bits_at(row0 + get<0>(c(r, 0)), get<1>(c(r, 0)), col0, chunks);
          const uint64_t w = (uint64_t(bits[at.word + 1]) << 32) | bits[at.word];
          const uint32_t window = uint32_t(w >> at.shift);
          for (int col = 0; col < size<1>(c); ++col) {
            const int i = row0 + get<0>(c(r, col)), j = col0 + get<1>(c(r, col));
            const int want = j < cols ? mask[size_t(i) * cols + j] : 0;
            if (int((window >> col) & 1u) != want) {
              std::printf("%s tid %d row %d col %d: bit %d, mask %d\n", name, tid, i, j, int((window >> col) & 1u), want);
              return 1;
            }
          }
        }
  }
  std::printf("%s ok\n", name);
  return 0;
}

int main() {
  using bf16 = cutlass::bfloat16_t;
  int failures = 0;
  using F64 = jax_fa3::FwdTraits<bf16, 64>;
  using F256 = jax_fa3::FwdTraits<bf16, 256>;
  using F192x64 = jax_fa3::FwdTraits<bf16, 64, jax_fa3::FwdTile<192, 128, 2, false>>;
  failures += check<F64::TiledMmaQK, Shape<Int<F64::kBlockM>, Int<F64::kBlockN>>, F64::kBlockN>("fwd_d64", F64::kNumMmaThreads);
  failures += check<F256::TiledMmaQK, Shape<Int<F256::kBlockM>, Int<F256::kBlockN>>, F256::kBlockN>("fwd_d256", F256::kNumMmaThreads);
  failures += check<F192x64::TiledMmaQK, Shape<Int<F192x64::kBlockM>, Int<F192x64::kBlockN>>, F192x64::kBlockN>(
      "fwd_d64_m192", F192x64::kNumMmaThreads);
  using P128 = jax_fa3::Fp8FwdTraits<bf16, 128>;
  failures += check<P128::TiledMmaQK, Shape<Int<P128::kBlockM>, Int<P128::kBlockN>>, P128::kBlockN>("fp8_d128", P128::kNumMmaThreads);
  using B64 = jax_fa3::BwdTraits<bf16, 64>;
  using B128 = jax_fa3::BwdTraits<bf16, 128>;
  using B256 = jax_fa3::BwdTraits<bf16, 256>;
  failures += check<B64::TiledMmaSdP, B64::TileSdP, B64::kBlockM>("bwd_d64", B64::kNumMmaThreads);
  failures += check<B128::TiledMmaSdP, B128::TileSdP, B128::kBlockM>("bwd_d128", B128::kNumMmaThreads);
  failures += check<B256::TiledMmaSdP, B256::TileSdP, B256::kBlockM>("bwd_d256", B256::kNumMmaThreads);
  std::printf("failures=%d\n", failures);
  return failures != 0;
}

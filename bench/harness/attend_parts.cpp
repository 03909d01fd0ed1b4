// One KV block of the paged attention with 16 queries (n = 8 forked rows, 2 query heads a KV
// head), its K and V in L1, and its parts alone: the whole block as attend() runs it (two tiles
// of 4 pairs, attend_pairs<4>), the scores alone (dot4_pairs and sums8_pairs), the value sums
// alone (accumulate_span_z) and the exponentials alone (vexp over the pair layout).
//
//   g++ -O3 -std=c++20 -mavx2 -mfma -mavx512f -mavx512vl -o /tmp/attend_parts bench/harness/attend_parts.cpp
//   /tmp/attend_parts
//
// Best of 5 rounds of 200000 blocks each; microseconds a block. Needs AVX-512VL. The block's
// multiply-adds (16 queries x 32 keys x 64, twice) are 4096 16-lane instructions: at two a cycle,
// 0.8 us on a core that runs 5.2 G of them a second (bench/harness/fma_rate.cpp).
#include "../../worker/engine/kernels/csrc/pa_kernel_avx512.cpp"
#include <algorithm>
#include <chrono>
#include <cstdio>

namespace mlxq_pa::avx512 {
namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void run() {
  constexpr int D = 64, BS = 32, NQ = 16, reps = 200000;
  alignas(64) static float K[BS * D], V[BS * D], q2[NQ / 2][2 * D], acc[NQ][D], m[NQ], l[NQ];
  for (int i = 0; i < BS * D; ++i) {
    K[i] = ((i * 37) % 100) / 100.f - 0.5f;
    V[i] = ((i * 53) % 100) / 100.f - 0.5f;
  }
  for (int i = 0; i < NQ / 2; ++i)
    for (int d = 0; d < 2 * D; ++d)
      q2[i][d] = ((i * 7 + d * 3) % 50) / 50.f - 0.5f;
  QRef qs[NQ];
  for (int i = 0; i < NQ; ++i)
    qs[i] = {q2[i / 2], &m[i], &l[i], acc[i], 0, BS, nullptr, i % 2 == 0 ? q2[i / 2] : nullptr};
  alignas(64) float s[kTileRows * kMaxBlock] = {}, p[kTileRows * kMaxBlock] = {};
  PrefetchQueue pq;
  const F32Rows k{K, D}, v{V, D};
  float corr[NQ];
  std::fill(corr, corr + NQ, 1.0f);
  float sink = 0;
  const char* names[] = {"whole block (2 tiles of 4 pairs)", "scores alone", "value sums alone", "exponentials alone"};
  for (int part = 0; part < 4; ++part) {
    double best = 1e9;
    for (int r = 0; r < 5; ++r) {
      for (int i = 0; i < NQ; ++i) {
        m[i] = kNegInf;
        l[i] = 0.0f;
        std::fill(acc[i], acc[i] + D, 0.0f);
      }
      const double t0 = now();
      for (int it = 0; it < reps; ++it) {
        if (part == 0) {
          attend_pairs<4>(qs, k, v, D, D, s, p, pq);
          attend_pairs<4>(qs + 8, k, v, D, D, s, p, pq);
        } else if (part == 1) {
          __m512 lo[4], hi[4];
          for (int t = 0; t < 2; ++t)
            for (int j8 = 0; j8 < BS; j8 += 8) {
              dot4_pairs<4>(qs + 8 * t, k, j8, D, lo);
              dot4_pairs<4>(qs + 8 * t, k, j8 + 4, D, hi);
              for (int i = 0; i < 4; ++i)
                _mm512_storeu_ps(s + i * 2 * kMaxBlock + (j8 >> 3) * 16, sums8_pairs(lo[i], hi[i]));
            }
        } else if (part == 2) {
          for (int t = 0; t < 4; ++t)
            accumulate_span_z<4>(qs + 4 * t, D, corr, p, v, 0, BS, pq);
        } else {
          for (int t = 0; t < 2; ++t)
            for (int i = 0; i < 4; ++i) {
              vz sum = vz{};
              for (int j8 = 0; j8 < BS; j8 += 8) {
                vz x;
                std::memcpy(&x, s + i * 2 * kMaxBlock + (j8 >> 3) * 16, sizeof(x));
                const vz e = vexp_t<vz, vzi>(x - vz{});
                std::memcpy(p + i * 2 * kMaxBlock + (j8 >> 3) * 16, &e, sizeof(e));
                sum += e;
              }
              sink += sum[0];
            }
        }
      }
      best = std::min(best, (now() - t0) / reps);
    }
    printf("%-34s %.3f us a block\n", names[part], best * 1e6);
  }
  printf("(%g)\n", sink + acc[3][5] + s[7]);
}
} // namespace
} // namespace mlxq_pa::avx512

int main() {
  mlxq_pa::avx512::run();
}

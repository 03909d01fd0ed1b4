// Two 8-lane computations in one 16-lane register (AVX-512F): the low half carries one row's
// 8 lanes and the high half another's, each lane the very operations the 8-lane loops give it,
// so the bits stay the 8-lane build's. Shared by the attention's query pairs (pa_kernel_impl.h,
// PA_ZMM) and the matmul's row pairs (rowdot_impl.h, ROWDOT_ZMM); only their AVX-512 builds
// include it.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace mlxq::pairs16 {

// p[0..8) into both halves: a 256-bit broadcast, a load and no shuffle.
inline __m512 bcast8(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

// Half h (0: low, 1: high) of z as 8 lanes.
inline __m256 half(__m512 z, int h) {
  return h == 0 ? _mm512_castps512_ps256(z) : _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1));
}

// Rows a and b (n floats, n a multiple of 8) interleaved 8 floats at a time into dst (2 n
// floats): a[0..8), b[0..8), a[8..16), ...; b null gives zeros in its place.
inline void interleave8(const float* a, const float* b, int64_t n, float* dst) {
  for (int64_t d = 0; d < n; d += 8) {
    std::memcpy(dst + 2 * d, a + d, 8 * sizeof(float));
    if (b != nullptr)
      std::memcpy(dst + 2 * d + 8, b + d, 8 * sizeof(float));
    else
      std::memset(dst + 2 * d + 8, 0, 8 * sizeof(float));
  }
}

// buf sized for n floats from a 64-byte boundary, and that boundary: a pair's 8 + 8 floats of a
// k-step then lie in one cache line (a 16-lane load across two lines is two loads; unaligned,
// the bench model's 64-row matmuls from L1 took 31-33 ms against 26-29, one thread).
inline float* aligned64(std::vector<float>& buf, size_t n) {
  buf.resize(n + 64 / sizeof(float));
  const uintptr_t a = reinterpret_cast<uintptr_t>(buf.data());
  return buf.data() + ((64 - (a & 63)) & 63) / sizeof(float);
}

} // namespace mlxq::pairs16

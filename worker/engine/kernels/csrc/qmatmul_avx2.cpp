// qmatmul_impl.h in 8-lane AVX2 registers with FMA (built -mavx2 -mfma, and -ffp-contract=off: the
// dequantizing multiply and add stay two roundings, as MLX's dequantize).
#include <immintrin.h>

#include <cstdint>

namespace mlxq::qmatmul::avx2 {
namespace {
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
// The 8 nibbles of one word, low first.
inline V unpack4(uint32_t word) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), _mm256_set1_epi32(15));
  return _mm256_cvtepi32_ps(q);
}
// The 8 bytes of two words, low first.
inline V unpack8(const uint32_t* words) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(words))));
}
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): rowdot's hsum.
inline float vhsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
} // namespace
} // namespace mlxq::qmatmul::avx2

#define QMATMUL_NS avx2
#include "qmatmul_impl.h"

// qmatmul_impl.h in 8-lane AVX2 registers with FMA (built -mavx2 -mfma, and -ffp-contract=off: the
// dequantizing multiply and add stay two roundings, as MLX's dequantize).
#include <immintrin.h>

#include <cstdint>

namespace mlxq::qmatmul::avx2 {
namespace {
#include "lanes8_avx2.h"
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
} // namespace
} // namespace mlxq::qmatmul::avx2

#define QMATMUL_NS avx2
#include "qmatmul_impl.h"

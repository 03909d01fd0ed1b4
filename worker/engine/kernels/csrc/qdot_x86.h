// qdot_impl.h in AVX2 registers, for qdot_avx2.cpp and qdot_vnni.cpp (built -mavx2 -mfma
// -ffp-contract=off; with QDOT_VNNI also -mavxvnni). A lane's integer is the same either way: AVX2 multiplies bytes into 16-bit pairs
// (maddubs) and adds pairs into 32 bits (madd), AVX-VNNI's dpbusd does both in one instruction.
// 8-bit weights go through maddubs as two nibbles (a whole byte times 127 twice would saturate
// its 16 bits); dpbusd takes the byte whole.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace mlxq::qdot::QDOT_NS {
namespace {
using V = __m256;
using I = __m256i;
using W = __m256i;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float sfma(float a, float b, float c) {
  return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c)));
}
inline V vcvt(I x) { return _mm256_cvtepi32_ps(x); }
inline float vhsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
template <int BITS>
inline W load_weights(const uint8_t* p) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    return _mm256_set_m128i(hi, lo);
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
}
template <int BITS>
inline I dot4(W w, const int8_t* xp) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp));
#ifdef QDOT_VNNI
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
  } else {
    const __m256i m = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w, m), x), ones);
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), m), x), ones);
    return _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4));
  }
#endif
}
} // namespace
} // namespace mlxq::qdot::QDOT_NS

#include "qdot_impl.h"

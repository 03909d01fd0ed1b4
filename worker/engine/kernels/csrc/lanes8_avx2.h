// 8 float lanes in an AVX2 register, for the AVX2 builds of the quantized matmuls (qmatmul_avx2.cpp,
// qdot_x86.h): the operations lanes8_generic.h emulates. Included inside the namespace that uses them
// (no include guard: each such namespace gets its own copy).
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): rowdot's hsum.
inline float vhsum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

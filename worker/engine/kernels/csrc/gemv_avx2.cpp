// One-row weight matmul (y = W x, W rows contiguous) for x86-64 with AVX2 and FMA;
// CMakeLists.txt compiles this file alone with -mavx2 -mfma, and linear_ops.cpp
// calls it only when the CPU reports both (__builtin_cpu_supports).
//
// A decode step at batch 1 reads every weight once, so its matmuls are bound by
// memory bandwidth. OpenBLAS's single-threaded sgemv reads the bench model's
// 57 matrices at ~27 GB/s over 2 threads here; this loop (4 rows at a time, two
// accumulators each, x from L1) at ~32 GB/s. Each row's sum has one fixed order
// whichever group of 4 it falls in, so a row's result does not depend on how the
// rows are split over threads.
#include <immintrin.h>

#include <cstdint>

#include "gemv.h"

namespace mlxq::gemv_avx2 {

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The part of a row's sum past the last full 16: one more 8, then one at a time.
inline float tail(const float* r, const float* x, int k16, int K, __m256 a, __m256 b) {
  int k = k16;
  if (k + 8 <= K) {
    a = _mm256_fmadd_ps(_mm256_loadu_ps(r + k), _mm256_loadu_ps(x + k), a);
    k += 8;
  }
  float s = hsum(_mm256_add_ps(a, b));
  for (; k < K; ++k)
    s += r[k] * x[k];
  return s;
}

} // namespace

void rows(const float* w, int64_t ldw, const float* x, float* y, int K, int n0, int n1, bool add) {
  const int k16 = K & ~15;
  int n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float* r0 = w + (int64_t)n * ldw;
    const float* r1 = r0 + ldw;
    const float* r2 = r1 + ldw;
    const float* r3 = r2 + ldw;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int k = 0; k < k16; k += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + k), x0, a0);
      b0 = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + k + 8), x1, b0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(r1 + k), x0, a1);
      b1 = _mm256_fmadd_ps(_mm256_loadu_ps(r1 + k + 8), x1, b1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(r2 + k), x0, a2);
      b2 = _mm256_fmadd_ps(_mm256_loadu_ps(r2 + k + 8), x1, b2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(r3 + k), x0, a3);
      b3 = _mm256_fmadd_ps(_mm256_loadu_ps(r3 + k + 8), x1, b3);
    }
    const float s0 = tail(r0, x, k16, K, a0, b0), s1 = tail(r1, x, k16, K, a1, b1);
    const float s2 = tail(r2, x, k16, K, a2, b2), s3 = tail(r3, x, k16, K, a3, b3);
    y[n] = add ? y[n] + s0 : s0;
    y[n + 1] = add ? y[n + 1] + s1 : s1;
    y[n + 2] = add ? y[n + 2] + s2 : s2;
    y[n + 3] = add ? y[n + 3] + s3 : s3;
  }
  for (; n < n1; ++n) {
    const float* r = w + (int64_t)n * ldw;
    __m256 a = _mm256_setzero_ps(), b = a;
    for (int k = 0; k < k16; k += 16) {
      a = _mm256_fmadd_ps(_mm256_loadu_ps(r + k), _mm256_loadu_ps(x + k), a);
      b = _mm256_fmadd_ps(_mm256_loadu_ps(r + k + 8), _mm256_loadu_ps(x + k + 8), b);
    }
    const float s = tail(r, x, k16, K, a, b);
    y[n] = add ? y[n] + s : s;
  }
}

} // namespace mlxq::gemv_avx2

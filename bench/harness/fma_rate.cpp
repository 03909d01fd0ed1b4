// How many 16-lane (8-lane without AVX-512) fused multiply-adds a second a core of this machine runs right now, on one
// thread and on two at once: 12 independent chains, nothing from memory. On a shared VM the rate
// moves with what the other tenants of the physical cores do (2026-11-26, 17:10: 5.2-5.3 G a
// second on one thread, a minute later 3.45; 17:40: 3.33 alone, 2.20 + 5.36 on two), and every
// compute-bound figure moves with it.
//
//   g++ -O3 -std=c++17 -mavx512f -pthread -o /tmp/fma_rate bench/harness/fma_rate.cpp
//   /tmp/fma_rate
// Without AVX-512 (an AMD Zen 3 VM, 2026-11-27), 8-lane ones: -mavx2 -mfma in place of -mavx512f.
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <thread>

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// G multiply-add instructions a second over `iters` rounds of 12.
#ifdef __AVX512F__
typedef __m512 V;
static V set1(float x) { return _mm512_set1_ps(x); }
static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static float sum(V v) { return _mm512_reduce_add_ps(v); }
#else // AVX2 + FMA only (-mavx2 -mfma): 8-lane instructions
typedef __m256 V;
static V set1(float x) { return _mm256_set1_ps(x); }
static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static float sum(V v) { float f[8]; _mm256_storeu_ps(f, v); return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7]; }
#endif

static double rate(long iters = 50000000) {
  V a[12];
  for (int i = 0; i < 12; ++i)
    a[i] = set1(i * 0.1f);
  const V m = set1(0.999f), c = set1(0.001f);
  const double t0 = now();
  for (long it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i)
      a[i] = fma(a[i], m, c);
  const double t = now() - t0;
  float s = 0;
  for (int i = 0; i < 12; ++i)
    s += sum(a[i]);
  if (s == 12345.0f) // keeps the chains
    printf(" ");
  return iters * 12.0 / t / 1e9;
}

int main() {
  printf("one thread: %.2f G a second\n", rate());
  double other = 0;
  std::thread t([&] { other = rate(); });
  const double mine = rate();
  t.join();
  printf("two threads at once: %.2f + %.2f G a second\n", mine, other);
}

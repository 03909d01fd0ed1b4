// Can a core fetch the next layer's K/V while its weight matmuls compute, so that the attention
// then reads them from cache? One thread: multiply-adds on data in L1 for ~2.5 ms (a layer's
// matmuls at batch 64), with or without prefetches of a 21 MB buffer (one layer's K and V at 64
// rows of ~150 tokens) spread over them, then a read of that buffer; a 512 MB read first flushes
// the caches each round.
//
//   g++ -O3 -std=c++17 -mavx512f -o /tmp/prefetch_during_compute bench/harness/prefetch_during_compute.cpp
//   /tmp/prefetch_during_compute 21 0 20000   # MB, hint (0 none, 1 T1, 2 T2, 3 T0, 4 NTA), rounds of 64 x 8 FMAs
//
// 2026-11-26 17:00-17:40 (this VM, two runs): without prefetches 2.3-2.6 ms of multiply-adds,
// then 11.5-12.8 GB/s; with T1 or T2 3.0-3.3 ms, then 12.3-14.8 GB/s; NTA 3.4-3.6 ms, then
// 9.6-10.0 GB/s. The read is hardly faster and the multiply-adds a quarter slower: no gain.
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static float sum(const float* p, size_t n) {
  __m512 a = _mm512_setzero_ps(), b = a, c = a, d = a;
  for (size_t i = 0; i < n; i += 64) {
    a = _mm512_add_ps(a, _mm512_load_ps(p + i));
    b = _mm512_add_ps(b, _mm512_load_ps(p + i + 16));
    c = _mm512_add_ps(c, _mm512_load_ps(p + i + 32));
    d = _mm512_add_ps(d, _mm512_load_ps(p + i + 48));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
}

// iters rounds of 64 x 8 independent multiply-adds on x (in L1), prefetching the pn bytes at pf
// evenly over them with `hint`.
static float compute(const float* x, long iters, const char* pf, size_t pn, int hint) {
  __m512 acc[8];
  for (int i = 0; i < 8; ++i)
    acc[i] = _mm512_setzero_ps();
  const __m512 w = _mm512_set1_ps(1.0001f);
  const size_t lines = pn / 64, per = lines ? (lines + iters - 1) / iters : 0;
  size_t li = 0;
  for (long it = 0; it < iters; ++it) {
    for (int k = 0; k < 64; ++k) {
      const __m512 v = _mm512_load_ps(x + (k & 15) * 16);
      for (int i = 0; i < 8; ++i)
        acc[i] = _mm512_fmadd_ps(v, w, acc[i]);
    }
    for (size_t j = 0; j < per && li < lines; ++j, ++li) {
      const char* a = pf + li * 64;
      switch (hint) {
        case 1: _mm_prefetch(a, _MM_HINT_T1); break;
        case 2: _mm_prefetch(a, _MM_HINT_T2); break;
        case 3: _mm_prefetch(a, _MM_HINT_T0); break;
        default: _mm_prefetch(a, _MM_HINT_NTA); break;
      }
    }
  }
  __m512 s = acc[0];
  for (int i = 1; i < 8; ++i)
    s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

int main(int argc, char** argv) {
  if (argc < 4)
    return fprintf(stderr, "usage: prefetch_during_compute MB hint rounds\n"), 2;
  const size_t mb = atoi(argv[1]), n = mb << 18, big = (size_t)512 << 18;
  const int hint = atoi(argv[2]);
  const long iters = atol(argv[3]);
  float* p = (float*)aligned_alloc(64, n * 4);
  float* flush = (float*)aligned_alloc(64, big * 4);
  float* x = (float*)aligned_alloc(64, 4096);
  memset(p, 1, n * 4);
  memset(flush, 1, big * 4);
  memset(x, 0, 4096);
  float sink = 0;
  for (int r = 0; r < 6; ++r) {
    sink += sum(flush, big);
    const double t0 = now();
    sink += compute(x, iters, (const char*)p, hint ? n * 4 : 0, hint);
    const double t1 = now();
    sink += sum(p, n);
    const double t2 = now();
    printf("%zu MB, hint %d: multiply-adds %.2f ms, then the read %.2f ms = %.1f GB/s\n", mb, hint,
           (t1 - t0) * 1e3, (t2 - t1) * 1e3, n * 4 / (t2 - t1) / 1e9);
  }
  return sink == 12345.0f;
}

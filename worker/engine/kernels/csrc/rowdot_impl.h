// x @ w^T over rows as stored, for x86-64 with AVX2 and FMA; see rowdot.h. Included by
// rowdot_avx2.cpp (-mavx2 -mfma: 16 vector registers, 4 x 3 tiles) and rowdot_avx512.cpp
// (also -mavx512f -mavx512vl: the same 8-lane instructions with 32 registers, 4 x 6
// tiles); linear_ops.cpp calls the one the CPU supports (isa.h). Both sum every output in
// the same order, so they give the same bits.
//
// Why not OpenBLAS's sgemm: at a decode step's few rows it packs the weight panel on
// every call (sgemm_incopy: a third of a batch-16 step's time on the bench model, more
// than its kernel), and its rounding of a row can depend on the batch. Here each weight
// row is read once per block of up to kRowBlock rows of x, straight from where it lies.
//
// A tile is MR rows of x by NR rows of w: MR * NR accumulators, per 8 k's MR + NR loads
// and MR * NR fused multiply-adds (4 x 3: 7 loads, 12 FMAs; 4 x 6: 10 loads, 24 FMAs and
// half the reads of x from L2 per FMA: ~82 against ~103 GFLOP/s on one Zen 4 core).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "rowdot.h"

namespace mlxq::rowdot::ROWDOT_NS {

namespace {

// The lanes' one fixed tree: (0+4, 1+5, 2+6, 3+7), then (a+c, b+d), then the two.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows of x per block: a block's rows (up to 64 x K floats) stay in L2 while every weight
// row of the part streams past them once; a decode step's batch (<= 64) is one block, so
// its weights are read from memory once.
constexpr int kRowBlock = 64;

constexpr int MR = ROWDOT_MR, NR = ROWDOT_NR;
// Tiles of a block (MR rows each) that prefetch the next strip: enough to keep the reads in
// flight through the block's first rows; in every tile, the repeated prefetches of lines
// already in L1 cost a prefill (256-512 rows) ~10%.
constexpr int kPrefetchTiles = 2;
static_assert(MR <= 4, "the last rows of a block are 1 to 3");

// pf: pf_rows weight rows (stride ldw) a later tile reads, prefetched one line per two
// k-steps while this tile computes, so that their reads from memory overlap this tile's
// arithmetic instead of stalling the next one (only timing: the same bits either way).
// Into L2 (prefetcht1): into L1 the next strip (6 rows of K floats: 12 KB at K = 512,
// 28 KB at 1184) evicted the strip and the rows of x the block's other tiles still read
// (the bench model's matmuls, interleaved in one process, medians of 4: 8 rows 5.30 ->
// 4.15 ms, 16 rows 7.61 -> 6.35, 64 rows 19.44 -> 18.28).
template <int TM, int TN>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int K, int k8,
                 bool add, const float* pf, int pf_rows) {
  __m256 acc[TM][TN];
#pragma GCC unroll 8
  for (int i = 0; i < TM; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j)
      acc[i][j] = _mm256_setzero_ps();
  for (int k = 0; k < k8; k += 8) {
    if ((k & 15) == 0)
      for (int j = 0; j < pf_rows; ++j)
        _mm_prefetch((const char*)(pf + j * ldw + k), _MM_HINT_T1);
    __m256 xv[TM];
#pragma GCC unroll 8
    for (int i = 0; i < TM; ++i)
      xv[i] = _mm256_loadu_ps(x + i * ldx + k);
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + j * ldw + k);
#pragma GCC unroll 8
      for (int i = 0; i < TM; ++i)
        acc[i][j] = _mm256_fmadd_ps(wv, xv[i], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < TM; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j) {
      float s = hsum(acc[i][j]);
      const float* xr = x + i * ldx;
      const float* wr = w + j * ldw;
      for (int k = k8; k < K; ++k)
        s = std::fma(wr[k], xr[k], s);
      float& out = y[i * ldy + j];
      out = add ? out + s : s;
    }
}

// The last R < TN weight rows of a strip, as one TM x R tile (a part's 16 columns are
// 2 x 6 + 4: singly, a quarter of the columns would run at 5 loads per 4 FMAs).
template <int TM, int R>
inline void rest(int r, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int K,
                 int k8, bool add, const float* pf, int pf_rows) {
  if constexpr (R > 0) {
    if (r == R)
      tile<TM, R>(x, ldx, w, ldw, y, ldy, K, k8, add, pf, pf_rows);
    else
      rest<TM, R - 1>(r, x, ldx, w, ldw, y, ldy, K, k8, add, pf, pf_rows);
  }
}

// TM rows of x against weight rows [n0, n1): TN at a time, then the rest as one tile; each
// tile prefetches pf_rows rows from pf on (see tile()), or with AHEAD the TN rows after its
// own (the strip's reads run one tile ahead of its arithmetic).
template <int TM, int TN, bool AHEAD = false>
inline void row_strip(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int K,
                      int k8, int n0, int n1, bool add, const float* pf = nullptr, int pf_rows = 0) {
  int n = n0;
  for (; n + TN <= n1; n += TN) {
    if (AHEAD) {
      pf = w + (int64_t)(n + TN) * ldw;
      pf_rows = std::min(TN, n1 - n - TN);
    }
    tile<TM, TN>(x, ldx, w + n * ldw, ldw, y + n, ldy, K, k8, add, pf, pf_rows);
  }
  if (AHEAD)
    pf_rows = 0;
  if (n < n1)
    rest<TM, TN - 1>(n1 - n, x, ldx, w + n * ldw, ldw, y + n, ldy, K, k8, add, pf, pf_rows);
}

#ifdef ROWDOT_FEW_MR
// A few rows (FMIN to FMR, a decode step of a handful of sequences): all of them in one tile
// against FNR weight rows at a time. Each weight element is then loaded into a register
// once, as it streams in, where the MR x NR tiles read a strip twice at 8 rows (the second
// time from L1) and hold it in L1 meanwhile; the reads of memory overlap the arithmetic
// better. The bench model's matmuls through linear on the pool, grouped as the engine calls
// them, 4 alternations, 2026-11-26: 6 rows 4.1-5.0 -> 3.4-3.7 ms, 8 rows 4.3-5.5 -> 4.1-4.7
// (one row: 2.9-3.3). Fewer than 5 rows gained nothing; the same bits either way.
// Each tile prefetches the FNR weight rows after its own (row_strip's read-ahead, as for one row).
constexpr int FMIN = 5, FMR = ROWDOT_FEW_MR, FNR = ROWDOT_FEW_NR;

template <int TM>
inline void few_rows(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy, int K,
                     int k8, int n0, int n1, bool add) {
  if constexpr (TM > FMIN) {
    if (M < TM)
      return few_rows<TM - 1>(x, ldx, M, w, ldw, y, ldy, K, k8, n0, n1, add);
  }
  row_strip<TM, FNR, true>(x, ldx, w, ldw, y, ldy, K, k8, n0, n1, add);
}
#endif

} // namespace

void matmul(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy, int K, int n0,
            int n1, bool add) {
  const int k8 = K & ~7;
  if (M == 1) { // memory-bound: 8 weight rows in flight, one x row from L1, and the next 8
    // rows prefetched into L2 as they go (a 1-row step's matmuls, interleaved in one process,
    // medians of 5: 4.33 -> 3.57 ms; into L1 the same prefetch measured no faster)
    row_strip<1, 8, true>(x, ldx, w, ldw, y, ldy, K, k8, n0, n1, add);
    return;
  }
#ifdef ROWDOT_FEW_MR
  if (M >= FMIN && M <= FMR) { // fewer: the MR x NR tiles (as fast, more accumulators)
    few_rows<FMR>(x, ldx, M, w, ldw, y, ldy, K, k8, n0, n1, add);
    return;
  }
#endif
  for (int m0 = 0; m0 < M; m0 += kRowBlock) {
    const int mb = std::min(kRowBlock, M - m0);
    const float* xb = x + m0 * ldx;
    float* yb = y + m0 * ldy;
    // weight rows NR at a time (in L1), every MR rows of the block against them; the
    // block's first tiles also prefetch the next strip's rows, which its first rows would
    // otherwise wait on with nothing to compute (the bench model's matmuls, 2026-11-25,
    // best of 3: 4 rows 633 -> 768 tok/s, 8 1076 -> 1332, 16 1645 -> 1868, 64 2975 -> 3168,
    // 512 unchanged)
    for (int nb = n0; nb < n1; nb += NR) {
      const int ne = std::min(n1, nb + NR);
      const int pf_rows = std::min(n1, ne + NR) - ne;
      const float* pf = w + (int64_t)ne * ldw;
      int m = 0;
      for (; m + MR <= mb; m += MR) {
        const int r = m < kPrefetchTiles * MR ? pf_rows : 0;
        row_strip<MR, NR>(xb + m * ldx, ldx, w, ldw, yb + m * ldy, ldy, K, k8, nb, ne, add, pf, r);
      }
      const int r = m < kPrefetchTiles * MR ? pf_rows : 0;
      switch (mb - m) {
        case 3: row_strip<3, NR>(xb + m * ldx, ldx, w, ldw, yb + m * ldy, ldy, K, k8, nb, ne, add, pf, r); break;
        case 2: row_strip<2, NR>(xb + m * ldx, ldx, w, ldw, yb + m * ldy, ldy, K, k8, nb, ne, add, pf, r); break;
        case 1: row_strip<1, NR>(xb + m * ldx, ldx, w, ldw, yb + m * ldy, ldy, K, k8, nb, ne, add, pf, r); break;
        default: break;
      }
    }
  }
}

} // namespace mlxq::rowdot::ROWDOT_NS

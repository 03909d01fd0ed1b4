// x @ w^T over rows as stored, for x86-64 with AVX2 and FMA; see rowdot.h. Included by
// rowdot_avx2.cpp (-mavx2 -mfma: 16 vector registers, 4 x 3 tiles, 3 x 4 from 17 rows) and rowdot_avx512.cpp
// (also -mavx512f -mavx512vl: the same 8-lane instructions with 32 registers, 4 x 6
// tiles, and from 5 rows on two rows' 8-lane chains in each 16-lane register, see
// rows_pairs); linear_ops.cpp calls the one the CPU supports (isa.h). Both sum every output in
// the same order, so they give the same bits.
//
// Why not OpenBLAS's sgemm: at a decode step's few rows it packs the weight panel on
// every call (sgemm_incopy: a third of a batch-16 step's time on the bench model, more
// than its kernel), and its rounding of a row can depend on the batch. Here each weight
// row is read once per block of up to kRowBlock rows of x, straight from where it lies.
//
// A tile is MR rows of x by NR rows of w: MR * NR accumulators, per 8 k's MR + NR loads
// and MR * NR fused multiply-adds (3 x 4: 7 loads, 12 FMAs; 4 x 6: 10 loads, 24 FMAs and
// half the reads of x from L2 per FMA: ~82 against ~103 GFLOP/s on one Zen 4 core).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "rowdot.h"
#ifdef ROWDOT_ZMM
#include "pairs16.h"
#endif

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

// pf: pf_rows weight rows (stride ldw) a later tile reads, prefetched one line per two
// k-steps while this tile computes, so that their reads from memory overlap this tile's
// arithmetic instead of stalling the next one (only timing: the same bits either way).
// Into L2 (prefetcht1): into L1 the next strip (6 rows of K floats: 12 KB at K = 512,
// 28 KB at 1184) evicted the strip and the rows of x the block's other tiles still read
// (the bench model's matmuls, interleaved in one process, medians of 4: 8 rows 5.30 ->
// 4.15 ms, 16 rows 7.61 -> 6.35, 64 rows 19.44 -> 18.28).
// x rows as stored, one 8-lane register a row and 8 k's.
struct Lanes8 {
  using V = __m256;
  static V zero() {
    return _mm256_setzero_ps();
  }
  static V x(const float* row, int k) {
    return _mm256_loadu_ps(row + k);
  }
  static V w(const float* p) {
    return _mm256_loadu_ps(p);
  }
  static V fma(V a, V b, V c) {
    return _mm256_fmadd_ps(a, b, c);
  }
};

// acc[i][j] = the 8-lane partial sums of x row i times w row j over k < k8 (L: how rows of x
// and w load into registers), prefetching pf_rows rows of pf as it goes: every lane one fused
// multiply-add chain from 0, whatever L.
template <class L, int TM, int TN>
inline void tile_loop(const float* x, int64_t ldx, const float* w, int64_t ldw, int k8, const float* pf, int pf_rows,
                      typename L::V (&acc)[TM][TN]) {
#pragma GCC unroll 8
  for (int i = 0; i < TM; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j)
      acc[i][j] = L::zero();
  for (int k = 0; k < k8; k += 8) {
    if ((k & 15) == 0)
      for (int j = 0; j < pf_rows; ++j)
        _mm_prefetch((const char*)(pf + j * ldw + k), _MM_HINT_T1);
    typename L::V xv[TM];
#pragma GCC unroll 8
    for (int i = 0; i < TM; ++i)
      xv[i] = L::x(x + i * ldx, k);
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j) {
      const typename L::V wv = L::w(w + j * ldw + k);
#pragma GCC unroll 8
      for (int i = 0; i < TM; ++i)
        acc[i][j] = L::fma(wv, xv[i], acc[i][j]);
    }
  }
}

// out (+)= the 8 lanes of v in hsum's tree, then the K % 8 last products of x row xr and w row wr.
inline void finish(__m256 v, const float* xr, const float* wr, int K, int k8, bool add, float& out) {
  float s = hsum(v);
  for (int k = k8; k < K; ++k)
    s = std::fma(wr[k], xr[k], s);
  out = add ? out + s : s;
}

// A tile row's TN accumulators (one per weight row) as the 8 that hsum8 / hsum_pairs8 reduce, zeros
// past TN.
template <class V, int TN>
inline void pad8(const V (&r)[TN], V (&a)[8]) {
  static_assert(TN <= 8, "a tile row's sums are one reduction of 8");
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j)
    a[j] = j < TN ? r[j] : V{};
}

// hsum of a[0..8) at once, lane j the sum of a[j]: per sum hsum's tree ((l0 + l4) + (l2 + l6)) +
// ((l1 + l5) + (l3 + l7)), the shuffles only moving lanes (the same bits, as hsum_pairs8).
inline __m256 hsum8(const __m256 (&a)[8]) {
  __m256 s1[4];
#pragma GCC unroll 4
  for (int u = 0; u < 4; ++u) // [a (l0..l3) + (l4..l7) | b's]
    s1[u] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * u], a[2 * u + 1], 0x20),
                          _mm256_permute2f128_ps(a[2 * u], a[2 * u + 1], 0x31));
  __m256 s2[2];
#pragma GCC unroll 2
  for (int u = 0; u < 2; ++u)
    s2[u] = _mm256_add_ps(_mm256_shuffle_ps(s1[2 * u], s1[2 * u + 1], 0x44),
                          _mm256_shuffle_ps(s1[2 * u], s1[2 * u + 1], 0xEE));
  const __m256 s3 = _mm256_add_ps(_mm256_shuffle_ps(s2[0], s2[1], 0x88), _mm256_shuffle_ps(s2[0], s2[1], 0xDD));
  // s3's lanes: a[0] a[2] a[4] a[6] a[1] a[3] a[5] a[7]
  return _mm256_permutevar8x32_ps(s3, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// A function of its own, never inlined: inlined into matmul's one-row strip (tile<1, 8>, once
// tile_loop and finish were split out of it), the compiler kept the 8 weight-row pointers on the
// stack and reloaded one before every multiply-add. Out of line they stay in registers, as before
// the split. The bench model's one-row matmuls (bench/harness/rowdot_rows.cpp, 2 threads, runs
// alternating): inlined 2.61-3.21 ms against 2.39-2.69 before the split (16 runs each); out of
// line again as fast as before the split (10 runs each); through MLX and the pool (linear at
// batch 1, 8 processes each) best 3.10 -> 2.99 ms. The same bits.
template <int TM, int TN>
[[gnu::noinline]] void tile(const float* x, int64_t ldx, const float* w, int64_t ldw, float* y, int64_t ldy, int K,
                            int k8, bool add, const float* pf, int pf_rows) {
  __m256 acc[TM][TN];
  tile_loop<Lanes8, TM, TN>(x, ldx, w, ldw, k8, pf, pf_rows, acc);
  // A row's TN sums at once (fewer: hsum's ~5 instructions a sum are as few). 4 rows from L1 on two
  // threads (rowdot_rows.cpp, 2026-11-27) 2.06-2.36 -> 1.83-2.00 ms; 1 to 4 rows from memory, bound by
  // the reads, unchanged.
  if constexpr (TN >= 5) {
    if (k8 == K) {
      const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i cols = _mm256_cmpgt_epi32(_mm256_set1_epi32(TN), lanes);
#pragma GCC unroll 8
      for (int i = 0; i < TM; ++i) {
        __m256 a[8];
        pad8(acc[i], a);
        __m256 s = hsum8(a);
        float* out = y + i * ldy;
        if (add)
          s = _mm256_add_ps(_mm256_maskload_ps(out, cols), s);
        if constexpr (TN == 8)
          _mm256_storeu_ps(out, s);
        else
          _mm256_maskstore_ps(out, cols, s);
      }
      return;
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < TM; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j)
      finish(acc[i][j], x + i * ldx, w + j * ldw, K, k8, add, y[i * ldy + j]);
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


#ifdef ROWDOT_ZMM
// Rows of x in pairs, in 16-lane registers (AVX-512F): a register holds the 8-lane accumulator
// of row 2p (low half) and of row 2p + 1 (high half) against one weight row, each half the very
// chain of fused multiply-adds the 8-lane tiles give that output, then the same hsum tree: the
// same bits. The weight row's 8 floats are loaded into both halves at once (a 256-bit broadcast:
// a load, no shuffle), so each multiply-add instruction does two rows' work.
// * 2 to 4 rows (memory-bound): the 4 x 6 tiles of 8-lane registers were faster.
// * 5 to 8 rows (n = 8's forked samples, a handful of jobs): all the pairs against the weight rows,
//   3 or 4 pairs a tile (strip_pairs). It replaced 8 x 3 tiles of 8-lane registers, which at 8
//   rows needed 33 registers and spilled: the bench model's matmuls on two threads, one process
//   alternating, 2026-11-26, 8 rows 4.5-4.9 -> 3.4-3.8 ms, 5 to 7 rows within the noise.
// * More (a decode step of 9 or more rows, a prefill): blocks of kRowBlock rows, 4 pairs by 6
//   weight rows a tile (many_rows_pairs), in place of the 4 x 6 tiles of 8-lane registers, which
//   ran each multiply-add instruction at half the work. bench/harness/rowdot_rows.cpp, the bench
//   model's matmuls, 2026-11-26: 64 rows with the weights from L1, one thread, 41-44 -> 26-29 ms;
//   from memory on two threads 64 rows 32.7-34.4 -> 25.6-26.5 ms, 16 rows 10.4-11.7 -> 8.4-9.6.
// xp: the rows packed by pairs (pack_rows), pair p's k-th 8-float chunks at xp + p * 2 * k8 + 2 * k,
// from a 64-byte boundary (pairs16::aligned64: without it 64 rows from L1 took 31-33 ms).
constexpr int ZMIN = ROWDOT_ZMM_MIN; // rows from which this path takes them
static_assert(ZMIN >= 5, "rows_pairs tiles 3 or 4 pairs from 5 rows");

// Pairs of x rows (packed, pack_rows) in 16-lane registers, the weight row in both halves.
struct Pairs16 {
  using V = __m512;
  static V zero() {
    return _mm512_setzero_ps();
  }
  static V x(const float* pair, int k) {
    return _mm512_loadu_ps(pair + 2 * k);
  }
  static V w(const float* p) {
    return pairs16::bcast8(p);
  }
  static V fma(V a, V b, V c) {
    return _mm512_fmadd_ps(a, b, c);
  }
};

// The hsum tree of every half of a[0..8) at once (a[j]: one pair of rows against weight row j; a
// row past the tile's weight rows is zeros): the low 8 lanes of the result are row a's 8 sums
// (weight rows 0..7), the high 8 lanes row b's. Each sum is hsum's: ((l0 + l4) + (l2 + l6)) +
// ((l1 + l5) + (l3 + l7)); the shuffles only move lanes, so the bits are finish()'s, in 15 shuffles
// and 7 adds for 16 sums where one hsum at a time took ~5 instructions a sum (the finishes were ~30%
// of tile_pairs<4, 6>'s cycles at 64 rows from L1, perf). bench/harness/rowdot_rows.cpp, the bench
// model's matmuls, runs alternating, 2026-11-27: two threads from memory 8 rows 5.33-5.91 -> 4.50-4.84
// ms, 16 rows 8.65-9.51 -> 7.07-7.61, 64 rows 26.6-27.4 -> 19.7-20.9; from L1, 8 rows on two threads
// 2.89-3.13 -> 2.08-2.18, 64 rows on one 28.3-28.5 -> 23.8-24.9.
inline __m512 hsum_pairs8(const __m512 (&a)[8]) {
  __m512 s1[4];
#pragma GCC unroll 4
  for (int u = 0; u < 4; ++u) // 128-bit lanes [a.r0 a.r1 b.r0 b.r1] of (l0..l3) + (l4..l7)
    s1[u] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * u], a[2 * u + 1], 0x88),
                          _mm512_shuffle_f32x4(a[2 * u], a[2 * u + 1], 0xDD));
  __m512 s2[2];
#pragma GCC unroll 2
  for (int u = 0; u < 2; ++u) // per lane (x0 + x2, x1 + x3) of two registers
    s2[u] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * u], s1[2 * u + 1], 0x44),
                          _mm512_shuffle_ps(s1[2 * u], s1[2 * u + 1], 0xEE));
  const __m512 s3 = _mm512_add_ps(_mm512_shuffle_ps(s2[0], s2[1], 0x88), _mm512_shuffle_ps(s2[0], s2[1], 0xDD));
  // s3's lanes: [0 2 4 6]a [0 2 4 6]b [1 3 5 7]a [1 3 5 7]b (weight rows, row a / b of the pair)
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15), s3);
}

// tile_pairs' outputs where K is a multiple of 8 (no tail): per pair one hsum_pairs8 and a masked
// store of each real row's TN sums (out + s where add, as finish).
template <int P, int TN>
inline void finish_pairs(const __m512 (&acc)[P][TN], int M, float* y, int64_t ldy, bool add) {
  constexpr __mmask8 cols = (__mmask8)((1u << TN) - 1);
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    __m512 a[8];
    pad8(acc[p], a);
    const __m512 s = hsum_pairs8(a);
    for (int h = 0; h < 2 && 2 * p + h < M; ++h) {
      float* out = y + (2 * p + h) * ldy;
      __m256 v = pairs16::half(s, h);
      if (add)
        v = _mm256_add_ps(_mm256_maskz_loadu_ps(cols, out), v);
      _mm256_mask_storeu_ps(out, cols, v);
    }
  }
}

template <int P, int TN>
inline void tile_pairs(const float* xp, int M, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                       int64_t ldy, int K, int k8, bool add, const float* pf, int pf_rows) {
  __m512 acc[P][TN];
  tile_loop<Pairs16, P, TN>(xp, 2 * k8, w, ldw, k8, pf, pf_rows, acc);
  if (k8 == K) {
    finish_pairs<P, TN>(acc, M, y, ldy, add);
    return;
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int j = 0; j < TN; ++j)
      for (int h = 0; h < 2 && 2 * p + h < M; ++h) {
        const int i = 2 * p + h;
        finish(pairs16::half(acc[p][j], h), x + i * ldx, w + j * ldw, K, k8, add, y[i * ldy + j]);
      }
}

template <int P, int R>
inline void rest_pairs(int r, const float* xp, int M, const float* x, int64_t ldx, const float* w, int64_t ldw,
                       float* y, int64_t ldy, int K, int k8, bool add) {
  if constexpr (R > 0) {
    if (r == R)
      tile_pairs<P, R>(xp, M, x, ldx, w, ldw, y, ldy, K, k8, add, nullptr, 0);
    else
      rest_pairs<P, R - 1>(r, xp, M, x, ldx, w, ldw, y, ldy, K, k8, add);
  }
}

// Weight rows [n0, n1), TN at a time, each tile prefetching the TN rows after its own.
template <int P, int TN>
inline void strip_pairs(const float* xp, int M, const float* x, int64_t ldx, const float* w, int64_t ldw, float* y,
                        int64_t ldy, int K, int k8, int n0, int n1, bool add) {
  int n = n0;
  for (; n + TN <= n1; n += TN)
    tile_pairs<P, TN>(xp, M, x, ldx, w + n * ldw, ldw, y + n, ldy, K, k8, add, w + (int64_t)(n + TN) * ldw,
                      std::min(TN, n1 - n - TN));
  if (n < n1)
    rest_pairs<P, TN - 1>(n1 - n, xp, M, x, ldx, w + n * ldw, ldw, y + n, ldy, K, k8, add);
}

// Pairs [p0, p1) of x's rows [0, M), 8 floats of row 2p then 8 of row 2p + 1 per chunk (zeros past
// row M - 1).
inline void pack_rows(const float* x, int64_t ldx, int M, int k8, float* buf, int p0, int p1) {
  for (int p = p0; p < p1; ++p)
    pairs16::interleave8(x + 2 * p * ldx, 2 * p + 1 < M ? x + (2 * p + 1) * ldx : nullptr, k8,
                         buf + (int64_t)p * 2 * k8);
}

// Pairs [p0, p0 + P) (rows 2 p0 .. min(M, 2 (p0 + P)) - 1) against weight rows [n, ne), ne - n <= TN.
template <int P, int TN>
inline void pair_group(int p0, const float* xp, int M, const float* x, int64_t ldx, const float* w, int64_t ldw,
                       float* y, int64_t ldy, int K, int k8, int n, int ne, bool add, const float* pf, int pf_rows) {
  const int r0 = 2 * p0, rows = std::min(M - r0, 2 * P);
  const float* xg = xp + (int64_t)p0 * 2 * k8;
  if (ne - n == TN)
    tile_pairs<P, TN>(xg, rows, x + r0 * ldx, ldx, w + n * ldw, ldw, y + r0 * ldy + n, ldy, K, k8, add, pf, pf_rows);
  else
    rest_pairs<P, TN - 1>(ne - n, xg, rows, x + r0 * ldx, ldx, w + n * ldw, ldw, y + r0 * ldy + n, ldy, K, k8, add);
}

// More than 8 rows: blocks of kRowBlock rows (in L2); in each, the weight rows TN at a time (in
// L1) against the block's pairs 4 at a time (4 x TN accumulators: 4 + TN loads per 4 TN
// multiply-adds), the block's first groups prefetching the next TN weight rows.
template <int TN>
inline void many_rows_pairs(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy,
                            int K, int k8, int n0, int n1, bool add, const float* xp) {
  for (int m0 = 0; m0 < M; m0 += kRowBlock) {
    const int mb = std::min(kRowBlock, M - m0), pb = (mb + 1) / 2, q0 = m0 / 2;
    for (int n = n0; n < n1; n += TN) {
      const int ne = std::min(n1, n + TN);
      const int pf_rows = std::min(n1, ne + TN) - ne;
      const float* pf = w + (int64_t)ne * ldw;
      int p = 0;
      for (; p + 4 <= pb; p += 4)
        pair_group<4, TN>(q0 + p, xp, M, x, ldx, w, ldw, y, ldy, K, k8, n, ne, add, pf,
                          p < 4 * kPrefetchTiles ? pf_rows : 0);
      switch (pb - p) {
        case 3: pair_group<3, TN>(q0 + p, xp, M, x, ldx, w, ldw, y, ldy, K, k8, n, ne, add, pf, 0); break;
        case 2: pair_group<2, TN>(q0 + p, xp, M, x, ldx, w, ldw, y, ldy, K, k8, n, ne, add, pf, 0); break;
        case 1: pair_group<1, TN>(q0 + p, xp, M, x, ldx, w, ldw, y, ldy, K, k8, n, ne, add, pf, 0); break;
        default: break;
      }
    }
  }
}

inline void rows_pairs(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy,
                       int K, int k8, int n0, int n1, bool add, const float* xp) {
  thread_local std::vector<float> own;
  if (xp == nullptr) // a call of its own: pack here
    xp = pack_pairs(x, ldx, M, K, own);
  if (M > 8) {
    many_rows_pairs<6>(x, ldx, M, w, ldw, y, ldy, K, k8, n0, n1, add, xp);
    return;
  }
  if (M > 6) // 4 pairs x 6 weight rows: 24 accumulators, 4 + 6 loads per 24 multiply-adds
    strip_pairs<4, 6>(xp, M, x, ldx, w, ldw, y, ldy, K, k8, n0, n1, add);
  else
    strip_pairs<3, 8>(xp, M, x, ldx, w, ldw, y, ldy, K, k8, n0, n1, add);
}
#endif

// Blocks of kRowBlock rows of x (in L2); in each, the weight rows TN at a time (in L1), every TM
// rows of the block against them (TM x TN tiles: TM + TN loads per TM * TN multiply-adds).
template <int TM, int TN>
inline void blocks(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy, int K,
                   int k8, int n0, int n1, bool add) {
  static_assert(TM <= 4, "the last rows of a block are 1 to 3");
  for (int m0 = 0; m0 < M; m0 += kRowBlock) {
    const int mb = std::min(kRowBlock, M - m0);
    const float* xb = x + m0 * ldx;
    float* yb = y + m0 * ldy;
    // the block's first tiles also prefetch the next strip's rows, which its first rows would
    // otherwise wait on with nothing to compute (the bench model's matmuls, 2026-11-25,
    // best of 3: 4 rows 633 -> 768 tok/s, 8 1076 -> 1332, 16 1645 -> 1868, 64 2975 -> 3168,
    // 512 unchanged)
    for (int nb = n0; nb < n1; nb += TN) {
      const int ne = std::min(n1, nb + TN);
      const int pf_rows = std::min(n1, ne + TN) - ne;
      const float* pf = w + (int64_t)ne * ldw;
      int m = 0;
      for (; m + TM <= mb; m += TM) {
        const int r = m < kPrefetchTiles * TM ? pf_rows : 0;
        row_strip<TM, TN>(xb + m * ldx, ldx, w, ldw, yb + m * ldy, ldy, K, k8, nb, ne, add, pf, r);
      }
      const int r = m < kPrefetchTiles * TM ? pf_rows : 0;
      switch (mb - m) {
        case 3: row_strip<3, TN>(xb + m * ldx, ldx, w, ldw, yb + m * ldy, ldy, K, k8, nb, ne, add, pf, r); break;
        case 2: row_strip<2, TN>(xb + m * ldx, ldx, w, ldw, yb + m * ldy, ldy, K, k8, nb, ne, add, pf, r); break;
        case 1: row_strip<1, TN>(xb + m * ldx, ldx, w, ldw, yb + m * ldy, ldy, K, k8, nb, ne, add, pf, r); break;
        default: break;
      }
    }
  }
}

} // namespace

void matmul(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy, int K, int n0,
            int n1, bool add, [[maybe_unused]] const float* xpairs) {
  const int k8 = K & ~7;
  if (M == 1) { // memory-bound: 8 weight rows in flight, one x row from L1, and the next 8
    // rows prefetched into L2 as they go (a 1-row step's matmuls, interleaved in one process,
    // medians of 5: 4.33 -> 3.57 ms; into L1 the same prefetch measured no faster)
    row_strip<1, 8, true>(x, ldx, w, ldw, y, ldy, K, k8, n0, n1, add);
    return;
  }
#ifdef ROWDOT_ZMM
  if (M >= ZMIN) { // fewer: the MR x NR tiles (as fast: bound by memory)
    rows_pairs(x, ldx, M, w, ldw, y, ldy, K, k8, n0, n1, add, xpairs);
    return;
  }
#endif
#ifdef ROWDOT_MANY_MR
  if (M >= ROWDOT_MANY_MIN) {
    blocks<ROWDOT_MANY_MR, ROWDOT_MANY_NR>(x, ldx, M, w, ldw, y, ldy, K, k8, n0, n1, add);
    return;
  }
#endif
  blocks<MR, NR>(x, ldx, M, w, ldw, y, ldy, K, k8, n0, n1, add);
}

#ifdef ROWDOT_ZMM
float* pairs_buffer(int M, int K, std::vector<float>& buf) {
  return M < ZMIN ? nullptr : pairs16::aligned64(buf, (size_t)(M + 1) / 2 * 2 * (K & ~7));
}

void pack_pairs_range(const float* x, int64_t ldx, int M, int K, float* dst, int p0, int p1) {
  pack_rows(x, ldx, M, K & ~7, dst, p0, p1);
}

const float* pack_pairs(const float* x, int64_t ldx, int M, int K, std::vector<float>& buf) {
  float* p = pairs_buffer(M, K, buf);
  if (p != nullptr)
    pack_pairs_range(x, ldx, M, K, p, 0, (M + 1) / 2);
  return p;
}
#endif

} // namespace mlxq::rowdot::ROWDOT_NS

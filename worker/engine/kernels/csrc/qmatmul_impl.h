// qmatmul.h's loops for one vector type (QMATMUL_NS: avx2 or generic), included once by each after
// it defines V and its operations. A tile is TM rows of x against TN weight rows; every output's
// chain is the same in any tile (qmatmul.h), so the tile shapes are free to follow the row count.
#include <algorithm>
#include <cstdint>

#include "qmatmul.h"

namespace mlxq::qmatmul::QMATMUL_NS {

namespace {

// q's float32 scales and biases (the only kind these loops are given).
inline const float* scales(const QWeight& q) { return static_cast<const float*>(q.s); }
inline const float* biases(const QWeight& q) { return static_cast<const float*>(q.b); }

// Weight values k .. k + 7 (k a multiple of 8) of the row at words w, dequantized: (s * q) + b.
template <int BITS>
inline V chunk(const uint32_t* w, int k, V s, V b) {
  const V q = BITS == 4 ? unpack4(w[k / 8]) : unpack8(w + k / 4);
  return vadd(vmul(s, q), b);
}

template <int BITS, int TM, int TN>
inline void tile(const float* x, const QWeight& q, int64_t ldw, int G, int n, float* y, int64_t ldy) {
  const int K = q.K, gs = q.gs;
  V acc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j)
      acc[i][j] = vzero();
  for (int g = 0; g < G; ++g) {
    V s[TN], b[TN];
    for (int j = 0; j < TN; ++j) {
      s[j] = vset1(scales(q)[(int64_t)(n + j) * G + g]);
      b[j] = vset1(biases(q)[(int64_t)(n + j) * G + g]);
    }
    for (int k = g * gs; k < (g + 1) * gs; k += 8) {
      V xv[TM];
      for (int i = 0; i < TM; ++i)
        xv[i] = vload(x + (int64_t)i * K + k);
      for (int j = 0; j < TN; ++j) {
        const V wv = chunk<BITS>(q.w + (int64_t)(n + j) * ldw, k, s[j], b[j]);
        for (int i = 0; i < TM; ++i)
          acc[i][j] = vfma(wv, xv[i], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j)
      y[i * ldy + n + j] = vhsum(acc[i][j]);
}

template <int BITS, int TM, int TN>
inline void strip(const float* x, const QWeight& q, int64_t ldw, int G, float* y, int64_t ldy, int n0, int n1) {
  int n = n0;
  for (; n + TN <= n1; n += TN)
    tile<BITS, TM, TN>(x, q, ldw, G, n, y, ldy);
  for (; n < n1; ++n)
    tile<BITS, TM, 1>(x, q, ldw, G, n, y, ldy);
}

template <int BITS>
void rows(const float* x, int M, const QWeight& q, float* y, int64_t ldy, int n0, int n1) {
  const int G = q.K / q.gs;
  const int64_t ldw = (int64_t)q.K * BITS / 32;
  int m = 0; // pairs of rows against 4 weight rows, then an odd last row
  for (; m + 2 <= M; m += 2)
    strip<BITS, 2, 4>(x + (int64_t)m * q.K, q, ldw, G, y + m * ldy, ldy, n0, n1);
  if (m < M)
    strip<BITS, 1, 4>(x + (int64_t)m * q.K, q, ldw, G, y + m * ldy, ldy, n0, n1);
}

template <int BITS>
void dequant(const QWeight& q, int n0, int n1, float* out) {
  const int G = q.K / q.gs;
  const int64_t ldw = (int64_t)q.K * BITS / 32;
  for (int n = n0; n < n1; ++n) {
    const uint32_t* w = q.w + n * ldw;
    float* o = out + (int64_t)(n - n0) * q.K;
    for (int g = 0; g < G; ++g) {
      const V s = vset1(scales(q)[(int64_t)n * G + g]), b = vset1(biases(q)[(int64_t)n * G + g]);
      for (int k = g * q.gs; k < (g + 1) * q.gs; k += 8)
        vstore(o + k, chunk<BITS>(w, k, s, b));
    }
  }
}

} // namespace

void matvec(const float* x, int M, const QWeight& q, float* y, int64_t ldy, int n0, int n1) {
  if (q.bits == 4)
    rows<4>(x, M, q, y, ldy, n0, n1);
  else
    rows<8>(x, M, q, y, ldy, n0, n1);
}

void dequantize_rows(const QWeight& q, int n0, int n1, float* out) {
  if (q.bits == 4)
    dequant<4>(q, n0, n1, out);
  else
    dequant<8>(q, n0, n1, out);
}

} // namespace mlxq::qmatmul::QMATMUL_NS

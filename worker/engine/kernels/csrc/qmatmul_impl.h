// qmatmul.h's loops for one vector type (QMATMUL_NS: avx2 or generic), included once by each.
// A tile is TM rows of x against TN weight rows; each output's chain is the same in any tile
// (see qmatmul.h), so the tile shapes are free to follow the row count.
#include <algorithm>
#include <cstdint>

#include "qmatmul.h"

namespace mlxq::qmatmul::QMATMUL_NS {

namespace {

// One weight row's quantized values, chunk by chunk (8 values as floats: exact small integers).
template <int BITS>
struct Row {
  const uint32_t* w; // the row's words
  V chunk(int k) const { // values k .. k + 7 (k a multiple of 8)
    if constexpr (BITS == 4)
      return unpack4(w[k / 8]);
    else
      return unpack8(w + k / 4);
  }
};

template <int BITS, int TM, int TN>
inline void tile(const float* x, const float* xs, int K, int gs, const uint32_t* w, int64_t ldw, const float* s,
                 const float* b, int G, float* y, int64_t ldy) {
  V acc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j)
      acc[i][j] = vzero();
  Row<BITS> rows[TN];
  for (int j = 0; j < TN; ++j)
    rows[j].w = w + j * ldw;
  for (int g = 0; g < G; ++g) {
    const int k0 = g * gs;
    V d[TM][TN];
    for (int j = 0; j < TN; ++j) {
      V q = rows[j].chunk(k0);
      for (int i = 0; i < TM; ++i)
        d[i][j] = vmul(q, vload(x + (int64_t)i * K + k0));
    }
    for (int k = k0 + 8; k < k0 + gs; k += 8)
      for (int j = 0; j < TN; ++j) {
        V q = rows[j].chunk(k);
        for (int i = 0; i < TM; ++i)
          d[i][j] = vfma(q, vload(x + (int64_t)i * K + k), d[i][j]);
      }
    for (int j = 0; j < TN; ++j) {
      const V sj = vset1(s[j * (int64_t)G + g]), bj = vset1(b[j * (int64_t)G + g]);
      for (int i = 0; i < TM; ++i)
        acc[i][j] = vfma(sj, d[i][j], vfma(bj, vload(xs + ((int64_t)i * G + g) * 8), acc[i][j]));
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j)
      y[i * ldy + j] = vhsum(acc[i][j]);
}

// Weight rows [n0, n1) TN at a time (the rest one at a time) against rows of x TM at a time.
template <int BITS, int TM, int TN>
inline void strip(const float* x, const float* xs, int K, int gs, const uint32_t* w, int64_t ldw, const float* s,
                  const float* b, int G, float* y, int64_t ldy, int n0, int n1) {
  int n = n0;
  for (; n + TN <= n1; n += TN)
    tile<BITS, TM, TN>(x, xs, K, gs, w + n * ldw, ldw, s + (int64_t)n * G, b + (int64_t)n * G, G, y + n, ldy);
  for (; n < n1; ++n)
    tile<BITS, TM, 1>(x, xs, K, gs, w + n * ldw, ldw, s + (int64_t)n * G, b + (int64_t)n * G, G, y + n, ldy);
}

template <int BITS>
void run(const float* x, const float* xs, int M, int K, const uint32_t* w, const float* s, const float* b, int gs,
         float* y, int64_t ldy, int n0, int n1) {
  const int G = K / gs;
  const int64_t ldw = (int64_t)K * BITS / 32;
  // one row: 4 weight rows in flight (their chains overlap); more: 2 x 2 tiles, each weight
  // chunk unpacked once for two rows; an odd last row alone.
  if (M == 1) {
    strip<BITS, 1, 4>(x, xs, K, gs, w, ldw, s, b, G, y, ldy, n0, n1);
    return;
  }
  int m = 0;
  for (; m + 2 <= M; m += 2)
    strip<BITS, 2, 2>(x + (int64_t)m * K, xs + (int64_t)m * G * 8, K, gs, w, ldw, s, b, G, y + m * ldy, ldy, n0, n1);
  if (m < M)
    strip<BITS, 1, 4>(x + (int64_t)m * K, xs + (int64_t)m * G * 8, K, gs, w, ldw, s, b, G, y + m * ldy, ldy, n0, n1);
}

} // namespace

void matmul(const float* x, const float* xs, int M, int K, const uint32_t* w, const float* s, const float* b,
            int bits, int gs, float* y, int64_t ldy, int n0, int n1) {
  if (bits == 4)
    run<4>(x, xs, M, K, w, s, b, gs, y, ldy, n0, n1);
  else
    run<8>(x, xs, M, K, w, s, b, gs, y, ldy, n0, n1);
}

} // namespace mlxq::qmatmul::QMATMUL_NS

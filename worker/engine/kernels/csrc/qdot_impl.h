// qdot.h's loops for one vector type (QDOT_NS), included once by each after it defines V (8 float
// lanes), I (8 int32 lanes) and: vzero, vset1, vfma, vhsum, vcvt (int lanes to float), and
// dot4<BITS>(weight block bytes, x block) giving each lane the integer dot of its 4 bytes.
#include <cstdint>

#include "qdot.h"

namespace mlxq::qdot::QDOT_NS {

namespace {

template <int BITS, int TM, int TN>
inline void tile(const QAct& a, const qmatmul::QWeight& q, int64_t ldw, int n, float* y, int64_t ldy) {
  const int K = q.K, B = K / kBlock, G = K / q.gs, per = q.gs / kBlock;
  V acc[TM][TN];
  float bias[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) {
      acc[i][j] = vzero();
      bias[i][j] = 0.0f;
    }
  for (int b = 0; b < B; ++b) {
    const int g = b / per;
    const int8_t* xq[TM];
    for (int i = 0; i < TM; ++i)
      xq[i] = a.q + (int64_t)i * K + (int64_t)b * kBlock;
    for (int j = 0; j < TN; ++j) {
      const uint8_t* wb = reinterpret_cast<const uint8_t*>(q.w + (int64_t)(n + j) * ldw) + (int64_t)b * kBlock * BITS / 8;
      const float s = q.s[(int64_t)(n + j) * G + g], bb = q.b[(int64_t)(n + j) * G + g];
      const W wv = load_weights<BITS>(wb);
      for (int i = 0; i < TM; ++i) {
        const int64_t at = (int64_t)i * B + b;
        acc[i][j] = vfma(vcvt(dot4<BITS>(wv, xq[i])), vset1(s * a.d[at]), acc[i][j]);
        bias[i][j] = sfma(bb, a.sum[at], bias[i][j]);
      }
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j)
      y[i * ldy + n + j] = vhsum(acc[i][j]) + bias[i][j];
}

template <int BITS, int TM>
inline void strip(const QAct& a, const qmatmul::QWeight& q, float* y, int64_t ldy, int n0, int n1) {
  const int64_t ldw = (int64_t)q.K * BITS / 32;
  int n = n0;
  for (; n + 4 <= n1; n += 4)
    tile<BITS, TM, 4>(a, q, ldw, n, y, ldy);
  for (; n < n1; ++n)
    tile<BITS, TM, 1>(a, q, ldw, n, y, ldy);
}

template <int BITS>
void rows(const QAct& a, int M, const qmatmul::QWeight& q, float* y, int64_t ldy, int n0, int n1) {
  const int B = q.K / kBlock;
  int m = 0; // pairs of rows against 4 weight rows, then an odd last row
  for (; m + 2 <= M; m += 2) {
    const QAct am{a.q + (int64_t)m * q.K, a.d + (int64_t)m * B, a.sum + (int64_t)m * B, q.K};
    strip<BITS, 2>(am, q, y + m * ldy, ldy, n0, n1);
  }
  if (m < M) {
    const QAct am{a.q + (int64_t)m * q.K, a.d + (int64_t)m * B, a.sum + (int64_t)m * B, q.K};
    strip<BITS, 1>(am, q, y + m * ldy, ldy, n0, n1);
  }
}

} // namespace

void dot(const QAct& a, int M, const qmatmul::QWeight& q, float* y, int64_t ldy, int n0, int n1) {
  if (q.bits == 4)
    rows<4>(a, M, q, y, ldy, n0, n1);
  else
    rows<8>(a, M, q, y, ldy, n0, n1);
}

} // namespace mlxq::qdot::QDOT_NS

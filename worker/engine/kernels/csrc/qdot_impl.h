// qdot.h's loops for one vector type (QDOT_NS), included once by each after it defines V (8 float
// lanes), I (8 int32 lanes), WChunk (a chunk's weights) and: quantize_block (one block of x rounded into
// its chunk at x_at's places, its step and the sum of its values), vzero, vload, vmul, vfma, vcvt, vhsum,
// chunk_of<BITS, KIND>(row, c, per, nb) (lane l: row[(8c + lane_block(BITS, l)) / per], widened as
// widen() widens it, where that block is one of the chunk's nb, else 0: a chunk's scales or biases,
// a row holding one per group of `per` blocks), load_chunk<BITS>(bytes, nb, &chunk), and
// dots8<BITS>(chunk, x's chunk) giving lane l the exact integer dot of block lane_block(BITS, l), and
// dots8_at<BITS>(bytes, nb, x's chunk) the same straight from the weights' bytes.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "qdot.h"

namespace mlxq::qdot::QDOT_NS {

namespace {

// One row of x against weight rows [n, n + TN): with no other row of x to share a chunk's decoded
// weights, each chunk is read straight into its dot products, and the TN accumulators stay in
// registers (tile's, kept in memory for up to 64 rows of x, made each chunk a store and a load). The
// same operations in the same order as tile's, so the same bits.
template <int BITS, ScaleKind KIND, int TN>
inline void tile1(const QAct& a, const qmatmul::QWeight& q, float* y, int n) {
  const int K = q.K, B = K / kBlock, Bp = padded_blocks(K), G = K / q.gs, per = q.gs / kBlock;
  const int64_t ldw = (int64_t)K * BITS / 32;
  constexpr int kBlockBytes = kBlock * BITS / 8;
  const auto* qs = static_cast<const ScaleT<KIND>*>(q.s);
  const auto* qb = static_cast<const ScaleT<KIND>*>(q.b);
  V acc[TN];
#pragma GCC unroll 4
  for (int j = 0; j < TN; ++j)
    acc[j] = vzero();
  for (int c = 0; c < Bp / 8; ++c) {
    const int nb = std::min(8, B - 8 * c);
    const int8_t* xq = a.q + (int64_t)8 * c * kBlock;
    const V d8 = vload(a.d + 8 * c), sum8 = vload(a.sum + 8 * c);
#pragma GCC unroll 4
    for (int j = 0; j < TN; ++j) {
      const uint8_t* wrow = reinterpret_cast<const uint8_t*>(q.w + (int64_t)(n + j) * ldw);
      const V s8 = chunk_of<BITS, KIND>(qs + (int64_t)(n + j) * G, c, per, nb);
      const V b8 = chunk_of<BITS, KIND>(qb + (int64_t)(n + j) * G, c, per, nb);
      const V t = vfma(vcvt(dots8_at<BITS>(wrow + (int64_t)8 * c * kBlockBytes, nb, xq)), vmul(s8, d8), acc[j]);
      acc[j] = vfma(b8, sum8, t);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < TN; ++j)
    y[n + j] = vhsum(acc[j]);
}

// Weight rows [n, n + TN) against every row of x: TN independent chains in flight, each chunk's
// weights decoded once for all of x's rows.
template <int BITS, ScaleKind KIND, int TN>
inline void tile(const QAct& a, int M, const qmatmul::QWeight& q, float* y, int64_t ldy, int n, V* acc) {
  const int K = q.K, B = K / kBlock, Bp = padded_blocks(K), G = K / q.gs, per = q.gs / kBlock;
  const int64_t ldw = (int64_t)K * BITS / 32, Kp = (int64_t)Bp * kBlock;
  constexpr int kBlockBytes = kBlock * BITS / 8;
  const auto* qs = static_cast<const ScaleT<KIND>*>(q.s);
  const auto* qb = static_cast<const ScaleT<KIND>*>(q.b);
  for (int m = 0; m < M * TN; ++m)
    acc[m] = vzero();
  for (int c = 0; c < Bp / 8; ++c) {
    const int nb = std::min(8, B - 8 * c);
    WChunk w[TN];
    V s8[TN], b8[TN];
    for (int j = 0; j < TN; ++j) {
      const uint8_t* wrow = reinterpret_cast<const uint8_t*>(q.w + (int64_t)(n + j) * ldw);
      load_chunk<BITS>(wrow + (int64_t)8 * c * kBlockBytes, nb, &w[j]);
      s8[j] = chunk_of<BITS, KIND>(qs + (int64_t)(n + j) * G, c, per, nb);
      b8[j] = chunk_of<BITS, KIND>(qb + (int64_t)(n + j) * G, c, per, nb);
    }
    for (int m = 0; m < M; ++m) {
      const int8_t* xq = a.q + m * Kp + (int64_t)8 * c * kBlock;
      const V d8 = vload(a.d + (int64_t)m * Bp + 8 * c), sum8 = vload(a.sum + (int64_t)m * Bp + 8 * c);
      for (int j = 0; j < TN; ++j) {
        const V t = vfma(vcvt(dots8<BITS>(w[j], xq)), vmul(s8[j], d8), acc[m * TN + j]);
        acc[m * TN + j] = vfma(b8[j], sum8, t);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < TN; ++j)
      y[m * ldy + n + j] = vhsum(acc[m * TN + j]);
}

// x's rows 64 at a time (their chunk of x, 16 KB, and their accumulators, 8 KB, stay in L1 while the
// weight rows go by), each block of rows against every weight row [n0, n1).
template <int BITS, ScaleKind KIND>
void rows(const QAct& a, int M, const qmatmul::QWeight& q, float* y, int64_t ldy, int n0, int n1) {
  constexpr int TN = 4, kRows = 64;
  const int64_t Bp = padded_blocks(q.K), Kp = Bp * kBlock;
  if (M == 1) {
    int n = n0;
    for (; n + TN <= n1; n += TN)
      tile1<BITS, KIND, TN>(a, q, y, n);
    for (; n < n1; ++n)
      tile1<BITS, KIND, 1>(a, q, y, n);
    return;
  }
  thread_local std::vector<V> acc;
  acc.resize((size_t)std::min(M, kRows) * TN);
  for (int m0 = 0; m0 < M; m0 += kRows) {
    const int mb = std::min(kRows, M - m0);
    const QAct am{a.q + m0 * Kp, a.d + m0 * Bp, a.sum + m0 * Bp, a.K};
    float* ym = y + m0 * ldy;
    int n = n0;
    for (; n + TN <= n1; n += TN)
      tile<BITS, KIND, TN>(am, mb, q, ym, ldy, n, acc.data());
    for (; n < n1; ++n)
      tile<BITS, KIND, 1>(am, mb, q, ym, ldy, n, acc.data());
  }
}

} // namespace

// Each block by quantize_block (each element on its own: every build gives the same q, d and sum).
void quantize_rows(const float* x, int M, int K, int bits, int8_t* q, float* d, float* sum) {
  const int B = K / kBlock, Bp = padded_blocks(K);
  const int64_t Kp = (int64_t)Bp * kBlock;
  int lane_of[8];
  for (int l = 0; l < 8; ++l)
    lane_of[lane_block(bits, l)] = l;
  for (int m = 0; m < M; ++m) {
    std::fill(q + m * Kp, q + (m + 1) * Kp, (int8_t)0);
    std::fill(d + (int64_t)m * Bp, d + (int64_t)(m + 1) * Bp, 0.0f);
    std::fill(sum + (int64_t)m * Bp, sum + (int64_t)(m + 1) * Bp, 0.0f);
    for (int b = 0; b < B; ++b) {
      float step;
      int total;
      quantize_block(x + (int64_t)m * K + (int64_t)b * kBlock, bits, b % 8, q + m * Kp + (int64_t)(b / 8) * 8 * kBlock,
                     &step, &total);
      const int64_t at = (int64_t)m * Bp + (b / 8) * 8 + lane_of[b % 8];
      d[at] = step;
      sum[at] = step * (float)total;
    }
  }
}

template <int BITS>
void rows_of_kind(const QAct& a, int M, const qmatmul::QWeight& q, float* y, int64_t ldy, int n0, int n1) {
  switch (q.kind) {
  case ScaleKind::f16:
    return rows<BITS, ScaleKind::f16>(a, M, q, y, ldy, n0, n1);
  case ScaleKind::bf16:
    return rows<BITS, ScaleKind::bf16>(a, M, q, y, ldy, n0, n1);
  case ScaleKind::f32:
    return rows<BITS, ScaleKind::f32>(a, M, q, y, ldy, n0, n1);
  }
}

void dot(const QAct& a, int M, const qmatmul::QWeight& q, float* y, int64_t ldy, int n0, int n1) {
  if (q.bits == 4)
    rows_of_kind<4>(a, M, q, y, ldy, n0, n1);
  else
    rows_of_kind<8>(a, M, q, y, ldy, n0, n1);
}

} // namespace mlxq::qdot::QDOT_NS

// qdot_impl.h with the 8 lanes emulated one at a time, the AVX2 build's operations in the same
// order (built with -ffp-contract=off: std::fma is the only fused one), so the same bits; and the
// rounding of x's rows, which every build shares (element by element: no order to keep).
#include <cmath>
#include <cstdint>

#include "qdot.h"

namespace mlxq::qdot {

void quantize_rows(const float* x, int M, int K, int bits, int8_t* q, float* d, float* sum) {
  const int B = K / kBlock;
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < B; ++b) {
      const float* xb = x + (int64_t)m * K + (int64_t)b * kBlock;
      float amax = 0.0f;
      for (int k = 0; k < kBlock; ++k)
        amax = std::fmax(amax, std::fabs(xb[k]));
      const float step = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* qb = q + (int64_t)m * K + (int64_t)b * kBlock;
      int total = 0;
      for (int k = 0; k < kBlock; ++k) {
        const int v = (int)std::nearbyint(xb[k] * inv); // ties to even, as cvtps_epi32
        total += v;
        // 4 bits: a block's byte p holds elements 2p (low nibble) and 2p + 1 (high): evens, then odds
        const int at = bits == 4 ? (k % 2) * 16 + k / 2 : k;
        qb[at] = (int8_t)v;
      }
      d[(int64_t)m * B + b] = step;
      sum[(int64_t)m * B + b] = step * (float)total;
    }
}

namespace generic {
namespace {
struct V {
  float l[8];
};
struct I {
  int32_t l[8];
};
struct W {
  uint8_t b[32]; // the block's weights as values, in the byte order of qdot.h
};
inline V vzero() { return V{}; }
inline V vset1(float f) {
  V v;
  for (float& x : v.l)
    x = f;
  return v;
}
inline V vfma(const V& a, const V& b, V c) {
  for (int i = 0; i < 8; ++i)
    c.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
  return c;
}
inline float sfma(float a, float b, float c) { return std::fma(a, b, c); }
inline V vcvt(const I& x) {
  V v;
  for (int i = 0; i < 8; ++i)
    v.l[i] = (float)x.l[i];
  return v;
}
inline float vhsum(const V& v) {
  const float* l = v.l;
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
template <int BITS>
inline W load_weights(const uint8_t* p) {
  W w;
  if (BITS == 4)
    for (int i = 0; i < 16; ++i) {
      w.b[i] = p[i] & 15;
      w.b[16 + i] = p[i] >> 4;
    }
  else
    for (int i = 0; i < 32; ++i)
      w.b[i] = p[i];
  return w;
}
template <int BITS>
inline I dot4(const W& w, const int8_t* x) {
  I r;
  for (int l = 0; l < 8; ++l) {
    int32_t s = 0;
    for (int k = 4 * l; k < 4 * l + 4; ++k)
      s += (int32_t)w.b[k] * (int32_t)x[k];
    r.l[l] = s;
  }
  return r;
}
} // namespace
} // namespace generic
} // namespace mlxq::qdot

#define QDOT_NS generic
#include "qdot_impl.h"

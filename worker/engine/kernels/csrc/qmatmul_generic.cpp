// qmatmul_impl.h with 8 lanes emulated one float at a time, the AVX2 build's operations in the
// same order (built with -ffp-contract=off: a multiply stays a multiply, std::fma is the only
// fused one), so the same bits; also the group sums every build shares.
#include <cmath>
#include <cstdint>

#include "qmatmul.h"

namespace mlxq::qmatmul {

void group_sums(const float* x, int M, int K, int gs, float* xs) {
  const int G = K / gs;
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < G; ++g) {
      const float* xg = x + (int64_t)m * K + (int64_t)g * gs;
      float* out = xs + ((int64_t)m * G + g) * 8;
      for (int l = 0; l < 8; ++l) {
        float a = xg[l];
        for (int c = 8; c < gs; c += 8)
          a += xg[c + l];
        out[l] = a;
      }
    }
}

namespace generic {
namespace {
struct V {
  float l[8];
};
inline V vzero() { return V{}; }
inline V vload(const float* p) {
  V v;
  for (int i = 0; i < 8; ++i)
    v.l[i] = p[i];
  return v;
}
inline V vset1(float f) {
  V v;
  for (int i = 0; i < 8; ++i)
    v.l[i] = f;
  return v;
}
inline V vmul(V a, V b) {
  for (int i = 0; i < 8; ++i)
    a.l[i] *= b.l[i];
  return a;
}
inline V vfma(V a, V b, V c) {
  for (int i = 0; i < 8; ++i)
    c.l[i] = std::fma(a.l[i], b.l[i], c.l[i]);
  return c;
}
inline V unpack4(uint32_t word) {
  V v;
  for (int i = 0; i < 8; ++i)
    v.l[i] = (float)((word >> (4 * i)) & 15u);
  return v;
}
inline V unpack8(const uint32_t* words) {
  V v;
  for (int i = 0; i < 8; ++i)
    v.l[i] = (float)((words[i / 4] >> (8 * (i % 4))) & 255u);
  return v;
}
inline float vhsum(const V& v) {
  const float* l = v.l;
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
} // namespace
} // namespace generic
} // namespace mlxq::qmatmul

#define QMATMUL_NS generic
#include "qmatmul_impl.h"

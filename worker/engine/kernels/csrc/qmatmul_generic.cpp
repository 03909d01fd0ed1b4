// qmatmul_impl.h with 8 lanes emulated one float at a time, the AVX2 build's operations in the
// same order (built with -ffp-contract=off: a multiply stays a multiply, std::fma is the only
// fused one), so the same bits.
#include <cmath>
#include <cstdint>

namespace mlxq::qmatmul::generic {
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
inline void vstore(float* p, const V& v) {
  for (int i = 0; i < 8; ++i)
    p[i] = v.l[i];
}
inline V vset1(float f) {
  V v;
  for (int i = 0; i < 8; ++i)
    v.l[i] = f;
  return v;
}
inline V vmul(V a, const V& b) {
  for (int i = 0; i < 8; ++i)
    a.l[i] *= b.l[i];
  return a;
}
inline V vadd(V a, const V& b) {
  for (int i = 0; i < 8; ++i)
    a.l[i] += b.l[i];
  return a;
}
inline V vfma(const V& a, const V& b, V c) {
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
} // namespace mlxq::qmatmul::generic

#define QMATMUL_NS generic
#include "qmatmul_impl.h"

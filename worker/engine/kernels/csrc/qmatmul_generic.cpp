// qmatmul_impl.h with 8 lanes emulated one float at a time, the AVX2 build's operations in the
// same order (built with -ffp-contract=off: a multiply stays a multiply, std::fma is the only
// fused one), so the same bits.
#include <cmath>
#include <cstdint>

namespace mlxq::qmatmul::generic {
namespace {
#include "lanes8_generic.h"
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
} // namespace
} // namespace mlxq::qmatmul::generic

#define QMATMUL_NS generic
#include "qmatmul_impl.h"

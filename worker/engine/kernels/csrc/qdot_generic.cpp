// qdot_impl.h with the 8 lanes emulated one at a time, the AVX2 build's operations in the same
// order (built with -ffp-contract=off: std::fma is the only fused one), so the same bits.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "qdot.h"

namespace mlxq::qdot {
namespace generic {
namespace {
#include "lanes8_generic.h"
struct I {
  int32_t l[8];
};
// The 32 values of x's block at xb: step = max|x| / 127, each round(x * 127 / max|x|) (ties to even)
// at x_at(bits, b, e) of the chunk qc; total their sum.
inline void quantize_block(const float* xb, int bits, int b, int8_t* qc, float* step, int* total) {
  float amax = 0.0f;
  for (int k = 0; k < kBlock; ++k)
    amax = std::fmax(amax, std::fabs(xb[k]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  *step = amax / 127.0f;
  int t = 0;
  for (int k = 0; k < kBlock; ++k) {
    const int v = (int)std::nearbyint(xb[k] * inv);
    t += v;
    qc[x_at(bits, b, k)] = (int8_t)v;
  }
  *total = t;
}
inline V vcvt(const I& x) {
  V v;
  for (int i = 0; i < 8; ++i)
    v.l[i] = (float)x.l[i];
  return v;
}
template <int BITS, ScaleKind KIND>
inline V chunk_of(const ScaleT<KIND>* row, int c, int per, int nb) {
  V v;
  for (int l = 0; l < 8; ++l) {
    const int b = lane_block(BITS, l);
    v.l[l] = b < nb ? widen<KIND>(row[(8 * c + b) / per]) : 0.0f;
  }
  return v;
}
// A chunk's weights: block b's 32 values in element order, nb blocks (the rest unused).
struct WChunk {
  uint8_t v[8][kBlock];
  int nb;
};
template <int BITS>
inline void load_chunk(const uint8_t* p, int nb, WChunk* w) {
  w->nb = nb;
  for (int b = 0; b < nb; ++b)
    for (int e = 0; e < kBlock; ++e)
      w->v[b][e] = BITS == 4 ? (p[b * 16 + e / 2] >> (4 * (e % 2))) & 15 : p[b * 32 + e];
}
// Lane l: the exact integer dot of block lane_block(BITS, l) with x's chunk (0 past nb).
template <int BITS>
inline I dots8(const WChunk& w, const int8_t* x) {
  I r{};
  for (int l = 0; l < 8; ++l) {
    const int b = lane_block(BITS, l);
    if (b >= w.nb)
      continue;
    int32_t s = 0;
    for (int e = 0; e < kBlock; ++e)
      s += (int32_t)w.v[b][e] * (int32_t)x[x_at(BITS, b, e)];
    r.l[l] = s;
  }
  return r;
}
template <int BITS>
inline I dots8_at(const uint8_t* p, int nb, const int8_t* x) {
  WChunk w;
  load_chunk<BITS>(p, nb, &w);
  return dots8<BITS>(w, x);
}
} // namespace
} // namespace generic
} // namespace mlxq::qdot

#define QDOT_NS generic
#include "qdot_impl.h"

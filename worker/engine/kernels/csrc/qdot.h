// The matmul quantized_linear runs with int8_dot (cpu_weights=int8-dot): llama.cpp's method on MLX's
// affine blocks. Each row of x is rounded to 8 bits per block of 32 (d = max|x| / 127, q = round(x / d),
// ties to even), and each output is
//   y[m, n] = sum over blocks b of  s[n, g] * d[m, b] * dot(q_w, q_x)  +  b[n, g] * d[m, b] * sum(q_x)
// with dot(q_w, q_x) an exact integer (4- or 8-bit unsigned weights times signed 8-bit x). The integer
// dot products run 32 multiply-adds an instruction (AVX2 maddubs, or AVX-VNNI dpbusd), against 8 for
// the fp32 path, and read 4 or 8 bits a weight. The price: x is rounded, so logits differ from the
// fp32 path's (docs/design/quantized-weights.md gives by how much).
//
// What a row's output is does not depend on the batch, the column split or the ISA: the integer dot of
// each block is exact, and the float parts run in one order. The blocks go in chunks of 8, lane l of
// chunk c standing for block 8c + lane_block(bits, l) (zeros past the last block): from acc = 0 (8 lanes),
// for each chunk
//   acc = fma(float(dot), s * d, acc);  acc = fma(b, d * sum(q_x), acc)
// then the lanes added in hsum's tree. The generic loops emulate the lanes with the same operations.
// s and b may come as fp16 or bf16 (QWeight's kind): widened to the float32s they stand for as they
// are read (exact), so the same bits as from those float32s, for 20 bytes a 4-bit block of 32 against 24.
//
// The layouts serve the AVX loops. A 4-bit block's 16 bytes hold its even elements in their low nibbles
// and its odd ones in the high: two blocks' 32 bytes masked are their evens, shifted and masked their
// odds, each one register against x laid out to match, and the two blocks' dot products land in lanes
// 0-3 and 4-7 of one register. Four such pairs reduce to one register in three horizontal adds, in
// the lane order 0 2 4 6 1 3 5 7; x's steps and sums are stored in that order so that lanes match.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "qmatmul.h"

namespace mlxq::qdot {

constexpr int kBlock = 32;

using qmatmul::ScaleKind;

// How a scale or bias of kind KIND is stored.
template <ScaleKind KIND>
using ScaleT = std::conditional_t<KIND == ScaleKind::f32, float, uint16_t>;

// The float32 a scale or bias of kind KIND stands for: exact (fp16 and bf16 values are all float32
// values), as F16C's vcvtph2ps and a 16-bit shift give it.
template <ScaleKind KIND>
inline float widen(ScaleT<KIND> v) {
  if constexpr (KIND == ScaleKind::f32) {
    return v;
  } else {
    uint32_t bits;
    if constexpr (KIND == ScaleKind::bf16) {
      bits = (uint32_t)v << 16;
    } else {
      const uint32_t sign = (uint32_t)(v & 0x8000) << 16, exp = (v >> 10) & 0x1f, man = v & 0x3ff;
      if (exp == 0) // zero or subnormal: man * 2^-24, exact in float32
        return sign ? -((float)man * 0x1p-24f) : (float)man * 0x1p-24f;
      // inf and NaN keep their payload (a signalling NaN quieted, as vcvtph2ps does); else rebias 15 -> 127
      bits = exp == 0x1f ? sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u)
                         : sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
}

// Blocks a row of x holds: K / 32 rounded up to a whole chunk of 8 (the rest zeros).
inline int padded_blocks(int K) {
  return (K / kBlock + 7) / 8 * 8;
}

// The block (within its chunk) lane l stands for.
inline int lane_block(int bits, int l) {
  return bits == 4 ? (l < 4 ? 2 * l : 2 * (l - 4) + 1) : l;
}

// Where element e of block b (within its chunk) lies in x's chunk of 8 x 32 bytes: for 4 bits, each
// pair of blocks' evens (first block's 16, second's 16), then their odds; for 8 bits as they are.
inline int x_at(int bits, int b, int e) {
  if (bits != 4)
    return b * kBlock + e;
  return 64 * (b / 2) + 32 * (e % 2) + 16 * (b % 2) + e / 2;
}

// x's rows rounded: q (M rows of padded_blocks(K) * 32 int8, chunk by chunk in x_at's layout, zeros
// past K), d and sum (M rows of padded_blocks(K) floats in lane_block's order: each block's step, and
// d * sum(q); zeros past the last block).
struct QAct {
  const int8_t* q;
  const float* d;
  const float* sum;
  int K;
};

using QuantizeFn = void (*)(const float* x, int M, int K, int bits, int8_t* q, float* d, float* sum);
using DotFn = void (*)(const QAct& a, int M, const qmatmul::QWeight& w, float* y, int64_t ldy, int n0, int n1);

#define MLXQ_QDOT_DECLARE(ns)                                                                      \
  namespace ns {                                                                                   \
  void quantize_rows(const float* x, int M, int K, int bits, int8_t* q, float* d, float* sum);    \
  void dot(const QAct& a, int M, const qmatmul::QWeight& w, float* y, int64_t ldy, int n0, int n1); \
  }
MLXQ_QDOT_DECLARE(generic)
MLXQ_QDOT_DECLARE(avx2)
MLXQ_QDOT_DECLARE(vnni)
#undef MLXQ_QDOT_DECLARE

} // namespace mlxq::qdot

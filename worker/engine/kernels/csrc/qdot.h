// The matmul quantized_linear runs with int8_dot (cpu_weights=int8-dot): llama.cpp's method on MLX's
// affine blocks. Each row of x is rounded to 8 bits per block of 32 (d = max|x| / 127, q = round(x / d),
// ties to even), and each output is
//   y[m, n] = sum over blocks b of  s[n, g] * d[m, b] * dot(q_w, q_x)  +  b[n, g] * d[m, b] * sum(q_x)
// with dot(q_w, q_x) an exact integer (4- or 8-bit unsigned weights times signed 8-bit x). The integer
// dot products run 32 multiply-adds an instruction (AVX2 maddubs, or AVX-VNNI dpbusd), against 8 for
// the fp32 path, and read 4 or 8 bits a weight: fastest at few rows. The price: x is rounded, so logits
// differ from the fp32 path's (docs/design/quantized-weights.md gives by how much).
//
// What a row's output is does not depend on the batch, the tile, the column split or the ISA: the
// integer parts are exact, and the float parts run in one order (lane l of block b holds the integer
// dot of bytes 4l..4l+3 in the block's byte order; acc[l] = fma(float(lane), s * d, acc[l]) over
// the blocks in order; then hsum's tree; then the bias terms added from zero in block order). The
// generic loops emulate the 8 lanes with the same operations.
#pragma once

#include <cstdint>

#include "qmatmul.h"

namespace mlxq::qdot {

constexpr int kBlock = 32;

// x's rows rounded: q (M rows of K int8, each block of 32 in the weight's byte order: for 4 bits the
// even elements then the odd ones, as a block's 16 bytes hold them in their low and high nibbles;
// for 8 bits as they are), d and sum (M rows of K / 32 floats: the block's step, and d * sum(q)).
struct QAct {
  const int8_t* q;
  const float* d;
  const float* sum;
  int K;
};

void quantize_rows(const float* x, int M, int K, int bits, int8_t* q, float* d, float* sum);

using DotFn = void (*)(const QAct& a, int M, const qmatmul::QWeight& w, float* y, int64_t ldy, int n0, int n1);

namespace generic {
void dot(const QAct& a, int M, const qmatmul::QWeight& w, float* y, int64_t ldy, int n0, int n1);
}
namespace avx2 {
void dot(const QAct& a, int M, const qmatmul::QWeight& w, float* y, int64_t ldy, int n0, int n1);
}
namespace vnni {
void dot(const QAct& a, int M, const qmatmul::QWeight& w, float* y, int64_t ldy, int n0, int n1);
}

} // namespace mlxq::qdot

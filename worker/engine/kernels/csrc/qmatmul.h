// The matmul quantized_linear runs (qlinear_ops.h): y[m, n] = dot(x[m, :], w[n, :]) where w is
// MLX's affine quantization as stored (4 or 8 bits packed little-endian in uint32 words, a float
// scale s and bias b per group of gs values: w = s q + b), read as it is, never widened to fp32.
//
// Per group g of an output: d = q . x over the group's 8-lane chunks (a multiply, then one
// fused multiply-add a chunk), then acc = fma(s, d, fma(b, xs_g, acc)), where xs_g is the 8-lane
// partial sum of x over the group's chunks (computed once a call, group_sums); the 8 lanes added
// in one fixed tree at the end. So every output has one chain of operations whatever M is,
// whichever tile it falls in and however the columns are split: a row's bits do not depend on
// its batch. The generic loops emulate the 8 lanes one float at a time with the same operations
// (std::fma, compiled without contraction): the same bits as the AVX2 build.
#pragma once

#include <cstdint>

namespace mlxq::qmatmul {

using MatmulFn = void (*)(const float* x, const float* xs, int M, int K, const uint32_t* w, const float* s,
                          const float* b, int bits, int gs, float* y, int64_t ldy, int n0, int n1);

// xs[(m * G + g) * 8 + lane] = sum over the group's chunks c of x[m, g * gs + 8 c + lane], in chunk
// order (plain adds: the same bits in any build).
void group_sums(const float* x, int M, int K, int gs, float* xs);

// y[m * ldy + n] for m in [0, M), n in [n0, n1); x: M rows of K, contiguous; w: N rows of K * bits
// / 32 words; s, b: N rows of K / gs.
namespace avx2 {
void matmul(const float* x, const float* xs, int M, int K, const uint32_t* w, const float* s, const float* b,
            int bits, int gs, float* y, int64_t ldy, int n0, int n1);
}
namespace generic {
void matmul(const float* x, const float* xs, int M, int K, const uint32_t* w, const float* s, const float* b,
            int bits, int gs, float* y, int64_t ldy, int n0, int n1);
}

} // namespace mlxq::qmatmul

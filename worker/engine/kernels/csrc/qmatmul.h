// The matmul quantized_linear runs (qlinear_ops.h): y[m, n] = dot(x[m, :], w[n, :]) where w is
// MLX's affine quantization as stored (4 or 8 bits packed little-endian in uint32 words, a float32
// scale s and bias b per group of gs values), read as it is, never widened to fp32 in memory.
//
// Each weight is dequantized as MLX's dequantize computes it, (s * q) + b in two roundings (no
// fused multiply-add), and each output summed as linear's own loops sum it (rowdot.h): an 8-lane
// fused multiply-add chain from zero over k = 0, 8, 16, ..., then the lanes in hsum's tree. So a
// row's output is bit for bit linear()'s on the weights dequantized at load (the cpu_weights=fp32
// path), in any batch. Few rows: the chunks dequantized in registers (matvec); more: a strip of
// weight rows dequantized into a buffer that stays in cache (dequantize_rows), which linear's loops
// then read (qlinear_ops.cpp). The generic build emulates the 8 lanes one float at a time with the
// same operations (std::fma, compiled without contraction): the same bits as the AVX2 build.
#pragma once

#include <cstdint>

namespace mlxq::qmatmul {

// How a weight's scales and biases are stored: float32, or a 16-bit float that holds their values
// exactly (int8_dot's loops only, qdot.h: they read half the bytes and widen them to the same float32s).
enum class ScaleKind { f32, f16, bf16 };

// A weight as stored: N rows of K * bits / 32 words; s, b: N rows of K / gs, of `kind` (these loops
// take f32 alone: check_packed refuses them any other).
struct QWeight {
  const uint32_t* w;
  const void* s;
  const void* b;
  int K, bits, gs;
  ScaleKind kind = ScaleKind::f32;
};

// In registers: y[m * ldy + n] for m in [0, M), n in [n0, n1); x: M rows of K, contiguous.
using MatvecFn = void (*)(const float* x, int M, const QWeight& q, float* y, int64_t ldy, int n0, int n1);
// Weight rows [n0, n1) as float32, (s * q) + b, into out (n1 - n0 rows of K).
using DequantFn = void (*)(const QWeight& q, int n0, int n1, float* out);

namespace avx2 {
void matvec(const float* x, int M, const QWeight& q, float* y, int64_t ldy, int n0, int n1);
void dequantize_rows(const QWeight& q, int n0, int n1, float* out);
} // namespace avx2
namespace generic {
void matvec(const float* x, int M, const QWeight& q, float* y, int64_t ldy, int n0, int n1);
void dequantize_rows(const QWeight& q, int n0, int n1, float* out);
} // namespace generic

} // namespace mlxq::qmatmul

// The weight matmul linear_ops.cpp runs itself where the CPU has AVX2 and FMA
// (rowdot_impl.h): y[m, n] = dot(x[m, :], w[n, :]) with both operands read as
// stored (rows of K floats), no packing.
//
// Every output has one summation order, whatever M is, whichever tile it falls in and
// however the columns are split over threads: an 8-lane fused multiply-add chain over
// k = 0, 8, 16, ... (one accumulator), the 8 lanes added in one fixed tree, then the
// K % 8 last products one at a time (std::fma). So a row's bits do not depend on its
// batch: a row decoded alone and in a batch of 64, or prefilled alone and in a ragged
// pass with other prompts, gets the very same outputs.
#pragma once

#include <cstdint>

namespace mlxq::rowdot {

using MatmulFn = void (*)(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy,
                          int K, int n0, int n1, bool add);

// y[m * ldy + n] = dot(x[m * ldx : +K], w[n * ldw : +K]) for m in [0, M), n in [n0, n1)
// (y[...] + dot when add: the bias, already in y). avx2: AVX2 + FMA; avx512: the same
// instructions with AVX-512VL's 32 registers (bigger tiles), the same bits.
namespace avx2 {
void matmul(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy, int K,
            int n0, int n1, bool add);
}
namespace avx512 {
void matmul(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy, int K,
            int n0, int n1, bool add);
}

} // namespace mlxq::rowdot

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
#include <vector>

namespace mlxq::rowdot {

using MatmulFn = void (*)(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy,
                          int K, int n0, int n1, bool add, const float* xpairs);

// y[m * ldy + n] = dot(x[m * ldx : +K], w[n * ldw : +K]) for m in [0, M), n in [n0, n1)
// (y[...] + dot when add: the bias, already in y). avx2: AVX2 + FMA; avx512: the same
// instructions with AVX-512VL's 32 registers (bigger tiles), the same bits.
// xpairs: x as avx512::pack_pairs() packed it, for the parts of one call to share, or null
// (the avx512 loops then pack for themselves where they need it; avx2 never reads it).
namespace avx2 {
void matmul(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy, int K,
            int n0, int n1, bool add, const float* xpairs);
}
namespace avx512 {
void matmul(const float* x, int64_t ldx, int M, const float* w, int64_t ldw, float* y, int64_t ldy, int K,
            int n0, int n1, bool add, const float* xpairs);
// x's M rows as the pairs loops read them (from 5 rows: rows_pairs), into buf from a 64-byte
// boundary, which it returns (fewer rows: nothing, null).
const float* pack_pairs(const float* x, int64_t ldx, int M, int K, std::vector<float>& buf);
// The same in parts (for a pool's threads): pairs_buffer sizes buf and returns where the pairs go
// (null below 5 rows), then pack_pairs_range packs pairs [p0, p1) of the (M + 1) / 2 there.
float* pairs_buffer(int M, int K, std::vector<float>& buf);
void pack_pairs_range(const float* x, int64_t ldx, int M, int K, float* dst, int p0, int p1);
}

} // namespace mlxq::rowdot

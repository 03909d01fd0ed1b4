// The one-row weight matmul linear_ops.cpp runs itself where the CPU has AVX2 and
// FMA (gemv_avx2.cpp); elsewhere it calls the BLAS's sgemv.
#pragma once

#include <cstdint>

namespace mlxq::gemv_avx2 {

// y[n] = dot(w[n, 0:K], x) for n in [n0, n1) (y[n] += ... when add); row n of w
// starts at w + n * ldw.
void rows(const float* w, int64_t ldw, const float* x, float* y, int K, int n0, int n1, bool add);

} // namespace mlxq::gemv_avx2

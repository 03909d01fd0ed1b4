// The paged attention inner loop with AVX-512VL's 32 vector registers: the same
// 8-lane AVX2/FMA arithmetic as pa_kernel_avx2.cpp (so the same bits), in tiles of
// 4 queries (16 score or output accumulators, 4 queries or weights, 1 row), and for
// float blocks in tiles of 4 pairs of queries, a pair's two 8-lane computations in
// the two halves of 16-lane registers (PA_ZMM, pa_kernel_impl.h's attend_pairs).
// CMakeLists.txt compiles it with -mavx2 -mfma -mavx512f -mavx512vl; paged_attention.cpp
// calls it only where the CPU reports them (isa.h).
#define PA_NS avx512
#define PA_TQ 4
#define PA_NV 4
#define PA_ZMM 4
#include "pa_kernel_impl.h"

// The paged attention inner loop for x86-64 with AVX2 and FMA. CMakeLists.txt
// compiles this file alone with -mavx2 -mfma; paged_attention.cpp calls it only
// when the CPU reports both (__builtin_cpu_supports). 16 vector registers: tiles
// of 3 queries (12 score or output accumulators, 3 queries or weights, 1 row).
#define PA_NS avx2
#define PA_TQ 3
#define PA_NV 4
#include "pa_kernel_impl.h"

// The paged attention inner loop for x86-64 with AVX2 and FMA. CMakeLists.txt
// compiles this file alone with -mavx2 -mfma; paged_attention.cpp calls it only
// when the CPU reports both (__builtin_cpu_supports).
#define PA_NS avx2
#include "pa_kernel_impl.h"

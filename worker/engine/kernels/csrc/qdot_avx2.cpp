// qdot_x86.h with AVX2 alone.
#define QDOT_NS avx2
#include "qdot_x86.h"

// rowdot_impl.h for AVX2 + FMA (16 vector registers): 4 x 3 tiles.
#define ROWDOT_NS avx2
#define ROWDOT_MR 4
#define ROWDOT_NR 3
#include "rowdot_impl.h"

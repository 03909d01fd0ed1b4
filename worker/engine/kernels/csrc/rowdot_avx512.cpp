// rowdot_impl.h with AVX-512VL's 32 vector registers (the same 8-lane AVX2/FMA
// arithmetic, so the same bits): 4 x 6 tiles, and 5 to 8 rows in pairs in 16-lane
// registers (AVX-512F), each half one row's 8-lane chain (few_rows_pairs).
#define ROWDOT_NS avx512
#define ROWDOT_MR 4
#define ROWDOT_NR 6
#define ROWDOT_ZMM
#define ROWDOT_ZMM_MIN 5
#define ROWDOT_ZMM_MAX 8
#include "rowdot_impl.h"

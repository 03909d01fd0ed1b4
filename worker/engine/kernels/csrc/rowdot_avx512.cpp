// rowdot_impl.h with AVX-512VL's 32 vector registers (the same 8-lane AVX2/FMA
// arithmetic, so the same bits): 4 x 6 tiles for 2 to 4 rows, and from 5 rows on the rows in
// pairs in 16-lane registers (AVX-512F), each half one row's 8-lane chain (rows_pairs).
#define ROWDOT_NS avx512
#define ROWDOT_MR 4
#define ROWDOT_NR 6
#define ROWDOT_ZMM
#define ROWDOT_ZMM_MIN 5
#include "rowdot_impl.h"

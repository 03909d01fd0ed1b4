// rowdot_impl.h with AVX-512VL's 32 vector registers (the same 8-lane AVX2/FMA
// instructions, so the same bits): 4 x 6 tiles, and up to 8 rows as one 8 x 3 tile.
#define ROWDOT_NS avx512
#define ROWDOT_MR 4
#define ROWDOT_NR 6
#define ROWDOT_FEW_MR 8
#define ROWDOT_FEW_NR 3
#include "rowdot_impl.h"

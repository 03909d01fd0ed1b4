// rowdot_impl.h for AVX2 + FMA (16 vector registers): 4 x 3 tiles up to 16 rows, then 3 x 4.
// 4 x 3 holds 12 accumulators, 4 rows of x and a weight row: 17 registers, so the compiler reads
// one x row from memory at every multiply-add (10 loads per 12 multiply-adds); 3 x 4 fits (7 loads).
// On a core that loads two 256-bit vectors a cycle (AMD Zen 3) the loads bound 4 x 3 at many rows.
// bench/harness/rowdot_rows.cpp (built -mavx2 -mfma), the bench model's matmuls, one thread pinned
// to a core, runs alternating, 2026-11-27, a Zen 3 VM: 64 rows 57.1-57.7 -> 50.4-51.5 ms, 48 rows
// 44.9-58.2 -> 39.6-50.9, 24 rows 27.6-33.3 -> 23.9-31.8; with the weights from L1, 64 rows 50.6 ->
// 43.6 ms (2 x 6 tiles, 14 loads as compiled: 73.7). At 9 to 16 rows 3 x 4 was no faster (9 rows:
// 13.1-15.3 -> 15.4-16.1 ms, its third tile of 3 rows against 4 x 3's 4 + 4 + 1), so 4 x 3 stays.
// The same bits either way: a tile's shape changes no output's chain.
#define ROWDOT_NS avx2
#define ROWDOT_MR 4
#define ROWDOT_NR 3
#define ROWDOT_MANY_MR 3
#define ROWDOT_MANY_NR 4
#define ROWDOT_MANY_MIN 17
#include "rowdot_impl.h"

// The paged attention inner loop for the target's baseline instruction set (one
// query per tile: its 8-float vectors are pairs of 4-float registers there).
#define PA_NS generic
#define PA_TQ 1
#define PA_NV 4
#include "pa_kernel_impl.h"

// The paged attention inner loop for the target's baseline instruction set.
#define PA_NS generic
#include "pa_kernel_impl.h"

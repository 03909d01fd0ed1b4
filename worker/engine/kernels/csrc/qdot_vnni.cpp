// qdot_x86.h with AVX-VNNI's dpbusd for the integer dot products (the same integers).
#define QDOT_NS vnni
#define QDOT_VNNI
#include "qdot_x86.h"

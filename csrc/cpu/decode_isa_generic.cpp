// Baseline x86-64 / any-CPU build of the decode kernels (portable 16-lane arrays, no FMA).
#include <cmath>
#include <cstdint>
#include <cstring>

#define MTP_ISA_NAME "generic"
#define MTP_ISA_FN kernels_generic
#include "decode_kernels_impl.h"

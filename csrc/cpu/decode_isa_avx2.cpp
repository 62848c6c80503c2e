// AVX2 + FMA build of the decode kernels (16-lane vectors as register pairs, decode_kernels_impl.h).
#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC target("avx2,fma,f16c")
#define MTP_ISA_AVX2
#define MTP_ISA_NAME "avx2"
#define MTP_ISA_FN kernels_avx2
#include "decode_kernels_impl.h"

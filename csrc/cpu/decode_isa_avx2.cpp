// AVX2 + FMA build of the decode kernels (portable 16-lane arrays, vectorized by the compiler).
#include <cmath>
#include <cstdint>
#include <cstring>

#pragma GCC target("avx2,fma,f16c")
#define MTP_ISA_NAME "avx2"
#define MTP_ISA_FN kernels_avx2
#include "decode_kernels_impl.h"

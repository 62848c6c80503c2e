// AVX-512 (F/BW/VL/DQ + FMA) build of the decode kernels; used only when the CPU reports these features.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

// GCC 12 warns inside its own avx512fintrin.h (undefined-vector idiom of _mm512_undefined_*); not ours.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#define MTP_ISA_AVX512 1
#define MTP_ISA_NAME "avx512"
#define MTP_ISA_FN kernels_avx512
#include "decode_kernels_impl.h"

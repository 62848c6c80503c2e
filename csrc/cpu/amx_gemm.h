// AMX tile GEMM (Intel Sapphire Rapids and later) for row-wise bf16 weights: the activations are rounded to
// bf16 (round to nearest even) and the tiles accumulate in fp32. Used for every token count of a matrix that
// takes it (decode, verification and prefill alike), so each output is the same sequence of tile dot
// products whatever T is: batch-invariant, bitwise. Built in its own translation unit (amx_gemm.cpp) with
// the AMX target; nothing here runs unless amx_usable() said yes.
#pragma once

#include <cstdint>

#include "decode_kernels.h"

namespace mtp_core {
namespace cpu {

// The CPU has AMX-TILE and AMX-BF16 and the kernel granted this process the tile state (asked once).
bool amx_usable();

// A matrix the AMX GEMM takes: kRows, bf16, K a multiple of 32.
inline bool amx_takes(const Mat& W) { return W.layout == kRows && W.fmt == kBF16 && W.k % 32 == 0; }

// Y[t * ldy + n] = dot(bf16(X_t), W[n, :]) (+ bias[n]) for n in [n0, n1) (n0 a multiple of 16), t < T.
void amx_gemm(const Mat& W, const Rows& X, int64_t n0, int64_t n1, float* Y, int64_t ldy);

}  // namespace cpu
}  // namespace mtp_core

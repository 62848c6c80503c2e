// Row-wise GEMM on the core's bf16 dot products (AVX512-BF16 `vdpbf16ps`: Zen 4 / Zen 5, Sapphire Rapids and
// later) for bf16, FP8-block and NVFP4 weights read in place. The activations are rounded to bf16 (nearest
// even) once per call, as on the AMX tiles; each weight is decoded to its exact bf16 value in registers (e4m3
// by a 128-entry byte table, e2m1 by a 16-entry one: both are exact in bf16), and the products accumulate in
// fp32. FP8's block scales multiply the fp32 partial sum of each 128-input block, NVFP4's group scales the
// partial sum of each 16-input group, NVFP4's global scale each output once.
//
// Batch invariance: every output is the same sequence of instructions over its inputs in a fixed order
// whatever the number of tokens, the tiling or the thread (one fp32 partial per lane, a fixed tree over the
// lanes at the end), so the result is bitwise independent of T and of the split, as in the fp32 kernels.
// Built in its own translation unit (dot_gemm.cpp) with the AVX512-BF16 / VBMI target; nothing here runs
// unless dot_usable() said yes.
#pragma once

#include <cstdint>

#include "decode_kernels.h"

namespace mtp_core {
namespace cpu {

// The CPU has AVX-512 F/BW/VL/DQ, AVX512-BF16 and AVX512-VBMI.
bool dot_usable();

// A matrix the dot-product GEMM takes: row-wise bf16, FP8 block or NVFP4 (any K; NVFP4 has K % 16 == 0), or
// bf16 packed in input pairs (kPairs, which only this GEMM reads).
inline bool dot_takes(const Mat& W) {
  return (W.layout == kRows && (W.fmt == kBF16 || W.fmt == kFP8 || W.fmt == kNVFP4)) ||
         (W.layout == kPairs && W.fmt == kBF16);
}

// Y[t * ldy + n] = dot(bf16(X_t), W[n, :]) (+ bias[n]) for n in [n0, n1) and t < T.
void dot_gemm(const Mat& W, const Rows& X, int64_t n0, int64_t n1, float* Y, int64_t ldy);

// Activations rounded once (bf16, in the order a format's decode produces) and reused by every matrix of that
// format over the same rows: an expert's gate and up, all the row chunks of it one thread runs. The owner
// keeps it (one per thread); fill() overwrites it.
class DotActs {
 public:
  DotActs() = default;
  DotActs(const DotActs&) = delete;
  DotActs& operator=(const DotActs&) = delete;
  ~DotActs();
  void fill(const Rows& X, int64_t K, int fmt);
  const uint16_t* data() const { return p_; }
  int64_t ld() const { return ld_; }
  int64_t tokens() const { return T_; }
  int64_t k() const { return K_; }
  int fmt() const { return fmt_; }

 private:
  uint16_t* p_ = nullptr;
  int64_t cap_ = 0, ld_ = 0, T_ = 0, K_ = 0;
  int fmt_ = -1;
};
// dot_gemm over activations filled for W's format and K.
void dot_gemm(const Mat& W, const DotActs& X, int64_t n0, int64_t n1, float* Y, int64_t ldy);

}  // namespace cpu
}  // namespace mtp_core

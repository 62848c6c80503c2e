// The CPU decode step's compute kernels behind one table of function pointers, one table per ISA.
//
// decode_kernels_impl.h holds the algorithms, written once against a 16-lane vector type; it is
// compiled three times (decode_isa_avx512.cpp, decode_isa_avx2.cpp, decode_isa_generic.cpp), each
// translation unit with its own target and none of them including torch headers (so no inline
// function of a shared header is ever compiled for an ISA the CPU may lack). decode_cpu.cpp picks
// the best table the CPU supports at run time.
//
// Batch invariance: every output element (a dot product, a norm, an attention row) is reduced in an
// order fixed by the problem's inner sizes alone, never by the number of tokens in the call, how the
// tokens are tiled, or which thread computes it. So a token's hidden state is bitwise the same whether
// it is decoded alone or verified among K drafts, which makes greedy MTP equal plain greedy exactly.
#pragma once

#include <cstdint>

namespace mtp_core {
namespace cpu {

enum WeightType : int { kF32 = 0, kBF16 = 1 };

struct KernelTable {
  const char* isa;
  // Y[t, n] = dot(X[t, :K], W[n, :K]) (+ bias[n]) for the outputs n of panels [p0, p1), t in [0, T).
  // W [N, K] is packed in 64-row panels ([ceil(N/64), K, 64], zero rows past N; pack_weight() in
  // mtp_core/model/native_decode.py) in wtype; bias fp32 or null; X fp32 with row stride ldx, Y ldy.
  void (*gemm)(const float* X, int64_t ldx, int64_t T, const void* W, int wtype, int64_t K, int64_t N, int64_t p0,
               int64_t p1, float* Y, int64_t ldy, const float* bias);
  // y = w * (x * 1/sqrt(mean(x^2) + eps)) for each of `rows` rows of `dim` (strides ldx, ldy); w in wtype.
  void (*rms_norm)(const float* x, int64_t ldx, int64_t rows, int64_t dim, const void* w, int wtype, float eps,
                   float* y, int64_t ldy);
  // a[i] = silu(g[i]) * u[i] for each row: g = h[:, :I], u = h[:, I:2I] (row stride ldh), a row stride lda.
  void (*silu_mul)(const float* h, int64_t ldh, int64_t rows, int64_t inter, float* a, int64_t lda);
  // y[i] = 1 / (1 + exp(-x[i]))
  void (*sigmoid)(const float* x, int64_t n, float* y);
  // Varlen causal attention over a paged latent cache, one (query token, head) row at a time:
  //   q [T, H, D] fp32 (D = R + P, already roped), cache [blocks, page, D] in ctype,
  //   row b owns tokens [qstart[b], qstart[b+1]) and sees keys [0, ctx[b] - nq_b + i] for its i-th token;
  //   out [T, H, R] fp32. scores = q.k * scale; out = softmax(scores) @ c_kv (the latent part of the key).
  void (*attention)(const float* q, int64_t T, int64_t H, int64_t R, int64_t P, const void* cache, int ctype,
                    int64_t page, const int32_t* tables, int64_t max_blocks, const int32_t* qstart,
                    const int32_t* ctx, int64_t B, int64_t b0, int64_t b1, float scale, float* out,
                    float* scratch);
};

const KernelTable* kernels_avx512();
const KernelTable* kernels_avx2();
const KernelTable* kernels_generic();

}  // namespace cpu
}  // namespace mtp_core

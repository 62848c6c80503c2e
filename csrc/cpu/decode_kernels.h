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

// Element formats of a weight matrix.
//   kF32, kBF16  plain values.
//   kFP8         DeepSeek FP8: e4m3 values, one fp32 scale per 128 x 128 block of the source tensor.
//   kNVFP4       ModelOpt NVFP4: e2m1 codes two per byte, one e4m3 scale per 16 inputs, one global scale.
enum Fmt : int { kF32 = 0, kBF16 = 1, kFP8 = 2, kNVFP4 = 3 };

// Layouts of a weight matrix W [N outputs, K inputs].
//   kRows   W row-major, row n at data + n * ld (the checkpoint's own layout: nn.Linear, FP8 block). NVFP4:
//           ld bytes per row, the checkpoint's bytes (byte i: codes 2i low nibble, 2i + 1 high) with their
//           dwords reordered within each block of 256 inputs (G groups of 16: 16, fewer in a row's last
//           block): the dword of inputs [16g + 8h, 16g + 8h + 8) is dword h * G + g of the block, so one
//           64-byte load holds a dword of each of 16 groups (mtp_core/kernels/nvfp4_layout.py).
//   kCols   W stored transposed, [K, N] row-major (input k's row at data + k * ld): y = x @ S for a
//           stored S. Serves run-time MLA absorption (q_nope x W_UK reads kv_b_proj's rows in place).
//   kPanel  W packed in 64-row panels, [ceil(N/64), K, 64] (rows past N zero): a repacked copy, used for
//           small models whose matrices are too narrow for row-wise dot products to pay (f32/bf16).
//   kPairs  bf16 W packed for the bf16 dot products (dot_gemm.h) in 16-row blocks of input pairs,
//           [ceil(N/16), ceil(K/2), 16, 2] (row n's inputs 2p, 2p+1 side by side; zeros past N and K): the
//           packed layout's form on CPUs with AVX512-BF16.
enum Layout : int { kRows = 0, kCols = 1, kPanel = 2, kPairs = 3 };

struct Mat {
  int layout = kRows, fmt = kF32;
  int64_t n = 0, k = 0;             // outputs, inputs
  const void* data = nullptr;
  int64_t ld = 0;                   // kRows / kCols: elements (bytes for FP8 / NVFP4) between stored rows
  const float* scale = nullptr;     // kFP8: the source tensor's block scales, each times 256
  int64_t scale_ld = 0;             //       row stride of `scale`
  int64_t scale_r0 = 0;             //       source row (kRows: of output 0; kCols: of input 0) within its block
  const uint8_t* gscale = nullptr;  // kNVFP4: e4m3 scale per (output, 16 inputs), row stride gscale_ld
  int64_t gscale_ld = 0;
  float gscale2 = 1.f;              // kNVFP4: the global scale times 256
  const float* bias = nullptr;      // [N] or null
  bool amx = false;                 // served by amx_gemm (amx_gemm.h): bf16 activations, AMX tiles
  bool dot = false;                 // served by dot_gemm (dot_gemm.h): bf16 activations, AVX512-BF16 dot products
  bool defined() const { return data != nullptr; }
};

// Rows of X: X + t * ldx, or X + xrows[t] * ldx when xrows is set (a gather, e.g. the tokens of one expert).
struct Rows {
  const float* x;
  int64_t ldx;
  const int32_t* xrows;
  int64_t T;
};

struct KernelTable {
  const char* isa;
  // Y[t * ldy + n] = dot(X_t, W[n, :]) (+ bias[n]) for n in [n0, n1) and t < T. n0 must be a multiple of the
  // layout's granularity (gemm_align). scratch: at least gemm_scratch(W) floats (kRows with T > 4 decodes
  // each tile of rows once into it). Bitwise the same for any T, any [n0, n1) split and any thread.
  void (*gemm)(const Mat& W, const Rows& X, int64_t n0, int64_t n1, float* Y, int64_t ldy, float* scratch);
  // y = w * (x * 1/sqrt(mean(x^2) + eps)) for each of `rows` rows of `dim` (strides ldx, ldy); w in wtype.
  void (*rms_norm)(const float* x, int64_t ldx, int64_t rows, int64_t dim, const void* w, int wtype, float eps,
                   float* y, int64_t ldy);
  // a[i] = silu(g[i]) * u[i] for i < n.
  void (*silu_mul)(const float* g, const float* u, int64_t n, float* a);
  // y[i] = 1 / (1 + exp(-x[i]))
  void (*sigmoid)(const float* x, int64_t n, float* y);
  // Varlen causal attention over a paged latent cache for heads [h0, h1) of query token t (row b, i-th
  // query of that row): q [T, H, D] fp32 (D = R + P, already roped), cache [blocks, page, D] in ctype
  // (kF32 / kBF16, or kFP8: e4m3 with a per-tensor scale of 1); the token sees keys 0 .. visible-1 through
  // `table`; out [T, H, R] fp32.
  // scores = q.k * scale; out = softmax(scores) @ c_kv (the latent part of the key). scratch: H * (visible + 1).
  void (*attention)(const float* q_t, int64_t H, int64_t h0, int64_t h1, int64_t R, int64_t P, const void* cache,
                    int ctype, int64_t page, const int32_t* table, int64_t visible, float scale, float* out_t,
                    float* scratch);
  // DeepSeek-V3.2 sparse attention (dsa_cpu.cpp). The cache rows are `ld` wide: [c_kv (R) | k_pe (P) | index key].
  // index_scores: out[j - first] = sum_h w[h] * relu(q_h . ikey_j * scale) for the keys first <= j < first + n of
  // one query (q [heads, Di] fp32, w [heads]), ikey_j at offset `off` of key j's row (through `table`); heads in
  // order, so each score is the same whatever range it is computed in.
  void (*index_scores)(const float* q, const float* w, int64_t heads, int64_t Di, const void* cache, int ctype,
                       int64_t ld, int64_t off, int64_t page, const int32_t* table, int64_t first, int64_t n,
                       float scale, float* out);
  // attention over the n chosen keys at cache rows slots[0..n) (ascending positions), otherwise as `attention`.
  void (*sparse_attention)(const float* q_t, int64_t h0, int64_t h1, int64_t R, int64_t P, const void* cache,
                           int ctype, int64_t ld, const int32_t* slots, int64_t n, float scale, float* out_t,
                           float* scratch);
};

// Output granularity of a layout (n0 of a split must be a multiple of it), and gemm's scratch need.
inline int64_t gemm_align(const Mat& W) {
  return W.amx ? 16 : W.layout == kPairs ? 16 : W.dot ? 8 : W.layout == kPanel ? 64 : W.layout == kCols ? 64 : 8;
}
inline int64_t gemm_scratch(const Mat& W) { return W.layout == kRows ? 8 * (W.k + 32) : 0; }

const KernelTable* kernels_avx512();
const KernelTable* kernels_avx2();
const KernelTable* kernels_generic();

}  // namespace cpu
}  // namespace mtp_core

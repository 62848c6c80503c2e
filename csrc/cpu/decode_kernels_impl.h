// The decode kernels' algorithms, written once against a 16-lane float vector `VF` and compiled per ISA
// (see decode_kernels.h). The including translation unit defines, before including this file:
//   MTP_ISA_NAME  a string, MTP_ISA_FN  the name of its table getter,
//   and exactly one of MTP_ISA_AVX512 (AVX-512F intrinsics) or nothing (portable 16-lane arrays, which
//   the compiler vectorizes for the TU's target: AVX2+FMA or plain x86-64).
// Internal linkage only: nothing here may be merged with another TU's copy compiled for another ISA.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "decode_kernels.h"

#if defined(MTP_ISA_AVX512)
#include <immintrin.h>
#endif

namespace mtp_core {
namespace cpu {
namespace {

constexpr int kLanes = 16;

#if defined(MTP_ISA_AVX512)
struct VF {
  __m512 v;
};
inline VF vzero() { return {_mm512_setzero_ps()}; }
inline VF vset1(float a) { return {_mm512_set1_ps(a)}; }
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }
inline VF vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline VF vload_n(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(tail_mask(n), p)}; }
inline VF vload(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline VF vload_n(const uint16_t* p, int64_t n) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail_mask(n), p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline void vstore(float* p, VF a) { _mm512_storeu_ps(p, a.v); }
inline void vstore_n(float* p, VF a, int64_t n) { _mm512_mask_storeu_ps(p, tail_mask(n), a.v); }
inline VF vfma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VF vadd(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VF vsub(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VF vmul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VF vdiv(VF a, VF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VF vmax(VF a, VF b) { return {_mm512_max_ps(a.v, b.v)}; }
// Pairwise halves 16 -> 8 -> 4 -> 2 -> 1: a fixed tree.
inline float vhsum(VF a) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}
inline float vhmax(VF a) { return _mm512_reduce_max_ps(a.v); }
// Four sums at once (a fixed tree per sum): 128-bit quarters pairwise, then within each quarter.
inline void vhsum4(VF a, VF b, VF c, VF d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a.v, b.v, 0x44), _mm512_shuffle_f32x4(a.v, b.v, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c.v, d.v, 0x44), _mm512_shuffle_f32x4(c.v, d.v, 0xEE));
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
  alignas(64) float t[16];
  _mm512_store_ps(t, x);
  out[0] = t[0];
  out[1] = t[4];
  out[2] = t[8];
  out[3] = t[12];
}
// exp(x) for x <= 0 (scores minus their max, -g for silu): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
// p a degree-6 Taylor polynomial (relative error < 2e-7); x below -87 gives 0 (flushed, as expf underflows).
inline VF vexp(VF x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x.v, lo, _CMP_LT_OQ);
  __m512 xc = _mm512_max_ps(x.v, lo);
  xc = _mm512_min_ps(xc, _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return {_mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), p, n)};
}
#else
struct VF {
  float v[kLanes];
};
inline VF vzero() {
  VF r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = 0.f;
  return r;
}
inline VF vset1(float a) {
  VF r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = a;
  return r;
}
inline VF vload(const float* p) {
  VF r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = p[i];
  return r;
}
inline VF vload_n(const float* p, int64_t n) {
  VF r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = i < n ? p[i] : 0.f;
  return r;
}
inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline VF vload(const uint16_t* p) {
  VF r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = bf16_to_f32(p[i]);
  return r;
}
inline VF vload_n(const uint16_t* p, int64_t n) {
  VF r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = i < n ? bf16_to_f32(p[i]) : 0.f;
  return r;
}
inline void vstore(float* p, VF a) {
  for (int i = 0; i < kLanes; ++i) p[i] = a.v[i];
}
inline void vstore_n(float* p, VF a, int64_t n) {
  for (int i = 0; i < kLanes && i < n; ++i) p[i] = a.v[i];
}
#if defined(__FMA__)
inline float fma1(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
inline float fma1(float a, float b, float c) { return a * b + c; }
#endif
inline VF vfma(VF a, VF b, VF c) {
  VF r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = fma1(a.v[i], b.v[i], c.v[i]);
  return r;
}
#define MTP_VF_BINOP(name, expr)                          \
  inline VF name(VF a, VF b) {                            \
    VF r;                                                 \
    for (int i = 0; i < kLanes; ++i) r.v[i] = (expr);     \
    return r;                                             \
  }
MTP_VF_BINOP(vadd, a.v[i] + b.v[i])
MTP_VF_BINOP(vsub, a.v[i] - b.v[i])
MTP_VF_BINOP(vmul, a.v[i] * b.v[i])
MTP_VF_BINOP(vdiv, a.v[i] / b.v[i])
MTP_VF_BINOP(vmax, a.v[i] > b.v[i] ? a.v[i] : b.v[i])
#undef MTP_VF_BINOP
inline float vhsum(VF a) {
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) q[i] = h[i] + h[i + 4];
  const float d0 = q[0] + q[2], d1 = q[1] + q[3];
  return d0 + d1;
}
inline float vhmax(VF a) {
  float m = a.v[0];
  for (int i = 1; i < kLanes; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline VF vexp(VF x) {
  VF r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = x.v[i] < -87.0f ? 0.f : std::exp(x.v[i]);
  return r;
}
inline void vhsum4(VF a, VF b, VF c, VF d, float* out) {
  out[0] = vhsum(a);
  out[1] = vhsum(b);
  out[2] = vhsum(c);
  out[3] = vhsum(d);
}
#endif

template <typename WT>
inline VF wload(const WT* p, int64_t n) {
  return n >= kLanes ? vload(p) : vload_n(p, n);
}

// ---- GEMM over a packed weight ------------------------------------------------------------------
// W [N, K] is packed in panels of kPanel = 64 output rows: panel p holds W[64p .. 64p+63, k] for
// k = 0..K-1 as K consecutive runs of 64 values (rows past N are zero). A register tile is TT tokens x
// 64 outputs (4 vectors); each output is one chain of fused multiply-adds over k = 0..K-1, so its
// rounding depends on K alone: not on T, on the tile, or on the thread.
constexpr int64_t kPanel = 64;

template <typename WT, int TT>
inline void packed_tile(const float* X, int64_t ldx, const WT* P, int64_t K, float* Y, int64_t ldy,
                        const float* bias, int64_t n, int64_t N) {
  VF acc[TT][4];
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const WT* row = P + k * kPanel;
    const VF w0 = vload(row), w1 = vload(row + 16), w2 = vload(row + 32), w3 = vload(row + 48);
    for (int t = 0; t < TT; ++t) {
      const VF x = vset1(X[t * ldx + k]);
      acc[t][0] = vfma(w0, x, acc[t][0]);
      acc[t][1] = vfma(w1, x, acc[t][1]);
      acc[t][2] = vfma(w2, x, acc[t][2]);
      acc[t][3] = vfma(w3, x, acc[t][3]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t col = n + 16 * j, left = N - col;
    if (left <= 0) break;
    const VF b = bias ? (left >= kLanes ? vload(bias + col) : vload_n(bias + col, left)) : vzero();
    for (int t = 0; t < TT; ++t) {
      const VF y = bias ? vadd(acc[t][j], b) : acc[t][j];
      if (left >= kLanes) vstore(Y + t * ldy + col, y); else vstore_n(Y + t * ldy + col, y, left);
    }
  }
}

template <typename WT>
void gemm_typed(const float* X, int64_t ldx, int64_t T, const WT* W, int64_t K, int64_t N, int64_t p0, int64_t p1,
                float* Y, int64_t ldy, const float* bias) {
  for (int64_t p = p0; p < p1; ++p) {
    const WT* P = W + p * K * kPanel;
    const int64_t n = p * kPanel;
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) packed_tile<WT, 4>(X + t * ldx, ldx, P, K, Y + t * ldy, ldy, bias, n, N);
    switch (T - t) {
      case 3: packed_tile<WT, 3>(X + t * ldx, ldx, P, K, Y + t * ldy, ldy, bias, n, N); break;
      case 2: packed_tile<WT, 2>(X + t * ldx, ldx, P, K, Y + t * ldy, ldy, bias, n, N); break;
      case 1: packed_tile<WT, 1>(X + t * ldx, ldx, P, K, Y + t * ldy, ldy, bias, n, N); break;
      default: break;
    }
  }
}

void gemm(const float* X, int64_t ldx, int64_t T, const void* W, int wtype, int64_t K, int64_t N, int64_t p0,
          int64_t p1, float* Y, int64_t ldy, const float* bias) {
  if (wtype == kBF16) {
    gemm_typed(X, ldx, T, static_cast<const uint16_t*>(W), K, N, p0, p1, Y, ldy, bias);
  } else {
    gemm_typed(X, ldx, T, static_cast<const float*>(W), K, N, p0, p1, Y, ldy, bias);
  }
}

// ---- element-wise -------------------------------------------------------------------------------
template <typename WT>
void rms_norm_typed(const float* x, int64_t ldx, int64_t rows, int64_t dim, const WT* w, float eps, float* y,
                    int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
    VF acc = vzero();
    for (int64_t k = 0; k < dim; k += kLanes) {
      const VF v = wload(xr + k, dim - k);
      acc = vfma(v, v, acc);
    }
    const float inv = 1.0f / std::sqrt(vhsum(acc) / static_cast<float>(dim) + eps);
    const VF vinv = vset1(inv);
    for (int64_t k = 0; k < dim; k += kLanes) {
      const int64_t left = dim - k;
      const VF out = vmul(wload(w + k, left), vmul(wload(xr + k, left), vinv));
      if (left >= kLanes) vstore(yr + k, out); else vstore_n(yr + k, out, left);
    }
  }
}

void rms_norm(const float* x, int64_t ldx, int64_t rows, int64_t dim, const void* w, int wtype, float eps, float* y,
              int64_t ldy) {
  if (wtype == kBF16) {
    rms_norm_typed(x, ldx, rows, dim, static_cast<const uint16_t*>(w), eps, y, ldy);
  } else {
    rms_norm_typed(x, ldx, rows, dim, static_cast<const float*>(w), eps, y, ldy);
  }
}

void silu_mul(const float* h, int64_t ldh, int64_t rows, int64_t inter, float* a, int64_t lda) {
  const VF one = vset1(1.0f), zero = vzero();
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = h + r * ldh;
    const float* u = g + inter;
    float* out = a + r * lda;
    for (int64_t k = 0; k < inter; k += kLanes) {
      const int64_t left = inter - k;
      const VF gv = wload(g + k, left);
      const VF s = vdiv(gv, vadd(one, vexp(vsub(zero, gv))));
      const VF o = vmul(s, wload(u + k, left));
      if (left >= kLanes) vstore(out + k, o); else vstore_n(out + k, o, left);
    }
  }
}

void sigmoid(const float* x, int64_t n, float* y) {
  const VF one = vset1(1.0f), zero = vzero();
  for (int64_t k = 0; k < n; k += kLanes) {
    const int64_t left = n - k;
    const VF o = vdiv(one, vadd(one, vexp(vsub(zero, wload(x + k, left)))));
    if (left >= kLanes) vstore(y + k, o); else vstore_n(y + k, o, left);
  }
}

// ---- attention ----------------------------------------------------------------------------------
// o[hh, r0 .. r0+rlen) = inv[hh] * sum_j p[hh, j] * c_kv_j[r0 ..] for NH heads (probabilities p with row
// stride `visible`), accumulated in registers over the keys in order.
template <typename CT, int NH>
inline void attn_out_tile(const float* p, int64_t visible, const CT* cache, const int32_t* table, int64_t page,
                          int64_t D, int64_t r0, int64_t rlen, float* o, int64_t R, const float* inv) {
  VF acc[NH][4];
  for (int hh = 0; hh < NH; ++hh)
    for (int c = 0; c < 4; ++c) acc[hh][c] = vzero();
  const int nc = static_cast<int>((rlen + kLanes - 1) / kLanes);
  int64_t blk = 0, off = 0;   // key j lives at (table[blk], off): a running counter, no division per key
  for (int64_t j = 0; j < visible; ++j, ++off) {
    if (off == page) { off = 0; ++blk; }
    const CT* key = cache + (static_cast<int64_t>(table[blk]) * page + off) * D + r0;
    VF k[4];
    for (int c = 0; c < 4; ++c) k[c] = c < nc ? wload(key + 16 * c, rlen - 16 * c) : vzero();
    for (int hh = 0; hh < NH; ++hh) {
      const VF w = vset1(p[hh * visible + j]);
      for (int c = 0; c < 4; ++c) acc[hh][c] = vfma(w, k[c], acc[hh][c]);
    }
  }
  for (int hh = 0; hh < NH; ++hh) {
    const VF s = vset1(inv[hh]);
    for (int c = 0; c < nc; ++c) {
      const int64_t left = rlen - 16 * c;
      const VF y = vmul(acc[hh][c], s);
      if (left >= kLanes) vstore(o + hh * R + 16 * c, y); else vstore_n(o + hh * R + 16 * c, y, left);
    }
  }
}

// s[hh, j] = q_hh . k_j * scale for NH heads (queries with row stride D) and keys j < visible, in order.
// DC > 0: D is DC chunks of 16 (the last possibly partial) and the queries stay in registers; DC = 0: any D.
template <typename CT, int NH, int DC>
inline void attn_scores_tile(const float* q, int64_t D, const CT* cache, const int32_t* table, int64_t page,
                             int64_t visible, float scale, float* s) {
  constexpr int kChunks = DC > 0 ? DC : 1;
  VF qv[NH][kChunks];
  if (DC > 0) {
    for (int hh = 0; hh < NH; ++hh)
      for (int c = 0; c < kChunks; ++c) qv[hh][c] = wload(q + hh * D + 16 * c, D - 16 * c);
  }
  int64_t blk = 0, off = 0;
  for (int64_t j = 0; j < visible; ++j, ++off) {
    if (off == page) { off = 0; ++blk; }
    const CT* key = cache + (static_cast<int64_t>(table[blk]) * page + off) * D;
    VF acc[4] = {vzero(), vzero(), vzero(), vzero()};
    if (DC > 0) {
      for (int c = 0; c < kChunks; ++c) {
        const VF k = wload(key + 16 * c, D - 16 * c);
        for (int hh = 0; hh < NH; ++hh) acc[hh] = vfma(qv[hh][c], k, acc[hh]);
      }
    } else {
      for (int64_t d = 0; d < D; d += kLanes) {
        const VF k = wload(key + d, D - d);
        for (int hh = 0; hh < NH; ++hh) acc[hh] = vfma(wload(q + hh * D + d, D - d), k, acc[hh]);
      }
    }
    float r[4];
    vhsum4(acc[0], acc[1], acc[2], acc[3], r);
    for (int hh = 0; hh < NH; ++hh) s[hh * visible + j] = r[hh] * scale;
  }
}

template <typename CT, int NH>
inline void attn_scores(const float* q, int64_t D, const CT* cache, const int32_t* table, int64_t page,
                        int64_t visible, float scale, float* s) {
  switch ((D + kLanes - 1) / kLanes) {
    case 1: return attn_scores_tile<CT, NH, 1>(q, D, cache, table, page, visible, scale, s);
    case 2: return attn_scores_tile<CT, NH, 2>(q, D, cache, table, page, visible, scale, s);
    case 3: return attn_scores_tile<CT, NH, 3>(q, D, cache, table, page, visible, scale, s);
    case 4: return attn_scores_tile<CT, NH, 4>(q, D, cache, table, page, visible, scale, s);
    case 5: return attn_scores_tile<CT, NH, 5>(q, D, cache, table, page, visible, scale, s);
    case 6: return attn_scores_tile<CT, NH, 6>(q, D, cache, table, page, visible, scale, s);
    default: return attn_scores_tile<CT, NH, 0>(q, D, cache, table, page, visible, scale, s);
  }
}

template <typename CT>
void attention_typed(const float* q, int64_t H, int64_t R, int64_t P, const CT* cache, int64_t page,
                     const int32_t* tables, int64_t max_blocks, const int32_t* qstart, const int32_t* ctx,
                     int64_t b0, int64_t b1, float scale, float* out, float* scores) {
  const int64_t D = R + P;
  for (int64_t b = b0; b < b1; ++b) {
    const int32_t* table = tables + b * max_blocks;
    const int64_t nq = qstart[b + 1] - qstart[b];
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t t = qstart[b] + i;
      const int64_t visible = ctx[b] - nq + i + 1;
      const float* qt = q + t * H * D;
      float* ot = out + t * H * R;
      float* inv = scores + H * visible;   // [H] after the scores
      if (visible <= 0) {
        for (int64_t d = 0; d < H * R; ++d) ot[d] = 0.f;
        continue;
      }
      // scores[h, j] = q_h . k_j * scale: up to 4 heads against one key at a time (independent chains)
      for (int64_t h0 = 0; h0 < H; h0 += 4) {
        float* sh = scores + h0 * visible;
        const float* qh = qt + h0 * D;
        switch (H - h0 < 4 ? H - h0 : 4) {
          case 4: attn_scores<CT, 4>(qh, D, cache, table, page, visible, scale, sh); break;
          case 3: attn_scores<CT, 3>(qh, D, cache, table, page, visible, scale, sh); break;
          case 2: attn_scores<CT, 2>(qh, D, cache, table, page, visible, scale, sh); break;
          default: attn_scores<CT, 1>(qh, D, cache, table, page, visible, scale, sh); break;
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        float* s = scores + h * visible;
        float mx = -INFINITY;
        for (int64_t j = 0; j + kLanes <= visible; j += kLanes) {
          const float c = vhmax(vload(s + j));
          mx = c > mx ? c : mx;
        }
        for (int64_t j = visible - visible % kLanes; j < visible; ++j) mx = s[j] > mx ? s[j] : mx;
        const VF vmx = vset1(mx);
        VF sum = vzero();
        for (int64_t j = 0; j < visible; j += kLanes) {
          const int64_t left = visible - j;
          if (left >= kLanes) {
            const VF p = vexp(vsub(vload(s + j), vmx));
            vstore(s + j, p);
            sum = vadd(sum, p);
          } else {
            vstore_n(s + j, vexp(vsub(vload_n(s + j, left), vmx)), left);
            sum = vadd(sum, vload_n(s + j, left));   // masked lanes read back as 0
          }
        }
        inv[h] = 1.0f / vhsum(sum);
      }
      // out_h = sum_j p_hj * c_kv_j / sum_j p_hj, keys in order; register tiles of 4 heads x 64 latents
      for (int64_t h0 = 0; h0 < H; h0 += 4) {
        for (int64_t r0 = 0; r0 < R; r0 += 64) {
          const int64_t rlen = R - r0 < 64 ? R - r0 : 64;
          float* o = ot + h0 * R + r0;
          const float* sh = scores + h0 * visible;
          switch (H - h0 < 4 ? H - h0 : 4) {
            case 4: attn_out_tile<CT, 4>(sh, visible, cache, table, page, D, r0, rlen, o, R, inv + h0); break;
            case 3: attn_out_tile<CT, 3>(sh, visible, cache, table, page, D, r0, rlen, o, R, inv + h0); break;
            case 2: attn_out_tile<CT, 2>(sh, visible, cache, table, page, D, r0, rlen, o, R, inv + h0); break;
            default: attn_out_tile<CT, 1>(sh, visible, cache, table, page, D, r0, rlen, o, R, inv + h0); break;
          }
        }
      }
    }
  }
}

void attention(const float* q, int64_t T, int64_t H, int64_t R, int64_t P, const void* cache, int ctype,
               int64_t page, const int32_t* tables, int64_t max_blocks, const int32_t* qstart, const int32_t* ctx,
               int64_t B, int64_t b0, int64_t b1, float scale, float* out, float* scratch) {
  (void)T;
  (void)B;
  if (ctype == kBF16) {
    attention_typed(q, H, R, P, static_cast<const uint16_t*>(cache), page, tables, max_blocks, qstart, ctx, b0, b1,
                    scale, out, scratch);
  } else {
    attention_typed(q, H, R, P, static_cast<const float*>(cache), page, tables, max_blocks, qstart, ctx, b0, b1,
                    scale, out, scratch);
  }
}

const KernelTable kTable = {MTP_ISA_NAME, &gemm, &rms_norm, &silu_mul, &sigmoid, &attention};

}  // namespace

const KernelTable* MTP_ISA_FN() { return &kTable; }

}  // namespace cpu
}  // namespace mtp_core

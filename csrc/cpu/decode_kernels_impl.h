// The decode kernels' algorithms, written once against a 16-lane float vector `VF` and compiled per ISA
// (see decode_kernels.h). The including translation unit defines, before including this file:
//   MTP_ISA_NAME  a string, MTP_ISA_FN  the name of its table getter,
//   and exactly one of MTP_ISA_AVX512 (AVX-512F intrinsics) or nothing (portable 16-lane arrays, which
//   the compiler vectorizes for the TU's target: AVX2+FMA or plain x86-64).
// Internal linkage only: nothing here may be merged with another TU's copy compiled for another ISA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "decode_kernels.h"

#if defined(MTP_ISA_AVX512) || defined(MTP_ISA_AVX2)
#include <immintrin.h>
#endif

namespace mtp_core {
namespace cpu {
namespace {

constexpr int kLanes = 16;

// The value of an e4m3 byte (float8_e4m3fn; 0x7F / 0xFF, its NaNs, never occur in weights and decode to 480).
constexpr float e4m3_value(int b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float mag = e == 0 ? static_cast<float>(m) / 512.0f : static_cast<float>(8 + m) / 1024.0f;
  for (int i = 0; i < e; ++i) mag *= 2.0f;   // exact: powers of two
  return (b & 0x80) ? -mag : mag;
}
struct E4m3Table {
  float v[256];
  constexpr E4m3Table() : v() {
    for (int b = 0; b < 256; ++b) v[b] = e4m3_value(b);
  }
};
constexpr E4m3Table kE4m3{};

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
// e4m3 -> fp16 bits of (value / 256), exactly (denormals included): sign-extend each byte to 16 bits, shift
// its 7 magnitude bits to the fp16 exponent/mantissa position and clear the copy of the sign that lands in
// the exponent's top bit (fp16's exponent bias is 8 above e4m3's, hence the 1/256).
inline VF fp8_from_words(__m256i w) {
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return {_mm512_cvtph_ps(h)};
}
inline VF vload_fp8(const uint8_t* p) {
  return fp8_from_words(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline VF vload_fp8_n(const uint8_t* p, int64_t n) {
  return fp8_from_words(_mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(tail_mask(n), p)));
}
inline __m512 e2m1_lut() {
  return _mm512_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
}
// NVFP4, one group of 16 inputs: the codes of its first 8 inputs are the 4 bytes at p0, of its last 8 those at
// p1 (byte i: inputs 2i low nibble, 2i + 1 high). Each byte goes to two lanes, shifted by 0 and 4; the table
// lookup reads the low 4 bits (e2m1, exact).
inline VF vload_nvfp4_group(const uint8_t* p0, const uint8_t* p1) {
  uint32_t a, b;
  std::memcpy(&a, p0, 4);
  std::memcpy(&b, p1, 4);
  const __m128i x = _mm_cvtsi64_si128(static_cast<long long>((static_cast<uint64_t>(b) << 32) | a));
  const __m512i d = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(x, x));
  const __m512i c = _mm512_srlv_epi32(d, _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4));
  return {_mm512_permutexvar_ps(c, e2m1_lut())};
}
#else
inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
#if defined(MTP_ISA_AVX2)
// AVX2 + FMA: a 16-lane vector as two 256-bit registers. The element-wise operations use intrinsics (the
// portable arrays below leave GCC's vectorizer moving every accumulator through the stack); the rest is the
// portable build's lane-by-lane code after this block, over a lane array.
struct VF {
  __m256 lo, hi;
};
struct Lanes {
  float v[kLanes];
};
inline Lanes lanes(VF x) {
  Lanes a;
  _mm256_storeu_ps(a.v, x.lo);
  _mm256_storeu_ps(a.v + 8, x.hi);
  return a;
}
inline VF from_lanes(const Lanes& a) { return {_mm256_loadu_ps(a.v), _mm256_loadu_ps(a.v + 8)}; }
inline VF vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VF vset1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline VF vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline VF vload(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline void vstore(float* p, VF a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline VF vfma(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline VF vadd(VF a, VF b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline VF vsub(VF a, VF b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline VF vmul(VF a, VF b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline VF vdiv(VF a, VF b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
// a > b ? a : b per lane, as the portable build (maxps returns its second operand unless the first is greater)
inline VF vmax(VF a, VF b) { return {_mm256_max_ps(b.lo, a.lo), _mm256_max_ps(b.hi, a.hi)}; }
#else
struct VF {
  float v[kLanes];
};
using Lanes = VF;
inline Lanes lanes(VF x) { return x; }
inline VF from_lanes(const Lanes& a) { return a; }
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
inline VF vload(const uint16_t* p) {
  VF r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = bf16_to_f32(p[i]);
  return r;
}
inline void vstore(float* p, VF a) {
  for (int i = 0; i < kLanes; ++i) p[i] = a.v[i];
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
#endif

// lane by lane, for the AVX2 and the portable build alike
inline VF vload_n(const float* p, int64_t n) {
  Lanes r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = i < n ? p[i] : 0.f;
  return from_lanes(r);
}
inline VF vload_n(const uint16_t* p, int64_t n) {
  Lanes r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = i < n ? bf16_to_f32(p[i]) : 0.f;
  return from_lanes(r);
}
inline void vstore_n(float* p, VF x, int64_t n) {
  const Lanes a = lanes(x);
  for (int i = 0; i < kLanes && i < n; ++i) p[i] = a.v[i];
}
inline float vhsum(VF x) {
  const Lanes a = lanes(x);
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = a.v[i] + a.v[i + 8];
  for (int i = 0; i < 4; ++i) q[i] = h[i] + h[i + 4];
  const float d0 = q[0] + q[2], d1 = q[1] + q[3];
  return d0 + d1;
}
inline float vhmax(VF x) {
  const Lanes a = lanes(x);
  float m = a.v[0];
  for (int i = 1; i < kLanes; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline VF vexp(VF x) {
  Lanes r = lanes(x);
  for (int i = 0; i < kLanes; ++i) r.v[i] = r.v[i] < -87.0f ? 0.f : std::exp(r.v[i]);
  return from_lanes(r);
}
inline void vhsum4(VF a, VF b, VF c, VF d, float* out) {
  out[0] = vhsum(a);
  out[1] = vhsum(b);
  out[2] = vhsum(c);
  out[3] = vhsum(d);
}
inline float e2m1_value(int code) {
  static const float kLut[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                 -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  return kLut[code & 15];
}
inline VF vload_fp8(const uint8_t* p) {
  Lanes r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = kE4m3.v[p[i]] * (1.0f / 256.0f);
  return from_lanes(r);
}
inline VF vload_fp8_n(const uint8_t* p, int64_t n) {
  Lanes r;
  for (int i = 0; i < kLanes; ++i) r.v[i] = i < n ? kE4m3.v[p[i]] * (1.0f / 256.0f) : 0.f;
  return from_lanes(r);
}
inline VF vload_nvfp4_group(const uint8_t* p0, const uint8_t* p1) {
  Lanes r;
  for (int i = 0; i < 8; ++i) {
    const uint8_t byte = i < 4 ? p0[i] : p1[i - 4];
    r.v[2 * i] = e2m1_value(byte);
    r.v[2 * i + 1] = e2m1_value(byte >> 4);
  }
  return from_lanes(r);
}
#endif

// e4m3 cache entries (an FP8 KV cache) read as value / 256, exactly; the attention folds the 256 back in.
inline VF vload(const uint8_t* p) { return vload_fp8(p); }
inline VF vload_n(const uint8_t* p, int64_t n) { return vload_fp8_n(p, n); }

template <typename WT>
inline VF wload(const WT* p, int64_t n) {
  return n >= kLanes ? vload(p) : vload_n(p, n);
}


// ---- weight decoding: 32 inputs of one stored row --------------------------------------------------
// Row-wise formats hand out the inputs [32j, 32j + 32) of one row as two vectors of their real values (FP8:
// times its block scale; NVFP4: times its group scales, the global scale comes in the epilogue); tail2 the
// last, partial chunk (`left` < 32 inputs valid, lanes past it zero). Every path that reads a weight goes
// through these, so a weight has one value in every kernel.
template <int FMT>
struct RowDec;

// Bytes one chunk of 32 inputs takes in a stored row, by format.
template <int FMT>
constexpr int64_t chunk_bytes() {
  return FMT == kF32 ? 128 : FMT == kBF16 ? 64 : FMT == kFP8 ? 32 : 16;
}
template <int FMT>
inline const char* chunk_addr(const Mat& W, int64_t n, int64_t j) {
  constexpr int64_t elem = FMT == kF32 ? 4 : FMT == kBF16 ? 2 : 1;   // NVFP4: ld is in bytes, chunks of 16
  return static_cast<const char*>(W.data) + n * W.ld * elem + j * chunk_bytes<FMT>();
}

// fp32 and bf16: the stored values themselves (bf16 widened exactly).
template <typename T>
struct PlainRowDec {
  static void get2(const Mat& W, int64_t n, int64_t j, VF& a, VF& b) {
    const T* p = static_cast<const T*>(W.data) + n * W.ld + 32 * j;
    a = vload(p);
    b = vload(p + 16);
  }
  static void tail2(const Mat& W, int64_t n, int64_t j, int64_t left, VF& a, VF& b) {
    const T* p = static_cast<const T*>(W.data) + n * W.ld + 32 * j;
    a = wload(p, left);
    b = left > 16 ? vload_n(p + 16, left - 16) : vzero();
  }
};
template <>
struct RowDec<kF32> : PlainRowDec<float> {};
template <>
struct RowDec<kBF16> : PlainRowDec<uint16_t> {};
template <>
struct RowDec<kFP8> {
  static VF scale(const Mat& W, int64_t n, int64_t j) {
    return vset1(W.scale[((W.scale_r0 + n) >> 7) * W.scale_ld + ((32 * j) >> 7)]);
  }
  static void get2(const Mat& W, int64_t n, int64_t j, VF& a, VF& b) {
    const uint8_t* p = static_cast<const uint8_t*>(W.data) + n * W.ld + 32 * j;
    const VF s = scale(W, n, j);
    a = vmul(vload_fp8(p), s);
    b = vmul(vload_fp8(p + 16), s);
  }
  static void tail2(const Mat& W, int64_t n, int64_t j, int64_t left, VF& a, VF& b) {
    const uint8_t* p = static_cast<const uint8_t*>(W.data) + n * W.ld + 32 * j;
    const VF s = scale(W, n, j);
    a = vmul(left >= 16 ? vload_fp8(p) : vload_fp8_n(p, left), s);
    b = left > 16 ? vmul(vload_fp8_n(p + 16, left - 16), s) : vzero();
  }
};
template <>
struct RowDec<kNVFP4> {
  // codes in the kernels' order (decode_kernels.h): in a block of 256 inputs with G groups (16; fewer in a
  // row's last block) the 4 bytes of inputs [16g + 8h, 16g + 8h + 8) are dword h * G + g of the block.
  static VF group(const Mat& W, int64_t n, int64_t g) {
    const int64_t b = g / 16, gi = g % 16, G = std::min<int64_t>(16, W.k / 16 - 16 * b);
    const uint8_t* base = static_cast<const uint8_t*>(W.data) + n * W.ld + 128 * b;
    return vmul(vload_nvfp4_group(base + 4 * gi, base + 4 * (G + gi)),
                vset1(kE4m3.v[W.gscale[n * W.gscale_ld + g]]));
  }
  static void get2(const Mat& W, int64_t n, int64_t j, VF& a, VF& b) {
    a = group(W, n, 2 * j);
    b = group(W, n, 2 * j + 1);
  }
  static void tail2(const Mat& W, int64_t n, int64_t j, int64_t left, VF& a, VF& b) {
    (void)left;   // K is a multiple of 16: the tail is exactly 16 inputs
    a = group(W, n, 2 * j);
    b = vzero();
  }
};

// ---- row-wise GEMM: each output one dot product over its stored row --------------------------------
// A register tile is R rows x TT tokens of 16-lane partial sums; lane l of an output accumulates inputs
// l, l + 16, l + 32, ... in order (one FMA chain), and the 16 lanes are summed by a fixed tree at the end,
// so an output's rounding depends on K alone.
template <int TT>
struct XPtrs {
  const float* p[TT];
  XPtrs(const Rows& X, int64_t t0) {
    for (int t = 0; t < TT; ++t) p[t] = X.x + (X.xrows ? X.xrows[t0 + t] : t0 + t) * X.ldx;
  }
};

// Sums of the R x TT accumulators (a fixed tree each, four at a time), times `post`, plus the bias.
template <int R, int TT>
inline void store_tile(VF (&acc)[R][TT], const Mat& W, int64_t n, int64_t t0, float* Y, int64_t ldy, float post) {
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; r += 4) {
      float s4[4];
      vhsum4(acc[r][t], r + 1 < R ? acc[r + 1][t] : vzero(), r + 2 < R ? acc[r + 2][t] : vzero(),
             r + 3 < R ? acc[r + 3][t] : vzero(), s4);
      for (int i = 0; i < 4 && r + i < R; ++i) {
        const float y = s4[i] * post;
        Y[(t0 + t) * ldy + n + r + i] = W.bias ? y + W.bias[n + r + i] : y;
      }
    }
}

template <int FMT, int R, int TT>
inline void rows_tile(const Mat& W, const Rows& X, int64_t t0, int64_t n, float* Y, int64_t ldy, float post) {
  VF acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = vzero();
  const XPtrs<TT> xp(X, t0);
  const int64_t K = W.k, full = K / 32, left = K - 32 * full;
  // Rows of a few KB are too short for the hardware prefetcher to ramp up on each: ask for the next tile's
  // rows (R rows further, the next bytes of the same contiguous matrix) one cache line at a time.
  constexpr int64_t every = 64 / chunk_bytes<FMT>() > 0 ? 64 / chunk_bytes<FMT>() : 1;
  for (int64_t j = 0; j < full; ++j) {
    if (j % every == 0)
      for (int r = 0; r < R; ++r) __builtin_prefetch(chunk_addr<FMT>(W, n + R + r, j), 0, 3);
    if (FMT == kF32)
      for (int r = 0; r < R; ++r) __builtin_prefetch(chunk_addr<FMT>(W, n + R + r, j) + 64, 0, 3);
    VF w0[R], w1[R];
    for (int r = 0; r < R; ++r) RowDec<FMT>::get2(W, n + r, j, w0[r], w1[r]);
    for (int t = 0; t < TT; ++t) {
      const VF x0 = vload(xp.p[t] + 32 * j), x1 = vload(xp.p[t] + 32 * j + 16);
      for (int r = 0; r < R; ++r) acc[r][t] = vfma(w1[r], x1, vfma(w0[r], x0, acc[r][t]));
    }
  }
  if (left) {   // the same FMA chain continues over the last one or two (masked) vectors
    VF w0[R], w1[R];
    for (int r = 0; r < R; ++r) RowDec<FMT>::tail2(W, n + r, full, left, w0[r], w1[r]);
    for (int t = 0; t < TT; ++t) {
      const VF x0 = wload(xp.p[t] + 32 * full, left);
      for (int r = 0; r < R; ++r) acc[r][t] = vfma(w0[r], x0, acc[r][t]);
      if (left > 16) {
        const VF x1 = vload_n(xp.p[t] + 32 * full + 16, left - 16);
        for (int r = 0; r < R; ++r) acc[r][t] = vfma(w1[r], x1, acc[r][t]);
      }
    }
  }
  store_tile<R, TT>(acc, W, n, t0, Y, ldy, post);
}

// Rows already decoded into fp32 (scratch, row stride `ld`, zeros past K): the same FMA chains as rows_tile.
struct DecodedRows {
  const float* rows;   // [R, ld] fp32, row 0 = output n0
  int64_t ld, n0;
};

template <int R, int TT>
inline void decoded_tile(const DecodedRows& D, const Mat& W, const Rows& X, int64_t t0, int64_t n, float* Y,
                         int64_t ldy, float post) {
  VF acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = vzero();
  const XPtrs<TT> xp(X, t0);
  const int64_t K = W.k, full = K / 16, left = K - 16 * full;
  const float* wr = D.rows + (n - D.n0) * D.ld;
  for (int64_t c = 0; c < full; ++c) {
    VF w[R];
    for (int r = 0; r < R; ++r) w[r] = vload(wr + r * D.ld + 16 * c);
    for (int t = 0; t < TT; ++t) {
      const VF x = vload(xp.p[t] + 16 * c);
      for (int r = 0; r < R; ++r) acc[r][t] = vfma(w[r], x, acc[r][t]);
    }
  }
  if (left) {
    VF w[R];
    for (int r = 0; r < R; ++r) w[r] = vload(wr + r * D.ld + 16 * full);
    for (int t = 0; t < TT; ++t) {
      const VF x = vload_n(xp.p[t] + 16 * full, left);
      for (int r = 0; r < R; ++r) acc[r][t] = vfma(w[r], x, acc[r][t]);
    }
  }
  store_tile<R, TT>(acc, W, n, t0, Y, ldy, post);
}

template <int FMT, int R>
inline void rows_tokens(const Mat& W, const Rows& X, int64_t n, float* Y, int64_t ldy, float post) {
  int64_t t = 0;
  for (; t + 4 <= X.T; t += 4) rows_tile<FMT, R, 4>(W, X, t, n, Y, ldy, post);
  switch (X.T - t) {
    case 3: rows_tile<FMT, R, 3>(W, X, t, n, Y, ldy, post); break;
    case 2: rows_tile<FMT, R, 2>(W, X, t, n, Y, ldy, post); break;
    case 1: rows_tile<FMT, R, 1>(W, X, t, n, Y, ldy, post); break;
    default: break;
  }
}

template <int R>
inline void decoded_tokens(const DecodedRows& D, const Mat& W, const Rows& X, int64_t n, float* Y, int64_t ldy,
                           float post) {
  int64_t t = 0;
  for (; t + 4 <= X.T; t += 4) decoded_tile<R, 4>(D, W, X, t, n, Y, ldy, post);
  switch (X.T - t) {
    case 3: decoded_tile<R, 3>(D, W, X, t, n, Y, ldy, post); break;
    case 2: decoded_tile<R, 2>(D, W, X, t, n, Y, ldy, post); break;
    case 1: decoded_tile<R, 1>(D, W, X, t, n, Y, ldy, post); break;
    default: break;
  }
}

template <int FMT>
void gemm_rows(const Mat& W, const Rows& X, int64_t n0, int64_t n1, float* Y, int64_t ldy, float* scratch) {
  const float post = FMT == kNVFP4 ? W.gscale2 : 1.f;
  if (X.T == 1) {   // decode: 8 rows in flight, each weight read once
    int64_t n = n0;
    for (; n + 8 <= n1; n += 8) rows_tile<FMT, 8, 1>(W, X, 0, n, Y, ldy, post);
    for (; n < n1; ++n) rows_tile<FMT, 1, 1>(W, X, 0, n, Y, ldy, post);
    return;
  }
  if (X.T <= 4 || FMT == kF32) {   // verify rows: every decoded weight serves all T tokens in registers
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) rows_tokens<FMT, 4>(W, X, n, Y, ldy, post);
    for (; n < n1; ++n) rows_tokens<FMT, 1>(W, X, n, Y, ldy, post);
    return;
  }
  // many tokens (prefill): decode each tile of 4 rows once into fp32, then run every token over it
  const int64_t ld = (W.k + 31) / 32 * 32, full = W.k / 32, left = W.k - 32 * full;
  for (int64_t n = n0; n < n1; n += 4) {
    const int64_t R = n1 - n < 4 ? n1 - n : 4;
    for (int64_t r = 0; r < R; ++r) {
      float* row = scratch + r * ld;
      VF a, b;
      for (int64_t j = 0; j < full; ++j) {
        RowDec<FMT>::get2(W, n + r, j, a, b);
        vstore(row + 32 * j, a);
        vstore(row + 32 * j + 16, b);
      }
      if (left) {
        RowDec<FMT>::tail2(W, n + r, full, left, a, b);
        vstore(row + 32 * full, a);
        vstore(row + 32 * full + 16, b);
      }
    }
    const DecodedRows D{scratch, ld, n};
    if (R == 4) {
      decoded_tokens<4>(D, W, X, n, Y, ldy, post);
    } else {
      for (int64_t r = 0; r < R; ++r) decoded_tokens<1>(D, W, X, n + r, Y, ldy, post);
    }
  }
}

// ---- column-wise GEMM (kCols): y = x @ S, S [K, N] row-major ----------------------------------------
// A tile is TT tokens x 64 outputs; each output one FMA chain over k = 0..K-1 (as the panel GEMM).
template <int FMT>
inline VF col_load(const Mat& W, int64_t k, int64_t col, int64_t left) {
  if (FMT == kF32) return wload(static_cast<const float*>(W.data) + k * W.ld + col, left);
  if (FMT == kBF16) return wload(static_cast<const uint16_t*>(W.data) + k * W.ld + col, left);
  const uint8_t* p = static_cast<const uint8_t*>(W.data) + k * W.ld + col;
  return left >= kLanes ? vload_fp8(p) : vload_fp8_n(p, left);
}

template <int FMT, int TT>
inline void cols_tile(const Mat& W, const Rows& X, int64_t t0, int64_t n, float* Y, int64_t ldy) {
  VF acc[TT][4];
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = vzero();
  const XPtrs<TT> xp(X, t0);
  const int64_t nv = W.n - n < 64 ? W.n - n : 64;
  const int nc = static_cast<int>((nv + kLanes - 1) / kLanes);
  for (int64_t k = 0; k < W.k; ++k) {
    VF w[4];
    for (int j = 0; j < 4; ++j) w[j] = j < nc ? col_load<FMT>(W, k, n + 16 * j, nv - 16 * j) : vzero();
    if (FMT == kFP8) {
      const VF s = vset1(W.scale[((W.scale_r0 + k) >> 7) * W.scale_ld + (n >> 7)]);
      for (int j = 0; j < 4; ++j) w[j] = vmul(w[j], s);
    }
    for (int t = 0; t < TT; ++t) {
      const VF x = vset1(xp.p[t][k]);
      for (int j = 0; j < 4; ++j) acc[t][j] = vfma(w[j], x, acc[t][j]);
    }
  }
  for (int j = 0; j < nc; ++j) {
    const int64_t col = n + 16 * j, left = nv - 16 * j;
    const VF b = W.bias ? wload(W.bias + col, left) : vzero();
    for (int t = 0; t < TT; ++t) {
      const VF y = W.bias ? vadd(acc[t][j], b) : acc[t][j];
      float* out = Y + (t0 + t) * ldy + col;
      if (left >= kLanes) vstore(out, y); else vstore_n(out, y, left);
    }
  }
}

template <int FMT>
void gemm_cols(const Mat& W, const Rows& X, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  for (int64_t n = n0; n < n1; n += 64) {
    int64_t t = 0;
    for (; t + 4 <= X.T; t += 4) cols_tile<FMT, 4>(W, X, t, n, Y, ldy);
    switch (X.T - t) {
      case 3: cols_tile<FMT, 3>(W, X, t, n, Y, ldy); break;
      case 2: cols_tile<FMT, 2>(W, X, t, n, Y, ldy); break;
      case 1: cols_tile<FMT, 1>(W, X, t, n, Y, ldy); break;
      default: break;
    }
  }
}

// ---- GEMM over 64-row panels (kPanel) ---------------------------------------------------------------
// W [N, K] packed in panels of kPanel = 64 output rows: panel p holds W[64p .. 64p+63, k] for k = 0..K-1
// as K consecutive runs of 64 values (rows past N are zero). A register tile is TT tokens x 64 outputs
// (4 vectors); each output is one chain of fused multiply-adds over k = 0..K-1, so its rounding depends
// on K alone: not on T, on the tile, or on the thread.
constexpr int64_t kPanelRows = 64;

template <typename WT, int TT>
inline void packed_tile(const Rows& X, int64_t t0, const WT* P, int64_t K, float* Y, int64_t ldy, const float* bias,
                        int64_t n, int64_t N) {
  VF acc[TT][4];
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = vzero();
  const XPtrs<TT> xp(X, t0);
  for (int64_t k = 0; k < K; ++k) {
    const WT* row = P + k * kPanelRows;
    const VF w0 = vload(row), w1 = vload(row + 16), w2 = vload(row + 32), w3 = vload(row + 48);
    for (int t = 0; t < TT; ++t) {
      const VF x = vset1(xp.p[t][k]);
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
      float* out = Y + (t0 + t) * ldy + col;
      if (left >= kLanes) vstore(out, y); else vstore_n(out, y, left);
    }
  }
}

template <typename WT>
void gemm_panels(const Mat& W, const Rows& X, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  const WT* base = static_cast<const WT*>(W.data);
  for (int64_t p = n0 / kPanelRows; p * kPanelRows < n1; ++p) {
    const WT* P = base + p * W.k * kPanelRows;
    const int64_t n = p * kPanelRows;
    int64_t t = 0;
    for (; t + 4 <= X.T; t += 4) packed_tile<WT, 4>(X, t, P, W.k, Y, ldy, W.bias, n, W.n);
    switch (X.T - t) {
      case 3: packed_tile<WT, 3>(X, t, P, W.k, Y, ldy, W.bias, n, W.n); break;
      case 2: packed_tile<WT, 2>(X, t, P, W.k, Y, ldy, W.bias, n, W.n); break;
      case 1: packed_tile<WT, 1>(X, t, P, W.k, Y, ldy, W.bias, n, W.n); break;
      default: break;
    }
  }
}

void gemm(const Mat& W, const Rows& X, int64_t n0, int64_t n1, float* Y, int64_t ldy, float* scratch) {
  if (X.T == 0 || n1 <= n0) return;
  if (W.layout == kPanel) {
    if (W.fmt == kBF16) gemm_panels<uint16_t>(W, X, n0, n1, Y, ldy); else gemm_panels<float>(W, X, n0, n1, Y, ldy);
  } else if (W.layout == kCols) {
    switch (W.fmt) {
      case kBF16: gemm_cols<kBF16>(W, X, n0, n1, Y, ldy); break;
      case kFP8: gemm_cols<kFP8>(W, X, n0, n1, Y, ldy); break;
      default: gemm_cols<kF32>(W, X, n0, n1, Y, ldy); break;
    }
  } else {
    switch (W.fmt) {
      case kBF16: gemm_rows<kBF16>(W, X, n0, n1, Y, ldy, scratch); break;
      case kFP8: gemm_rows<kFP8>(W, X, n0, n1, Y, ldy, scratch); break;
      case kNVFP4: gemm_rows<kNVFP4>(W, X, n0, n1, Y, ldy, scratch); break;
      default: gemm_rows<kF32>(W, X, n0, n1, Y, ldy, scratch); break;
    }
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

void silu_mul(const float* g, const float* u, int64_t n, float* a) {
  const VF one = vset1(1.0f), zero = vzero();
  for (int64_t k = 0; k < n; k += kLanes) {
    const int64_t left = n - k;
    const VF gv = wload(g + k, left);
    const VF s = vdiv(gv, vadd(one, vexp(vsub(zero, gv))));
    const VF o = vmul(s, wload(u + k, left));
    if (left >= kLanes) vstore(a + k, o); else vstore_n(a + k, o, left);
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
// Where the keys of one attention call live: cache rows `ld` elements apart, visited in order. PagedKeys: the
// positions 0, 1, ... of a row through its block table (a running (block, offset) counter, no division per
// key); SlotKeys: the rows a sparse (DSA) query chose, ascending positions.
// prefetch(): the keys a few steps ahead, where the hardware cannot guess them (SlotKeys: rows scattered over the
// context; without it each of the 2048 chosen rows costs a cache miss in every pass over them).
struct PagedKeys {
  const int32_t* table;
  int64_t page;
  int64_t blk = 0, off = 0;
  inline int64_t next() {
    if (off == page) { off = 0; ++blk; }
    return static_cast<int64_t>(table[blk]) * page + off++;
  }
  template <typename CT>
  inline void prefetch(const CT*, int64_t, int64_t, int64_t) const {}
};
struct SlotKeys {
  static constexpr int64_t kAhead = 6;
  const int32_t* slots;
  int64_t n;
  int64_t i = 0;
  inline int64_t next() { return slots[i++]; }
  // elements [r0, r0 + len) of the row kAhead keys ahead
  template <typename CT>
  inline void prefetch(const CT* cache, int64_t ld, int64_t r0, int64_t len) const {
    if (i + kAhead >= n) return;
    const char* p = reinterpret_cast<const char*>(cache + slots[i + kAhead] * ld + r0);
    for (int64_t b = 0; b < len * static_cast<int64_t>(sizeof(CT)); b += 64) __builtin_prefetch(p + b);
  }
};

// o[hh, r0 .. r0+rlen) = inv[hh] * sum_j p[hh, j] * c_kv_j[r0 ..] for NH heads (probabilities p with row
// stride `visible`), accumulated in registers over the keys in order.
template <typename CT, int NH, typename Keys>
inline void attn_out_tile(const float* p, int64_t visible, const CT* cache, Keys keys, int64_t ld, int64_t r0,
                          int64_t rlen, float* o, int64_t R, const float* inv) {
  VF acc[NH][4];
  for (int hh = 0; hh < NH; ++hh)
    for (int c = 0; c < 4; ++c) acc[hh][c] = vzero();
  const int nc = static_cast<int>((rlen + kLanes - 1) / kLanes);
  for (int64_t j = 0; j < visible; ++j) {
    keys.prefetch(cache, ld, r0, rlen);
    const CT* key = cache + keys.next() * ld + r0;
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
template <typename CT, int NH, int DC, typename Keys>
inline void attn_scores_tile(const float* q, int64_t D, const CT* cache, Keys keys, int64_t ld, int64_t visible,
                             float scale, float* s) {
  constexpr int kChunks = DC > 0 ? DC : 1;
  VF qv[NH][kChunks];
  if (DC > 0) {
    for (int hh = 0; hh < NH; ++hh)
      for (int c = 0; c < kChunks; ++c) qv[hh][c] = wload(q + hh * D + 16 * c, D - 16 * c);
  }
  for (int64_t j = 0; j < visible; ++j) {
    keys.prefetch(cache, ld, 0, D);
    const CT* key = cache + keys.next() * ld;
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

template <typename CT, int NH, typename Keys>
inline void attn_scores(const float* q, int64_t D, const CT* cache, Keys keys, int64_t ld, int64_t visible,
                        float scale, float* s) {
  switch ((D + kLanes - 1) / kLanes) {
    case 1: return attn_scores_tile<CT, NH, 1>(q, D, cache, keys, ld, visible, scale, s);
    case 2: return attn_scores_tile<CT, NH, 2>(q, D, cache, keys, ld, visible, scale, s);
    case 3: return attn_scores_tile<CT, NH, 3>(q, D, cache, keys, ld, visible, scale, s);
    case 4: return attn_scores_tile<CT, NH, 4>(q, D, cache, keys, ld, visible, scale, s);
    case 5: return attn_scores_tile<CT, NH, 5>(q, D, cache, keys, ld, visible, scale, s);
    case 6: return attn_scores_tile<CT, NH, 6>(q, D, cache, keys, ld, visible, scale, s);
    default: return attn_scores_tile<CT, NH, 0>(q, D, cache, keys, ld, visible, scale, s);
  }
}

// vscale multiplies every key and value the cache holds (256 for e4m3 entries read as value / 256).
template <typename CT, typename Keys>
void attention_typed(const float* qt, int64_t h0, int64_t h1, int64_t R, int64_t P, const CT* cache, Keys keys,
                     int64_t ld, int64_t visible, float scale, float* ot, float* scores, float vscale = 1.0f) {
  const int64_t D = R + P;
  if (visible <= 0) {
    for (int64_t d = h0 * R; d < h1 * R; ++d) ot[d] = 0.f;
    return;
  }
  const int64_t nh = h1 - h0;
  float* inv = scores + nh * visible;   // [nh] after the scores
  // scores[h, j] = q_h . k_j * scale: up to 4 heads against one key at a time (independent chains)
  for (int64_t g = 0; g < nh; g += 4) {
    float* sh = scores + g * visible;
    const float* qh = qt + (h0 + g) * D;
    switch (nh - g < 4 ? nh - g : 4) {
      case 4: attn_scores<CT, 4>(qh, D, cache, keys, ld, visible, scale, sh); break;
      case 3: attn_scores<CT, 3>(qh, D, cache, keys, ld, visible, scale, sh); break;
      case 2: attn_scores<CT, 2>(qh, D, cache, keys, ld, visible, scale, sh); break;
      default: attn_scores<CT, 1>(qh, D, cache, keys, ld, visible, scale, sh); break;
    }
  }
  for (int64_t h = 0; h < nh; ++h) {
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
    inv[h] = vscale / vhsum(sum);
  }
  // out_h = sum_j p_hj * c_kv_j / sum_j p_hj, keys in order; register tiles of 4 heads x 64 latents
  for (int64_t g = 0; g < nh; g += 4) {
    for (int64_t r0 = 0; r0 < R; r0 += 64) {
      const int64_t rlen = R - r0 < 64 ? R - r0 : 64;
      float* o = ot + (h0 + g) * R + r0;
      const float* sh = scores + g * visible;
      switch (nh - g < 4 ? nh - g : 4) {
        case 4: attn_out_tile<CT, 4>(sh, visible, cache, keys, ld, r0, rlen, o, R, inv + g); break;
        case 3: attn_out_tile<CT, 3>(sh, visible, cache, keys, ld, r0, rlen, o, R, inv + g); break;
        case 2: attn_out_tile<CT, 2>(sh, visible, cache, keys, ld, r0, rlen, o, R, inv + g); break;
        default: attn_out_tile<CT, 1>(sh, visible, cache, keys, ld, r0, rlen, o, R, inv + g); break;
      }
    }
  }
}

// The cache's element type, and the per-tensor factor of its values (e4m3 entries are read as value / 256).
template <typename F>
inline void with_cache(const void* cache, int ctype, F&& f) {
  if (ctype == kBF16) {
    f(static_cast<const uint16_t*>(cache), 1.0f);
  } else if (ctype == kFP8) {   // e4m3 entries, per-tensor scale 1: value = e4m3
    f(static_cast<const uint8_t*>(cache), 256.0f);
  } else {
    f(static_cast<const float*>(cache), 1.0f);
  }
}

void attention(const float* q_t, int64_t H, int64_t h0, int64_t h1, int64_t R, int64_t P, const void* cache,
               int ctype, int64_t page, const int32_t* table, int64_t visible, float scale, float* out_t,
               float* scratch) {
  (void)H;
  with_cache(cache, ctype, [&](const auto* c, float v) {
    attention_typed(q_t, h0, h1, R, P, c, PagedKeys{table, page}, R + P, visible, scale * v, out_t, scratch, v);
  });
}

void sparse_attention(const float* q_t, int64_t h0, int64_t h1, int64_t R, int64_t P, const void* cache, int ctype,
                      int64_t ld, const int32_t* slots, int64_t n, float scale, float* out_t, float* scratch) {
  with_cache(cache, ctype, [&](const auto* c, float v) {
    attention_typed(q_t, h0, h1, R, P, c, SlotKeys{slots, n}, ld, n, scale * v, out_t, scratch, v);
  });
}

// ---- DSA indexer scores -----------------------------------------------------------------------------
// out[j] = sum_h w[h] * relu(q_h . k_j * scale), heads in ascending order, each dot one FMA chain per lane over
// Di and a fixed tree over the lanes (4 heads per tree). DC > 0: Di is DC chunks of 16 and the key stays in
// registers; DC = 0: any Di.
template <typename CT, int DC>
void index_scores_tile(const float* q, const float* w, int64_t heads, int64_t Di, const CT* cache, int64_t ld,
                       int64_t off, PagedKeys keys, int64_t visible, float scale, float* out) {
  constexpr int kChunks = DC > 0 ? DC : 1;
  for (int64_t j = 0; j < visible; ++j) {
    const CT* key = cache + keys.next() * ld + off;
    VF kv[kChunks];
    if (DC > 0)
      for (int c = 0; c < kChunks; ++c) kv[c] = wload(key + 16 * c, Di - 16 * c);
    float acc = 0.f;
    for (int64_t h = 0; h < heads; h += 4) {
      const int64_t nh = heads - h < 4 ? heads - h : 4;
      VF a[4] = {vzero(), vzero(), vzero(), vzero()};
      for (int64_t hh = 0; hh < nh; ++hh) {
        const float* qh = q + (h + hh) * Di;
        if (DC > 0) {
          for (int c = 0; c < kChunks; ++c) a[hh] = vfma(wload(qh + 16 * c, Di - 16 * c), kv[c], a[hh]);
        } else {
          for (int64_t d = 0; d < Di; d += kLanes) a[hh] = vfma(wload(qh + d, Di - d), wload(key + d, Di - d), a[hh]);
        }
      }
      float r[4];
      vhsum4(a[0], a[1], a[2], a[3], r);
      for (int64_t hh = 0; hh < nh; ++hh) {
        const float v = r[hh] * scale;
        acc += w[h + hh] * (v > 0.f ? v : 0.f);
      }
    }
    out[j] = acc;
  }
}

template <typename CT>
void index_scores_typed(const float* q, const float* w, int64_t heads, int64_t Di, const CT* cache, int64_t ld,
                        int64_t off, PagedKeys keys, int64_t visible, float scale, float* out) {
  switch ((Di + kLanes - 1) / kLanes) {
    case 1: return index_scores_tile<CT, 1>(q, w, heads, Di, cache, ld, off, keys, visible, scale, out);
    case 2: return index_scores_tile<CT, 2>(q, w, heads, Di, cache, ld, off, keys, visible, scale, out);
    case 4: return index_scores_tile<CT, 4>(q, w, heads, Di, cache, ld, off, keys, visible, scale, out);
    case 8: return index_scores_tile<CT, 8>(q, w, heads, Di, cache, ld, off, keys, visible, scale, out);
    default: return index_scores_tile<CT, 0>(q, w, heads, Di, cache, ld, off, keys, visible, scale, out);
  }
}

void index_scores(const float* q, const float* w, int64_t heads, int64_t Di, const void* cache, int ctype, int64_t ld,
                  int64_t off, int64_t page, const int32_t* table, int64_t first, int64_t n, float scale, float* out) {
  const PagedKeys keys{table, page, first / page, first % page};
  with_cache(cache, ctype, [&](const auto* c, float v) {
    index_scores_typed(q, w, heads, Di, c, ld, off, keys, n, scale * v, out);
  });
}

const KernelTable kTable = {MTP_ISA_NAME, &gemm,           &rms_norm,        &silu_mul,
                            &sigmoid,     &attention,      &index_scores,    &sparse_attention};

}  // namespace

const KernelTable* MTP_ISA_FN() { return &kTable; }

}  // namespace cpu
}  // namespace mtp_core

// bf16 dot-product GEMM for row-wise bf16 / FP8 / NVFP4 weights (see dot_gemm.h).
//
// Inputs go in steps of 64: each stored row's step decodes into two vectors of 32 bf16 (w0, w1), the token's
// activations of that step are two vectors of 32 bf16 (x0, x1) in the same order, and one `vdpbf16ps` per
// vector adds 16 pair products into 16 fp32 lanes. The order of the 64 inputs within the two vectors is the
// one the format's decode produces cheaply; the activations are rounded into that order once per call:
//
//   bf16   natural: w0 = inputs 0..31, w1 = 32..63 (the stored row itself).
//   FP8    the 64 bytes are looked up twice (vpermi2b: the bf16's low and high byte of each e4m3 magnitude,
//          the sign or-ed in) and interleaved per 128-bit lane: w0 = inputs [0-7, 16-23, 32-39, 48-55],
//          w1 = [8-15, 24-31, 40-47, 56-63].
//   NVFP4  steps follow the blocks of 256 inputs (16 groups of 16; decode_kernels.h's dword order): a chunk
//          of 64 bytes holds one dword (8 inputs) of each of 16 groups, so dword l, i.e. words 2l and 2l + 1,
//          and fp32 lane l belong to group l. A step takes two of the 4 nibbles of each 16-bit word (shift,
//          then a 32-entry word lookup, vpermw, whose index bit 4 the duplicated table ignores): w0 nibble
//          q = 2p, w1 nibble q + 1, p = 0 / 1 for the chunk's two steps, 4 steps per block. A row's last block
//          of G < 16 groups takes 4 masked steps (G > 8) or 2 steps over both halves in one chunk (G <= 8:
//          lane l group l % G). The group scales multiply each block's fp32 partial sums once per block.
//
// Per output: bf16   acc += w.x over every step in order;
//             FP8    blk += w.x over the two steps of a 128-input block, acc = fma(blk, block scale, acc);
//             NVFP4  blk += w.x over the steps of a 256-input block, acc = fma(blk, its group-scale vector, acc);
// then a fixed tree over the 16 lanes, times the global scale (NVFP4), plus the bias. One token (decode)
// decodes each weight in registers with 8 rows in flight; several tokens decode a tile of 4 rows once into
// bf16 scratch (bf16 weights are read in place) and run register tiles of 4 rows x up to 6 (bf16) or 3 tokens
// over it: the same instructions per output in both, hence bitwise the same results.
#include "dot_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>

#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,fma,f16c,bmi2")
#include <immintrin.h>

namespace mtp_core {
namespace cpu {
namespace {

constexpr int64_t kStep = 64;   // inputs per step
enum Order : int { kNatural = 0, kFp8Order = 1, kNvfp4Order = 2 };

inline int order_of(int fmt) { return fmt == kFP8 ? kFp8Order : fmt == kNVFP4 ? kNvfp4Order : kNatural; }
inline int64_t steps_of(int64_t K) { return (K + kStep - 1) / kStep; }

// ---- NVFP4 step geometry --------------------------------------------------------------------------------
// A row of K inputs: nb blocks of 256 (4 steps each), then a last block of gt groups (0: none; 4 steps if
// gt > 8, 2 if gt <= 8).
inline int64_t nv4_steps(int64_t K) {
  const int64_t gt = (K % 256) / 16;
  return 4 * (K / 256) + (gt == 0 ? 0 : gt > 8 ? 4 : 2);
}
struct Nv4Geo {
  int64_t nb, gt, steps;
  __m512i tail_idx;   // 0 < gt <= 8: lane l takes group l % gt's scale (unused otherwise)
  explicit Nv4Geo(int64_t K) : nb(K / 256), gt((K % 256) / 16), steps(nv4_steps(K)), tail_idx(_mm512_setzero_si512()) {
    if (gt == 0 || gt > 8) return;
    alignas(64) int32_t idx[16];
    for (int l = 0; l < 16; ++l) idx[l] = static_cast<int32_t>(l % gt);
    tail_idx = _mm512_load_si512(idx);
  }
};
struct Nv4Step {
  int64_t off;    // byte offset of the step's chunk in the row
  __mmask16 m;    // its dwords
  int qp;         // nibbles 2 qp (w0) and 2 qp + 1 (w1) of each word
  bool end;       // the last step of its block: the group scales apply
  int64_t block;  // 256-input block
  int G;          // groups in the block
};
inline __mmask16 mask16(int64_t n) { return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u); }
inline Nv4Step nv4_step(const Nv4Geo& g, int64_t s) {
  if (s < 4 * g.nb) {
    const int i = static_cast<int>(s & 3);
    return {128 * (s >> 2) + 64 * (i >> 1), static_cast<__mmask16>(0xFFFF), i & 1, i == 3, s >> 2, 16};
  }
  const int i = static_cast<int>(s - 4 * g.nb), G = static_cast<int>(g.gt);
  if (G > 8) return {128 * g.nb + 4 * G * (i >> 1), mask16(G), i & 1, i == 3, g.nb, G};
  return {128 * g.nb, mask16(2 * G), i, i == 1, g.nb, G};
}
// The input (within its block, or -1) at slot z (0..63: w0's words, then w1's) of step i of a block of G
// groups, for the activations' order.
inline int nv4_slot_input(int i, int G, int z) {
  const int k = z / 32, l = (z % 32) / 2, h = z % 2;
  int c, g, qp;
  if (G > 8) {
    if (l >= G) return -1;
    c = i >> 1, g = l, qp = i & 1;
  } else {
    if (l >= 2 * G) return -1;
    c = l / G, g = l % G, qp = i;
  }
  return 16 * g + 8 * c + 4 * h + 2 * qp + k;
}
struct Nv4Slots {   // [G][4 steps][64 slots], G = 0 standing for a whole block of 16
  int16_t in[16][4][64];
  Nv4Slots() : in() {
    for (int G = 0; G < 16; ++G)
      for (int i = 0; i < 4; ++i)
        for (int z = 0; z < 64; ++z) in[G][i][z] = static_cast<int16_t>(nv4_slot_input(i, G == 0 ? 16 : G, z));
  }
};
const Nv4Slots kNv4Slots{};
inline int64_t steps_for(int64_t K, int fmt) { return fmt == kNVFP4 ? nv4_steps(K) : steps_of(K); }
inline __mmask64 mask64(int64_t n) { return n >= 64 ? ~0ULL : ((1ULL << n) - 1ULL); }
inline __mmask32 mask32(int64_t n) { return n >= 32 ? 0xFFFFFFFFu : ((1u << n) - 1u); }

// ---- tables -----------------------------------------------------------------------------------------
// bf16 bits of an e4m3 magnitude m (7 bits: exponent e = m >> 3, mantissa m & 7; bias 7). Denormals
// (e = 0) are (m & 7) * 2^-9, normal in bf16. 0x7F (NaN in e4m3fn) never occurs in weights.
constexpr uint16_t e4m3_bf16(int m) {
  const int e = m >> 3, man = m & 7;
  if (e > 0) return static_cast<uint16_t>(((e + 120) << 7) | (man << 4));
  if (man == 0) return 0;
  const int p = man >= 4 ? 2 : man >= 2 ? 1 : 0;   // man = 1.f * 2^p
  return static_cast<uint16_t>(((127 - 9 + p) << 7) | ((man << (7 - p)) & 0x7F));
}
struct Fp8Bytes {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  constexpr Fp8Bytes() : lo(), hi() {
    for (int m = 0; m < 128; ++m) {
      lo[m] = static_cast<uint8_t>(e4m3_bf16(m) & 0xFF);
      hi[m] = static_cast<uint8_t>(e4m3_bf16(m) >> 8);
    }
  }
};
constexpr Fp8Bytes kFp8Bytes{};
// bf16 bits of the 16 e2m1 codes (sign in bit 3): 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives
alignas(16) constexpr uint16_t kE2m1Bf16[16] = {0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
                                                0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

// acc += the 16 pair products of w and x. Written as the instruction itself: GCC 12's intrinsic takes
// __may_alias__ vector types and moves every converted operand through the stack (3x slower measured).
inline __m512 dp(__m512 acc, __m512i w, __m512i x) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}

// ---- weight decoding: one step (64 inputs) of one stored row -> w0, w1 --------------------------------
// full(p): the step at p is whole; part(p, rem): only `rem` < 64 inputs are left in the row (masked loads:
// nothing past the row is read, its lanes decode to zero).
inline const char* row_ptr(const Mat& W, int64_t n) {
  const int64_t elem = W.fmt == kBF16 ? 2 : 1;   // NVFP4: ld is in bytes
  return static_cast<const char*>(W.data) + n * W.ld * elem;
}

struct Bf16Dec {
  static constexpr int64_t kBytes = 128;   // stored bytes per step
  void full(const char* p, __m512i& w0, __m512i& w1) const {
    w0 = _mm512_loadu_si512(p);
    w1 = _mm512_loadu_si512(p + 64);
  }
  void part(const char* p, int64_t rem, __m512i& w0, __m512i& w1) const {
    w0 = _mm512_maskz_loadu_epi16(mask32(rem), p);
    w1 = rem > 32 ? _mm512_maskz_loadu_epi16(mask32(rem - 32), p + 64) : _mm512_setzero_si512();
  }
};

struct Fp8Dec {
  static constexpr int64_t kBytes = 64;
  __m512i l0, l1, h0, h1, sign;
  Fp8Dec()
      : l0(_mm512_load_si512(kFp8Bytes.lo)), l1(_mm512_load_si512(kFp8Bytes.lo + 64)),
        h0(_mm512_load_si512(kFp8Bytes.hi)), h1(_mm512_load_si512(kFp8Bytes.hi + 64)),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))) {}
  void decode(__m512i b, __m512i& w0, __m512i& w1) const {
    const __m512i lo = _mm512_permutex2var_epi8(l0, b, l1);   // index bits 0-6: the magnitude
    __m512i hi = _mm512_permutex2var_epi8(h0, b, h1);
    hi = _mm512_ternarylogic_epi32(hi, b, sign, 0xF8);        // hi | (b & 0x80)
    w0 = _mm512_unpacklo_epi8(lo, hi);
    w1 = _mm512_unpackhi_epi8(lo, hi);
  }
  void full(const char* p, __m512i& w0, __m512i& w1) const { decode(_mm512_loadu_si512(p), w0, w1); }
  void part(const char* p, int64_t rem, __m512i& w0, __m512i& w1) const {
    decode(_mm512_maskz_loadu_epi8(mask64(rem), p), w0, w1);
  }
};

struct Nvfp4Dec {
  static constexpr int64_t kBytes = 32;   // stored bytes per step, on average (the prefetch's stride)
  __m512i tab;                            // bf16 of e2m1 code (i & 15), i < 32
  Nvfp4Dec() : tab(_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kE2m1Bf16)))) {}
  template <int QP>   // nibbles 2 QP and 2 QP + 1 of each word
  void step(const char* row, const Nv4Step& st, __m512i& w0, __m512i& w1) const {
    const __m512i v = _mm512_maskz_loadu_epi32(st.m, row + st.off);
    w0 = _mm512_permutexvar_epi16(QP ? _mm512_srli_epi16(v, 8) : v, tab);
    w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, QP ? 12 : 4), tab);
  }
  void step(const char* row, const Nv4Step& st, __m512i& w0, __m512i& w1) const {
    if (st.qp) step<1>(row, st, w0, w1); else step<0>(row, st, w0, w1);
  }
};

template <typename Dec>
inline void decode_step(const Dec& dec, const char* row, int64_t s, int64_t K, __m512i& w0, __m512i& w1) {
  const int64_t rem = K - kStep * s;
  if (rem >= kStep) dec.full(row + Dec::kBytes * s, w0, w1); else dec.part(row + Dec::kBytes * s, rem, w0, w1);
}

// NVFP4: the group scales of row n's block (st.block), lane l's group's in lane l (G <= 8: group l % G, lanes
// past 2G zero), as fp32 value / 256 (e4m3 through the fp16 converter, exact: the global scale carries 256).
inline __m512 nv4_scales(const Mat& W, int64_t n, const Nv4Step& st, const Nv4Geo& geo) {
  const uint8_t* g = W.gscale + n * W.gscale_ld + 16 * st.block;
  const __m128i b = st.G == 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(g)) : _mm_maskz_loadu_epi8(mask16(st.G), g);
  const __m256i w = _mm256_cvtepi8_epi16(b);
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  const __m512 v = _mm512_cvtph_ps(h);
  if (st.G > 8) return v;
  return _mm512_maskz_permutexvar_ps(mask16(2 * st.G), geo.tail_idx, v);
}

// ---- activations -------------------------------------------------------------------------------------
// 64 floats (natural order, zero past the row) -> two vectors of bf16 in `order`, stored at out, out + 32.
inline void cvt_step(const float* x, int order, uint16_t* out) {
  const __m512i n0 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
  const __m512i n1 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 48), _mm512_loadu_ps(x + 32));
  __m512i a = n0, b = n1;
  if (order != kNatural) {   // 128-bit lanes (8 inputs each): FP8 [n0.0 n0.2 n1.0 n1.2], [n0.1 n0.3 n1.1 n1.3]
    a = _mm512_shuffle_i64x2(n0, n1, _MM_SHUFFLE(2, 0, 2, 0));
    b = _mm512_shuffle_i64x2(n0, n1, _MM_SHUFFLE(3, 1, 3, 1));
  }
  _mm512_storeu_si512(out, a);
  _mm512_storeu_si512(out + 32, b);
}

// NVFP4: X [T, K] -> out [T, ld] bf16, slot z of step s holding the input its weight slot holds (nv4_slot_input).
// Rounded in natural order first (the same rounding as the other orders), then placed word by word.
void convert_acts_nv4(const Rows& X, int64_t K, uint16_t* out, int64_t ld, uint16_t* nat) {
  const Nv4Geo geo(K);
  const int64_t full = K / kStep;
  alignas(64) float tmp[kStep];
  for (int64_t t = 0; t < X.T; ++t) {
    const float* x = X.x + (X.xrows ? X.xrows[t] : t) * X.ldx;
    for (int64_t s = 0; s < full; ++s) cvt_step(x + kStep * s, kNatural, nat + kStep * s);
    if (K > kStep * full) {
      std::memset(tmp, 0, sizeof(tmp));
      std::memcpy(tmp, x + kStep * full, sizeof(float) * (K - kStep * full));
      cvt_step(tmp, kNatural, nat + kStep * full);
    }
    uint16_t* o = out + t * ld;
    for (int64_t s = 0; s < geo.steps; ++s) {
      const Nv4Step st = nv4_step(geo, s);
      const int i = static_cast<int>(s < 4 * geo.nb ? s & 3 : s - 4 * geo.nb);
      const int16_t* in = kNv4Slots.in[st.G == 16 ? 0 : st.G][i];
      const uint16_t* blk = nat + 256 * st.block;
      for (int z = 0; z < 64; ++z) o[kStep * s + z] = in[z] < 0 ? 0 : blk[in[z]];
    }
  }
}

// X [T, K] -> out [T, ld] bf16 in `order` (ld = 64 * steps; zeros past K).
void convert_acts(const Rows& X, int64_t K, int order, uint16_t* out, int64_t ld) {
  const int64_t steps = steps_of(K), full = K / kStep;
  alignas(64) float tmp[kStep];
  for (int64_t t = 0; t < X.T; ++t) {
    const float* x = X.x + (X.xrows ? X.xrows[t] : t) * X.ldx;
    uint16_t* o = out + t * ld;
    for (int64_t s = 0; s < full; ++s) cvt_step(x + kStep * s, order, o + kStep * s);
    if (steps > full) {
      std::memset(tmp, 0, sizeof(tmp));
      std::memcpy(tmp, x + kStep * full, sizeof(float) * (K - kStep * full));
      cvt_step(tmp, order, o + kStep * full);
    }
  }
}

// ---- storing: a fixed tree over the 16 lanes of each output (the same as the fp32 kernels' vhsum4) ----
inline void hsum4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
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

template <int R>
inline void store_rows(const __m512 (&acc)[R], const Mat& W, int64_t n, float* y, float post) {
  for (int r = 0; r < R; r += 4) {
    float s4[4];
    const __m512 z = _mm512_setzero_ps();
    hsum4(acc[r], r + 1 < R ? acc[r + 1] : z, r + 2 < R ? acc[r + 2] : z, r + 3 < R ? acc[r + 3] : z, s4);
    for (int i = 0; i < 4 && r + i < R; ++i) {
      const float v = s4[i] * post;
      y[n + r + i] = W.bias ? v + W.bias[n + r + i] : v;
    }
  }
}

inline float fp8_block_scale(const Mat& W, int64_t n, int64_t kb) {
  return W.scale[((W.scale_r0 + n) >> 7) * W.scale_ld + kb] * (1.0f / 256.0f);   // the kernels keep scale x 256
}
inline float post_of(const Mat& W) { return W.fmt == kNVFP4 ? W.gscale2 * 256.0f : 1.0f; }

// A tile's R rows x TT tokens of accumulators -> Y[t * ldy + n + r] (times NVFP4's global scale, plus the bias).
template <int R, int TT>
inline void store_tile(const __m512 (&acc)[R][TT], const Mat& W, int64_t n, float* Y, int64_t ldy) {
  const float post = post_of(W);
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) {
    __m512 a[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) a[r] = acc[r][t];
    store_rows<R>(a, W, n, Y + t * ldy, post);
  }
}

// ---- one token: 8 rows in flight, weights decoded in registers ----------------------------------------
// Prefetch: the rows one tile further than the next (2 x 8 rows ahead), the bytes of this step, into L2
// (prefetcht1): rows of a few KB are too short for the hardware prefetcher, and L2's miss queue is deeper
// than L1's (measured on Zen 4, one thread, a 64 MB bf16 matrix: 20 GB/s without, 29.8 with: the read floor).
constexpr int kPfTiles = 2;

template <int FMT, int R, int TT, typename Dec>
inline void one_tile(const Mat& W, const Dec& dec, const uint16_t* xb, int64_t xld, int64_t n, float* Y, int64_t ldy) {
  constexpr bool kBlk = FMT == kFP8;
  __m512 acc[R][TT], blk[kBlk ? R : 1][kBlk ? TT : 1];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  if constexpr (kBlk)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) blk[r][t] = _mm512_setzero_ps();
  const int64_t K = W.k, steps = steps_of(K), full = K / kStep;
  const char* rp[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) rp[r] = row_ptr(W, n + r);
  const char* pf = row_ptr(W, n + kPfTiles * R);
  const int64_t rb = row_ptr(W, 1) - row_ptr(W, 0);
  for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const char* a = pf + r * rb + Dec::kBytes * s;
      __builtin_prefetch(a, 0, 2);
      if (Dec::kBytes > 64) __builtin_prefetch(a + 64, 0, 2);
    }
    __m512i x0[TT], x1[TT];
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      x0[t] = _mm512_loadu_si512(xb + t * xld + kStep * s);
      x1[t] = _mm512_loadu_si512(xb + t * xld + kStep * s + 32);
    }
    const bool whole = s < full;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512i w0, w1;
      if (whole) dec.full(rp[r] + Dec::kBytes * s, w0, w1); else dec.part(rp[r] + Dec::kBytes * s, K - kStep * s, w0, w1);
#pragma GCC unroll 4
      for (int t = 0; t < TT; ++t) {
        if constexpr (kBlk) blk[r][t] = dp(dp(blk[r][t], w0, x0[t]), w1, x1[t]);
        else acc[r][t] = dp(dp(acc[r][t], w0, x0[t]), w1, x1[t]);
      }
    }
    if constexpr (kBlk) {
      if ((s & 1) || s == steps - 1) {
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m512 sv = _mm512_set1_ps(fp8_block_scale(W, n + r, s >> 1));
#pragma GCC unroll 4
          for (int t = 0; t < TT; ++t) {
            acc[r][t] = _mm512_fmadd_ps(blk[r][t], sv, acc[r][t]);
            blk[r][t] = _mm512_setzero_ps();
          }
        }
      }
    }
  }
  store_tile<R, TT>(acc, W, n, Y, ldy);
}

// One NVFP4 step of R rows x TT tokens: blk += w.x.
template <int QP, int R, int TT>
inline void nv4_rows(const Nvfp4Dec& dec, const Nv4Step& st, const char* const (&rp)[R], const uint16_t* xs, int64_t xld,
                     __m512 (&blk)[R][TT]) {
  __m512i x0[TT], x1[TT];
#pragma GCC unroll 4
  for (int t = 0; t < TT; ++t) {
    x0[t] = _mm512_loadu_si512(xs + t * xld);
    x1[t] = _mm512_loadu_si512(xs + t * xld + 32);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    __m512i w0, w1;
    dec.step<QP>(rp[r], st, w0, w1);
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) blk[r][t] = dp(dp(blk[r][t], w0, x0[t]), w1, x1[t]);
  }
}

// NVFP4, the same in its steps: blk += w.x over a block's steps, then acc = fma(blk, the block's scales, acc).
template <int R, int TT>
inline void nv4_tile(const Mat& W, const Nvfp4Dec& dec, const Nv4Geo& geo, const uint16_t* xb, int64_t xld, int64_t n,
                     float* Y, int64_t ldy) {
  __m512 acc[R][TT], blk[R][TT];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) acc[r][t] = blk[r][t] = _mm512_setzero_ps();
  const char* rp[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) rp[r] = row_ptr(W, n + r);
  const char* pf = row_ptr(W, n + kPfTiles * R);
  const int64_t rb = row_ptr(W, 1) - row_ptr(W, 0);
  // the group scales of the rows the prefetch below brings (K / 16 bytes each)
  for (int r = 0; r < R; ++r)
    for (int64_t b = 0; b < W.k / 16; b += 64) __builtin_prefetch(W.gscale + (n + kPfTiles * R + r) * W.gscale_ld + b, 0, 2);
  for (int64_t s = 0; s < geo.steps; ++s) {
    if ((s & 1) == 0) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) __builtin_prefetch(pf + r * rb + Nvfp4Dec::kBytes * s, 0, 2);
    }
    const Nv4Step st = nv4_step(geo, s);
    if (st.qp) nv4_rows<1, R, TT>(dec, st, rp, xb + kStep * s, xld, blk);
    else nv4_rows<0, R, TT>(dec, st, rp, xb + kStep * s, xld, blk);
    if (st.end) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 sv = nv4_scales(W, n + r, st, geo);
#pragma GCC unroll 4
        for (int t = 0; t < TT; ++t) {
          acc[r][t] = _mm512_fmadd_ps(blk[r][t], sv, acc[r][t]);
          blk[r][t] = _mm512_setzero_ps();
        }
      }
    }
  }
  store_tile<R, TT>(acc, W, n, Y, ldy);
}

// One to four tokens: every weight decoded once in registers and used for all of them, R rows in flight (one
// token: 8, a memory-bound GEMV; more: 4, or 2 where two accumulators per output (FP8, NVFP4) would not fit
// the register file).
template <int FMT, int TT, typename Dec>
void gemm_few(const Mat& W, const uint16_t* xb, int64_t xld, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  constexpr int R = TT == 1 ? 8 : (FMT != kBF16 && TT > 2) ? 2 : 4;
  const Dec dec;
  int64_t n = n0;
  if constexpr (FMT == kNVFP4) {
    const Nv4Geo geo(W.k);
    for (; n + R <= n1; n += R) nv4_tile<R, TT>(W, dec, geo, xb, xld, n, Y, ldy);
    for (; n < n1; ++n) nv4_tile<1, TT>(W, dec, geo, xb, xld, n, Y, ldy);
  } else {
    for (; n + R <= n1; n += R) one_tile<FMT, R, TT>(W, dec, xb, xld, n, Y, ldy);
    for (; n < n1; ++n) one_tile<FMT, 1, TT>(W, dec, xb, xld, n, Y, ldy);
  }
}

// ---- several tokens: R rows decoded once (bf16: read in place), register tiles of R rows x TT tokens ---
struct Panel {        // rows n .. n + R - 1 as bf16 in the format's order
  const uint16_t* w;  // row r at w + r * ld
  int64_t ld;
  bool in_place;      // bf16 weights read in place: the last step is masked to K
  const float* S;     // NVFP4: [R][steps][16] step scale vectors
};

template <int FMT, int R, int TT>
__attribute__((noinline)) void many_tile(const Mat& W, const Panel& P, const uint16_t* xb, int64_t xld, int64_t t0, int64_t n,
                      float* Y, int64_t ldy) {
  constexpr bool kBlk = FMT != kBF16;
  constexpr int RB = kBlk ? R : 1, TB = kBlk ? TT : 1;
  __m512 acc[R][TT], blk[RB][TB];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < TB; ++t) blk[r][t] = _mm512_setzero_ps();
  const int64_t K = W.k, steps = steps_for(K, FMT), full = K / kStep;
  const Nv4Geo geo(FMT == kNVFP4 ? K : 0);
  const uint16_t* xp[TT];
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) xp[t] = xb + (t0 + t) * xld;
  const uint16_t* wp[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) wp[r] = P.w + r * P.ld;
  for (int64_t s = 0; s < steps; ++s) {
    const bool masked = P.in_place && s >= full;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const int64_t off = kStep * s + 32 * h;
      __m512i w[R];
      if (!masked) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) w[r] = _mm512_loadu_si512(wp[r] + off);
      } else {
        const int64_t left = K - off;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          w[r] = left > 0 ? _mm512_maskz_loadu_epi16(mask32(left), wp[r] + off) : _mm512_setzero_si512();
      }
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        const __m512i xv = _mm512_loadu_si512(xp[t] + off);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          if constexpr (kBlk) {
            blk[r][t] = dp(blk[r][t], w[r], xv);
          } else {
            acc[r][t] = dp(acc[r][t], w[r], xv);
          }
        }
      }
    }
    if constexpr (kBlk) {
      if (FMT == kNVFP4 ? nv4_step(geo, s).end : (s & 1) || s == steps - 1) {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512 sv = FMT == kNVFP4 ? _mm512_loadu_ps(P.S + (r * steps + s) * 16)
                                          : _mm512_set1_ps(fp8_block_scale(W, n + r, s >> 1));
#pragma GCC unroll 8
          for (int t = 0; t < TT; ++t) {
            acc[r][t] = _mm512_fmadd_ps(blk[r][t], sv, acc[r][t]);
            blk[r][t] = _mm512_setzero_ps();
          }
        }
      }
    }
  }
  store_tile<R, TT>(acc, W, n, Y + t0 * ldy, ldy);
}

template <int FMT, int R, int TT>
inline void many_tokens(const Mat& W, const Panel& P, const uint16_t* xb, int64_t xld, int64_t ta, int64_t tb,
                        int64_t n, float* Y, int64_t ldy) {
  int64_t t = ta;
  for (; t + TT <= tb; t += TT) many_tile<FMT, R, TT>(W, P, xb, xld, t, n, Y, ldy);
  const int64_t left = tb - t;
  if constexpr (TT > 5) if (left == 5) return many_tile<FMT, R, 5>(W, P, xb, xld, t, n, Y, ldy);
  if constexpr (TT > 4) if (left == 4) return many_tile<FMT, R, 4>(W, P, xb, xld, t, n, Y, ldy);
  if constexpr (TT > 3) if (left == 3) return many_tile<FMT, R, 3>(W, P, xb, xld, t, n, Y, ldy);
  if constexpr (TT > 2) if (left == 2) return many_tile<FMT, R, 2>(W, P, xb, xld, t, n, Y, ldy);
  if (left == 1) many_tile<FMT, R, 1>(W, P, xb, xld, t, n, Y, ldy);
}

struct Scratch {   // per thread, grown as needed, never shrunk
  uint16_t* x = nullptr;
  int64_t x_cap = 0;
  uint16_t* w = nullptr;
  int64_t w_cap = 0;
  float* f = nullptr;
  int64_t f_cap = 0;
  uint16_t* n = nullptr;   // NVFP4: a token's activations in natural order
  int64_t n_cap = 0;
  template <typename T>
  static T* grow(T*& p, int64_t& cap, int64_t n) {
    if (n > cap) {
      std::free(p);
      cap = std::max<int64_t>(n, 2 * cap);
      p = static_cast<T*>(std::aligned_alloc(64, ((cap * sizeof(T) + 63) / 64) * 64));
      if (!p) throw std::bad_alloc();
    }
    return p;
  }
  ~Scratch() {
    std::free(x);
    std::free(w);
    std::free(f);
    std::free(n);
  }
};
thread_local Scratch tls;

template <int FMT, typename Dec>
void gemm_many(const Mat& W, const uint16_t* xb, int64_t xld, int64_t T, int64_t n0, int64_t n1, float* Y,
               int64_t ldy) {
  constexpr int R = 4, TT = FMT == kBF16 ? 6 : 3;
  const int64_t K = W.k, steps = steps_for(K, FMT), ld = kStep * steps;
  const Nv4Geo geo(FMT == kNVFP4 ? K : 0);
  // tokens in blocks whose activations stay in L2 while every row tile passes over them
  const int64_t tblk = std::max<int64_t>(8 * TT, (768 << 10) / (2 * ld) / TT * TT);
  uint16_t* ws = FMT == kBF16 ? nullptr : Scratch::grow(tls.w, tls.w_cap, R * ld);
  float* S = FMT == kNVFP4 ? Scratch::grow(tls.f, tls.f_cap, R * steps * 16) : nullptr;
  const Dec dec;
  for (int64_t ta = 0; ta < T; ta += tblk) {
    const int64_t tb = std::min(T, ta + tblk);
    for (int64_t n = n0; n < n1; n += R) {
      const int64_t rows = std::min<int64_t>(R, n1 - n);
      Panel P{};
      if (FMT == kBF16) {
        P = Panel{static_cast<const uint16_t*>(W.data) + n * W.ld, W.ld, true, nullptr};
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          const char* row = row_ptr(W, n + r);
          for (int64_t s = 0; s < steps; ++s) {
            __m512i w0, w1;
            if constexpr (FMT == kNVFP4) {
              const Nv4Step st = nv4_step(geo, s);
              dec.step(row, st, w0, w1);
              if (st.end) _mm512_store_ps(S + (r * steps + s) * 16, nv4_scales(W, n + r, st, geo));
            } else {
              decode_step(dec, row, s, K, w0, w1);
            }
            _mm512_store_si512(ws + r * ld + kStep * s, w0);
            _mm512_store_si512(ws + r * ld + kStep * s + 32, w1);
          }
        }
        P = Panel{ws, ld, false, S};
      }
      if (rows == R) {
        many_tokens<FMT, R, TT>(W, P, xb, xld, ta, tb, n, Y, ldy);
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          Panel Pr = P;
          Pr.w = P.w + r * P.ld;
          if (FMT == kNVFP4) Pr.S = P.S + r * steps * 16;
          many_tokens<FMT, 1, TT>(W, Pr, xb, xld, ta, tb, n + r, Y, ldy);
        }
      }
    }
  }
}

// ---- bf16 weights packed in input pairs (kPairs) -------------------------------------------------------
// Block b holds outputs 16b .. 16b + 15: for each input pair p one vector of 16 (w[n, 2p], w[n, 2p + 1]); a
// token's pair (x_2p, x_2p+1) is broadcast to all lanes, and one dot product adds both products to each of the
// 16 outputs. Lane n of an output block accumulates its pairs in order, one chain over p = 0 .. K/2 - 1, so an
// output's rounding depends on K alone; no horizontal sum. Register tiles of RB blocks x TT tokens reuse each
// weight vector for every token and each broadcast pair for every block.
template <int RB, int TT>
__attribute__((noinline)) void pairs_tile(const Mat& W, const uint16_t* xb, int64_t xld, int64_t t0, int64_t b0,
                                          float* Y, int64_t ldy) {
  __m512 acc[RB][TT];
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i)
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) acc[i][t] = _mm512_setzero_ps();
  const int64_t P = (W.k + 1) / 2, ld = W.ld;   // pairs; a block is ld x 32 bf16
  const uint16_t* base = static_cast<const uint16_t*>(W.data) + b0 * ld * 32;
  const uint32_t* xp[TT];
#pragma GCC unroll 8
  for (int t = 0; t < TT; ++t) xp[t] = reinterpret_cast<const uint32_t*>(xb + (t0 + t) * xld);
  for (int64_t p = 0; p < P; ++p) {
    __m512i w[RB];
#pragma GCC unroll 8
    for (int i = 0; i < RB; ++i) w[i] = _mm512_loadu_si512(base + (i * ld + p) * 32);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(xp[t][p]));
#pragma GCC unroll 8
      for (int i = 0; i < RB; ++i) acc[i][t] = dp(acc[i][t], w[i], xv);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < RB; ++i) {
    const int64_t n = 16 * (b0 + i), left = W.n - n;
    if (left <= 0) break;
    const __mmask16 mk = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 bias = W.bias ? _mm512_maskz_loadu_ps(mk, W.bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t)
      _mm512_mask_storeu_ps(Y + (t0 + t) * ldy + n, mk, W.bias ? _mm512_add_ps(acc[i][t], bias) : acc[i][t]);
  }
}

template <int RB>
void pairs_tokens(const Mat& W, const uint16_t* xb, int64_t xld, int64_t T, int64_t b0, float* Y, int64_t ldy) {
  int64_t t = 0;
  for (; t + 6 <= T; t += 6) pairs_tile<RB, 6>(W, xb, xld, t, b0, Y, ldy);
  switch (T - t) {
    case 5: pairs_tile<RB, 5>(W, xb, xld, t, b0, Y, ldy); break;
    case 4: pairs_tile<RB, 4>(W, xb, xld, t, b0, Y, ldy); break;
    case 3: pairs_tile<RB, 3>(W, xb, xld, t, b0, Y, ldy); break;
    case 2: pairs_tile<RB, 2>(W, xb, xld, t, b0, Y, ldy); break;
    case 1: pairs_tile<RB, 1>(W, xb, xld, t, b0, Y, ldy); break;
    default: break;
  }
}

// outputs [n0, n1), n0 a multiple of 16. One token: 8 blocks in flight (a dot product's latency is 6 cycles on
// Zen 4: 8 independent chains keep one issuing per cycle); several: 4 blocks x up to 6 tokens.
template <int RB>
void pairs_rest(const Mat& W, const uint16_t* xb, int64_t xld, int64_t T, int64_t b, int64_t left, float* Y,
                int64_t ldy) {
  if constexpr (RB > 0) {
    if (left == RB) return pairs_tokens<RB>(W, xb, xld, T, b, Y, ldy);
    pairs_rest<RB - 1>(W, xb, xld, T, b, left, Y, ldy);
  }
}

void gemm_pairs(const Mat& W, const uint16_t* xb, int64_t xld, int64_t T, int64_t n0, int64_t n1, float* Y,
                int64_t ldy) {
  const int64_t b1 = (n1 + 15) / 16;
  int64_t b = n0 / 16;
  if (T == 1) {
    for (; b + 8 <= b1; b += 8) pairs_tile<8, 1>(W, xb, xld, 0, b, Y, ldy);
    if (b < b1) pairs_rest<7>(W, xb, xld, 1, b, b1 - b, Y, ldy);
    return;
  }
  for (; b + 4 <= b1; b += 4) pairs_tokens<4>(W, xb, xld, T, b, Y, ldy);
  if (b < b1) pairs_rest<3>(W, xb, xld, T, b, b1 - b, Y, ldy);
}

template <int FMT, typename Dec>
void gemm_fmt(const Mat& W, const uint16_t* xb, int64_t ld, int64_t T, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  // bf16 weights need no decode: tiles over the rows in place for any T > 1. FP8 / NVFP4: up to 4 tokens
  // decode in registers (a verify window reads its weights once); more decode a tile of rows once into scratch.
  switch (T == 1 ? 1 : FMT == kBF16 ? 0 : T) {
    case 1: return gemm_few<FMT, 1, Dec>(W, xb, ld, n0, n1, Y, ldy);
    case 2: return gemm_few<FMT, 2, Dec>(W, xb, ld, n0, n1, Y, ldy);
    case 3: return gemm_few<FMT, 3, Dec>(W, xb, ld, n0, n1, Y, ldy);
    case 4: return gemm_few<FMT, 4, Dec>(W, xb, ld, n0, n1, Y, ldy);
    default: return gemm_many<FMT, Dec>(W, xb, ld, T, n0, n1, Y, ldy);
  }
}

void gemm_acts(const Mat& W, const uint16_t* xb, int64_t ld, int64_t T, int64_t n0, int64_t n1, float* Y,
               int64_t ldy) {
  if (W.layout == kPairs) return gemm_pairs(W, xb, ld, T, n0, n1, Y, ldy);
  switch (W.fmt) {
    case kBF16: gemm_fmt<kBF16, Bf16Dec>(W, xb, ld, T, n0, n1, Y, ldy); break;
    case kFP8: gemm_fmt<kFP8, Fp8Dec>(W, xb, ld, T, n0, n1, Y, ldy); break;
    case kNVFP4: gemm_fmt<kNVFP4, Nvfp4Dec>(W, xb, ld, T, n0, n1, Y, ldy); break;
    default: break;
  }
}

void fill_acts(const Rows& X, int64_t K, int fmt, uint16_t* out, int64_t ld) {
  if (fmt != kNVFP4) return convert_acts(X, K, order_of(fmt), out, ld);
  convert_acts_nv4(X, K, out, ld, Scratch::grow(tls.n, tls.n_cap, kStep * steps_of(K)));
}

bool dot_probe() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

}  // namespace

bool dot_usable() {
  static const bool ok = dot_probe();
  return ok;
}

void dot_gemm(const Mat& W, const Rows& X, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  if (X.T == 0 || n1 <= n0) return;
  const int64_t ld = kStep * steps_for(W.k, W.fmt);
  uint16_t* xb = Scratch::grow(tls.x, tls.x_cap, X.T * ld);
  fill_acts(X, W.k, W.fmt, xb, ld);
  gemm_acts(W, xb, ld, X.T, n0, n1, Y, ldy);
}

DotActs::~DotActs() { std::free(p_); }

void DotActs::fill(const Rows& X, int64_t K, int fmt) {
  ld_ = kStep * steps_for(K, fmt);
  Scratch::grow(p_, cap_, std::max<int64_t>(1, X.T) * ld_);
  fill_acts(X, K, fmt, p_, ld_);
  T_ = X.T;
  K_ = K;
  fmt_ = fmt;
}

void dot_gemm(const Mat& W, const DotActs& X, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  if (X.tokens() == 0 || n1 <= n0) return;
  if (X.k() != W.k || order_of(X.fmt()) != order_of(W.fmt)) std::abort();   // a caller's bug, never input's
  gemm_acts(W, X.data(), X.ld(), X.tokens(), n0, n1, Y, ldy);
}

}  // namespace cpu
}  // namespace mtp_core

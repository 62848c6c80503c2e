// AMX bf16 tile GEMM for row-wise weights (see amx_gemm.h).
//
// C^T = W X^T, one 16 x Tb tile of C^T per (16 output rows, up to 16 tokens): the A tile is 16 rows x 32
// inputs of W read in place (the checkpoint's row-major layout, row stride = ld), the B tile 16 input pairs
// x Tb tokens of the activations, packed once per call as bf16 pairs (VNNI). Each output is the sum over
// k-steps of 32 in order, each step one tile dot product; nothing in it depends on Tb or on the other rows.
#include "amx_gemm.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")
#include <immintrin.h>

namespace mtp_core {
namespace cpu {
namespace {

constexpr int kArchReqXcompPerm = 0x1023;   // arch_prctl: ask for an extended state component
constexpr int kXfeatureXtiledata = 18;

bool amx_probe() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = (d >> 24) & 1, bf16 = (d >> 22) & 1, avx512bf16 = [] {
    unsigned a1, b1, c1, d1;
    return __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && ((a1 >> 5) & 1);
  }();
  if (!tile || !bf16 || !avx512bf16) return false;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0: C [rows x Tb fp32], tmm1: A [rows x 32 bf16], tmm2: B [16 pairs x Tb pairs]
void configure(int rows, int tb) {
  TileConfig cfg;
  cfg.rows[0] = static_cast<uint8_t>(rows);
  cfg.colsb[0] = static_cast<uint16_t>(tb * 4);
  cfg.rows[1] = static_cast<uint8_t>(rows);
  cfg.colsb[1] = 64;
  cfg.rows[2] = 16;
  cfg.colsb[2] = static_cast<uint16_t>(tb * 4);
  _tile_loadconfig(&cfg);
}

// bf16 pairs of X rows for tokens [t0, t0 + tb): out[p * tb + t] = (x_t[2p], x_t[2p+1]) as one 32-bit word.
void pack_pairs(const Rows& X, int64_t t0, int64_t tb, int64_t K, uint32_t* out) {
  alignas(64) uint32_t pairs[16];
  for (int64_t t = 0; t < tb; ++t) {
    const float* x = X.x + (X.xrows ? X.xrows[t0 + t] : t0 + t) * X.ldx;
    for (int64_t k = 0; k < K; k += 32) {
      // cvtne2ps rounds both halves to nearest even; the low 16 bf16 come from the second argument
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
      _mm512_store_si512(pairs, reinterpret_cast<__m512i>(v));
      for (int p = 0; p < 16; ++p) out[(k / 2 + p) * tb + t] = pairs[p];
    }
  }
}

}  // namespace

bool amx_usable() {
  static const bool ok = amx_probe();
  return ok;
}

void amx_gemm(const Mat& W, const Rows& X, int64_t n0, int64_t n1, float* Y, int64_t ldy) {
  if (X.T == 0 || n1 <= n0) return;
  const int64_t K = W.k, T = X.T, nblk = (T + 15) / 16;
  thread_local std::vector<uint32_t> packed;
  thread_local std::vector<float> cbuf;
  packed.resize(static_cast<size_t>(K / 2 * nblk * 16));
  cbuf.resize(16 * 16);
  for (int64_t b = 0; b < nblk; ++b) {   // every token block packed once: [K/2][tb] words each
    const int64_t tb = std::min<int64_t>(16, T - 16 * b);
    pack_pairs(X, 16 * b, tb, K, packed.data() + b * (K / 2) * 16);
  }
  const uint16_t* w = static_cast<const uint16_t*>(W.data);
  int cfg_rows = -1, cfg_tb = -1;
  for (int64_t n = n0; n < n1; n += 16) {   // a 16-row block of W stays in cache over every token block
    const int rows = static_cast<int>(std::min<int64_t>(16, n1 - n));
    for (int64_t b = 0; b < nblk; ++b) {
      const int tb = static_cast<int>(std::min<int64_t>(16, T - 16 * b));
      if (rows != cfg_rows || tb != cfg_tb) {
        configure(rows, tb);
        cfg_rows = rows;
        cfg_tb = tb;
      }
      const uint32_t* B = packed.data() + b * (K / 2) * 16;
      _tile_zero(0);
      for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(1, w + n * W.ld + k, W.ld * 2);
        _tile_loadd(2, B + (k / 2) * tb, tb * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, cbuf.data(), tb * 4);
      for (int i = 0; i < rows; ++i) {
        const float bias = W.bias ? W.bias[n + i] : 0.f;
        for (int t = 0; t < tb; ++t) {
          const float y = cbuf[i * tb + t];
          Y[(16 * b + t) * ldy + n + i] = W.bias ? y + bias : y;
        }
      }
    }
  }
  _tile_release();
}

}  // namespace cpu
}  // namespace mtp_core

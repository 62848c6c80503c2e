// FP8 absorbed-MLA decode over a paged latent cache (Hopper sm_90a; also builds for sm_100a).
//
// Contract (same as mtp_core/kernels/mla_decode_ref.py):
//   q_lat [B, Q, H, 512] bf16, q_pe [B, Q, H, 64] bf16, kv_cache [num_blocks, 64, 576] e4m3,
//   block_table [B, max_blocks] int32, cache_seqlens [B] int32 (includes the Q new tokens),
//   kv_scale: per-tensor float32 dequant scale (real = fp8 * kv_scale), optional.
//   Query i of row b sits at position seqlen - Q + i and sees keys 0..that position.
//   Returns out [B, Q, H, 512] bf16 = softmax(score) @ c_kv and lse [B, H, Q] float32 (natural log).
//
// Work split: one CTA = (16 * RW query rows, one KV split, one batch row); a query row is a
// (q_token, head) pair. The CTA streams its split one 64-token page at a time: cp.async brings the
// raw fp8 page into shared memory (kStages pages in flight), all threads dequantize it once to bf16,
// then RW x CW warps run bf16 mma.sync: warp (rw, cw) computes scores for 16 rows x (64 / CW) keys,
// the row maxima are exchanged through shared memory (online softmax), P goes to shared memory as
// bf16, and the same warp accumulates O for its 16 rows x (512 / CW) latent columns. With more than
// one split, partial (O, lse) pairs go to an fp32 workspace and a combine kernel merges them.
// The per-tensor kv_scale is folded into the score scale and the output scale, so the fp8 -> bf16
// conversion is exact. kv_scale stays on the device, so the launch is CUDA-graph safe.
//
// Splits: the grid's split extent comes from shapes only (mla_decode_num_splits: fill the SMs in one
// wave, graph-replayable for any lengths); each CTA derives its row's own split count from the row's
// actual length, so a short row's unneeded splits write lse = -inf (weightless in the combine) and exit
// before loading anything.
//
// The fp8 -> bf16 dequant (cvt e4m3x2 -> f16x2, 2 x f16 -> f32, one f32x2 -> bf16x2: 4 instructions per
// 2 values) is kept: the shorter integer re-biasing tricks either make bf16 subnormals of e4m3
// subnormals (and rely on the tensor cores' subnormal handling, or need compensating power-of-two
// scales on Q and P) or turn an e4m3 NaN into a finite value, and neither can be verified without a GPU.
// Each page is dequantized once per CTA that reads it: once in all for H <= 64 (one row tile per batch
// row), twice for H = 128 (two 64-row tiles; a 128-row tile does not fit the 227 KB of shared memory).
#include <algorithm>
#include <cmath>

#include "common.cuh"
#include "kernels.h"

namespace mtp_core::cuda {
namespace {

constexpr int kDimLatent = kMlaDimLatent;   // 512
constexpr int kDimRope = kMlaDimRope;       // 64
constexpr int kDim = kDimLatent + kDimRope;  // 576
constexpr int kPage = kMlaPageSize;         // 64 tokens per cache page = keys per tile
constexpr int kStride = kDim + 8;            // bf16 per shared row; +16 B keeps mma loads conflict-free
constexpr int kPStride = kPage + 8;
constexpr int kPageBytes = kPage * kDim;     // one fp8 page, contiguous in the cache
// Above the SM count of any current GPU (H100/H200 132, B200 148): batch 1 can fill every SM.
constexpr int kMaxSplits = 256;
constexpr int kMaxDevices = 64;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;


template <int RW, int CW>
struct Cfg {
  static constexpr int kThreads = RW * CW * 32;
  static constexpr int kRows = RW * 16;
  static constexpr int kStages = RW == 4 ? 1 : 2;  // RW == 4 has no room for a second raw page
  static constexpr int kKeysPerWarp = kPage / CW;
  static constexpr int kSTiles = kKeysPerWarp / 8;
  static constexpr int kColsPerWarp = kDimLatent / CW;
  static constexpr int kOTiles = kColsPerWarp / 8;
  static constexpr int kQBytes = kRows * kStride * 2;
  static constexpr int kKBytes = kPage * kStride * 2;
  static constexpr int kPBytes = kRows * kPStride * 2;
  static constexpr int kRedBytes = CW * kRows * 4;
  static constexpr int kRawBytes = kStages * kPageBytes;
  static constexpr int kSmem = kQBytes + kKBytes + kPBytes + kRedBytes + kRawBytes;
  static_assert(kSmem <= 227 * 1024, "shared memory budget of one Hopper SM");
  static_assert(kOTiles % 2 == 0 && kSTiles >= 1, "tile split");
};

template <int RW, int CW>
__global__ void __launch_bounds__(Cfg<RW, CW>::kThreads, 1) mla_decode_fp8_kernel(const MlaDecodeParams p) {
  using C = Cfg<RW, CW>;
  extern __shared__ __align__(16) uint8_t smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);                                   // [kRows][kStride]
  bf16* k_s = reinterpret_cast<bf16*>(smem + C::kQBytes);                      // [64][kStride]
  bf16* p_s = reinterpret_cast<bf16*>(smem + C::kQBytes + C::kKBytes);         // [kRows][kPStride]
  float* red = reinterpret_cast<float*>(smem + C::kQBytes + C::kKBytes + C::kPBytes);  // [CW][kRows]
  uint8_t* raw = smem + C::kQBytes + C::kKBytes + C::kPBytes + C::kRedBytes;   // [kStages][page]

  const bf16* q_lat = static_cast<const bf16*>(p.q_lat);
  const bf16* q_pe = static_cast<const bf16*>(p.q_pe);
  const uint8_t* kv = static_cast<const uint8_t*>(p.kv);
  const int split = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int rw = warp % RW, cw = warp / RW;
  const int g = lane / 4, t = lane % 4;
  const int num_rows = p.num_q * p.num_heads;
  const int row0 = blockIdx.x * C::kRows;

  const int seqlen = max(p.seqlens[b], 0);
  // As the reference: a row reads at most the pages its block table holds, and block ids are clamped
  // into the cache (a stale or padded entry reads a real block; the causal mask decides what counts).
  const int num_pages = min((seqlen + kPage - 1) / kPage, p.max_blocks);
  // This row's own split count, from its actual length: at least RW pages per split, so that a split's
  // fp32 partial (kRows x 2 KB) is not larger than the fp8 pages it reads (kRows / 16 x 36 KB).
  // Pages are dealt out evenly (no split gets more than one page above another).
  const int row_splits = max(1, min(p.num_splits, (num_pages + RW - 1) / RW));
  if (split >= row_splits) {  // a split this row does not need: weigh nothing in the combine, load nothing
    if (tid < C::kRows && row0 + tid < num_rows)
      p.part_lse[(static_cast<int64_t>(b) * p.num_splits + split) * num_rows + row0 + tid] = -INFINITY;
    return;
  }
  const int page_begin = static_cast<int>(static_cast<int64_t>(split) * num_pages / row_splits);
  const int page_end = static_cast<int>(static_cast<int64_t>(split + 1) * num_pages / row_splits);
  const int* table = p.block_table + static_cast<int64_t>(b) * p.block_table_stride;

  auto load_page = [&](int page, int stage) {
    if (page < page_end) {
      const int block = min(max(table[page], 0), p.num_blocks - 1);
      const uint8_t* src = kv + static_cast<int64_t>(block) * kPageBytes;
      uint8_t* dst = raw + stage * kPageBytes;
      for (int c = tid; c < kPageBytes / 16; c += C::kThreads) cp_async_16(dst + c * 16, src + c * 16);
    }
    cp_async_commit();  // always commit so the group count stays uniform
  };
#pragma unroll
  for (int s = 0; s < C::kStages; ++s) load_page(page_begin + s, s);

  // Query tile -> shared memory; rows past Q*H are zero and never stored.
  for (int c = tid; c < C::kRows * (kDim / 8); c += C::kThreads) {
    const int r = c / (kDim / 8), col = (c % (kDim / 8)) * 8;
    const int m = row0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (m < num_rows) {
      const int64_t row = static_cast<int64_t>(b) * num_rows + m;
      const bf16* src = col < kDimLatent ? q_lat + row * kDimLatent + col
                                         : q_pe + row * kDimRope + (col - kDimLatent);
      v = *reinterpret_cast<const uint4*>(src);
    }
    *reinterpret_cast<uint4*>(q_s + r * kStride + col) = v;
  }

  // This thread owns rows (rw*16 + g) and (rw*16 + g + 8) of the tile.
  int last_pos[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int m = row0 + rw * 16 + g + 8 * i;
    last_pos[i] = m < num_rows ? seqlen - p.num_q + m / p.num_heads : -1;
  }
  const float kv_scale = p.kv_scale != nullptr ? *p.kv_scale : 1.0f;
  const float score_scale = p.softmax_scale * kLog2e * kv_scale;

  float o[C::kOTiles][4];
#pragma unroll
  for (int n = 0; n < C::kOTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};  // this warp's keys only; summed across cw at the end

  for (int page = page_begin; page < page_end; ++page) {
    const int stage = (page - page_begin) % C::kStages;
    cp_async_wait<C::kStages - 1>();
    __syncthreads();  // page landed for every thread; previous tile's k_s / p_s readers are done

    // Slots past seqlen in the last page hold stale or uninitialized bytes (maybe fp8 NaN, and
    // 0 * NaN = NaN in P V): store them as zeros. The causal mask hides them from the scores.
    const uint8_t* src = raw + stage * kPageBytes;
    const int valid_keys = seqlen - page * kPage;
    for (int c = tid; c < kPageBytes / 8; c += C::kThreads) {
      const int key = c / (kDim / 8), col = (c % (kDim / 8)) * 8;
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      if (key < valid_keys) {
        const uint2 v = *reinterpret_cast<const uint2*>(src + c * 8);
        w.x = fp8x2_e4m3_to_bf16x2(v.x);
        w.y = fp8x2_e4m3_to_bf16x2(v.x >> 16);
        w.z = fp8x2_e4m3_to_bf16x2(v.y);
        w.w = fp8x2_e4m3_to_bf16x2(v.y >> 16);
      }
      *reinterpret_cast<uint4*>(k_s + key * kStride + col) = w;
    }
    __syncthreads();
    load_page(page + C::kStages, stage);  // the raw buffer is free again

    // S = Q K^T: 16 rows x kKeysPerWarp keys, contraction over all 576 dims.
    float s[C::kSTiles][4];
#pragma unroll
    for (int j = 0; j < C::kSTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    const bf16* q_row = q_s + (rw * 16 + g) * kStride + 2 * t;
    const bf16* k_row = k_s + (cw * C::kKeysPerWarp + g) * kStride + 2 * t;
#pragma unroll 4
    for (int ks = 0; ks < kDim / 16; ++ks) {
      const uint32_t a[4] = {ld_shared_u32(q_row + ks * 16), ld_shared_u32(q_row + 8 * kStride + ks * 16),
                             ld_shared_u32(q_row + ks * 16 + 8),
                             ld_shared_u32(q_row + 8 * kStride + ks * 16 + 8)};
#pragma unroll
      for (int j = 0; j < C::kSTiles; ++j) {
        const bf16* kp = k_row + j * 8 * kStride + ks * 16;
        mma_bf16_16816(s[j], a, ld_shared_u32(kp), ld_shared_u32(kp + 8));
      }
    }

    // Causal mask + scale (log2 domain), then the tile row max across the CW warps.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < C::kSTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = page * kPage + cw * C::kKeysPerWarp + j * 8 + 2 * t + (e & 1);
        const float v = key <= last_pos[e / 2] ? s[j][e] * score_scale : -INFINITY;
        s[j][e] = v;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], v);
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
      if (t == 0) red[cw * C::kRows + rw * 16 + g + 8 * i] = tile_max[i];
    }
    __syncthreads();
    float base[2], alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float new_max = row_max[i];
#pragma unroll
      for (int c = 0; c < CW; ++c) new_max = fmaxf(new_max, red[c * C::kRows + rw * 16 + g + 8 * i]);
      base[i] = new_max == -INFINITY ? 0.f : new_max;  // a fully masked row keeps p = 0, no NaN
      alpha[i] = exp2f(row_max[i] - base[i]);
      row_max[i] = new_max;
      row_sum[i] *= alpha[i];
    }
#pragma unroll
    for (int j = 0; j < C::kSTiles; ++j) {
      const float p0 = exp2f(s[j][0] - base[0]), p1 = exp2f(s[j][1] - base[0]);
      const float p2 = exp2f(s[j][2] - base[1]), p3 = exp2f(s[j][3] - base[1]);
      row_sum[0] += p0 + p1;
      row_sum[1] += p2 + p3;
      bf16* pp = p_s + (rw * 16 + g) * kPStride + cw * C::kKeysPerWarp + j * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(pp) = pack_bf16x2(p0, p1);
      *reinterpret_cast<uint32_t*>(pp + 8 * kPStride) = pack_bf16x2(p2, p3);
    }
    __syncthreads();  // P of all 64 keys is in shared memory

    // O = alpha * O + P V, V = the 512 latent dims of the same page.
#pragma unroll
    for (int n = 0; n < C::kOTiles; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
    const int mat = lane / 8, mat_row = lane % 8;
#pragma unroll
    for (int kk = 0; kk < kPage / 16; ++kk) {
      const bf16* pr = p_s + (rw * 16 + g) * kPStride + kk * 16 + 2 * t;
      const uint32_t a[4] = {ld_shared_u32(pr), ld_shared_u32(pr + 8 * kPStride), ld_shared_u32(pr + 8),
                             ld_shared_u32(pr + 8 * kPStride + 8)};
      const bf16* v_row = k_s + (kk * 16 + (mat & 1) * 8 + mat_row) * kStride + cw * C::kColsPerWarp +
                          (mat >> 1) * 8;
#pragma unroll
      for (int n2 = 0; n2 < C::kOTiles / 2; ++n2) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, v_row + n2 * 16);
        mma_bf16_16816(o[2 * n2], a, bv[0], bv[1]);
        mma_bf16_16816(o[2 * n2 + 1], a, bv[2], bv[3]);
      }
    }
  }
  cp_async_wait<0>();

  // Row sums: across the quad, then across the CW warps sharing the rows.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
    row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
  }
  __syncthreads();
  if (t == 0) {
    red[cw * C::kRows + rw * 16 + g] = row_sum[0];
    red[cw * C::kRows + rw * 16 + g + 8] = row_sum[1];
  }
  __syncthreads();

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int m = row0 + rw * 16 + g + 8 * i;
    if (m >= num_rows) continue;
    float total = 0.f;
#pragma unroll
    for (int c = 0; c < CW; ++c) total += red[c * C::kRows + rw * 16 + g + 8 * i];
    const float inv = total > 0.f ? kv_scale / total : 0.f;
    const float lse = total > 0.f ? (row_max[i] + log2f(total)) * kLn2 : -INFINITY;
    const int col0 = cw * C::kColsPerWarp + 2 * t;
    if (p.num_splits == 1) {
      bf16* dst = static_cast<bf16*>(p.out) + (static_cast<int64_t>(b) * num_rows + m) * kDimLatent + col0;
#pragma unroll
      for (int n = 0; n < C::kOTiles; ++n)
        *reinterpret_cast<uint32_t*>(dst + n * 8) = pack_bf16x2(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
      if (cw == 0 && t == 0) {
        const int qi = m / p.num_heads, h = m % p.num_heads;
        p.lse[(static_cast<int64_t>(b) * p.num_heads + h) * p.num_q + qi] = lse;
      }
    } else {
      const int64_t prow = (static_cast<int64_t>(b) * p.num_splits + split) * num_rows + m;
      float* dst = p.part_out + prow * kDimLatent + col0;
#pragma unroll
      for (int n = 0; n < C::kOTiles; ++n)
        *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
      if (cw == 0 && t == 0) p.part_lse[prow] = lse;
    }
  }
}

template <int RW, int CW>
cudaError_t launch(const MlaDecodeParams& p, cudaStream_t stream) {
  using C = Cfg<RW, CW>;
  auto* kernel = &mla_decode_fp8_kernel<RW, CW>;
  // The dynamic shared-memory limit is raised once per device, before any graph capture needs it.
  static bool configured[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (!configured[device]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
    if (err != cudaSuccess) return err;
    configured[device] = true;
  }
  const int num_rows = p.num_q * p.num_heads;
  const dim3 grid((num_rows + C::kRows - 1) / C::kRows, p.num_splits, p.batch);
  kernel<<<grid, C::kThreads, C::kSmem, stream>>>(p);
  return cudaGetLastError();
}

int rows_per_cta(int num_rows) { return num_rows <= 16 ? 16 : (num_rows <= 32 ? 32 : 64); }

}  // namespace

int mla_decode_num_splits(int batch, int num_q, int num_heads, int max_blocks, int num_sms) {
  const int num_rows = num_q * num_heads;
  const int rows = rows_per_cta(num_rows);
  const int64_t ctas = static_cast<int64_t>(batch) * ((num_rows + rows - 1) / rows);
  if (ctas <= 0) return 1;
  // One CTA fits per SM: use as many splits as fill the SMs in one wave (rounding down; a second,
  // mostly empty wave would cost a whole extra CTA time).
  const int64_t splits = num_sms / ctas;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({splits, max_blocks, kMaxSplits})));
}

cudaError_t mla_decode_fp8(const MlaDecodeParams& p, cudaStream_t stream) {
  const int num_rows = p.num_q * p.num_heads;
  if (p.batch == 0 || num_rows == 0) return cudaSuccess;
  const int rows = rows_per_cta(num_rows);
  const cudaError_t err = rows == 16 ? launch<1, 4>(p, stream)
                        : rows == 32 ? launch<2, 4>(p, stream)
                                     : launch<4, 2>(p, stream);
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return mla_decode_combine(p, stream);
}

}  // namespace mtp_core::cuda

// Weight-only NVFP4 GEMM: y[M, N] = x[M, K] @ W[N, K]^T with W stored as NVFP4
// (e2m1 codes two per byte, low nibble = even k; one e4m3 scale per 16 k; one float32 scale_2).
// Runs on Hopper (sm_90a) and Blackwell (sm_100a): W is dequantized in the kernel to bf16 and fed
// to bf16 mma.sync; no FP4 tensor-core instruction is needed, so an H200 can verify it.
//
// e2m1 * e4m3 has at most 6 significant bits and fits the bf16 exponent range, so the dequantized
// tile (code value * block scale) is exact in bf16; scale_2 multiplies the fp32 accumulator.
//
// Tiling: CTA = 64 x 64 output tile, 4 warps of 32 x 32, K in steps of 64 (4 scale groups).
// x tiles and the raw weight bytes/scales arrive by cp.async, kStages deep; the weight tile is
// dequantized once per step into shared memory by all 128 threads. When the output has fewer
// tiles than the GPU has SMs (decode: M is a handful of tokens), K is split and an fp32 workspace
// is reduced by a second kernel.
#include <algorithm>

#include "common.cuh"
#include "kernels.h"

namespace mtp_core::cuda {
namespace {

constexpr int kBM = 64, kBN = 64, kBK = kNvfp4GemmTileK;
constexpr int kThreads = 128;
constexpr int kStages = 3;
constexpr int kXStride = kBK + 8;  // bf16 per shared row (+16 B: conflict-free fragment loads)
constexpr int kWStride = kBK + 8;
constexpr int kMaxSplits = 32;
// Split-K sizing (decode: M is a handful of tokens, the GEMM streams the weight once). Each CTA keeps
// kStages - 1 = 2 weight tiles in flight (2 x (2 KB codes + 256 B scales); the x rows of a decode are a few
// hundred bytes). Little's law: H200's ~4.8 TB/s at ~0.7 us DRAM latency needs ~3.4 MB in flight; two CTAs
// per SM (the old target) keep ~1.2 MB (~1.7 TB/s). Occupancy allows 5 CTAs per SM (95 registers x 128
// threads and 43.8 KB of static shared memory, ptxas sm_90a), ~3 MB in flight: aim there.
constexpr int kTargetCtasPerSm = 5;
// Each split writes an fp32 M x N partial that the reduce kernel reads back (mostly from L2): keep all
// partials within the weight bytes (N x K / 2): splits <= K / (8 M). Prefill-sized M gets no split.
constexpr int kPartialBytesDivisor = 8;

struct Smem {
  bf16 x[kStages][kBM][kXStride];
  uint8_t w_raw[kStages][kBN][kBK / 2];
  uint8_t s_raw[kStages][kBN][kBK / 16];
  bf16 w[kBN][kWStride];
  float lut[16];
};

// Value of each 4-bit e2m1 code: sign | 2-bit exponent (bias 1) | 1-bit mantissa.
__device__ __forceinline__ float e2m1_value(int code) {
  const int exp = (code >> 1) & 3, man = code & 1;
  const float mag = exp == 0 ? 0.5f * man : (1.0f + 0.5f * man) * static_cast<float>(1 << (exp - 1));
  return (code & 8) ? -mag : mag;
}

__global__ void __launch_bounds__(kThreads) nvfp4_gemm_kernel(const Nvfp4GemmParams p,
                                                              int k_tiles_per_split) {
  __shared__ __align__(16) Smem sm;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int wm = warp % 2, wn = warp / 2;
  const int n0 = blockIdx.x * kBN, m0 = blockIdx.y * kBM, split = blockIdx.z;
  const int k_tiles = p.K / kBK;
  const int kt_begin = split * k_tiles_per_split;
  const int kt_end = min(k_tiles, kt_begin + k_tiles_per_split);
  const bf16* x = static_cast<const bf16*>(p.x);
  if (tid < 16) sm.lut[tid] = e2m1_value(tid);

  auto load_tile = [&](int kt, int stage) {
    if (kt < kt_end) {
      for (int c = tid; c < kBM * (kBK / 8); c += kThreads) {  // x: 8 chunks of 16 B per row
        const int r = c / (kBK / 8), col = (c % (kBK / 8)) * 8;
        const int m = m0 + r;
        const bf16* src = m < p.M ? x + static_cast<int64_t>(m) * p.K + kt * kBK + col : x;
        cp_async_16(&sm.x[stage][r][col], src, m < p.M);
      }
      {  // weight codes: 2 chunks of 16 B per row, one chunk per thread
        const int r = tid / 2, half = tid % 2;
        const int n = n0 + r;
        const uint8_t* src =
            n < p.N ? p.weight + static_cast<int64_t>(n) * (p.K / 2) + kt * (kBK / 2) + half * 16 : p.weight;
        cp_async_16(&sm.w_raw[stage][r][half * 16], src, n < p.N);
      }
      if (tid < kBN) {  // 4 block scales per row
        const int n = n0 + tid;
        const uint8_t* src =
            n < p.N ? p.weight_scale + static_cast<int64_t>(n) * (p.K / 16) + kt * (kBK / 16) : p.weight_scale;
        cp_async_4(&sm.s_raw[stage][tid][0], src, n < p.N);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) load_tile(kt_begin + s, s);

  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

  for (int kt = kt_begin; kt < kt_end; ++kt) {
    const int stage = (kt - kt_begin) % kStages;
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile kt landed; every warp finished step kt-1 (its stage and sm.w are free)
    load_tile(kt + kStages - 1, (kt - kt_begin + kStages - 1) % kStages);

    {  // dequantize: thread -> row tid/2, k half (tid%2)*32..+32 = 16 code bytes, 2 scale groups
      const int r = tid / 2, half = tid % 2;
      const uint4 codes = *reinterpret_cast<const uint4*>(&sm.w_raw[stage][r][half * 16]);
      const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
      const float s0 = fp8_e4m3_to_float(sm.s_raw[stage][r][half * 2]);
      const float s1 = fp8_e4m3_to_float(sm.s_raw[stage][r][half * 2 + 1]);
      uint32_t out[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) {  // byte i holds k = 2i (low nibble) and 2i + 1 (high nibble)
        const uint32_t byte = (words[i / 4] >> (8 * (i % 4))) & 0xFFu;
        const float scale = i < 8 ? s0 : s1;
        out[i] = pack_bf16x2(sm.lut[byte & 0xF] * scale, sm.lut[byte >> 4] * scale);
      }
      uint4* dst = reinterpret_cast<uint4*>(&sm.w[r][half * 32]);
#pragma unroll
      for (int i = 0; i < 4; ++i) dst[i] = make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
    }
    __syncthreads();

#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t a[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const bf16* xr = &sm.x[stage][wm * 32 + i * 16 + g][ks * 16 + 2 * t];
        a[i][0] = ld_shared_u32(xr);
        a[i][1] = ld_shared_u32(xr + 8 * kXStride);
        a[i][2] = ld_shared_u32(xr + 8);
        a[i][3] = ld_shared_u32(xr + 8 * kXStride + 8);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bf16* wr = &sm.w[wn * 32 + j * 8 + g][ks * 16 + 2 * t];
        const uint32_t b0 = ld_shared_u32(wr), b1 = ld_shared_u32(wr + 8);
        mma_bf16_16816(acc[0][j], a[0], b0, b1);
        mma_bf16_16816(acc[1][j], a[1], b0, b1);
      }
    }
  }
  cp_async_wait<0>();

  const float scale_2 = *p.weight_scale_2;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m = m0 + wm * 32 + i * 16 + g + (e / 2) * 8;
        const int n = n0 + wn * 32 + j * 8 + 2 * t + (e % 2);
        if (m >= p.M || n >= p.N) continue;
        const float v = acc[i][j][e] * scale_2;
        if (p.splits == 1) {
          static_cast<bf16*>(p.out)[static_cast<int64_t>(m) * p.N + n] = __float2bfloat16_rn(v);
        } else {
          p.partial[(static_cast<int64_t>(split) * p.M + m) * p.N + n] = v;
        }
      }
    }
  }
}

__global__ void splitk_reduce_kernel(const Nvfp4GemmParams p) {
  const int64_t total = static_cast<int64_t>(p.M) * p.N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float sum = 0.f;
    for (int s = 0; s < p.splits; ++s) sum += p.partial[s * total + i];
    static_cast<bf16*>(p.out)[i] = __float2bfloat16_rn(sum);
  }
}

int k_tiles_per_split(int K, int splits) {
  const int k_tiles = K / kBK;
  return (k_tiles + splits - 1) / splits;
}

}  // namespace

int nvfp4_gemm_num_splits(int M, int N, int K, int num_sms) {
  const int64_t tiles = static_cast<int64_t>((M + kBM - 1) / kBM) * ((N + kBN - 1) / kBN);
  const int k_tiles = K / kBK;
  if (tiles <= 0 || k_tiles <= 1 || tiles >= num_sms) return 1;
  // Aim at the occupancy (kTargetCtasPerSm per SM); keep at least two k-steps per split and the partials'
  // traffic small against the weights (see kPartialBytesDivisor).
  // Rounded down: the CTAs fit in one wave (a second, mostly empty wave would cost a whole extra CTA time).
  int splits = static_cast<int>(
      std::min<int64_t>(static_cast<int64_t>(kTargetCtasPerSm) * num_sms / tiles, kMaxSplits));
  splits = std::min(splits, std::max(1, K / (kPartialBytesDivisor * std::max(M, 1))));
  splits = std::max(1, std::min(splits, k_tiles / 2));
  // Drop splits that would get no k-steps.
  return (k_tiles + k_tiles_per_split(K, splits) - 1) / k_tiles_per_split(K, splits);
}

cudaError_t nvfp4_gemm(const Nvfp4GemmParams& params, cudaStream_t stream) {
  if (params.M == 0 || params.N == 0) return cudaSuccess;
  const dim3 grid((params.N + kBN - 1) / kBN, (params.M + kBM - 1) / kBM, params.splits);
  nvfp4_gemm_kernel<<<grid, kThreads, 0, stream>>>(params, k_tiles_per_split(params.K, params.splits));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || params.splits == 1) return err;
  const int64_t total = static_cast<int64_t>(params.M) * params.N;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 4096));
  splitk_reduce_kernel<<<blocks, 256, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace mtp_core::cuda

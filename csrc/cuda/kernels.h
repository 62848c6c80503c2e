// Plain-C++ interface between the torch bindings (ops_cuda.cpp) and the CUDA kernels (*.cu).
// Launchers return the launch status (cudaGetLastError); they never synchronize.
// No torch types here: the .cu files build with nvcc alone, and the bindings own every tensor
// check, allocation, device guard and stream.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace mtp_core::cuda {

// ---- FP8 MLA decode (mla_decode_fp8.cu) -------------------------------------------------------
constexpr int kMlaDimLatent = 512;
constexpr int kMlaDimRope = 64;
constexpr int kMlaPageSize = 64;

struct MlaDecodeParams {
  const void* q_lat;          // bf16 [B, Q*H, 512]
  const void* q_pe;           // bf16 [B, Q*H, 64]
  const void* kv;             // e4m3 [num_blocks, 64, 576]
  const int* block_table;     // int32 [B, block_table_stride]
  const int* seqlens;         // int32 [B]
  const float* kv_scale;      // float32 [1] or nullptr (= 1.0)
  void* out;                  // bf16 [B, Q*H, 512]
  float* lse;                 // float32 [B, H, Q]
  float* part_out;            // float32 [B, num_splits, Q*H, 512], only when num_splits > 1
  float* part_lse;            // float32 [B, num_splits, Q*H], only when num_splits > 1
  int64_t block_table_stride;
  int max_blocks;             // block_table.size(1): a row reads at most this many pages
  int num_blocks;             // kv_cache.size(0): block ids are clamped to [0, num_blocks - 1]
  int batch, num_q, num_heads, num_splits;
  float softmax_scale;
};

// KV splits of a launch (the grid's y extent): a function of shapes only, so a CUDA graph can replay it
// for any lengths. Each CTA then derives its row's own split count from that row's actual length
// (mla_decode_fp8.cu); splits a short row does not need exit at once.
int mla_decode_num_splits(int batch, int num_q, int num_heads, int max_blocks, int num_sms);
cudaError_t mla_decode_fp8(const MlaDecodeParams& params, cudaStream_t stream);
// Merge the num_splits partial (out, lse) pairs into out / lse (mla_combine.cu); called by
// mla_decode_fp8 when num_splits > 1.
cudaError_t mla_decode_combine(const MlaDecodeParams& params, cudaStream_t stream);

// ---- NVFP4 weight-only GEMM (nvfp4_gemm.cu) ---------------------------------------------------
constexpr int kNvfp4GemmTileK = 64;  // K must be a multiple of this

struct Nvfp4GemmParams {
  const void* x;              // bf16 [M, K]
  const uint8_t* weight;      // [N, K/2], two e2m1 per byte, low nibble = even k
  const uint8_t* weight_scale;  // e4m3 [N, K/16]
  const float* weight_scale_2;  // float32 [1]
  void* out;                  // bf16 [M, N]
  float* partial;             // float32 [splits, M, N], only when splits > 1
  int M, N, K, splits;
};

int nvfp4_gemm_num_splits(int M, int N, int K, int num_sms);
cudaError_t nvfp4_gemm(const Nvfp4GemmParams& params, cudaStream_t stream);

// ---- NVFP4 activation quantization (nvfp4_quantize.cu) ----------------------------------------
struct Nvfp4QuantizeParams {
  const void* x;              // bf16 [M, K], K % 16 == 0
  const float* global_scale;  // float32 [1], the decode scale (ModelOpt input_scale)
  uint8_t* packed;            // [M, K/2]
  uint8_t* scale;             // e4m3 [M, K/16]
  int64_t num_blocks;         // M * K / 16
};

cudaError_t nvfp4_quantize(const Nvfp4QuantizeParams& params, cudaStream_t stream);

}  // namespace mtp_core::cuda

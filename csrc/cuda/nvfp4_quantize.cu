// NVFP4 activation quantization (the A operand of the Blackwell W4A4 GEMM), one thread per block of
// 16 consecutive elements of a row. Bit-for-bit the same recipe as quantize_nvfp4_ref in
// mtp_core/kernels/nvfp4_gemm_ref.py:
//   block_scale = e4m3_rne(min(amax / (6 * global_scale), 448))
//   decode      = float(block_scale) * global_scale
//   code        = e2m1_rne(x * (1 / decode))        (0 when decode == 0)
// NaN (as the reference): a block holding a NaN (or whose amax / (6 * global_scale) is NaN) gets the e4m3
// NaN scale 0x7F and all-zero codes, so it dequantizes to NaN; +-inf saturates to scale 448 and code +-6.
// global_scale is the per-tensor decode scale (ModelOpt `input_scale`), read on the device.
// Plain CUDA arithmetic, so it runs (and is verified) on Hopper as well as Blackwell.
#include "common.cuh"
#include "kernels.h"

namespace mtp_core::cuda {
namespace {

// Round |v| to the nearest e2m1 magnitude {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code,
// saturating at 6; returns the 4-bit code with the sign of v (v < 0). Counted as the reference counts
// (e2m1_codes): every comparison is false for NaN, so NaN gets code 0.
__device__ __forceinline__ uint32_t e2m1_rne(float v) {
  const float a = fabsf(v);
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                        (a >= 3.5f) + (a > 5.0f);
  return v < 0.f ? (code | 8u) : code;
}

__global__ void __launch_bounds__(256) nvfp4_quantize_kernel(const Nvfp4QuantizeParams p) {
  const int64_t blk = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (blk >= p.num_blocks) return;
  const uint4* src = reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.x) + blk * 16);
  const uint4 lo = src[0], hi = src[1];
  const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  float v[16];
#pragma unroll
  for (int i = 0; i < 8; ++i) {  // bf16 -> fp32 is a 16-bit shift
    v[2 * i] = __uint_as_float(words[i] << 16);
    v[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  }
  float amax = 0.f;
  bool nan = false;  // fmaxf drops NaN; the reference's amax propagates it
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    amax = fmaxf(amax, fabsf(v[i]));
    nan |= v[i] != v[i];
  }

  const float global_scale = *p.global_scale;
  const float ratio = amax / (6.0f * global_scale);
  nan |= ratio != ratio;  // 0 / 0 with a zero global scale
  const __nv_fp8_storage_t scale_byte =
      nan ? static_cast<__nv_fp8_storage_t>(0x7F)
          : __nv_cvt_float_to_fp8(fminf(ratio, 448.0f), __NV_SATFINITE, __NV_E4M3);
  const float decode = fp8_e4m3_to_float(scale_byte) * global_scale;
  const float inv = decode > 0.f ? 1.0f / decode : 0.f;  // NaN decode -> 0: every code 0

  uint32_t packed[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 16; ++i) packed[i / 8] |= e2m1_rne(v[i] * inv) << (4 * (i % 8));
  *reinterpret_cast<uint2*>(p.packed + blk * 8) = make_uint2(packed[0], packed[1]);
  p.scale[blk] = scale_byte;
}

}  // namespace

cudaError_t nvfp4_quantize(const Nvfp4QuantizeParams& params, cudaStream_t stream) {
  if (params.num_blocks == 0) return cudaSuccess;
  const int64_t grid = (params.num_blocks + 255) / 256;
  nvfp4_quantize_kernel<<<static_cast<unsigned>(grid), 256, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace mtp_core::cuda

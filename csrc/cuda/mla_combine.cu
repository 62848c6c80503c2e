// Split-KV combine step of the FP8 MLA decode (mla_decode_fp8.cu): each of the num_splits CTAs of
// a query row wrote a normalized partial output out_s and its log-sum-exp lse_s; then
//   lse = log sum_s exp(lse_s),   out = sum_s exp(lse_s - lse) * out_s.
// Splits that saw no key have lse_s = -inf and weigh nothing; a row with no key at all gets
// out = 0, lse = -inf (same as the reference).
#include <cmath>

#include "common.cuh"
#include "kernels.h"

namespace mtp_core::cuda {
namespace {

constexpr int kThreads = kMlaDimLatent / 4;  // 4 columns per thread

// Grid (Q*H, B): one CTA per query row.
__global__ void __launch_bounds__(kThreads) mla_combine_kernel(const MlaDecodeParams p) {
  const int m = blockIdx.x, b = blockIdx.y;
  const int num_rows = p.num_q * p.num_heads;
  const int64_t row_base = static_cast<int64_t>(b) * p.num_splits * num_rows + m;  // split s: + s * num_rows
  float max_lse = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) max_lse = fmaxf(max_lse, p.part_lse[row_base + s * num_rows]);
  float total = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float l = p.part_lse[row_base + s * num_rows];
    total += l == -INFINITY ? 0.f : expf(l - max_lse);
  }
  const int col = threadIdx.x * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (total > 0.f) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float l = p.part_lse[row_base + s * num_rows];
      if (l == -INFINITY) continue;
      const float w = expf(l - max_lse) / total;
      const float4 v =
          *reinterpret_cast<const float4*>(p.part_out + (row_base + s * num_rows) * kMlaDimLatent + col);
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
  }
  bf16* dst = static_cast<bf16*>(p.out) + (static_cast<int64_t>(b) * num_rows + m) * kMlaDimLatent + col;
  *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16x2(acc.x, acc.y), pack_bf16x2(acc.z, acc.w));
  if (threadIdx.x == 0) {
    const int qi = m / p.num_heads, h = m % p.num_heads;
    p.lse[(static_cast<int64_t>(b) * p.num_heads + h) * p.num_q + qi] =
        total > 0.f ? max_lse + logf(total) : -INFINITY;
  }
}

}  // namespace

cudaError_t mla_decode_combine(const MlaDecodeParams& p, cudaStream_t stream) {
  mla_combine_kernel<<<dim3(p.num_q * p.num_heads, p.batch), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace mtp_core::cuda

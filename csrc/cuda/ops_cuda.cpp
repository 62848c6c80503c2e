// CUDA implementations of the mtp_core ops (schemas: csrc/registration.cpp, loaded first by
// mtp_core._C). Tensor checks, allocation, device guard and stream live here; the kernels take
// plain pointers (kernels.h). Built into mtp_core._C_cuda only when torch has CUDA.
#include <Python.h>

#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels.h"

namespace mtp_core {
namespace {

namespace k = mtp_core::cuda;

// Multiprocessor count of the tensor's device, queried once per device (launch shapes depend on it).
int num_sms(const at::Tensor& t) {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  const int device = t.get_device();
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "mtp_core CUDA ops: device index ", device, " unsupported");
  if (cached[device] == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&cached[device], cudaDevAttrMultiProcessorCount, device));
  }
  return cached[device];
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

std::tuple<at::Tensor, at::Tensor> mla_decode_cuda(const at::Tensor& q_lat, const at::Tensor& q_pe,
                                                   const at::Tensor& kv_cache,
                                                   const at::Tensor& block_table,
                                                   const at::Tensor& cache_seqlens, double softmax_scale,
                                                   const std::optional<at::Tensor>& kv_scale) {
  TORCH_CHECK(q_lat.dim() == 4 && q_lat.size(3) == k::kMlaDimLatent && q_lat.scalar_type() == at::kBFloat16,
              "mla_decode (CUDA): q_lat must be bfloat16 [B, Q, H, 512]");
  const int64_t B = q_lat.size(0), Q = q_lat.size(1), H = q_lat.size(2);
  TORCH_CHECK(q_pe.dim() == 4 && q_pe.size(0) == B && q_pe.size(1) == Q && q_pe.size(2) == H &&
                  q_pe.size(3) == k::kMlaDimRope && q_pe.scalar_type() == at::kBFloat16,
              "mla_decode (CUDA): q_pe must be bfloat16 [B, Q, H, 64]");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat8_e4m3fn && kv_cache.dim() == 3 &&
                  kv_cache.size(1) == k::kMlaPageSize &&
                  kv_cache.size(2) == k::kMlaDimLatent + k::kMlaDimRope && kv_cache.is_contiguous() &&
                  aligned16(kv_cache),
              "mla_decode (CUDA): kv_cache must be a contiguous, 16-byte aligned float8_e4m3fn "
              "[num_blocks, 64, 576]");
  TORCH_CHECK(kv_cache.size(0) >= 1 && kv_cache.size(0) <= INT32_MAX,
              "mla_decode (CUDA): kv_cache must hold between 1 and 2^31 - 1 blocks, got ", kv_cache.size(0));
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.size(0) == B &&
                  block_table.stride(1) == 1,
              "mla_decode (CUDA): block_table must be int32 [B, max_blocks] with unit column stride");
  TORCH_CHECK(cache_seqlens.scalar_type() == at::kInt && cache_seqlens.numel() == B &&
                  cache_seqlens.is_contiguous(),
              "mla_decode (CUDA): cache_seqlens must be a contiguous int32 [B]");
  for (const at::Tensor* t : {&q_pe, &kv_cache, &block_table, &cache_seqlens}) {
    TORCH_CHECK(t->device() == q_lat.device(), "mla_decode (CUDA): all tensors must be on ", q_lat.device());
  }
  if (kv_scale.has_value()) {
    TORCH_CHECK(kv_scale->scalar_type() == at::kFloat && kv_scale->numel() == 1 &&
                    kv_scale->device() == q_lat.device(),
                "mla_decode (CUDA): kv_scale must be a float32 tensor with one element on ", q_lat.device());
  }
  const c10::cuda::CUDAGuard guard(q_lat.device());
  const at::Tensor ql = q_lat.contiguous(), qp = q_pe.contiguous();
  TORCH_CHECK(aligned16(ql) && aligned16(qp), "mla_decode (CUDA): q_lat and q_pe must be 16-byte aligned");
  at::Tensor out = at::empty({B, Q, H, k::kMlaDimLatent}, q_lat.options());
  at::Tensor lse = at::empty({B, H, Q}, q_lat.options().dtype(at::kFloat));

  k::MlaDecodeParams p{};
  p.batch = static_cast<int>(B);
  p.num_q = static_cast<int>(Q);
  p.num_heads = static_cast<int>(H);
  p.num_splits = k::mla_decode_num_splits(p.batch, p.num_q, p.num_heads,
                                          static_cast<int>(block_table.size(1)), num_sms(q_lat));
  at::Tensor part_out, part_lse;
  if (p.num_splits > 1) {
    part_out = at::empty({B, p.num_splits, Q * H, k::kMlaDimLatent}, q_lat.options().dtype(at::kFloat));
    part_lse = at::empty({B, p.num_splits, Q * H}, q_lat.options().dtype(at::kFloat));
    p.part_out = part_out.data_ptr<float>();
    p.part_lse = part_lse.data_ptr<float>();
  }
  p.q_lat = ql.data_ptr();
  p.q_pe = qp.data_ptr();
  p.kv = kv_cache.data_ptr();
  p.block_table = block_table.data_ptr<int>();
  p.seqlens = cache_seqlens.data_ptr<int>();
  p.kv_scale = kv_scale.has_value() ? kv_scale->data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.block_table_stride = block_table.stride(0);
  p.max_blocks = static_cast<int>(block_table.size(1));
  p.num_blocks = static_cast<int>(kv_cache.size(0));
  p.softmax_scale = static_cast<float>(softmax_scale);
  C10_CUDA_CHECK(k::mla_decode_fp8(p, c10::cuda::getCurrentCUDAStream().stream()));
  return {out, lse};
}

at::Tensor nvfp4_gemm_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                           const at::Tensor& weight_scale_2) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "nvfp4_gemm (CUDA): x must be bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % k::kNvfp4GemmTileK == 0, "nvfp4_gemm (CUDA): K must be a multiple of ", k::kNvfp4GemmTileK);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.size(1) == K / 2 &&
                  weight.is_contiguous() && aligned16(weight),
              "nvfp4_gemm (CUDA): weight must be a contiguous uint8 [N, K/2]");
  const int64_t N = weight.size(0);
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat8_e4m3fn && weight_scale.dim() == 2 &&
                  weight_scale.size(0) == N && weight_scale.size(1) == K / 16 && weight_scale.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(weight_scale.data_ptr()) % 4 == 0,
              "nvfp4_gemm (CUDA): weight_scale must be a contiguous float8_e4m3fn [N, K/16]");
  TORCH_CHECK(weight_scale_2.scalar_type() == at::kFloat && weight_scale_2.numel() == 1,
              "nvfp4_gemm (CUDA): weight_scale_2 must be a float32 tensor with one element");
  for (const at::Tensor* t : {&weight, &weight_scale, &weight_scale_2}) {
    TORCH_CHECK(t->device() == x.device(), "nvfp4_gemm (CUDA): all tensors must be on ", x.device());
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  TORCH_CHECK(aligned16(xc), "nvfp4_gemm (CUDA): x must be 16-byte aligned");
  at::Tensor out = at::empty({M, N}, x.options());
  k::Nvfp4GemmParams p{};
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.splits = k::nvfp4_gemm_num_splits(p.M, p.N, p.K, num_sms(x));
  at::Tensor partial;
  if (p.splits > 1) {
    partial = at::empty({p.splits, M, N}, x.options().dtype(at::kFloat));
    p.partial = partial.data_ptr<float>();
  }
  p.x = xc.data_ptr();
  p.weight = weight.data_ptr<uint8_t>();
  p.weight_scale = reinterpret_cast<const uint8_t*>(weight_scale.data_ptr());
  p.weight_scale_2 = weight_scale_2.data_ptr<float>();
  p.out = out.data_ptr();
  C10_CUDA_CHECK(k::nvfp4_gemm(p, c10::cuda::getCurrentCUDAStream().stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> nvfp4_quantize_cuda(const at::Tensor& x, const at::Tensor& global_scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(1) % 16 == 0,
              "nvfp4_quantize (CUDA): x must be bfloat16 [M, K] with K a multiple of 16");
  TORCH_CHECK(global_scale.scalar_type() == at::kFloat && global_scale.numel() == 1 &&
                  global_scale.device() == x.device(),
              "nvfp4_quantize (CUDA): global_scale must be a float32 tensor with one element on ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  TORCH_CHECK(aligned16(xc), "nvfp4_quantize (CUDA): x must be 16-byte aligned");
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor packed = at::empty({M, K / 2}, x.options().dtype(at::kByte));
  at::Tensor scale = at::empty({M, K / 16}, x.options().dtype(at::kFloat8_e4m3fn));
  k::Nvfp4QuantizeParams p{};
  p.x = xc.data_ptr();
  p.global_scale = global_scale.data_ptr<float>();
  p.packed = packed.data_ptr<uint8_t>();
  p.scale = reinterpret_cast<uint8_t*>(scale.data_ptr());
  p.num_blocks = M * K / 16;
  C10_CUDA_CHECK(k::nvfp4_quantize(p, c10::cuda::getCurrentCUDAStream().stream()));
  return {packed, scale};
}

}  // namespace
}  // namespace mtp_core

TORCH_LIBRARY_IMPL(mtp_core, CUDA, m) {
  m.impl("mla_decode", &mtp_core::mla_decode_cuda);
  m.impl("nvfp4_gemm", &mtp_core::nvfp4_gemm_cuda);
  m.impl("nvfp4_quantize", &mtp_core::nvfp4_quantize_cuda);
}

// `import mtp_core._C_cuda` loads this library; the static TORCH_LIBRARY_IMPL above registers the
// kernels. The module only carries CUDA_ARCHS, the targets compiled in (e.g. "90a_100a"), so that
// mtp_core.kernels uses the kernels only on a GPU they were built for.
#ifndef MTP_CORE_CUDA_ARCHS
#define MTP_CORE_CUDA_ARCHS unknown
#endif
#define MTP_CORE_STR2(x) #x
#define MTP_CORE_STR(x) MTP_CORE_STR2(x)

PyMODINIT_FUNC PyInit__C_cuda(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C_cuda", nullptr, -1, nullptr};
  PyObject* mod = PyModule_Create(&module);
  if (mod != nullptr && PyModule_AddStringConstant(mod, "CUDA_ARCHS", MTP_CORE_STR(MTP_CORE_CUDA_ARCHS)) < 0) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}

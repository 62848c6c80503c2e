// Small fused CPU ops for the decode path. On a model as small as the shipped one a decode step is
// hundreds of tiny tensor ops, each paying the dispatcher's few microseconds; these two replace
// ~6 (RMSNorm) and ~10 (rotary embedding) such ops with one call each. Same math as the torch
// references in mtp_core/kernels/fused_ref.py (fp32 arithmetic, result in the input's dtype).
#include <cmath>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

namespace mtp_core {
namespace {

// y = w * (x * rsqrt(mean(x^2) + eps)).to(dtype), row by row over the last dimension.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int64_t i = 0;
      for (; i + 8 <= dim; i += 8) {
        for (int j = 0; j < 8; ++j) {
          const float v = static_cast<float>(xr[i + j]);
          acc[j] += v * v;
        }
      }
      float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; i < dim; ++i) sum += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
      T* yr = y + r * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const T normed = static_cast<T>(static_cast<float>(xr[d]) * inv);
        yr[d] = static_cast<T>(static_cast<float>(w[d]) * static_cast<float>(normed));
      }
    }
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm (CPU): weight must be [", x.size(-1), "]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm (CPU): x and weight dtypes differ");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t dim = x.size(-1), rows = dim ? xc.numel() / dim : 0;
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(xc.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), rows, dim,
                  static_cast<float>(eps));
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows(xc.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(),
                  rows, dim, static_cast<float>(eps));
  } else {
    TORCH_CHECK(false, "rms_norm (CPU): x must be float32 or bfloat16");
  }
  return y;
}

// x [T, ..., D] (D even), cos/sin float32 [T, D/2]. Pairs (x1, x2) are (x[2i], x[2i+1]) when
// interleaved, else (x[i], x[i + D/2]); the output is [x1*c - x2*s | x2*c + x1*s] in both cases.
template <typename T>
void rope_rows(const T* x, const float* cos, const float* sin, T* y, int64_t tokens, int64_t per_token,
               int64_t dim, bool interleave) {
  const int64_t half = dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos + t * half;
    const float* s = sin + t * half;
    for (int64_t v = 0; v < per_token; ++v) {
      const T* xr = x + (t * per_token + v) * dim;
      T* yr = y + (t * per_token + v) * dim;
      for (int64_t i = 0; i < half; ++i) {
        // the reference multiplies in the input dtype: round cos/sin and each product as it does
        const float ci = static_cast<float>(static_cast<T>(c[i])), si = static_cast<float>(static_cast<T>(s[i]));
        const float x1 = static_cast<float>(interleave ? xr[2 * i] : xr[i]);
        const float x2 = static_cast<float>(interleave ? xr[2 * i + 1] : xr[i + half]);
        const float a = static_cast<float>(static_cast<T>(x1 * ci)), b = static_cast<float>(static_cast<T>(x2 * si));
        const float e = static_cast<float>(static_cast<T>(x2 * ci)), f = static_cast<float>(static_cast<T>(x1 * si));
        yr[i] = static_cast<T>(a - b);
        yr[i + half] = static_cast<T>(e + f);
      }
    }
  }
}

at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleave) {
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) % 2 == 0, "rope (CPU): x must be [T, ..., D] with D even");
  const int64_t tokens = x.size(0), dim = x.size(-1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                  cos.size(0) == tokens && cos.size(1) == dim / 2 && sin.sizes() == cos.sizes(),
              "rope (CPU): cos and sin must be float32 [", tokens, ", ", dim / 2, "]");
  const at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t per_token = (tokens && dim) ? xc.numel() / (tokens * dim) : 0;
  if (x.scalar_type() == at::kFloat) {
    rope_rows(xc.data_ptr<float>(), cc.data_ptr<float>(), sc.data_ptr<float>(), y.data_ptr<float>(), tokens,
              per_token, dim, interleave);
  } else if (x.scalar_type() == at::kBFloat16) {
    rope_rows(xc.data_ptr<c10::BFloat16>(), cc.data_ptr<float>(), sc.data_ptr<float>(),
              y.data_ptr<c10::BFloat16>(), tokens, per_token, dim, interleave);
  } else {
    TORCH_CHECK(false, "rope (CPU): x must be float32 or bfloat16");
  }
  return y;
}

}  // namespace
}  // namespace mtp_core

TORCH_LIBRARY_IMPL(mtp_core, CPU, m) {
  m.impl("rms_norm", &mtp_core::rms_norm_cpu);
  m.impl("rope", &mtp_core::rope_cpu);
}

// CPU implementation of mtp_core::mla_decode: the GPU kernel's contract (paged latent cache,
// K+1 causal query rows, per-tensor kv_scale) with generic R, P and page size. It is the second
// oracle next to the torch reference, and the fast path on CPU (no Python op overhead).
//
// Per batch row b: dequantize the seqlen[b] cached entries once to fp32, then for each query row
// (q token i, head h) with last visible position seqlen - Q + i: scores = q . k * scale over the
// visible keys, a max-subtracted softmax, out = p @ c_kv / sum(p), lse = max + log(sum(p)).
// A row that sees no key (seqlen < Q, e.g. a padded batch slot) yields out = 0, lse = -inf.
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

namespace mtp_core {
namespace {

struct Shapes {
  int64_t batch, num_q, num_heads, dim_latent, dim_rope, page_size, num_blocks, max_blocks;
  int64_t dim() const { return dim_latent + dim_rope; }
};

// Eight independent partial sums so the compiler can keep the multiply-adds in flight.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

template <typename QT, typename CT>
void decode_row(const Shapes& s, int64_t b, const QT* q_lat, const QT* q_pe, const CT* cache,
                const int32_t* table_row, int64_t seqlen, float softmax_scale, float kv_scale, QT* out,
                float* lse) {
  const int64_t D = s.dim(), R = s.dim_latent, P = s.dim_rope;
  std::vector<float> keys(static_cast<size_t>(seqlen * D));  // [seqlen, D], dequantized once
  for (int64_t pos = 0; pos < seqlen; ++pos) {
    const int64_t block = table_row[pos / s.page_size];
    const CT* src = cache + (block * s.page_size + pos % s.page_size) * D;
    float* dst = keys.data() + pos * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * kv_scale;
  }
  std::vector<float> q(static_cast<size_t>(D)), scores(static_cast<size_t>(seqlen)),
      acc(static_cast<size_t>(R));
  for (int64_t qi = 0; qi < s.num_q; ++qi) {
    const int64_t visible = std::max<int64_t>(0, seqlen - s.num_q + qi + 1);
    for (int64_t h = 0; h < s.num_heads; ++h) {
      const int64_t row = (b * s.num_q + qi) * s.num_heads + h;
      for (int64_t d = 0; d < R; ++d) q[d] = static_cast<float>(q_lat[row * R + d]);
      for (int64_t d = 0; d < P; ++d) q[R + d] = static_cast<float>(q_pe[row * P + d]);
      float* lse_out = lse + (b * s.num_heads + h) * s.num_q + qi;
      QT* o = out + row * R;
      if (visible == 0) {
        for (int64_t d = 0; d < R; ++d) o[d] = static_cast<QT>(0.f);
        *lse_out = -std::numeric_limits<float>::infinity();
        continue;
      }
      float max_score = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < visible; ++j) {
        scores[j] = dot(q.data(), keys.data() + j * D, D) * softmax_scale;
        max_score = std::max(max_score, scores[j]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      float sum = 0.f;
      for (int64_t j = 0; j < visible; ++j) {
        const float p = std::exp(scores[j] - max_score);
        sum += p;
        const float* v = keys.data() + j * D;  // the latent part of the key is the value
        for (int64_t d = 0; d < R; ++d) acc[d] += p * v[d];
      }
      for (int64_t d = 0; d < R; ++d) o[d] = static_cast<QT>(acc[d] / sum);
      *lse_out = max_score + std::log(sum);
    }
  }
}

template <typename QT, typename CT>
void decode_all(const Shapes& s, const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& cache,
                const at::Tensor& block_table, const at::Tensor& seqlens, float softmax_scale, float kv_scale,
                at::Tensor& out, at::Tensor& lse) {
  const QT* ql = q_lat.const_data_ptr<QT>();
  const QT* qp = q_pe.const_data_ptr<QT>();
  const CT* kv = cache.const_data_ptr<CT>();
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  const int32_t* lens = seqlens.const_data_ptr<int32_t>();
  QT* o = out.mutable_data_ptr<QT>();
  float* l = lse.mutable_data_ptr<float>();
  at::parallel_for(0, s.batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      decode_row<QT, CT>(s, b, ql, qp, kv, table + b * s.max_blocks, lens[b], softmax_scale, kv_scale, o, l);
    }
  });
}

template <typename QT>
void dispatch_cache(const Shapes& s, const at::Tensor& q_lat, const at::Tensor& q_pe, const at::Tensor& cache,
                    const at::Tensor& block_table, const at::Tensor& seqlens, float softmax_scale, float kv_scale,
                    at::Tensor& out, at::Tensor& lse) {
  switch (cache.scalar_type()) {
    case at::kFloat:
      return decode_all<QT, float>(s, q_lat, q_pe, cache, block_table, seqlens, softmax_scale, kv_scale, out, lse);
    case at::kBFloat16:
      return decode_all<QT, c10::BFloat16>(s, q_lat, q_pe, cache, block_table, seqlens, softmax_scale, kv_scale,
                                           out, lse);
    case at::kFloat8_e4m3fn:
      return decode_all<QT, c10::Float8_e4m3fn>(s, q_lat, q_pe, cache, block_table, seqlens, softmax_scale,
                                                kv_scale, out, lse);
    default:
      TORCH_CHECK(false, "mla_decode (CPU): kv_cache dtype must be float32, bfloat16 or float8_e4m3fn");
  }
}

std::tuple<at::Tensor, at::Tensor> mla_decode_cpu(const at::Tensor& q_lat, const at::Tensor& q_pe,
                                                  const at::Tensor& kv_cache, const at::Tensor& block_table,
                                                  const at::Tensor& cache_seqlens, double softmax_scale,
                                                  const std::optional<at::Tensor>& kv_scale) {
  TORCH_CHECK(q_lat.dim() == 4 && q_pe.dim() == 4 && kv_cache.dim() == 3,
              "mla_decode (CPU): expected q_lat [B, Q, H, R], q_pe [B, Q, H, P], kv_cache [blocks, page, R+P]");
  const Shapes s{q_lat.size(0), q_lat.size(1), q_lat.size(2), q_lat.size(3), q_pe.size(3),
                 kv_cache.size(1), kv_cache.size(0), block_table.size(1)};
  TORCH_CHECK(q_pe.size(0) == s.batch && q_pe.size(1) == s.num_q && q_pe.size(2) == s.num_heads,
              "mla_decode (CPU): q_pe must match q_lat in [B, Q, H]");
  TORCH_CHECK(q_pe.scalar_type() == q_lat.scalar_type(), "mla_decode (CPU): q_lat and q_pe dtypes differ");
  TORCH_CHECK(kv_cache.size(2) == s.dim(), "mla_decode (CPU): kv_cache last dim must be R + P = ", s.dim());
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 && block_table.size(0) == s.batch,
              "mla_decode (CPU): block_table must be int32 [B, max_blocks]");
  TORCH_CHECK(cache_seqlens.scalar_type() == at::kInt && cache_seqlens.numel() == s.batch,
              "mla_decode (CPU): cache_seqlens must be int32 [B]");
  const at::Tensor ql = q_lat.contiguous(), qp = q_pe.contiguous(), kv = kv_cache.contiguous();
  const at::Tensor table = block_table.contiguous(), lens = cache_seqlens.contiguous();
  const int32_t* lens_ptr = lens.const_data_ptr<int32_t>();
  const int32_t* table_ptr = table.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < s.batch; ++b) {  // every used page must exist
    TORCH_CHECK(lens_ptr[b] >= 0 && lens_ptr[b] <= s.max_blocks * s.page_size,
                "mla_decode (CPU): cache_seqlens[", b, "] = ", lens_ptr[b], " outside [0, max_blocks * page_size]");
    for (int64_t i = 0; i < (lens_ptr[b] + s.page_size - 1) / s.page_size; ++i) {
      const int32_t block = table_ptr[b * s.max_blocks + i];
      TORCH_CHECK(block >= 0 && block < s.num_blocks, "mla_decode (CPU): block_table[", b, ", ", i, "] = ", block,
                  " is not a cache block");
    }
  }
  float scale = 1.f;
  if (kv_scale.has_value()) {
    TORCH_CHECK(kv_scale->numel() == 1, "mla_decode (CPU): kv_scale must have one element");
    scale = kv_scale->item().toFloat();
  }
  at::Tensor out = at::empty({s.batch, s.num_q, s.num_heads, s.dim_latent}, q_lat.options());
  at::Tensor lse = at::empty({s.batch, s.num_heads, s.num_q}, q_lat.options().dtype(at::kFloat));
  const float sm = static_cast<float>(softmax_scale);
  if (q_lat.scalar_type() == at::kFloat) {
    dispatch_cache<float>(s, ql, qp, kv, table, lens, sm, scale, out, lse);
  } else if (q_lat.scalar_type() == at::kBFloat16) {
    dispatch_cache<c10::BFloat16>(s, ql, qp, kv, table, lens, sm, scale, out, lse);
  } else {
    TORCH_CHECK(false, "mla_decode (CPU): q_lat dtype must be float32 or bfloat16");
  }
  return {out, lse};
}

}  // namespace
}  // namespace mtp_core

TORCH_LIBRARY_IMPL(mtp_core, CPU, m) { m.impl("mla_decode", &mtp_core::mla_decode_cpu); }

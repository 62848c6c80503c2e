// DeepSeek-V3.2 sparse attention in the native CPU forward: see dsa_cpu.h. Everything here is per token and
// computed whole by one thread, so it is batch- and thread-invariant like the rest of the forward.
#include "dsa_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include <c10/util/BFloat16.h>

namespace mtp_core {
namespace dsa {
namespace {

inline float at(const NormW& v, int64_t i) {
  return v.type == cpu::kBF16 ? static_cast<float>(static_cast<const c10::BFloat16*>(v.p)[i])
                              : static_cast<const float*>(v.p)[i];
}

// [x1 * c - x2 * s | x2 * c + x1 * s] over the two halves of x[0..P) (the non-interleaved form).
inline void rope_half(float* x, int64_t P, const float* c, const float* s) {
  const int64_t half = P / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] - x2 * s[i];
    x[i + half] = x2 * c[i] + x1 * s[i];
  }
}

}  // namespace

void index_key(const float* k, int64_t Di, int64_t P, const NormW& w, const NormW& b, float eps, const float* cos,
               const float* sin, float* out) {
  float mean = 0.f;
  for (int64_t i = 0; i < Di; ++i) mean += k[i];
  mean /= static_cast<float>(Di);
  float var = 0.f;
  for (int64_t i = 0; i < Di; ++i) var += (k[i] - mean) * (k[i] - mean);
  const float inv = 1.0f / std::sqrt(var / static_cast<float>(Di) + eps);
  for (int64_t i = 0; i < Di; ++i) out[i] = (k[i] - mean) * inv * at(w, i) + at(b, i);
  rope_half(out, P, cos, sin);
}

void index_query(float* q, float* w, int64_t heads, int64_t Di, int64_t P, const float* cos, const float* sin) {
  const float ws = static_cast<float>(std::pow(static_cast<double>(heads), -0.5));
  for (int64_t h = 0; h < heads; ++h) {
    rope_half(q + h * Di, P, cos, sin);
    w[h] *= ws;
  }
}

int64_t select(const float* scores, int64_t n, int64_t k, const int32_t* table, int64_t page, int32_t* slots,
               float* tmp) {
  const auto slot = [&](int64_t pos) { return static_cast<int32_t>(table[pos / page] * page + pos % page); };
  if (n <= k) {
    for (int64_t i = 0; i < n; ++i) slots[i] = slot(i);
    return n;
  }
  // the k-th best score; every key above it, then the ones equal to it in position order until k are taken
  for (int64_t i = 0; i < n; ++i) tmp[i] = std::isnan(scores[i]) ? -INFINITY : scores[i];
  std::nth_element(tmp, tmp + (k - 1), tmp + n, std::greater<float>());
  const float kth = tmp[k - 1];
  int64_t ties = k;
  for (int64_t i = 0; i < n; ++i) ties -= scores[i] > kth;
  int64_t m = 0;
  for (int64_t i = 0; i < n && m < k; ++i) {
    const float s = std::isnan(scores[i]) ? -INFINITY : scores[i];
    if (s > kth || (s == kth && ties-- > 0)) slots[m++] = slot(i);
  }
  return m;
}

}  // namespace dsa
}  // namespace mtp_core

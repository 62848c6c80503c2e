// DeepSeek-V3.2 sparse attention (DSA) in the native CPU forward: the per-token pieces of the lightning indexer
// and the top-k selection (dsa_cpu.cpp). The forward (decode_cpu.cpp) runs them inside its one call:
//   projections    q_i = wq_b(q latent), k_i = wk(h), w = weights_proj(h)            (the team's GEMMs)
//   per token      index_key (LayerNorm + bias, half-split rope) into the cache row after [c_kv | k_pe];
//                  index_query (half-split rope per head; w times heads^-0.5)
//   per token      scores over the row's visible index keys (KernelTable::index_scores), select() the top-k
//   per (token, 4 heads)  absorbed MLA over the chosen latents only (KernelTable::sparse_attention)
// Torch reference: mtp_core/model/dsa.py (the model) and mtp_core/kernels/native_ref.py (this forward).
#pragma once

#include <cstdint>

#include "decode_weights.h"

namespace mtp_core {
namespace dsa {

// out[0..Di) = half-split rope of the first P dims of layer_norm(k) * w + b (fp32, eps as k_norm's).
void index_key(const float* k, int64_t Di, int64_t P, const NormW& w, const NormW& b, float eps, const float* cos,
               const float* sin, float* out);

// q [heads, Di] in place: the half-split rope of each head's first P dims; w [heads] times heads^-0.5.
void index_query(float* q, float* w, int64_t heads, int64_t Di, int64_t P, const float* cos, const float* sin);

// The k best of scores[0..n) (all n when n <= k), equal scores taken lower position first, as the cache slots of
// their positions (through the row's block table) in ascending position order; tmp: n floats. Returns how many.
int64_t select(const float* scores, int64_t n, int64_t k, const int32_t* table, int64_t page, int32_t* slots,
               float* tmp);

}  // namespace dsa
}  // namespace mtp_core

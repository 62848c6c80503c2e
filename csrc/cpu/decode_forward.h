// The native forward's entry points inside the extension (csrc/cpu/decode_cpu.cpp), shared by the ops that
// run it: decode_forward, decode_logits, and the fused MTP step (mtp_step_cpu.cpp).
#pragma once

#include <optional>
#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

#include "decode_weights.h"

namespace mtp_core {

// The batch: T tokens in B rows (row b owns tokens [qstart[b], qstart[b+1]) at consecutive positions, the last
// at ctx[b] - 1), paged cache addressing through tables [B, max_blocks], rope tables [max_pos, P/2].
struct Batch {
  int64_t T = 0, B = 0, max_blocks = 0, max_ctx = 0, page = 0;
  const int64_t* positions = nullptr;
  const int64_t* slots = nullptr;
  const int32_t* qstart = nullptr;
  const int32_t* tables = nullptr;
  const int32_t* ctx = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
  std::vector<int32_t> row_of;   // [T]: the row of each token
};

// The tokens whose outputs a forward writes: every token's (out [T, H]), each row's last one (out [B, H]; every
// row must feed at least one token), or none (only the caches are written). Where outputs are left out, the last
// layer runs up to its KV write for those tokens (the query, attention and feed-forward of a position whose output
// nobody reads change nothing a later token sees): an MTP module's forward over positions that only fill its
// cache (a prompt's, a lagging row's, Eagle's forward 1 before the last accepted position), or a prefill chunk
// whose hidden states nobody keeps. The outputs kept are the same numbers as kAll's rows (batch invariance).
enum class Outputs { kAll, kLast, kNone };

// Layers [first_layer, first_layer + num_layers) over the batch (the caches, one per layer, written at
// b.slots); tok [T] the token ids, mtp_hidden [T, H] for an MTP module's layer; x_in [T, H] (main layers): the
// residual stream entering first_layer, instead of the embedding of tok (a forward split before its last layer,
// whose rest runs later); out fp32 after the final norm (final_norm) or the last layer, of the tokens `outputs`
// says. Inputs must have been checked (nothing inside throws).
void forward_layers(const DecodeWeights& W, int64_t first_layer, int64_t num_layers, const int64_t* tok,
                    const float* mtp_hidden, const std::vector<at::Tensor>& caches, const Batch& b, bool final_norm,
                    float* out, Outputs outputs = Outputs::kAll, const float* x_in = nullptr);

// logits y [T, vocab] = x [T, H] @ lm_head^T, batch-invariant, on the thread team.
void lm_head(const DecodeWeights& W, const float* x, int64_t T, float* y);
// the drafts' head (DecodeWeights::draft_head): y [T, draft_vocab()]
void draft_logits(const DecodeWeights& W, const float* x, int64_t T, float* y);

// The op mtp_core::mtp_step (mtp_step_cpu.cpp; registered with the others in decode_cpu.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mtp_step_cpu(
    const c10::intrusive_ptr<DecodeWeights>& weights, const at::Tensor& ids, const at::Tensor& query_start,
    const at::Tensor& start, const at::Tensor& block_tables, const at::Tensor& num_drafts, at::TensorList caches,
    const at::Tensor& rope_cos, const at::Tensor& rope_sin, int64_t mtp_layer, int64_t num_modules,
    const std::optional<at::Tensor>& window_ids, const std::optional<at::Tensor>& window_hidden,
    const std::optional<at::Tensor>& window_len, const std::optional<at::Tensor>& mtp_valid, double confidence,
    const std::optional<at::Tensor>& accept_cap, const std::optional<at::Tensor>& rule_start,
    const std::optional<at::Tensor>& rule_ids, const std::optional<at::Tensor>& rule_vals,
    const std::optional<at::Tensor>& mask_of, const std::optional<at::Tensor>& masks,
    const std::optional<at::Tensor>& top_logprobs);

// The op mtp_core::eagle_draft: MTP Eagle's forward 1 and chain alone, for rows whose target ran elsewhere
// (mtp_step_cpu.cpp).
at::Tensor eagle_draft_cpu(const c10::intrusive_ptr<DecodeWeights>& weights, const at::Tensor& ids,
                           const at::Tensor& hidden, const at::Tensor& query_start, const at::Tensor& start,
                           const at::Tensor& block_tables, const at::Tensor& num_drafts, at::TensorList caches,
                           const at::Tensor& rope_cos, const at::Tensor& rope_sin, int64_t mtp_layer);

// The op mtp_core::verify_greedy: mtp_step's strict verification alone, on given logits (mtp_step_cpu.cpp).
at::Tensor verify_greedy_cpu(const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& query_start,
                             const std::optional<at::Tensor>& accept_cap, const std::optional<at::Tensor>& rule_start,
                             const std::optional<at::Tensor>& rule_ids, const std::optional<at::Tensor>& rule_vals,
                             const std::optional<at::Tensor>& mask_of, const std::optional<at::Tensor>& masks);

// The op mtp_core::apply_logits_rules: the logits processing verify_greedy applies, alone (mtp_step_cpu.cpp).
at::Tensor apply_logits_rules_cpu(const at::Tensor& logits, const at::Tensor& rule_start, const at::Tensor& rule_ids,
                                  const at::Tensor& rule_vals, const std::optional<at::Tensor>& mask_of,
                                  const std::optional<at::Tensor>& masks);

}  // namespace mtp_core

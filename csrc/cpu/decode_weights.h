// The weights of a DeepseekV3ForCausalLM as the native CPU forward reads them, built once per model
// (mtp_core/model/native_weights.py writes the dictionaries; this file reads and checks them once).
//
// Every entry is named, never positional:
//   tensors["<mat>.data"], ["<mat>.scale"], ["<mat>.gscale"], ["<mat>.bias"]      (a matrix, see Mat)
//   ints["<mat>.layout" | ".fmt" | ".n" | ".k" | ".ld" | ".scale_r0"], floats["<mat>.gscale2"]
//   tensors["<vec>"] for norms, ints["dims.<name>"], floats["params.<name>"],
//   layer l's entries under "layers.<l>." (q_in, kv_a, q_b, uk.<h>, uv.<h>, o, mlp.gate/up/down,
//   router, experts.<e>.gate/up/down, shared.gate/up/down, eh_proj, DSA's idx_q/idx_k/idx_w; norms in_norm,
//   q_a_norm, kv_norm, post_norm, enorm, hnorm, head_norm, idx_norm, idx_bias; router_bias) and the model's
//   embed, final_norm, lm_head; optionally the drafts' head over a draft vocabulary: draft_head (its rows are the
//   lm_head rows of the ids tensors["draft_ids"], int64 [n], in that order).
// The tensors are kept alive here (views of the model's own parameters: no copy is made), so the forward
// takes only the batch.
#pragma once

#include <string>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include "decode_kernels.h"

namespace mtp_core {

struct NormW {
  const void* p = nullptr;
  int type = cpu::kF32;
  int64_t n = 0;
  bool defined() const { return p != nullptr; }
};

struct FFNW {
  cpu::Mat gate, up, down;
  int64_t inter = 0;
  bool defined() const { return down.defined(); }
};

struct LayerW {
  NormW in_norm, q_a_norm, kv_norm, post_norm, enorm, hnorm, head_norm;
  cpu::Mat q_in;     // q_a_proj (q_lora) or q_proj; pre-absorbed: per head [latent | rope] (no q_lora)
  cpu::Mat kv_a;     // kv_a_proj_with_mqa
  cpu::Mat q_b;      // q_b_proj (per head [nope | rope]) or pre-absorbed per head [latent | rope]
  std::vector<cpu::Mat> uk, uv;   // run-time absorption, per head: q_nope -> latent (kCols), latent -> v
  cpu::Mat o;        // o_proj, or pre-absorbed latent -> hidden
  cpu::Mat eh_proj, router;
  const float* router_bias = nullptr;
  FFNW mlp, shared;
  std::vector<FFNW> experts;
  // DeepSeek-V3.2's lightning indexer (dsa_cpu.cpp): wq_b (q latent -> heads x Di), wk (h -> Di), weights_proj
  // (h -> heads), k_norm's LayerNorm weight and bias
  cpu::Mat idx_q, idx_k, idx_w;
  NormW idx_norm, idx_bias;
  bool absorbed() const { return uk.empty(); }
  bool dsa() const { return idx_k.defined(); }
};

struct DecodeDims {
  int64_t H = 0, q_lora = 0, R = 0, P = 0, dn = 0, dv = 0, heads = 0, experts = 0, top_k = 0, groups = 1,
          topk_groups = 1, vocab = 0, num_main = 0;
  bool norm_topk = false, interleave = false;
  float eps = 1e-6f, scale = 1.f, routed_scale = 1.f;
  // DSA (0 when the model has none): indexer heads, head dim, keys each query attends to, k_norm's eps
  int64_t idx_heads = 0, idx_dim = 0, idx_topk = 0;
  float idx_eps = 1e-6f;
  // elements per token of a layer's cache row: [c_kv | k_pe] (+ the index key with DSA)
  int64_t cache_row() const { return R + P + (idx_topk ? idx_dim : 0); }
};

// One matrix `name` of the dictionaries (undefined when absent and not required), checked; adds the bytes it
// reads to *bytes.
cpu::Mat parse_mat(const c10::Dict<std::string, at::Tensor>& tensors, const c10::Dict<std::string, int64_t>& ints,
                   const c10::Dict<std::string, double>& floats, const std::string& name, bool required,
                   int64_t* bytes);

class DecodeWeights : public torch::CustomClassHolder {
 public:
  DecodeWeights(c10::Dict<std::string, at::Tensor> tensors, c10::Dict<std::string, int64_t> ints,
                c10::Dict<std::string, double> floats);

  const DecodeDims& dims() const { return d_; }
  const std::vector<LayerW>& layers() const { return layers_; }
  const NormW& embed() const { return embed_; }
  const NormW& final_norm() const { return final_norm_; }
  const cpu::Mat& lm_head() const { return lm_head_; }
  // the LM head MTP drafts are scored with: draft_head over the draft vocabulary when the model was given one,
  // else lm_head; draft_id maps its output column to a token id
  const cpu::Mat& draft_head() const { return draft_ids_ ? draft_head_ : lm_head_; }
  int64_t draft_vocab() const { return draft_head().n; }
  int64_t draft_id(int64_t column) const { return draft_ids_ ? draft_ids_[column] : column; }
  int64_t max_scratch() const { return max_scratch_; }      // floats of gemm scratch any matrix needs
  int64_t max_inter() const { return max_inter_; }          // widest FFN intermediate
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  std::string summary() const;

 private:
  cpu::Mat mat(const std::string& name, bool required = false);
  NormW norm(const std::string& name, int64_t n, bool required = false);
  FFNW ffn(const std::string& name);

  c10::Dict<std::string, at::Tensor> tensors_;
  c10::Dict<std::string, int64_t> ints_;
  c10::Dict<std::string, double> floats_;
  DecodeDims d_;
  std::vector<LayerW> layers_;
  NormW embed_, final_norm_;
  cpu::Mat lm_head_, draft_head_;
  const int64_t* draft_ids_ = nullptr;
  int64_t max_scratch_ = 0, max_inter_ = 0;
  int64_t bytes_ = 0, num_amx_ = 0, num_dot_ = 0;
  bool use_amx_ = false, use_dot_ = false;
};

}  // namespace mtp_core

// Reading and checking the named weight dictionaries of DecodeWeights (decode_weights.h), once per model.
#include "decode_weights.h"

#include "amx_gemm.h"
#include "dot_gemm.h"

#include <sstream>

#include <c10/util/Exception.h>

namespace mtp_core {
namespace {

int64_t get_int(const c10::Dict<std::string, int64_t>& d, const std::string& key) {
  TORCH_CHECK(d.contains(key), "DecodeWeights: missing int entry '", key, "'");
  return d.at(key);
}

int64_t get_int(const c10::Dict<std::string, int64_t>& d, const std::string& key, int64_t dflt) {
  return d.contains(key) ? d.at(key) : dflt;
}

const char* fmt_name(int f) {
  switch (f) {
    case cpu::kF32: return "f32";
    case cpu::kBF16: return "bf16";
    case cpu::kFP8: return "fp8";
    case cpu::kNVFP4: return "nvfp4";
    default: return "?";
  }
}

}  // namespace

NormW DecodeWeights::norm(const std::string& name, int64_t n, bool required) {
  if (!tensors_.contains(name)) {
    TORCH_CHECK(!required, "DecodeWeights: missing tensor '", name, "'");
    return {};
  }
  const at::Tensor t = tensors_.at(name);
  TORCH_CHECK(t.is_contiguous() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  (n < 0 || t.numel() == n),
              "DecodeWeights: '", name, "' must be a contiguous float32/bfloat16 vector of ", n, ", got ",
              t.scalar_type(), " ", t.sizes());
  bytes_ += t.numel() * t.element_size();
  return {t.data_ptr(), t.scalar_type() == at::kBFloat16 ? cpu::kBF16 : cpu::kF32, t.numel()};
}

cpu::Mat DecodeWeights::mat(const std::string& name, bool required) {
  cpu::Mat m = parse_mat(tensors_, ints_, floats_, name, required, &bytes_);
  m.amx = use_amx_ && m.defined() && cpu::amx_takes(m);
  num_amx_ += m.amx;
  m.dot = (use_dot_ || m.layout == cpu::kPairs) && m.defined() && !m.amx && cpu::dot_takes(m);
  TORCH_CHECK(!m.defined() || m.layout != cpu::kPairs || cpu::dot_usable(), "DecodeWeights: '", name,
              "' is packed in bf16 input pairs but this CPU has no AVX512-BF16");
  num_dot_ += m.dot;
  max_scratch_ = std::max(max_scratch_, cpu::gemm_scratch(m));
  return m;
}

cpu::Mat parse_mat(const c10::Dict<std::string, at::Tensor>& tensors_, const c10::Dict<std::string, int64_t>& ints_,
                   const c10::Dict<std::string, double>& floats_, const std::string& name, bool required,
                   int64_t* bytes) {
  cpu::Mat m;
  if (!tensors_.contains(name + ".data")) {
    TORCH_CHECK(!required, "DecodeWeights: missing matrix '", name, "'");
    return m;
  }
  const at::Tensor data = tensors_.at(name + ".data");
  m.layout = static_cast<int>(get_int(ints_, name + ".layout"));
  m.fmt = static_cast<int>(get_int(ints_, name + ".fmt"));
  m.n = get_int(ints_, name + ".n");
  m.k = get_int(ints_, name + ".k");
  const auto st = data.scalar_type();
  const bool dtype_ok = (m.fmt == cpu::kF32 && st == at::kFloat) || (m.fmt == cpu::kBF16 && st == at::kBFloat16) ||
                        (m.fmt == cpu::kFP8 && (st == at::kFloat8_e4m3fn || st == at::kByte)) ||
                        (m.fmt == cpu::kNVFP4 && st == at::kByte);
  TORCH_CHECK(dtype_ok, "DecodeWeights: '", name, "' is ", fmt_name(m.fmt), " but its data is ", st);
  TORCH_CHECK(m.n > 0 && m.k > 0, "DecodeWeights: '", name, "' has n=", m.n, " k=", m.k);
  m.data = data.data_ptr();
  const std::string where = "DecodeWeights: '" + name + "' ";
  if (m.layout == cpu::kPairs) {
    TORCH_CHECK(data.dim() == 3 && data.is_contiguous() && data.size(2) == 32 && data.size(1) * 2 >= m.k &&
                    data.size(0) * 16 >= m.n && m.fmt == cpu::kBF16,
                where, "must be bf16 input pairs [ceil(n/16), ceil(k/2), 32], got ", data.sizes());
    m.ld = data.size(1);   // input pairs per 16-row block
  } else if (m.layout == cpu::kPanel) {
    TORCH_CHECK(data.dim() == 3 && data.is_contiguous() && data.size(2) == 64 && data.size(1) == m.k &&
                    data.size(0) * 64 >= m.n && (m.fmt == cpu::kF32 || m.fmt == cpu::kBF16),
                where, "must be f32/bf16 panels [ceil(n/64), k, 64], got ", data.sizes());
  } else {
    TORCH_CHECK(m.layout == cpu::kRows || m.layout == cpu::kCols, where, "has an unknown layout ", m.layout);
    TORCH_CHECK(data.dim() == 2 && (data.stride(1) == 1 || data.size(1) == 1), where,
                "must be 2-D with unit column stride");
    m.ld = data.stride(0);
    const int64_t rows = m.layout == cpu::kRows ? m.n : m.k, cols = m.layout == cpu::kRows ? m.k : m.n;
    const int64_t cols_stored = m.fmt == cpu::kNVFP4 ? 2 * data.size(1) : data.size(1);
    TORCH_CHECK(data.size(0) >= rows && cols_stored >= cols, where, "data ", data.sizes(), " holds less than ",
                rows, " x ", cols);
    TORCH_CHECK(m.fmt != cpu::kNVFP4 || (m.layout == cpu::kRows && m.k % 16 == 0), where,
                "NVFP4 must be row-wise with k a multiple of 16");
  }
  if (m.fmt == cpu::kFP8) {
    TORCH_CHECK(tensors_.contains(name + ".scale"), where, "is FP8 but has no .scale");
    const at::Tensor s = tensors_.at(name + ".scale");
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 2 && (s.stride(1) == 1 || s.size(1) == 1), where,
                "scale must be float32 2-D, got ", s.scalar_type(), " ", s.sizes());
    m.scale = s.data_ptr<float>();
    m.scale_ld = s.stride(0);
    m.scale_r0 = get_int(ints_, name + ".scale_r0", 0);
    const int64_t rows = m.layout == cpu::kRows ? m.n : m.k, cols = m.layout == cpu::kRows ? m.k : m.n;
    TORCH_CHECK(m.scale_r0 >= 0 && (m.scale_r0 + rows - 1) / 128 < s.size(0) && (cols - 1) / 128 < s.size(1),
                where, "scale ", s.sizes(), " does not cover ", rows, " x ", cols, " from row ", m.scale_r0);
    *bytes += s.numel() * 4;
  }
  if (m.fmt == cpu::kNVFP4) {
    TORCH_CHECK(tensors_.contains(name + ".gscale"), where, "is NVFP4 but has no .gscale");
    const at::Tensor g = tensors_.at(name + ".gscale");
    TORCH_CHECK(g.element_size() == 1 && g.dim() == 2 && (g.stride(1) == 1 || g.size(1) == 1) && g.size(0) >= m.n &&
                    g.size(1) * 16 >= m.k,
                where, "gscale must be one byte per (output, 16 inputs), got ", g.sizes());
    m.gscale = static_cast<const uint8_t*>(g.data_ptr());
    m.gscale_ld = g.stride(0);
    TORCH_CHECK(floats_.contains(name + ".gscale2"), where, "is NVFP4 but has no .gscale2");
    m.gscale2 = static_cast<float>(floats_.at(name + ".gscale2"));
    *bytes += g.numel();
  }
  if (tensors_.contains(name + ".bias")) {
    const at::Tensor b = tensors_.at(name + ".bias");
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.is_contiguous() && b.numel() == m.n, where,
                "bias must be float32 [n]");
    m.bias = b.data_ptr<float>();
  }
  *bytes += data.numel() * data.element_size();
  return m;
}

FFNW DecodeWeights::ffn(const std::string& name) {
  FFNW f;
  f.down = mat(name + ".down");
  if (!f.down.defined()) return f;
  f.gate = mat(name + ".gate", true);
  f.up = mat(name + ".up", true);
  f.inter = f.down.k;
  const int64_t H = d_.H;
  TORCH_CHECK(f.down.n == H && f.gate.k == H && f.gate.n == f.inter && f.up.n == f.inter && f.up.k == H &&
                  f.gate.layout == f.up.layout,
              "DecodeWeights: '", name, "' gate/up/down shapes disagree");
  max_inter_ = std::max(max_inter_, f.inter);
  return f;
}

DecodeWeights::DecodeWeights(c10::Dict<std::string, at::Tensor> tensors, c10::Dict<std::string, int64_t> ints,
                             c10::Dict<std::string, double> floats)
    : tensors_(std::move(tensors)), ints_(std::move(ints)), floats_(std::move(floats)) {
  for (auto it = tensors_.begin(); it != tensors_.end(); ++it)
    TORCH_CHECK(it->value().device().is_cpu(), "DecodeWeights: '", it->key(), "' is not on the CPU");
  auto I = [&](const char* k) { return get_int(ints_, std::string("dims.") + k); };
  auto F = [&](const char* k) {
    const std::string key = std::string("params.") + k;
    TORCH_CHECK(floats_.contains(key), "DecodeWeights: missing float entry '", key, "'");
    return static_cast<float>(floats_.at(key));
  };
  d_.H = I("hidden"); d_.q_lora = I("q_lora"); d_.R = I("kv_lora"); d_.P = I("rope"); d_.dn = I("nope");
  d_.dv = I("v_head"); d_.heads = I("heads"); d_.experts = I("experts"); d_.top_k = I("top_k");
  d_.groups = I("groups"); d_.topk_groups = I("topk_groups"); d_.norm_topk = I("norm_topk") != 0;
  d_.interleave = I("interleave") != 0; d_.vocab = I("vocab"); d_.num_main = I("num_main");
  d_.eps = F("eps"); d_.scale = F("softmax_scale"); d_.routed_scale = F("routed_scale");
  d_.idx_heads = get_int(ints_, "dims.index_heads", 0);
  d_.idx_dim = get_int(ints_, "dims.index_dim", 0);
  d_.idx_topk = get_int(ints_, "dims.index_topk", 0);
  if (d_.idx_topk) {
    d_.idx_eps = F("index_eps");
    TORCH_CHECK(d_.idx_heads > 0 && d_.idx_dim >= d_.P && d_.idx_dim % 2 == 0 && d_.idx_dim <= 512 && d_.q_lora > 0,
                "DecodeWeights: DSA needs index heads > 0, an even index dim in [rope dim, 512] and q_lora");
  }
  use_amx_ = get_int(ints_, "dims.amx", 0) != 0;
  TORCH_CHECK(!use_amx_ || cpu::amx_usable(), "DecodeWeights: dims.amx set but this CPU / kernel has no AMX");
  use_dot_ = get_int(ints_, "dims.bf16_dot", 0) != 0;
  TORCH_CHECK(!use_dot_ || cpu::dot_usable(), "DecodeWeights: dims.bf16_dot set but this CPU has no AVX512-BF16");
  TORCH_CHECK(d_.P % 2 == 0 && d_.heads > 0 && d_.H > 0, "DecodeWeights: bad dims");
  TORCH_CHECK(d_.groups >= 1 && d_.groups <= 256 && d_.experts <= 1024 &&
                  (d_.experts == 0 || d_.experts % d_.groups == 0) && d_.top_k <= d_.experts,
              "DecodeWeights: MoE dims out of range (at most 1024 experts in 256 groups)");
  TORCH_CHECK(d_.R + d_.P <= 1280 && d_.P <= 512, "DecodeWeights: kv_lora_rank + rope dim must be <= 1280");
  {
    const at::Tensor e = tensors_.at("embed");
    TORCH_CHECK(e.dim() == 2 && e.size(1) == d_.H && e.size(0) >= d_.vocab, "DecodeWeights: embed must be [V, H]");
  }
  embed_ = norm("embed", -1, true);
  final_norm_ = norm("final_norm", d_.H, true);
  lm_head_ = mat("lm_head", true);
  TORCH_CHECK(lm_head_.n == d_.vocab && lm_head_.k == d_.H, "DecodeWeights: lm_head must be [vocab, hidden]");
  draft_head_ = mat("draft_head");
  if (draft_head_.defined()) {
    TORCH_CHECK(tensors_.contains("draft_ids"), "DecodeWeights: draft_head needs draft_ids");
    const at::Tensor ids = tensors_.at("draft_ids");
    TORCH_CHECK(draft_head_.k == d_.H && draft_head_.n >= 1 && ids.scalar_type() == at::kLong &&
                    ids.is_contiguous() && ids.dim() == 1 && ids.numel() == draft_head_.n,
                "DecodeWeights: draft_head must be [n, hidden] with draft_ids int64 [n]");
    draft_ids_ = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < draft_head_.n; ++i)
      TORCH_CHECK(draft_ids_[i] >= 0 && draft_ids_[i] < d_.vocab, "DecodeWeights: draft_ids[", i, "] = ",
                  draft_ids_[i], " is outside the vocabulary");
  }
  const int64_t L = get_int(ints_, "num_layers");
  const int64_t R = d_.R, P = d_.P, nh = d_.heads;
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    LayerW w;
    w.in_norm = norm(p + "in_norm", d_.H, true);
    w.kv_norm = norm(p + "kv_norm", R, true);
    w.post_norm = norm(p + "post_norm", d_.H, true);
    w.q_a_norm = norm(p + "q_a_norm", d_.q_lora);
    w.enorm = norm(p + "enorm", d_.H);
    w.hnorm = norm(p + "hnorm", d_.H);
    w.head_norm = norm(p + "head_norm", d_.H);
    w.q_in = mat(p + "q_in", true);
    w.kv_a = mat(p + "kv_a", true);
    w.q_b = mat(p + "q_b");
    w.o = mat(p + "o", true);
    w.eh_proj = mat(p + "eh_proj");
    const int64_t nuk = get_int(ints_, p + "num_uk", 0);
    TORCH_CHECK(nuk == 0 || nuk == nh, "DecodeWeights: ", p, "num_uk must be 0 or the head count");
    for (int64_t h = 0; h < nuk; ++h) {
      w.uk.push_back(mat(p + "uk." + std::to_string(h), true));
      w.uv.push_back(mat(p + "uv." + std::to_string(h), true));
      TORCH_CHECK(w.uk.back().layout == cpu::kCols && w.uk.back().n == R && w.uk.back().k == d_.dn &&
                      w.uv.back().n == d_.dv && w.uv.back().k == R,
                  "DecodeWeights: ", p, "uk/uv of head ", h, " have the wrong shapes");
    }
    const int64_t q_width = w.absorbed() ? nh * (R + P) : nh * (d_.dn + P);
    if (d_.q_lora) {
      TORCH_CHECK(w.q_a_norm.defined() && w.q_b.defined() && w.q_b.k == d_.q_lora && w.q_b.n == q_width,
                  "DecodeWeights: ", p, "q_b must map q_lora to ", q_width);
    }
    const int64_t q_in_n = d_.q_lora ? d_.q_lora : q_width;
    TORCH_CHECK(w.q_in.n == q_in_n && w.q_in.k == d_.H, "DecodeWeights: ", p, "q_in must be [", q_in_n, ", H]");
    TORCH_CHECK(w.kv_a.n == R + P && w.kv_a.k == d_.H, "DecodeWeights: ", p, "kv_a shape");
    TORCH_CHECK(w.o.n == d_.H && w.o.k == (w.absorbed() ? nh * R : nh * d_.dv), "DecodeWeights: ", p, "o shape");
    TORCH_CHECK(!w.eh_proj.defined() || (w.eh_proj.n == d_.H && w.eh_proj.k == 2 * d_.H && w.enorm.defined() &&
                                         w.hnorm.defined()),
                "DecodeWeights: ", p, "MTP prologue shapes");
    if (d_.idx_topk) {
      const int64_t Di = d_.idx_dim;
      w.idx_q = mat(p + "idx_q", true);
      w.idx_k = mat(p + "idx_k", true);
      w.idx_w = mat(p + "idx_w", true);
      w.idx_norm = norm(p + "idx_norm", Di, true);
      w.idx_bias = norm(p + "idx_bias", Di, true);
      TORCH_CHECK(w.idx_q.n == d_.idx_heads * Di && w.idx_q.k == d_.q_lora && w.idx_k.n == Di && w.idx_k.k == d_.H &&
                      w.idx_w.n == d_.idx_heads && w.idx_w.k == d_.H,
                  "DecodeWeights: ", p, "indexer shapes (wq_b [heads * Di, q_lora], wk [Di, H], weights_proj "
                  "[heads, H])");
    }
    w.mlp = ffn(p + "mlp");
    const int64_t E = get_int(ints_, p + "num_experts", 0);
    if (!w.mlp.defined()) {
      TORCH_CHECK(E == d_.experts && E > 0, "DecodeWeights: ", p, "has neither an MLP nor ", d_.experts, " experts");
      w.router = mat(p + "router", true);
      TORCH_CHECK(w.router.n == E && w.router.k == d_.H && w.router.fmt == cpu::kF32,
                  "DecodeWeights: ", p, "router must be float32 [E, H]");
      const at::Tensor rb = tensors_.at(p + "router_bias");
      TORCH_CHECK(rb.scalar_type() == at::kFloat && rb.is_contiguous() && rb.numel() == E,
                  "DecodeWeights: ", p, "router_bias must be float32 [E]");
      w.router_bias = rb.data_ptr<float>();
      for (int64_t e = 0; e < E; ++e) {
        w.experts.push_back(ffn(p + "experts." + std::to_string(e)));
        TORCH_CHECK(w.experts.back().defined(), "DecodeWeights: ", p, "expert ", e, " is missing");
      }
      w.shared = ffn(p + "shared");
    }
    layers_.push_back(std::move(w));
  }
  TORCH_CHECK(d_.num_main >= 1 && d_.num_main <= L, "DecodeWeights: num_main out of range");
}

std::string DecodeWeights::summary() const {
  std::ostringstream s;
  const LayerW& l0 = layers_.front();
  s << layers_.size() << " layers, " << (l0.q_in.layout == cpu::kPanel   ? "packed panels"
                                      : l0.q_in.layout == cpu::kPairs ? "packed bf16 input pairs"
                                                                      : "weights in place")
    << ", attention " << (l0.absorbed() ? "pre-absorbed" : "absorbed at run time") << ", "
    << fmt_name((l0.mlp.defined() ? l0.mlp.down : l0.q_in).fmt) << " weights, " << bytes_ / (1 << 20) << " MiB";
  if (d_.idx_topk)
    s << ", sparse attention (DSA: " << d_.idx_heads << " indexer heads of " << d_.idx_dim << ", top-" << d_.idx_topk
      << ")";
  if (draft_ids_) s << ", drafts over a vocabulary of " << draft_head_.n << " of " << d_.vocab << " ids";
  if (num_amx_) s << ", " << num_amx_ << " matrices on AMX tiles (bf16 activations)";
  if (num_dot_) s << ", " << num_dot_ << " matrices on AVX512-BF16 dot products (bf16 activations)";
  return s.str();
}

}  // namespace mtp_core

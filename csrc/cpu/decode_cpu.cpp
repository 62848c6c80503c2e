// The native CPU decode forward: mtp_core::decode_forward runs a whole stack of DeepSeek-V3 decoder
// layers (the main model's, or one MTP module with its enorm/hnorm/eh_proj prologue and shared-head
// norm) over a decode / verification batch in one call, and mtp_core::linear_bi is the batch-invariant
// projection used for the LM head. Torch reference: mtp_core/kernels/decode_ref.py (same contract).
//
// Per layer, T tokens from B rows (row b owns tokens [query_start[b], query_start[b+1]), positions
// consecutive, its keys live in the paged latent cache through block_tables[b]):
//   h  = rms_norm(x) ; a = h @ W_a^T (+ b_a)                      [q_c | c_kv | k_pe]
//   q  = rms_norm(q_c) @ W_q^T  (absorbed: per head [q_latent | q_rope]) ; rope(q_rope), rope(k_pe)
//   cache[slot] = [rms_norm(c_kv) | k_pe] ; o = softmax(q . cache * scale) @ c_kv (per head)
//   x += o @ W_o^T (absorbed output projection)
//   x += MLP(rms_norm(x))  or  MoE: sigmoid router + correction bias, group-limited top-k, each chosen
//        expert once over exactly its tokens (gather, two small GEMMs, weighted scatter), shared expert.
// Weights stay in the checkpoint's dtype (fp32 or bf16, converted in registers); activations and the
// residual stream are fp32 throughout. The kernels (decode_kernels_impl.h) are batch-invariant.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "decode_kernels.h"

namespace mtp_core {
namespace {

using cpu::KernelTable;

const KernelTable* pick_table() {
  const char* forced = std::getenv("MTP_CORE_CPU_ISA");
  const std::string want = forced ? forced : "auto";
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("fma");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if ((want == "auto" || want == "avx512") && avx512) return cpu::kernels_avx512();
  if ((want == "auto" || want == "avx512" || want == "avx2") && avx2) return cpu::kernels_avx2();
  return cpu::kernels_generic();
}

const KernelTable& K() {
  static const KernelTable* table = pick_table();
  return *table;
}

// ---- layout of the per-layer weight list (mtp_core/kernels/decode_ref.py: WEIGHT_SLOTS) -----------
enum Slot : int {
  kInNorm = 0, kWa, kBa, kQaNorm, kWq, kKvNorm, kWo, kPostNorm,
  kMlpW13, kMlpW2,                     // dense MLP: [2I, H] (gate | up), [H, I]
  kGate, kGateBias,                    // router [E, H] fp32, correction bias [E] fp32
  kExpW13, kExpW2,                     // routed experts [E, 2I, H], [E, H, I]
  kShW13, kShW2,                       // shared expert [2Is, H], [H, Is] (undefined: none)
  kENorm, kHNorm, kEhProj, kHeadNorm,  // MTP module prologue / epilogue (undefined in main layers)
  kNumSlots
};

// dims: see decode_ref.py DIMS
enum Dim : int { dH = 0, dQLora, dR, dP, dHeads, dExperts, dTopK, dGroups, dTopKGroups, dNormTopK, dInterleave,
                 dNumDims };
enum FParam : int { fEps = 0, fScale, fRoutedScale, fNumF };

int wtype_of(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat) return cpu::kF32;
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "decode_forward: weights must be float32 or bfloat16, got ",
              t.scalar_type());
  return cpu::kBF16;
}

// A weight as the kernels see it: norms / biases as plain vectors, projections packed in 64-row panels
// ([ceil(N/64), K, 64], see decode_kernels.h) — `k` is then K and `panels` the panel count.
struct W {
  const void* p = nullptr;
  int type = cpu::kF32;
  int64_t panels = 0, k = 0;
  bool defined() const { return p != nullptr; }
};

W weight(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return {};
  TORCH_CHECK(t.is_contiguous(), "decode_forward: weights must be contiguous");
  W w{t.data_ptr(), wtype_of(t), 0, 0};
  if (t.dim() == 3) {
    TORCH_CHECK(t.size(2) == 64, "decode_forward: packed weights must be [panels, K, 64]");
    w.panels = t.size(0);
    w.k = t.size(1);
  }
  return w;
}

// Threads: a parallel region (wake the pool, split, join) costs about what one of this model's projections
// computes, so work is split only where each thread gets plenty of it. Measured on the shipped model
// (2 cores): a region per projection / per MoE block made a batch-1 step 1.5x slower on 2 threads, and with
// regions only for batched work a batch-16 step was still ~10% slower; so these thresholds keep small
// models on one thread (2 threads = 1 thread) and split only large projections (a 4096 x 1024 projection
// of 64 tokens runs 2.25x faster on 2 threads). A thread team that lives through the whole forward, with
// barriers between ops, is what small models would need.
constexpr int64_t kParallelMinMacs = 1 << 22;     // T x N x K of a projection
constexpr int64_t kParallelMinPairs = 256;        // (token, expert) pairs of an MoE block
constexpr int64_t kParallelMinRows = 64;          // rows of an attention call

// Y[T, N] = X[T, K] @ W^T (+ bias) with W packed: split over panels across threads when there is work.
void gemm(const float* X, int64_t ldx, int64_t T, const void* w, int wtype, int64_t panels, int64_t Kd, int64_t N,
          float* Y, int64_t ldy, const float* bias = nullptr) {
  if (T == 0 || N == 0) return;
  TORCH_CHECK(panels * 64 >= N, "decode_forward: a packed weight has ", panels * 64, " rows, ", N, " needed");
  const int64_t work = T * N * Kd;
  const int nt = at::get_num_threads();
  if (nt > 1 && work >= kParallelMinMacs && panels >= 2) {
    at::parallel_for(0, panels, (panels + nt - 1) / nt, [&](int64_t p0, int64_t p1) {
      K().gemm(X, ldx, T, w, wtype, Kd, N, p0, p1, Y, ldy, bias);
    });
  } else {
    K().gemm(X, ldx, T, w, wtype, Kd, N, 0, panels, Y, ldy, bias);
  }
}

void gemm(const float* X, int64_t ldx, int64_t T, const W& w, int64_t N, float* Y, int64_t ldy,
          const float* bias = nullptr) {
  gemm(X, ldx, T, w.p, w.type, w.panels, w.k, N, Y, ldy, bias);
}

void norm(const float* x, int64_t ldx, int64_t rows, int64_t dim, const W& w, float eps, float* y, int64_t ldy) {
  K().rms_norm(x, ldx, rows, dim, w.p, w.type, eps, y, ldy);
}

// Rotary embedding of `dim` values in place, cos/sin [dim/2]; output [x1*c - x2*s | x2*c + x1*s].
void rope_inplace(float* x, int64_t dim, const float* c, const float* s, bool interleave, float* tmp) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = interleave ? x[2 * i] : x[i];
    const float x2 = interleave ? x[2 * i + 1] : x[i + half];
    tmp[i] = x1 * c[i] - x2 * s[i];
    tmp[i + half] = x2 * c[i] + x1 * s[i];
  }
  std::memcpy(x, tmp, sizeof(float) * dim);
}

struct Batch {
  int64_t T = 0, B = 0, max_blocks = 0, max_ctx = 0;
  const int64_t* positions = nullptr;
  const int64_t* slots = nullptr;
  const int32_t* qstart = nullptr;
  const int32_t* tables = nullptr;
  const int32_t* ctx = nullptr;
  const float* cos = nullptr;
  const float* sin = nullptr;
};

struct Dims {
  int64_t H, q_lora, R, P, heads, experts, top_k, groups, topk_groups;
  bool norm_topk, interleave;
  float eps, scale, routed_scale;
};

void attention_block(const Dims& d, const Batch& b, const std::vector<at::Tensor>& w, const at::Tensor& cache,
                     float* x) {
  const int64_t T = b.T, H = d.H, R = d.R, P = d.P, nh = d.heads, D = R + P;
  const W in_norm = weight(w[kInNorm]), wa = weight(w[kWa]), qa_norm = weight(w[kQaNorm]), wq = weight(w[kWq]);
  const W kv_norm = weight(w[kKvNorm]), wo = weight(w[kWo]);
  const float* ba = w[kBa].defined() && w[kBa].numel() ? w[kBa].data_ptr<float>() : nullptr;
  const int64_t na = (d.q_lora ? d.q_lora : nh * D) + R + P;   // [q_c | c_kv | k_pe] (q itself without q_lora)
  const int64_t q_in = d.q_lora ? d.q_lora : 0;
  std::vector<float> h(T * H), a(T * na), q(T * nh * D), o(T * nh * R), tmp(std::max<int64_t>(D, 2 * P));
  norm(x, H, T, H, in_norm, d.eps, h.data(), H);
  gemm(h.data(), H, T, wa, na, a.data(), na, ba);
  const int64_t kv_off = na - (R + P);
  if (d.q_lora) {
    std::vector<float> qc(T * q_in);
    norm(a.data(), na, T, q_in, qa_norm, d.eps, qc.data(), q_in);
    gemm(qc.data(), q_in, T, wq, nh * D, q.data(), nh * D);
  } else {
    for (int64_t t = 0; t < T; ++t) std::memcpy(&q[t * nh * D], &a[t * na], sizeof(float) * nh * D);
  }
  // the latent KV of every token, into its cache slot
  const int64_t half = P / 2;
  std::vector<float> kv(R + P);
  const bool bf16_cache = cache.scalar_type() == at::kBFloat16;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = b.cos + b.positions[t] * half;
    const float* s = b.sin + b.positions[t] * half;
    norm(&a[t * na + kv_off], na, 1, R, kv_norm, d.eps, kv.data(), R);
    std::memcpy(&kv[R], &a[t * na + kv_off + R], sizeof(float) * P);
    rope_inplace(&kv[R], P, c, s, d.interleave, tmp.data());
    if (bf16_cache) {
      c10::BFloat16* dst = cache.data_ptr<c10::BFloat16>() + b.slots[t] * D;
      for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<c10::BFloat16>(kv[i]);
    } else {
      std::memcpy(cache.data_ptr<float>() + b.slots[t] * D, kv.data(), sizeof(float) * D);
    }
    for (int64_t hh = 0; hh < nh; ++hh) rope_inplace(&q[(t * nh + hh) * D + R], P, c, s, d.interleave, tmp.data());
  }
  const int ctype = bf16_cache ? cpu::kBF16 : cpu::kF32;
  const int64_t page = cache.size(1);
  auto run_rows = [&](int64_t b0, int64_t b1) {
    std::vector<float> scratch(nh * (std::max<int64_t>(b.max_ctx, 1) + 1));
    K().attention(q.data(), T, nh, R, P, cache.data_ptr(), ctype, page, b.tables, b.max_blocks, b.qstart, b.ctx, b.B,
                  b0, b1, d.scale, o.data(), scratch.data());
  };
  if (at::get_num_threads() > 1 && b.B >= kParallelMinRows) {
    at::parallel_for(0, b.B, 1, run_rows);
  } else {
    run_rows(0, b.B);
  }
  std::vector<float>& out = h;   // reuse: [T, H]
  gemm(o.data(), nh * R, T, wo, H, out.data(), H);
  for (int64_t i = 0; i < T * H; ++i) x[i] += out[i];
}

// One SwiGLU MLP over n gathered rows: y = (silu(X W1^T) * (X W3^T)) W2^T, W13 = [W1 | W3] as [2I, H].
// w13 packed [ceil(2I/64), H, 64], w2 packed [ceil(H/64), I, 64]; single-threaded (experts run in parallel).
void mlp_rows(const float* X, int64_t n, int64_t H, const void* w13, const void* w2, int wtype, int64_t inter,
              float* Y) {
  std::vector<float> g(n * 2 * inter), act(n * inter);
  K().gemm(X, H, n, w13, wtype, H, 2 * inter, 0, (2 * inter + 63) / 64, g.data(), 2 * inter, nullptr);
  K().silu_mul(g.data(), 2 * inter, n, inter, act.data(), inter);
  K().gemm(act.data(), inter, n, w2, wtype, inter, H, 0, (H + 63) / 64, Y, H, nullptr);
}

void route(const Dims& d, const float* h, int64_t T, const std::vector<at::Tensor>& w, std::vector<int64_t>& idx,
           std::vector<float>& wts) {
  const int64_t E = d.experts, k = d.top_k;
  std::vector<float> logits(T * E), scores(T * E);
  const W gate = weight(w[kGate]);
  K().gemm(h, d.H, T, gate.p, gate.type, d.H, E, 0, gate.panels, logits.data(), E, nullptr);
  K().sigmoid(logits.data(), T * E, scores.data());
  const float* bias = w[kGateBias].data_ptr<float>();
  const int64_t G = d.groups, per = E / std::max<int64_t>(G, 1);
  std::vector<float> choice(E), gscore(G);
  std::vector<char> keep(G);
  idx.assign(T * k, 0);
  wts.assign(T * k, 0.f);
  for (int64_t t = 0; t < T; ++t) {
    const float* sc = &scores[t * E];
    for (int64_t e = 0; e < E; ++e) choice[e] = sc[e] + bias[e];
    if (G > 1) {
      for (int64_t g = 0; g < G; ++g) {   // group score: the sum of its two best (biased) scores
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) {
          if (choice[e] > b1) { b2 = b1; b1 = choice[e]; } else if (choice[e] > b2) { b2 = choice[e]; }
        }
        gscore[g] = per >= 2 ? b1 + b2 : b1;
        keep[g] = 0;
      }
      for (int64_t n = 0; n < d.topk_groups; ++n) {   // keep the topk_group best groups (first on ties)
        int64_t best = -1;
        for (int64_t g = 0; g < G; ++g)
          if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
        keep[best] = 1;
      }
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per]) choice[e] = -INFINITY;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) {   // top-k experts, best first (lower id on ties)
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= idx[t * k + i] == e;
        if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
      }
      idx[t * k + j] = best;
      wts[t * k + j] = sc[best];
      sum += sc[best];
    }
    for (int64_t j = 0; j < k; ++j) {
      if (d.norm_topk) wts[t * k + j] = wts[t * k + j] / (sum + 1e-20f);
      wts[t * k + j] *= d.routed_scale;
    }
  }
}

void ffn_block(const Dims& d, int64_t T, const std::vector<at::Tensor>& w, float* x) {
  const int64_t H = d.H;
  std::vector<float> h(T * H), out(T * H, 0.f);
  norm(x, H, T, H, weight(w[kPostNorm]), d.eps, h.data(), H);
  if (w[kMlpW13].defined() && w[kMlpW13].numel()) {   // dense MLP
    const W w13 = weight(w[kMlpW13]), w2 = weight(w[kMlpW2]);
    const int64_t inter = w2.k;
    std::vector<float> g(T * 2 * inter), act(T * inter);
    gemm(h.data(), H, T, w13, 2 * inter, g.data(), 2 * inter);
    K().silu_mul(g.data(), 2 * inter, T, inter, act.data(), inter);
    gemm(act.data(), inter, T, w2, H, out.data(), H);
    for (int64_t i = 0; i < T * H; ++i) x[i] += out[i];
    return;
  }
  std::vector<int64_t> idx;
  std::vector<float> wts;
  route(d, h.data(), T, w, idx, wts);
  const int64_t E = d.experts, k = d.top_k;
  const at::Tensor& e13 = w[kExpW13];
  const at::Tensor& e2 = w[kExpW2];
  const int wtype = wtype_of(e13);
  TORCH_CHECK(e13.dim() == 4 && e2.dim() == 4 && e13.is_contiguous() && e2.is_contiguous(),
              "decode_forward: stacked experts must be packed [E, panels, K, 64]");
  const int64_t inter = e2.size(2), esize = wtype == cpu::kBF16 ? 2 : 4;
  const int64_t e13_stride = e13.size(1) * e13.size(2) * 64, e2_stride = e2.size(1) * e2.size(2) * 64;
  const char* e13p = static_cast<const char*>(e13.data_ptr());
  const char* e2p = static_cast<const char*>(e2.data_ptr());
  // tokens per chosen expert (each distinct expert once, over exactly its tokens)
  std::vector<std::vector<int64_t>> pairs(E);   // flat (token * k + slot) ids
  for (int64_t p = 0; p < T * k; ++p) pairs[idx[p]].push_back(p);
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (!pairs[e].empty()) active.push_back(e);
  const bool shared = w[kShW13].defined() && w[kShW13].numel();
  std::vector<float> ybuf(T * k * H), shared_out(shared ? T * H : 0);
  const int64_t n_tasks = static_cast<int64_t>(active.size()) + (shared ? 1 : 0);
  auto run = [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (i == static_cast<int64_t>(active.size())) {   // the shared expert, over every token
        const W s13 = weight(w[kShW13]), s2 = weight(w[kShW2]);
        mlp_rows(h.data(), T, H, s13.p, s2.p, s13.type, s2.k, shared_out.data());
        continue;
      }
      const int64_t e = active[i];
      const std::vector<int64_t>& ps = pairs[e];
      const int64_t n = static_cast<int64_t>(ps.size());
      std::vector<float> X(n * H), Y(n * H);
      for (int64_t r = 0; r < n; ++r) std::memcpy(&X[r * H], &h[(ps[r] / k) * H], sizeof(float) * H);
      mlp_rows(X.data(), n, H, e13p + e * e13_stride * esize, e2p + e * e2_stride * esize, wtype, inter, Y.data());
      for (int64_t r = 0; r < n; ++r) std::memcpy(&ybuf[ps[r] * H], &Y[r * H], sizeof(float) * H);
    }
  };
  if (at::get_num_threads() > 1 && n_tasks > 1 && T * k >= kParallelMinPairs) {
    at::parallel_for(0, n_tasks, 1, run);
  } else {
    run(0, n_tasks);
  }
  // combine per token in ascending expert order (the reference's order), then the shared expert
  std::vector<int64_t> order(k);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) order[j] = j;
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return idx[t * k + a] < idx[t * k + b]; });
    float* o = &out[t * H];
    for (int64_t j : order) {
      const float wj = wts[t * k + j];
      const float* y = &ybuf[(t * k + j) * H];
      for (int64_t i = 0; i < H; ++i) o[i] += y[i] * wj;
    }
    if (shared) {
      for (int64_t i = 0; i < H; ++i) o[i] += shared_out[t * H + i];
    }
    for (int64_t i = 0; i < H; ++i) x[t * H + i] += o[i];
  }
}

at::Tensor decode_forward_cpu(const at::Tensor& ids, const at::Tensor& embed, const std::optional<at::Tensor>& mtp_hidden,
                              at::TensorList weights, at::IntArrayRef dims, at::ArrayRef<double> fparams,
                              at::TensorList caches, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                              const at::Tensor& positions, const at::Tensor& slot_mapping,
                              const at::Tensor& query_start, const at::Tensor& block_tables,
                              const at::Tensor& seqlens, const std::optional<at::Tensor>& final_norm) {
  TORCH_CHECK(dims.size() == dNumDims && fparams.size() == fNumF, "decode_forward: dims/fparams have the wrong length");
  const int64_t L = static_cast<int64_t>(caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * kNumSlots, "decode_forward: expected ", L * kNumSlots,
              " weights for ", L, " layers, got ", weights.size());
  const Dims d{dims[dH], dims[dQLora], dims[dR], dims[dP], dims[dHeads], dims[dExperts], dims[dTopK], dims[dGroups],
               dims[dTopKGroups], dims[dNormTopK] != 0, dims[dInterleave] != 0, static_cast<float>(fparams[fEps]),
               static_cast<float>(fparams[fScale]), static_cast<float>(fparams[fRoutedScale])};
  const int64_t T = ids.numel(), H = d.H;
  TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  slot_mapping.scalar_type() == at::kLong && positions.numel() == T && slot_mapping.numel() == T,
              "decode_forward: ids, positions and slot_mapping must be int64 [T]");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && block_tables.scalar_type() == at::kInt &&
                  seqlens.scalar_type() == at::kInt && block_tables.dim() == 2,
              "decode_forward: query_start, block_tables and seqlens must be int32");
  TORCH_CHECK(embed.dim() == 2 && embed.size(1) == H && embed.is_contiguous(), "decode_forward: embed must be [V, H]");
  TORCH_CHECK(rope_cos.scalar_type() == at::kFloat && rope_cos.is_contiguous() && rope_sin.is_contiguous(),
              "decode_forward: rope tables must be contiguous float32");
  Batch b;
  b.T = T;
  b.B = block_tables.size(0);
  b.max_blocks = block_tables.size(1);
  TORCH_CHECK(query_start.numel() == b.B + 1 && seqlens.numel() == b.B,
              "decode_forward: query_start must be [B+1] and seqlens [B]");
  const at::Tensor qs = query_start.contiguous(), bt = block_tables.contiguous(), sl = seqlens.contiguous();
  const at::Tensor pos = positions.contiguous(), slots = slot_mapping.contiguous(), idc = ids.contiguous();
  b.positions = pos.data_ptr<int64_t>();
  b.slots = slots.data_ptr<int64_t>();
  b.qstart = qs.data_ptr<int32_t>();
  b.tables = bt.data_ptr<int32_t>();
  b.ctx = sl.data_ptr<int32_t>();
  b.cos = rope_cos.data_ptr<float>();
  b.sin = rope_sin.data_ptr<float>();
  TORCH_CHECK(b.qstart[0] == 0 && b.qstart[b.B] == T, "decode_forward: query_start must run from 0 to T");
  for (int64_t r = 0; r < b.B; ++r) {
    const int64_t nq = b.qstart[r + 1] - b.qstart[r];
    TORCH_CHECK(nq >= 0 && b.ctx[r] >= nq && b.ctx[r] <= b.max_blocks * (caches.empty() ? 1 : caches[0].size(1)),
                "decode_forward: row ", r, " has ", nq, " queries and context length ", b.ctx[r]);
    b.max_ctx = std::max<int64_t>(b.max_ctx, b.ctx[r]);
  }
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(b.positions[t] >= 0 && b.positions[t] < rope_cos.size(0), "decode_forward: position ",
                b.positions[t], " outside the rope table");
  }
  // every layer's cache has the same layout (one pool, one block table): check the slots and pages once
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.dim() == 3 && c.size(2) == d.R + d.P && c.is_contiguous() &&
                    (c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16) &&
                    c.sizes() == caches[0].sizes() && c.scalar_type() == caches[0].scalar_type(),
                "decode_forward: caches must be contiguous [blocks, page, R+P] float32/bfloat16, all alike");
  }
  if (!caches.empty()) {
    const at::Tensor& c = caches[0];
    const int64_t capacity = c.size(0) * c.size(1);
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(b.slots[t] >= 0 && b.slots[t] < capacity, "decode_forward: slot ", b.slots[t], " outside the cache");
    for (int64_t r = 0; r < b.B; ++r)
      for (int64_t i = 0; i < (b.ctx[r] + c.size(1) - 1) / c.size(1); ++i) {
        const int32_t blk = b.tables[r * b.max_blocks + i];
        TORCH_CHECK(blk >= 0 && blk < c.size(0), "decode_forward: block_tables[", r, ", ", i, "] = ", blk,
                    " is not a cache block");
      }
  }
  // x: the embeddings (fp32 residual stream)
  std::vector<float> x(T * H);
  const int64_t* tok = idc.data_ptr<int64_t>();
  const W emb = weight(embed);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(tok[t] >= 0 && tok[t] < embed.size(0), "decode_forward: token id ", tok[t], " outside the vocabulary");
    if (emb.type == cpu::kBF16) {
      const c10::BFloat16* src = embed.data_ptr<c10::BFloat16>() + tok[t] * H;
      for (int64_t i = 0; i < H; ++i) x[t * H + i] = static_cast<float>(src[i]);
    } else {
      std::memcpy(&x[t * H], embed.data_ptr<float>() + tok[t] * H, sizeof(float) * H);
    }
  }
  std::vector<at::Tensor> lw(kNumSlots);
  for (int64_t l = 0; l < L; ++l) {
    for (int s = 0; s < kNumSlots; ++s) lw[s] = weights[l * kNumSlots + s];
    if (lw[kEhProj].defined() && lw[kEhProj].numel()) {   // MTP prologue: eh_proj([enorm(emb) | hnorm(h)])
      TORCH_CHECK(mtp_hidden.has_value() && mtp_hidden->numel() == T * H, "decode_forward: an MTP layer needs hidden [T, H]");
      const at::Tensor hid = mtp_hidden->to(at::kFloat).contiguous();
      std::vector<float> cat(T * 2 * H);
      norm(x.data(), H, T, H, weight(lw[kENorm]), d.eps, cat.data(), 2 * H);
      norm(hid.data_ptr<float>(), H, T, H, weight(lw[kHNorm]), d.eps, cat.data() + H, 2 * H);
      gemm(cat.data(), 2 * H, T, weight(lw[kEhProj]), H, x.data(), H);
    }
    attention_block(d, b, lw, caches[l], x.data());
    ffn_block(d, T, lw, x.data());
    if (lw[kHeadNorm].defined() && lw[kHeadNorm].numel()) {
      std::vector<float> y(T * H);
      norm(x.data(), H, T, H, weight(lw[kHeadNorm]), d.eps, y.data(), H);
      x.swap(y);
    }
  }
  at::Tensor out = at::empty({T, H}, embed.options().dtype(at::kFloat));
  if (final_norm.has_value() && final_norm->defined()) {
    norm(x.data(), H, T, H, weight(*final_norm), d.eps, out.data_ptr<float>(), H);
  } else {
    std::memcpy(out.data_ptr<float>(), x.data(), sizeof(float) * T * H);
  }
  return embed.scalar_type() == at::kFloat ? out : out.to(embed.scalar_type());
}

// y [T, N] fp32 = x [T, K] @ W^T, W [N, K] packed [ceil(N/64), K, 64], with the batch-invariant kernel.
at::Tensor linear_bi_cpu(const at::Tensor& x, const at::Tensor& w_packed, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && w_packed.dim() == 3 && w_packed.size(2) == 64 && x.size(1) == w_packed.size(1) &&
                  n >= 0 && n <= w_packed.size(0) * 64,
              "linear_bi: x [T, K] and a packed weight [ceil(N/64), K, 64] with N = n expected");
  const at::Tensor xf = x.to(at::kFloat).contiguous(), wc = w_packed.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  gemm(xf.data_ptr<float>(), x.size(1), x.size(0), wc.data_ptr(), wtype_of(wc), wc.size(0), wc.size(1), n,
       y.data_ptr<float>(), n);
  return y;
}

}  // namespace
}  // namespace mtp_core

extern "C" const char* mtp_core_cpu_isa() { return mtp_core::K().isa; }

TORCH_LIBRARY_IMPL(mtp_core, CPU, m) {
  m.impl("decode_forward", &mtp_core::decode_forward_cpu);
  m.impl("linear_bi", &mtp_core::linear_bi_cpu);
}

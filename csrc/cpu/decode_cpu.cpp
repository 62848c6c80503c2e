// The native CPU decode forward: mtp_core::decode_forward runs a stack of DeepSeek-V3 decoder layers (the
// main model's, or one MTP module with its enorm/hnorm/eh_proj prologue and shared-head norm) over a
// decode / verification / prefill batch in one call, with the weights of a DecodeWeights built once per
// model; mtp_core::decode_logits is the batch-invariant LM head. Torch reference: the model's own torch
// path (mtp_core/model/*.py) and mtp_core/kernels/native_ref.py.
//
// Per layer, T tokens from B rows (row b owns tokens [query_start[b], query_start[b+1]), positions
// consecutive, its keys live in the paged latent cache through block_tables[b]):
//   h  = rms_norm(x);  q = q_in(h) (q_lora: q_b(rms_norm(q_in(h))));  kv = kv_a(h)      per head [nope | rope]
//   cache[slot] = [rms_norm(c_kv) | rope(k_pe)];  q_rope = rope(q_rope)
//   absorbed at run time: q_latent_h = W_UK_h^T q_nope_h (kv_b_proj's rows read in place), or pre-absorbed
//   o_h = softmax(q_h . cache * scale) @ c_kv;   v_h = W_UV_h o_h (run time) ;  x += o_proj(v)
//   x += MLP(rms_norm(x))  or  MoE: sigmoid router + correction bias, group-limited top-k, each chosen
//        expert over exactly its tokens, combined in ascending expert order, then the shared expert.
// Weights are read in their stored format (fp32, bf16, FP8 block, NVFP4), converted in registers;
// activations and the residual stream are fp32. The kernels (decode_kernels_impl.h) are batch-invariant,
// and every output is computed whole by one thread, so results do not depend on the thread count either.
//
// Threads: one team per call (thread_team.h) that lives through all layers; each op splits its outputs
// (projection rows, (head, latent) tiles, (token, head) attention items, expert rows) across the members,
// and the members meet at a barrier between ops.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include "amx_gemm.h"
#include "dot_gemm.h"
#include "decode_forward.h"
#include "decode_kernels.h"
#include "decode_weights.h"
#include "dsa_cpu.h"
#include "thread_team.h"

namespace mtp_core {
namespace {

using cpu::KernelTable;
using cpu::Mat;
using cpu::Rows;

// The table for the instruction set Python asks for (mtp_core_set_cpu_isa: runtime.cpu_isa, the config's or its
// environment override, mtp_core/config/runtime.py), capped by what the CPU has.
const KernelTable* pick_table(const std::string& want) {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("fma");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  // amx / avx512 / avx512f differ in which matrices take the AMX tiles or the bf16 dot products (decided
  // in Python, dims.amx / dims.bf16_dot); the table itself is the same AVX-512 one
  const bool any512 = want == "auto" || want == "amx" || want == "avx512" || want == "avx512f";
  if (any512 && avx512) return cpu::kernels_avx512();
  if ((any512 || want == "avx2") && avx2) return cpu::kernels_avx2();
  return cpu::kernels_generic();
}

// Set by Python when the native ops load and when an engine is configured; "auto" until then. Every call reads
// it once per op: a table swapped between calls is whole either way.
std::atomic<const KernelTable*> g_table{nullptr};

const KernelTable& K() {
  const KernelTable* table = g_table.load(std::memory_order_acquire);
  if (table == nullptr) {
    table = pick_table("auto");
    const KernelTable* none = nullptr;
    if (!g_table.compare_exchange_strong(none, table, std::memory_order_acq_rel)) table = none;
  }
  return *table;
}

// Every projection goes through here: the AMX tile GEMM or the bf16 dot-product GEMM for the matrices marked for
// them, the table's (fp32 activations) otherwise.
inline void run_gemm(const Mat& M, const Rows& X, int64_t n0, int64_t n1, float* Y, int64_t ldy, float* scratch) {
  if (M.amx) {
    cpu::amx_gemm(M, X, n0, n1, Y, ldy);
  } else if (M.dot) {
    cpu::dot_gemm(M, X, n0, n1, Y, ldy);
  } else {
    K().gemm(M, X, n0, n1, Y, ldy, scratch);
  }
}

// Per thread: activations rounded for the bf16 dot products, reused within one op (ffn_up).
thread_local cpu::DotActs tl_acts;

template <typename T>
std::unique_ptr<T[]> buf(int64_t n) {
  return std::unique_ptr<T[]>(new T[static_cast<size_t>(std::max<int64_t>(n, 1))]);
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

// A slice of the call's arena (below).
template <typename T>
struct Buf {
  T* p = nullptr;
  T* get() const { return p; }
  T& operator[](int64_t i) const { return p[i]; }
};

// The work buffers of a forward call, one block per calling thread, kept from call to call up to kArenaKeep
// bytes: memory fresh from the kernel costs a page fault and a zeroing per 4 KiB (6% of a 512-token prefill
// at Moonlight's widths, measured), a decode step's buffers are a few hundred KiB, and a call that needs more
// than the cap (a long prefill chunk) frees its block when it ends.
class Arena {
 public:
  static constexpr size_t kArenaKeep = size_t(192) << 20;
  // Hands out consecutive 64-byte aligned slices of `counts` elements (the sizes of the call, in order).
  void reserve(size_t bytes) {
    if (bytes > cap_) {
      std::free(base_);
      base_ = static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
      TORCH_CHECK(base_ != nullptr, "decode_forward: out of memory for ", bytes, " bytes of work buffers");
      cap_ = (bytes + 63) / 64 * 64;
    }
    used_ = 0;
  }
  template <typename T>
  static size_t bytes(int64_t n) { return (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T) + 63) / 64 * 64; }
  template <typename T>
  Buf<T> take(int64_t n) {
    Buf<T> b{reinterpret_cast<T*>(base_ + used_)};
    used_ += bytes<T>(n);
    return b;
  }
  void release_if_large() {
    if (cap_ > kArenaKeep) {
      std::free(base_);
      base_ = nullptr;
      cap_ = 0;
    }
  }
  ~Arena() { std::free(base_); }

 private:
  char* base_ = nullptr;
  size_t cap_ = 0, used_ = 0;
};
thread_local Arena tl_arena;

// Work buffers of one call, shared by the team (each member writes only its own share of them).
struct Work {
  int64_t T;
  Buf<float> x, h, aq, akv, qc, q, qlat, olat, v, out;
  Buf<float> g, u, act;                 // dense MLP / routed experts [pairs, I], shared [T, Is]
  Buf<float> gs, us, acts;
  Buf<float> logits, wts;               // router
  Buf<int32_t> idx;
  Buf<float> iq, ik, iw;                // DSA: indexer queries [T, heads * Di], keys [T, Di], head weights [T, heads]
  Buf<float> isc;                       // DSA, few tokens: their indexer scores [T, max_ctx] (else null)
  Buf<int32_t> sel, nsel;               // DSA: each token's chosen cache slots [T, sel_ld] and their count [T]
  int64_t sel_ld = 0;
  // routing result: experts in ascending id with their tokens (pair rows into act) and weights
  std::vector<int32_t> active, first, tokens;         // tokens of active[i] at tokens[first[i]..first[i+1])
  std::vector<float> weight;                          // parallel to tokens
  int64_t q_in_ld = 0;
};

struct Forward {
  const DecodeWeights& W;
  const DecodeDims& d;
  const Batch& b;
  Work& w;
  int64_t scratch_floats;
  std::vector<Buf<float>>& dsa_scratch;   // per member: the scores of one query and selection's copy of them

  // ---- helpers ------------------------------------------------------------------------------------
  void gemm(Team& tm, const Mat& M, const Rows& X, float* Y, int64_t ldy, float* scratch) const {
    const auto [n0, n1] = tm.split(M.n, cpu::gemm_align(M));
    run_gemm(M, X, n0, n1, Y, ldy, scratch);
  }
  void norm_rows(Team& tm, const float* x, int64_t ldx, int64_t dim, const NormW& nw, float* y, int64_t ldy) const {
    const auto [t0, t1] = tm.split(w.T);
    if (t1 > t0) K().rms_norm(x + t0 * ldx, ldx, t1 - t0, dim, nw.p, nw.type, d.eps, y + t0 * ldy, ldy);
  }

  // ---- attention ----------------------------------------------------------------------------------
  // kv_only: the latent KV (and DSA's index keys) of every token into the cache, and nothing else (no query, no
  // attention): for tokens whose outputs nobody reads (Outputs)
  void attention(Team& tm, const LayerW& L, const at::Tensor& cache, float* scratch, float* att_scratch,
                 bool kv_only = false) {
    const int64_t T = w.T, H = d.H, R = d.R, P = d.P, nh = d.heads, D = R + P;
    const bool absorbed = L.absorbed();
    const int64_t dq = absorbed ? D : d.dn + P;               // per-head width of q
    norm_rows(tm, w.x.get(), H, H, L.in_norm, w.h.get(), H);
    tm.sync();
    const Rows hx{w.h.get(), H, nullptr, T};
    const bool dsa = L.dsa();
    const int64_t nih = d.idx_heads, Di = d.idx_dim, ld = cache.size(2);   // cache row: [c_kv | k_pe (| index key)]
    if (!kv_only) gemm(tm, L.q_in, hx, w.aq.get(), w.q_in_ld, scratch);
    gemm(tm, L.kv_a, hx, w.akv.get(), R + P, scratch);
    if (dsa) {
      gemm(tm, L.idx_k, hx, w.ik.get(), Di, scratch);
      if (!kv_only) gemm(tm, L.idx_w, hx, w.iw.get(), nih, scratch);
    }
    tm.sync();
    const float* kv_src = w.akv.get();
    const int64_t kv_ld = R + P;
    float* q = w.aq.get();
    int64_t q_ld = w.q_in_ld;
    if (d.q_lora && !kv_only) {
      norm_rows(tm, w.aq.get(), w.q_in_ld, d.q_lora, L.q_a_norm, w.qc.get(), d.q_lora);
      tm.sync();
      gemm(tm, L.q_b, Rows{w.qc.get(), d.q_lora, nullptr, T}, w.q.get(), nh * dq, scratch);
      if (dsa) gemm(tm, L.idx_q, Rows{w.qc.get(), d.q_lora, nullptr, T}, w.iq.get(), nih * Di, scratch);
      tm.sync();
      q = w.q.get();
      q_ld = nh * dq;
    }
    // the latent KV of every token into its cache slot; the rope part of q rotated
    float* qlat = absorbed ? q : w.qlat.get();
    const int64_t qlat_ld = absorbed ? q_ld : nh * D;
    {
      const auto [t0, t1] = tm.split(T);
      const auto cache_type = cache.scalar_type();
      float tmp[2 * 512 + 64], kv[1280 + 512];
      for (int64_t t = t0; t < t1; ++t) {
        const float* c = b.cos + b.positions[t] * (P / 2);
        const float* s = b.sin + b.positions[t] * (P / 2);
        K().rms_norm(kv_src + t * kv_ld, kv_ld, 1, R, L.kv_norm.p, L.kv_norm.type, d.eps, kv, R);
        std::memcpy(kv + R, kv_src + t * kv_ld + R, sizeof(float) * P);
        rope_inplace(kv + R, P, c, s, d.interleave, tmp);
        if (dsa) {   // the token's index key after its latent; its indexer query and head weights
          dsa::index_key(w.ik.get() + t * Di, Di, P, L.idx_norm, L.idx_bias, d.idx_eps, c, s, kv + D);
          if (!kv_only) dsa::index_query(w.iq.get() + t * nih * Di, w.iw.get() + t * nih, nih, Di, P, c, s);
        }
        if (cache_type == at::kBFloat16) {
          c10::BFloat16* dst = cache.data_ptr<c10::BFloat16>() + b.slots[t] * ld;
          for (int64_t i = 0; i < ld; ++i) dst[i] = static_cast<c10::BFloat16>(kv[i]);
        } else if (cache_type == at::kFloat8_e4m3fn) {   // torch's rounding (nearest even, saturating)
          c10::Float8_e4m3fn* dst = cache.data_ptr<c10::Float8_e4m3fn>() + b.slots[t] * ld;
          for (int64_t i = 0; i < ld; ++i) dst[i] = static_cast<c10::Float8_e4m3fn>(kv[i]);
        } else {
          std::memcpy(cache.data_ptr<float>() + b.slots[t] * ld, kv, sizeof(float) * ld);
        }
        for (int64_t hh = 0; hh < (kv_only ? 0 : nh); ++hh) {
          float* qr = q + t * q_ld + hh * dq + (dq - P);
          rope_inplace(qr, P, c, s, d.interleave, tmp);
          if (!absorbed) std::memcpy(qlat + t * qlat_ld + hh * D + R, qr, sizeof(float) * P);
        }
      }
    }
    tm.sync();
    if (kv_only) return;
    if (!absorbed) {   // q_latent_h = q_nope_h @ W_UK_h (kv_b_proj's key rows, read in place)
      const int64_t tiles = (R + 63) / 64;
      const auto [i0, i1] = tm.split(nh * tiles);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t hh = i / tiles, n0 = (i % tiles) * 64;
        run_gemm(L.uk[hh], Rows{q + hh * dq, q_ld, nullptr, T}, n0, std::min(R, n0 + 64), qlat + hh * D, qlat_ld,
                 scratch);
      }
      tm.sync();
    }
    const auto visible_of = [&](int64_t t) {
      const int64_t r = b.row_of[t];
      return b.ctx[r] - (b.qstart[r + 1] - b.qstart[r]) + (t - b.qstart[r]) + 1;
    };
    const auto st = cache.scalar_type();
    const int ctype = st == at::kBFloat16 ? cpu::kBF16 : st == at::kFloat8_e4m3fn ? cpu::kFP8 : cpu::kF32;
    if (dsa) {   // each token's indexer scores over its visible keys, then its top-k (dsa_cpu.h)
      const float iscale = static_cast<float>(std::pow(static_cast<double>(Di), -0.5));
      const auto scores = [&](int64_t t, int64_t first, int64_t n, float* out) {
        K().index_scores(w.iq.get() + t * nih * Di, w.iw.get() + t * nih, nih, Di, cache.data_ptr(), ctype, ld, D,
                         b.page, b.tables + b.row_of[t] * b.max_blocks, first, n, iscale, out);
      };
      const auto choose = [&](int64_t t, const float* sc, float* tmp) {
        const int32_t* table = b.tables + b.row_of[t] * b.max_blocks;
        w.nsel[t] = static_cast<int32_t>(
            dsa::select(sc, visible_of(t), d.idx_topk, table, b.page, w.sel.get() + t * w.sel_ld, tmp));
      };
      float* mine = dsa_scratch[tm.rank()].get();
      if (w.isc.get() != nullptr) {   // few tokens (decode, verify): every member scores chunks of keys, then select
        constexpr int64_t kChunk = 512;
        const int64_t per = (b.max_ctx + kChunk - 1) / kChunk;
        const auto [i0, i1] = tm.split_cost(T * per, [&](int64_t i) {
          return std::max<int64_t>(0, std::min(kChunk, visible_of(i / per) - (i % per) * kChunk));
        });
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t t = i / per, first = (i % per) * kChunk, n = std::min(kChunk, visible_of(t) - first);
          if (n > 0) scores(t, first, n, w.isc.get() + t * b.max_ctx + first);
        }
        tm.sync();
        const auto [t0, t1] = tm.split(T);
        for (int64_t t = t0; t < t1; ++t) choose(t, w.isc.get() + t * b.max_ctx, mine);
      } else {                        // many (prefill chunks): a token each
        const auto [t0, t1] = tm.split_cost(T, [&](int64_t t) { return visible_of(t) + 16; });
        for (int64_t t = t0; t < t1; ++t) {
          scores(t, 0, visible_of(t), mine);
          choose(t, mine, mine + b.max_ctx + 16);
        }
      }
      tm.sync();
    }
    {   // attention: (token, group of 4 heads) items
      const int64_t groups = (nh + 3) / 4;
      const auto keys_of = [&](int64_t t) { return dsa ? static_cast<int64_t>(w.nsel[t]) : visible_of(t); };
      // balanced by the keys each item reads (a prefill's later tokens see more of them)
      const auto [i0, i1] = tm.split_cost(T * groups, [&](int64_t i) { return keys_of(i / groups) + 16; });
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / groups, h0 = (i % groups) * 4, h1 = std::min(nh, h0 + 4);
        float* out_t = w.olat.get() + t * nh * R;
        if (dsa) {
          K().sparse_attention(qlat + t * qlat_ld, h0, h1, R, P, cache.data_ptr(), ctype, ld,
                               w.sel.get() + t * w.sel_ld, w.nsel[t], d.scale, out_t, att_scratch);
        } else {
          K().attention(qlat + t * qlat_ld, nh, h0, h1, R, P, cache.data_ptr(), ctype, b.page,
                        b.tables + b.row_of[t] * b.max_blocks, visible_of(t), d.scale, out_t, att_scratch);
        }
      }
    }
    tm.sync();
    const float* o_in = w.olat.get();
    int64_t o_ld = nh * R;
    if (!absorbed) {   // v_h = W_UV_h o_h (kv_b_proj's value rows, read in place)
      const int64_t tiles = (d.dv + 31) / 32;
      const auto [i0, i1] = tm.split(nh * tiles);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t hh = i / tiles, n0 = (i % tiles) * 32;
        run_gemm(L.uv[hh], Rows{w.olat.get() + hh * R, nh * R, nullptr, T}, n0, std::min(d.dv, n0 + 32),
                 w.v.get() + hh * d.dv, nh * d.dv, scratch);
      }
      tm.sync();
      o_in = w.v.get();
      o_ld = nh * d.dv;
    }
    {   // x += o_proj(.): each member adds the columns it computed
      const auto [n0, n1] = tm.split(H, cpu::gemm_align(L.o));
      run_gemm(L.o, Rows{o_in, o_ld, nullptr, T}, n0, n1, w.out.get(), H, scratch);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t n = n0; n < n1; ++n) w.x[t * H + n] += w.out[t * H + n];
    }
    tm.sync();
  }

  // ---- feed-forward -------------------------------------------------------------------------------
  // gate/up rows [i0, i1) of f over X into g/u (row stride ldo), and act = silu(g) * u for them.
  // acts: a per-thread buffer of X rounded for the bf16 dot products, filled when `fresh` (the caller fills it
  // once per expert and reuses it over the expert's chunks); null or not dot matrices: converted per call.
  static void ffn_up(const FFNW& f, const Rows& X, int64_t i0, int64_t i1, float* g, float* u, float* act,
                     int64_t ldo, float* scratch, cpu::DotActs* acts = nullptr, bool fresh = true) {
    if (acts && f.gate.dot && f.up.dot && f.gate.fmt == f.up.fmt) {
      if (fresh) acts->fill(X, f.gate.k, f.gate.fmt);
      cpu::dot_gemm(f.gate, *acts, i0, i1, g, ldo);
      cpu::dot_gemm(f.up, *acts, i0, i1, u, ldo);
    } else {
      run_gemm(f.gate, X, i0, i1, g, ldo, scratch);
      run_gemm(f.up, X, i0, i1, u, ldo, scratch);
    }
    for (int64_t t = 0; t < X.T; ++t) K().silu_mul(g + t * ldo + i0, u + t * ldo + i0, i1 - i0, act + t * ldo + i0);
  }

  void dense_mlp(Team& tm, const FFNW& f, float* scratch) {
    const int64_t T = w.T, H = d.H, I = f.inter;
    const Rows hx{w.h.get(), H, nullptr, T};
    {
      const auto [i0, i1] = tm.split(I, cpu::gemm_align(f.gate));
      ffn_up(f, hx, i0, i1, w.g.get(), w.u.get(), w.act.get(), I, scratch, &tl_acts);
    }
    tm.sync();
    const auto [n0, n1] = tm.split(H, cpu::gemm_align(f.down));
    run_gemm(f.down, Rows{w.act.get(), I, nullptr, T}, n0, n1, w.out.get(), H, scratch);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = n0; n < n1; ++n) w.x[t * H + n] += w.out[t * H + n];
    tm.sync();
  }

  // Router of token t: sigmoid scores + correction bias, group-limited top-k (lower id on ties).
  void route_token(const LayerW& L, int64_t t) {
    const int64_t E = d.experts, k = d.top_k, G = d.groups, per = E / G;
    float* lg = w.logits.get() + t * E;
    float sc[1024], choice[1024], gscore[256];
    K().sigmoid(lg, E, sc);
    for (int64_t e = 0; e < E; ++e) choice[e] = sc[e] + L.router_bias[e];
    if (G > 1) {
      bool keep[256];
      for (int64_t g = 0; g < G; ++g) {   // group score: the sum of its two best (biased) scores
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) {
          if (choice[e] > b1) { b2 = b1; b1 = choice[e]; } else if (choice[e] > b2) { b2 = choice[e]; }
        }
        gscore[g] = per >= 2 ? b1 + b2 : b1;
        keep[g] = false;
      }
      for (int64_t n = 0; n < d.topk_groups; ++n) {   // keep the topk_group best groups (first on ties)
        int64_t best = -1;
        for (int64_t g = 0; g < G; ++g)
          if (!keep[g] && (best < 0 || gscore[g] > gscore[best])) best = g;
        keep[best] = true;
      }
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per]) choice[e] = -INFINITY;
    }
    int32_t* idx = w.idx.get() + t * k;
    float* wts = w.wts.get() + t * k;
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) {   // top-k experts, best first (lower id on ties)
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int64_t i = 0; i < j; ++i) taken |= idx[i] == e;
        if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
      }
      idx[j] = static_cast<int32_t>(best);
      wts[j] = sc[best];
      sum += sc[best];
    }
    for (int64_t j = 0; j < k; ++j) {
      if (d.norm_topk) wts[j] = wts[j] / (sum + 1e-20f);
      wts[j] *= d.routed_scale;
    }
  }

  void moe(Team& tm, const LayerW& L, float* scratch) {
    const int64_t T = w.T, H = d.H, E = d.experts, k = d.top_k;
    const Rows hx{w.h.get(), H, nullptr, T};
    gemm(tm, L.router, hx, w.logits.get(), E, scratch);
    tm.sync();
    {
      const auto [t0, t1] = tm.split(T);
      for (int64_t t = t0; t < t1; ++t) route_token(L, t);
    }
    tm.sync();
    if (tm.rank() == 0) {   // experts in ascending id, each with its tokens in token order
      std::vector<int32_t> count(E, 0);
      for (int64_t p = 0; p < T * k; ++p) ++count[w.idx[p]];
      w.active.clear();
      w.first.assign(1, 0);
      std::vector<int32_t> start(E, 0);
      for (int64_t e = 0; e < E; ++e)
        if (count[e]) {
          start[e] = w.first.back();
          w.active.push_back(static_cast<int32_t>(e));
          w.first.push_back(w.first.back() + count[e]);
        }
      w.tokens.assign(T * k, 0);
      w.weight.assign(T * k, 0.f);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < k; ++j) {
          const int32_t e = w.idx[t * k + j];
          w.tokens[start[e]] = static_cast<int32_t>(t);
          w.weight[start[e]++] = w.wts[t * k + j];
        }
    }
    tm.sync();
    // gate / up / act of every (expert, 32-row chunk of its intermediate) and of the shared expert
    const int64_t na = static_cast<int64_t>(w.active.size());
    const int64_t I = na ? L.experts[w.active[0]].inter : 0, Is = L.shared.defined() ? L.shared.inter : 0;
    // chunks of 32 rows (64 for panels: a chunk is whole panels; 128 for input pairs: 8 blocks of 16 rows keep
    // the dot products' chains independent enough to issue one per cycle)
    const cpu::Mat& g0 = na ? L.experts[w.active[0]].gate : L.shared.gate;
    const int64_t chunk = g0.layout == cpu::kPairs ? 128 : std::max<int64_t>(32, cpu::gemm_align(g0));
    const int64_t per_e = (I + chunk - 1) / chunk, per_s = (Is + chunk - 1) / chunk;
    {
      // balanced by work (an expert's chunk costs its token count; a prefill routes very unevenly)
      const auto [i0, i1] = tm.split_cost(na * per_e + per_s, [&](int64_t i) {
        return i < na * per_e ? w.first[i / per_e + 1] - w.first[i / per_e] : T;
      });
      int64_t held = -1;   // the expert (na: the shared one) whose rounded activations tl_acts holds
      for (int64_t i = i0; i < i1; ++i) {
        if (i < na * per_e) {
          const int64_t a = i / per_e, c0 = (i % per_e) * chunk, c1 = std::min(I, c0 + chunk);
          const FFNW& f = L.experts[w.active[a]];
          const int64_t off = w.first[a];
          const Rows X{w.h.get(), H, w.tokens.data() + off, w.first[a + 1] - off};
          ffn_up(f, X, c0, c1, w.g.get() + off * I, w.u.get() + off * I, w.act.get() + off * I, I, scratch,
                 &tl_acts, held != a);
          held = a;
        } else {
          const int64_t c0 = (i - na * per_e) * chunk, c1 = std::min(Is, c0 + chunk);
          ffn_up(L.shared, hx, c0, c1, w.gs.get(), w.us.get(), w.acts.get(), Is, scratch, &tl_acts, held != na);
          held = na;
        }
      }
    }
    tm.sync();
    // down projections over this member's hidden columns, combined per token in ascending expert order
    {
      const auto [n0, n1] = tm.split(H, 16);
      float* out = w.out.get();
      for (int64_t t = 0; t < T; ++t) std::fill(out + t * H + n0, out + t * H + n1, 0.f);
      float* y = scratch + scratch_floats;   // [T, H] beyond the gemm scratch
      for (int64_t a = 0; a < na; ++a) {
        const int64_t off = w.first[a], n = w.first[a + 1] - off;
        run_gemm(L.experts[w.active[a]].down, Rows{w.act.get() + off * I, I, nullptr, n}, n0, n1, y, H, scratch);
        for (int64_t r = 0; r < n; ++r) {
          const float wt = w.weight[off + r];
          float* o = out + w.tokens[off + r] * H;
          const float* yr = y + r * H;
          for (int64_t c = n0; c < n1; ++c) o[c] += yr[c] * wt;
        }
      }
      if (Is) {
        run_gemm(L.shared.down, Rows{w.acts.get(), Is, nullptr, T}, n0, n1, y, H, scratch);
        for (int64_t t = 0; t < T; ++t)
          for (int64_t c = n0; c < n1; ++c) out[t * H + c] += y[t * H + c];
      }
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = n0; c < n1; ++c) w.x[t * H + c] += out[t * H + c];
    }
    tm.sync();
  }

  // ---- one layer ----------------------------------------------------------------------------------
  // kWhole: the layer; kKvOnly: up to its KV write (attention's kv_only), for tokens whose outputs nobody reads;
  // kAfterPrologue: the layer without an MTP module's prologue, over tokens whose x already holds it
  enum class Part { kWhole, kKvOnly, kAfterPrologue };
  void layer(Team& tm, const LayerW& L, const at::Tensor& cache, const float* mtp_hidden, float* scratch,
             float* att_scratch, Part part = Part::kWhole) {
    const int64_t T = w.T, H = d.H;
    if (L.eh_proj.defined() && part != Part::kAfterPrologue) {   // MTP: x = eh_proj([enorm(embed) | hnorm(h)])
      norm_rows(tm, w.x.get(), H, H, L.enorm, w.g.get(), 2 * H);
      norm_rows(tm, mtp_hidden, H, H, L.hnorm, w.g.get() + H, 2 * H);
      tm.sync();
      gemm(tm, L.eh_proj, Rows{w.g.get(), 2 * H, nullptr, T}, w.x.get(), H, scratch);
      tm.sync();
    }
    attention(tm, L, cache, scratch, att_scratch, part == Part::kKvOnly);
    if (part == Part::kKvOnly) return;
    norm_rows(tm, w.x.get(), H, H, L.post_norm, w.h.get(), H);
    tm.sync();
    if (L.mlp.defined()) dense_mlp(tm, L.mlp, scratch); else moe(tm, L, scratch);
    if (L.head_norm.defined()) {
      norm_rows(tm, w.x.get(), H, H, L.head_norm, w.h.get(), H);
      tm.sync();
      const auto [t0, t1] = tm.split(T);
      std::memcpy(w.x.get() + t0 * H, w.h.get() + t0 * H, sizeof(float) * (t1 - t0) * H);
      tm.sync();
    }
  }
};

}  // namespace

void forward_layers(const DecodeWeights& W, int64_t first_layer, int64_t num_layers, const int64_t* tok,
                    const float* mtp_hidden, const std::vector<at::Tensor>& caches, const Batch& b, bool final_norm,
                    float* out, Outputs outputs, const float* x_in) {
  const DecodeDims& d = W.dims();
  const int64_t T = b.T, H = d.H, R = d.R, P = d.P, nh = d.heads;
  if (T == 0) return;
  // work buffers
  Work w;
  w.T = T;
  int64_t q_in_n = 0, q_n = 0;
  for (int64_t l = first_layer; l < first_layer + num_layers; ++l) {
    q_in_n = std::max(q_in_n, W.layers()[l].q_in.n);
    q_n = std::max(q_n, W.layers()[l].q_b.defined() ? W.layers()[l].q_b.n : 0);
  }
  w.q_in_ld = q_in_n;
  // FFN buffers sized by what these layers run: the dense MLP over T tokens, the experts over T * top_k
  // (token, expert) pairs, the shared expert over T
  int64_t I_dense = 1, I_exp = 1, I_sh = 1;
  for (int64_t l = first_layer; l < first_layer + num_layers; ++l) {
    const LayerW& L = W.layers()[l];
    if (L.mlp.defined()) I_dense = std::max(I_dense, L.mlp.inter);
    if (!L.experts.empty()) I_exp = std::max(I_exp, L.experts[0].inter);
    if (L.shared.defined()) I_sh = std::max(I_sh, L.shared.inter);
  }
  bool any_dsa = false;
  for (int64_t l = first_layer; l < first_layer + num_layers; ++l) any_dsa |= W.layers()[l].dsa();
  for (const at::Tensor& c : caches)   // a DSA layer writes and reads its index keys after [c_kv | k_pe]
    TORCH_CHECK(!any_dsa || c.size(2) == d.cache_row(), "decode forward: DeepSeek-V3.2 layers need cache rows of ",
                d.cache_row(), " ([c_kv | k_pe | index key]), got ", c.size(2));
  const int64_t nih = any_dsa ? d.idx_heads : 0, Di = any_dsa ? d.idx_dim : 0;
  w.sel_ld = any_dsa ? std::min(d.idx_topk, b.max_ctx) : 0;
  const int64_t k = std::max<int64_t>(d.top_k, 1);
  const int64_t ffn = std::max(T * k * I_exp, T * I_dense);
  const int64_t scratch_floats = W.max_scratch() + 64;
  const int nt = at::get_num_threads();
  struct Want {
    Buf<float>* f;
    Buf<int32_t>* i;
    int64_t n;
  };
  std::vector<Buf<float>> scratch(nt), att(nt), dsa_sc(nt);
  std::vector<Want> want = {
      {&w.x, nullptr, T * H}, {&w.h, nullptr, T * H}, {&w.aq, nullptr, T * q_in_n}, {&w.akv, nullptr, T * (R + P)},
      {&w.qc, nullptr, T * d.q_lora}, {&w.q, nullptr, T * q_n}, {&w.qlat, nullptr, T * nh * (R + P)},
      {&w.olat, nullptr, T * nh * R}, {&w.v, nullptr, T * nh * d.dv}, {&w.out, nullptr, T * H},
      {&w.g, nullptr, std::max(ffn, 2 * T * H)},   // also the MTP prologue's [enorm | hnorm]
      {&w.u, nullptr, ffn}, {&w.act, nullptr, ffn}, {&w.gs, nullptr, T * I_sh}, {&w.us, nullptr, T * I_sh},
      {&w.acts, nullptr, T * I_sh}, {&w.logits, nullptr, T * std::max<int64_t>(d.experts, 1)},
      {&w.wts, nullptr, T * k}, {nullptr, &w.idx, T * k}, {&w.iq, nullptr, T * nih * Di}, {&w.ik, nullptr, T * Di},
      {&w.iw, nullptr, T * nih}, {nullptr, &w.sel, T * w.sel_ld}, {nullptr, &w.nsel, any_dsa ? T : 0}};
  // DSA scores of a few tokens (decode / verify / draft batches: up to 64 tokens and 16 Mi scores) are computed by
  // key chunks across the team into one buffer; a prefill chunk's tokens are split among the members instead
  const bool split_keys = any_dsa && T <= 64 && T * b.max_ctx <= (int64_t(1) << 24);
  if (split_keys) want.push_back({&w.isc, nullptr, T * b.max_ctx});
  for (int i = 0; i < nt; ++i) {
    want.push_back({&scratch[i], nullptr, scratch_floats + T * H});
    want.push_back({&att[i], nullptr, nh * (b.max_ctx + 2)});
    want.push_back({&dsa_sc[i], nullptr, any_dsa ? 2 * (b.max_ctx + 16) : 0});
  }
  size_t total = 0;
  for (const Want& x : want) total += x.f ? Arena::bytes<float>(x.n) : Arena::bytes<int32_t>(x.n);
  Arena& arena = tl_arena;
  arena.reserve(total);
  for (const Want& x : want) {
    if (x.f) *x.f = arena.take<float>(x.n); else *x.i = arena.take<int32_t>(x.n);
  }
  Forward f{W, d, b, w, scratch_floats, dsa_sc};
  // outputs left out: the last layer's KV write over every token, then (kLast) the rest of it over each row's
  // last token alone, as a batch of B one-token rows
  const bool cut = outputs == Outputs::kNone || (outputs == Outputs::kLast && T > b.B);
  Batch last;
  std::vector<int64_t> last_src, last_pos, last_slot;
  std::vector<int32_t> last_qs;
  if (cut && outputs == Outputs::kLast) {
    last = b;
    last.T = b.B;
    last.row_of.resize(b.B);
    last_qs.resize(b.B + 1);
    for (int64_t r = 0; r < b.B; ++r) {
      const int64_t t = b.qstart[r + 1] - 1;
      last_src.push_back(t);
      last_pos.push_back(b.positions[t]);
      last_slot.push_back(b.slots[t]);
      last_qs[r] = static_cast<int32_t>(r);
      last.row_of[r] = static_cast<int32_t>(r);
    }
    last_qs[b.B] = static_cast<int32_t>(b.B);
    last.positions = last_pos.data();
    last.slots = last_slot.data();
    last.qstart = last_qs.data();
  }
  Forward f_last{W, d, last, w, scratch_floats, dsa_sc};
  const float* emb_f = static_cast<const float*>(W.embed().p);
  const c10::BFloat16* emb_b = static_cast<const c10::BFloat16*>(W.embed().p);
  run_team(nt, [&](Team& tm) {
    float* sc = scratch[tm.rank()].get();
    float* at_sc = att[tm.rank()].get();
    {
      const auto [t0, t1] = tm.split(T);
      for (int64_t t = t0; t < t1; ++t) {
        if (x_in != nullptr) {
          std::memcpy(w.x.get() + t * H, x_in + t * H, sizeof(float) * H);
        } else if (W.embed().type == cpu::kBF16) {
          for (int64_t i = 0; i < H; ++i) w.x[t * H + i] = static_cast<float>(emb_b[tok[t] * H + i]);
        } else {
          std::memcpy(w.x.get() + t * H, emb_f + tok[t] * H, sizeof(float) * H);
        }
      }
    }
    tm.sync();
    for (int64_t l = 0; l < num_layers; ++l) {
      const LayerW& L = W.layers()[first_layer + l];
      if (!cut || l + 1 < num_layers) {
        f.layer(tm, L, caches[l], mtp_hidden, sc, at_sc);
        continue;
      }
      f.layer(tm, L, caches[l], mtp_hidden, sc, at_sc, Forward::Part::kKvOnly);
      if (outputs == Outputs::kNone) return;
      if (tm.rank() == 0) {   // x of each row's last token to row r (last_src[r] >= r, ascending: in place)
        for (int64_t r = 0; r < b.B; ++r)
          if (last_src[r] != r) std::memcpy(w.x.get() + r * H, w.x.get() + last_src[r] * H, sizeof(float) * H);
        w.T = b.B;
      }
      tm.sync();
      f_last.layer(tm, L, caches[l], nullptr, sc, at_sc, Forward::Part::kAfterPrologue);
    }
    const auto [t0, t1] = tm.split(w.T);
    if (t1 > t0) {
      if (final_norm) {
        K().rms_norm(w.x.get() + t0 * H, H, t1 - t0, H, W.final_norm().p, W.final_norm().type, d.eps,
                     out + t0 * H, H);
      } else {
        std::memcpy(out + t0 * H, w.x.get() + t0 * H, sizeof(float) * (t1 - t0) * H);
      }
    }
  });
  arena.release_if_large();
}

namespace {

// y [T, M.n] = x [T, M.k] @ M^T over the thread team (an LM head: every thread a range of output rows)
void head_gemm(const Mat& M, const float* x, int64_t T, float* y) {
  if (T == 0) return;
  const int nt = at::get_num_threads();
  std::vector<std::unique_ptr<float[]>> scratch(nt);
  for (int i = 0; i < nt; ++i) scratch[i] = buf<float>(cpu::gemm_scratch(M) + 64);
  const Rows X{x, M.k, nullptr, T};
  run_team(nt, [&](Team& tm) {
    const auto [n0, n1] = tm.split(M.n, cpu::gemm_align(M));
    run_gemm(M, X, n0, n1, y, M.n, scratch[tm.rank()].get());
  });
}

}  // namespace

void lm_head(const DecodeWeights& W, const float* x, int64_t T, float* y) { head_gemm(W.lm_head(), x, T, y); }

void draft_logits(const DecodeWeights& W, const float* x, int64_t T, float* y) {
  head_gemm(W.draft_head(), x, T, y);
}

namespace {

void check_batch(const DecodeDims& d, const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& slots,
                 const at::Tensor& query_start, const at::Tensor& block_tables, const at::Tensor& seqlens,
                 const at::Tensor& rope_cos, const at::Tensor& rope_sin, at::TensorList caches, Batch& b) {
  const int64_t T = ids.numel();
  TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                  slots.scalar_type() == at::kLong && positions.numel() == T && slots.numel() == T &&
                  ids.is_contiguous() && positions.is_contiguous() && slots.is_contiguous(),
              "decode_forward: ids, positions and slot_mapping must be contiguous int64 [T]");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && block_tables.scalar_type() == at::kInt &&
                  seqlens.scalar_type() == at::kInt && block_tables.dim() == 2 && query_start.is_contiguous() &&
                  block_tables.is_contiguous() && seqlens.is_contiguous(),
              "decode_forward: query_start, block_tables and seqlens must be contiguous int32");
  TORCH_CHECK(rope_cos.scalar_type() == at::kFloat && rope_sin.scalar_type() == at::kFloat &&
                  rope_cos.is_contiguous() && rope_sin.is_contiguous() && rope_cos.dim() == 2 &&
                  rope_cos.size(1) * 2 == d.P && rope_sin.sizes() == rope_cos.sizes(),
              "decode_forward: rope tables must be contiguous float32 [max_pos, rope/2]");
  b.T = T;
  b.B = block_tables.size(0);
  b.max_blocks = block_tables.size(1);
  TORCH_CHECK(query_start.numel() == b.B + 1 && seqlens.numel() == b.B,
              "decode_forward: query_start must be [B+1] and seqlens [B]");
  b.positions = positions.data_ptr<int64_t>();
  b.slots = slots.data_ptr<int64_t>();
  b.qstart = query_start.data_ptr<int32_t>();
  b.tables = block_tables.data_ptr<int32_t>();
  b.ctx = seqlens.data_ptr<int32_t>();
  b.cos = rope_cos.data_ptr<float>();
  b.sin = rope_sin.data_ptr<float>();
  TORCH_CHECK(b.qstart[0] == 0 && b.qstart[b.B] == T, "decode_forward: query_start must run from 0 to T");
  const int64_t D = d.cache_row();
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.dim() == 3 && c.size(2) == D && c.is_contiguous() &&
                    (c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16 ||
                     c.scalar_type() == at::kFloat8_e4m3fn) &&
                    c.sizes() == caches[0].sizes() && c.scalar_type() == caches[0].scalar_type(),
                "decode_forward: caches must be contiguous [blocks, page, ", D, "] (R+P, + the index key with DSA) "
                "float32/bfloat16/float8_e4m3fn, all alike");
  }
  b.page = caches.empty() ? 1 : caches[0].size(1);
  const int64_t num_blocks = caches.empty() ? 0 : caches[0].size(0);
  b.row_of.assign(T, 0);
  for (int64_t r = 0; r < b.B; ++r) {
    const int64_t nq = b.qstart[r + 1] - b.qstart[r];
    TORCH_CHECK(nq >= 0 && b.ctx[r] >= nq && b.ctx[r] <= b.max_blocks * b.page, "decode_forward: row ", r, " has ",
                nq, " queries and context length ", b.ctx[r]);
    b.max_ctx = std::max<int64_t>(b.max_ctx, b.ctx[r]);
    for (int64_t t = b.qstart[r]; t < b.qstart[r + 1]; ++t) b.row_of[t] = static_cast<int32_t>(r);
    for (int64_t i = 0; i < (b.ctx[r] + b.page - 1) / b.page; ++i) {
      const int32_t blk = b.tables[r * b.max_blocks + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "decode_forward: block_tables[", r, ", ", i, "] = ", blk,
                  " is not a cache block");
    }
  }
  const int64_t* tok = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(b.positions[t] >= 0 && b.positions[t] < rope_cos.size(0), "decode_forward: position ",
                b.positions[t], " outside the rope table");
    TORCH_CHECK(b.slots[t] >= 0 && b.slots[t] < num_blocks * b.page, "decode_forward: slot ", b.slots[t],
                " outside the cache");
    TORCH_CHECK(tok[t] >= 0 && tok[t] < d.vocab, "decode_forward: token id ", tok[t], " outside the vocabulary");
  }
}

at::Tensor decode_forward_cpu(const c10::intrusive_ptr<DecodeWeights>& weights, int64_t first_layer,
                              int64_t num_layers, const at::Tensor& ids, const std::optional<at::Tensor>& mtp_hidden,
                              at::TensorList caches, const at::Tensor& rope_cos, const at::Tensor& rope_sin,
                              const at::Tensor& positions, const at::Tensor& slot_mapping,
                              const at::Tensor& query_start, const at::Tensor& block_tables,
                              const at::Tensor& seqlens, bool final_norm, int64_t outputs) {
  const DecodeWeights& W = *weights;
  TORCH_CHECK(outputs >= 0 && outputs <= 2, "decode_forward: outputs must be 0 (all), 1 (each row's last) or 2 "
              "(none), got ", outputs);
  const Outputs which = static_cast<Outputs>(outputs);
  const DecodeDims& d = W.dims();
  TORCH_CHECK(first_layer >= 0 && num_layers >= 1 && first_layer + num_layers <= W.num_layers() &&
                  static_cast<int64_t>(caches.size()) == num_layers,
              "decode_forward: layers [", first_layer, ", ", first_layer + num_layers, ") of ", W.num_layers(),
              " with ", caches.size(), " caches");
  Batch b;
  check_batch(d, ids, positions, slot_mapping, query_start, block_tables, seqlens, rope_cos, rope_sin, caches, b);
  const int64_t T = b.T, H = d.H;
  const bool mtp = W.layers()[first_layer].eh_proj.defined();
  // an MTP layer's hidden input, or the residual stream main layers start from
  const bool given = mtp_hidden.has_value() && mtp_hidden->defined();
  TORCH_CHECK(!mtp || (given && mtp_hidden->numel() == T * H), "decode_forward: an MTP layer needs hidden [T, H]");
  TORCH_CHECK(mtp || !given || (mtp_hidden->dim() == 2 && mtp_hidden->size(0) == T && mtp_hidden->size(1) == H),
              "decode_forward: main layers' input must be [T, H] (T = ", T, ")");
  const at::Tensor hid = given ? mtp_hidden->to(at::kFloat).contiguous() : at::Tensor();
  if (which == Outputs::kLast)
    for (int64_t r = 0; r < b.B; ++r)
      TORCH_CHECK(b.qstart[r + 1] > b.qstart[r], "decode_forward: outputs=1 (each row's last) needs every row to "
                  "feed a token; row ", r, " feeds none");
  const int64_t rows = which == Outputs::kAll ? T : which == Outputs::kLast ? b.B : 0;
  at::Tensor out = at::empty({rows, H}, ids.options().dtype(at::kFloat));
  if (T == 0) return out;
  const std::vector<at::Tensor> cache_list(caches.begin(), caches.end());
  forward_layers(W, first_layer, num_layers, ids.data_ptr<int64_t>(), mtp ? hid.data_ptr<float>() : nullptr,
                 cache_list, b, final_norm, out.data_ptr<float>(), which,
                 !mtp && hid.defined() ? hid.data_ptr<float>() : nullptr);
  return out;
}

// logits [T, vocab] fp32 = hidden [T, H] @ lm_head^T, with the batch-invariant kernel and the thread team; draft:
// the drafts' head instead ([T, draft vocabulary]: DecodeWeights::draft_head).
at::Tensor decode_logits_cpu(const c10::intrusive_ptr<DecodeWeights>& weights, const at::Tensor& hidden, bool draft) {
  const Mat& M = draft ? weights->draft_head() : weights->lm_head();
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == M.k, "decode_logits: hidden must be [T, ", M.k, "]");
  const at::Tensor x = hidden.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), M.n}, x.options());
  head_gemm(M, x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
  return y;
}

// One matrix of any layout / format applied to x [T, k] -> y [T, n] fp32 (the same kernels as the forward):
// the quantized linears' CPU path and the kernels' parity tests.
at::Tensor mat_gemm_cpu(const at::Tensor& x, const at::Tensor& data, const std::optional<at::Tensor>& scale,
                        const std::optional<at::Tensor>& gscale, const std::optional<at::Tensor>& bias, int64_t layout,
                        int64_t fmt, int64_t n, int64_t k, int64_t scale_r0, double gscale2, bool amx, bool dot) {
  c10::Dict<std::string, at::Tensor> t;
  c10::Dict<std::string, int64_t> i;
  c10::Dict<std::string, double> f;
  t.insert("m.data", data);
  if (scale.has_value() && scale->defined()) t.insert("m.scale", scale->contiguous());
  if (gscale.has_value() && gscale->defined()) t.insert("m.gscale", *gscale);
  if (bias.has_value() && bias->defined()) t.insert("m.bias", bias->to(at::kFloat).contiguous());
  i.insert("m.layout", layout);
  i.insert("m.fmt", fmt);
  i.insert("m.n", n);
  i.insert("m.k", k);
  i.insert("m.scale_r0", scale_r0);
  f.insert("m.gscale2", gscale2);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "mat_gemm: x must be [T, ", k, "], got ", x.sizes());
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  int64_t bytes = 0;
  Mat M = parse_mat(t, i, f, "m", true, &bytes);
  TORCH_CHECK(!amx || (cpu::amx_usable() && cpu::amx_takes(M)), "mat_gemm: amx needs an AMX CPU and a bf16 row-wise "
              "matrix with k a multiple of 32");
  M.amx = amx;
  TORCH_CHECK(!dot || (cpu::dot_usable() && cpu::dot_takes(M)), "mat_gemm: dot needs a CPU with AVX512-BF16 and a "
              "row-wise bf16 / fp8 / nvfp4 matrix");
  TORCH_CHECK(!(amx && dot), "mat_gemm: amx and dot exclude each other");
  TORCH_CHECK(M.layout != cpu::kPairs || cpu::dot_usable(), "mat_gemm: bf16 input pairs need a CPU with AVX512-BF16");
  M.dot = dot || M.layout == cpu::kPairs;   // only the dot-product GEMM reads input pairs
  const int64_t T = xf.size(0);
  at::Tensor y = at::empty({T, n}, xf.options());
  if (T == 0) return y;
  const int nt = at::get_num_threads();
  std::vector<std::unique_ptr<float[]>> scratch(nt);
  for (int r = 0; r < nt; ++r) scratch[r] = buf<float>(cpu::gemm_scratch(M) + 64);
  const Rows X{xf.data_ptr<float>(), k, nullptr, T};
  run_team(nt, [&](Team& tm) {
    const auto [n0, n1] = tm.split(M.n, cpu::gemm_align(M));
    run_gemm(M, X, n0, n1, y.data_ptr<float>(), n, scratch[tm.rank()].get());
  });
  return y;
}

}  // namespace
}  // namespace mtp_core

extern "C" const char* mtp_core_cpu_isa() { return mtp_core::K().isa; }
// want: auto | amx | avx512 | avx512f | avx2 | generic (checked in Python); returns the table's ISA name.
extern "C" const char* mtp_core_set_cpu_isa(const char* want) {
  const mtp_core::cpu::KernelTable* table = mtp_core::pick_table(want);
  mtp_core::g_table.store(table, std::memory_order_release);
  return table->isa;
}
extern "C" int mtp_core_cpu_amx() { return mtp_core::cpu::amx_usable() ? 1 : 0; }
extern "C" int mtp_core_cpu_bf16_dot() { return mtp_core::cpu::dot_usable() ? 1 : 0; }

TORCH_LIBRARY_FRAGMENT(mtp_core, m) {
  // The model's weights for the native forward, built once (decode_weights.h; mtp_core/model/native_weights.py).
  m.class_<mtp_core::DecodeWeights>("DecodeWeights")
      .def(torch::init<c10::Dict<std::string, at::Tensor>, c10::Dict<std::string, int64_t>,
                       c10::Dict<std::string, double>>())
      .def("summary", &mtp_core::DecodeWeights::summary);
  // Native CPU decode forward: embeds ids [T], runs layers [first_layer, first_layer + num_layers) over the
  // paged latent caches (one per layer, written in place at slot_mapping; an MTP module's layer takes
  // mtp_hidden [T, H]; main layers given mtp_hidden start from it, the residual stream entering first_layer,
  // instead of the embedding of ids), optionally the final norm -> hidden [T, H] float32; outputs 1: each row's last token's
  // only ([B, H]; every row feeds one or more), 2: none ([0, H], the caches alone) (decode_forward.h: Outputs).
  m.def(
      "decode_forward(__torch__.torch.classes.mtp_core.DecodeWeights weights, int first_layer, int num_layers, "
      "Tensor ids, Tensor? mtp_hidden, Tensor(a!)[] caches, Tensor rope_cos, Tensor rope_sin, Tensor positions, "
      "Tensor slot_mapping, Tensor query_start, Tensor block_tables, Tensor seqlens, bool final_norm, "
      "int outputs=0) -> Tensor");
  // The LM head: hidden [T, H] -> logits [T, vocab] float32, batch-invariant.
  m.def("decode_logits(__torch__.torch.classes.mtp_core.DecodeWeights weights, Tensor hidden, bool draft=False) -> "
        "Tensor");
  // One matrix (layout kRows=0 / kCols=1 / kPanel=2 / kPairs=3, format f32=0 / bf16=1 / fp8=2 / nvfp4=3) applied to
  // x [T, k] -> [T, n] float32, with the forward's kernels.
  m.def(
      "mat_gemm(Tensor x, Tensor data, Tensor? scale, Tensor? gscale, Tensor? bias, int layout, int fmt, int n, "
      "int k, int scale_r0, float gscale2, bool amx=False, bool dot=False) -> Tensor");
  // The MTP decode step in one call (greedy, strict; mtp_step_cpu.cpp): target forward over each row's
  // [t, d_1..d_k], verification, then for the rows with num_drafts[b] > 0 Eagle (num_modules 1: forward 1 over
  // the positions from mtp_valid[b] and the chained drafts) or Vanilla (num_modules K: module k over the row's
  // window and its first drafts); the stored positions these re-read come in as window_len / window_ids /
  // window_hidden -> ([B, 1 + (kmax + 1) + dmax] int64: (n, emitted tokens, next drafts), -1 padded; the
  // target's hidden [T, H] float32; Vanilla's new windows [B, K, H] float32, else empty); confidence > 0: the
  // confidence gate stops a row's drafts early (drafter.py). Writes the main and
  // the MTP modules' KV in `caches` (all layers, indexed as model.layers); mtp_layer -1: no drafting (the
  // target step and its verification only). Rows that need their logits: accept_cap [B] (the most drafts a
  // grammar lets a row accept), rule_start [T + 1] / rule_ids [E] / rule_vals [E, 4] (penalties, logit_bias,
  // min_tokens as per-token entries per position), mask_of [T] / masks [M, ceil(V / 32)] (grammar masks per
  // position): verification takes the argmax of the processed, masked logits; top_logprobs [B] (N >= 0, -1 none):
  // the log-probabilities of each asking row's emitted tokens and its top N -> (vals [R, 1 + Nmax] float32, ids
  // [R, Nmax] int64), R the asking rows' emitted tokens (empty without top_logprobs).
  m.def(
      "mtp_step(__torch__.torch.classes.mtp_core.DecodeWeights weights, Tensor ids, Tensor query_start, "
      "Tensor start, Tensor block_tables, Tensor num_drafts, Tensor(a!)[] caches, Tensor rope_cos, "
      "Tensor rope_sin, int mtp_layer, int num_modules=1, Tensor? window_ids=None, Tensor? window_hidden=None, "
      "Tensor? window_len=None, Tensor? mtp_valid=None, float confidence=0.0, Tensor? accept_cap=None, "
      "Tensor? rule_start=None, Tensor? rule_ids=None, Tensor? rule_vals=None, Tensor? mask_of=None, "
      "Tensor? masks=None, Tensor? top_logprobs=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.impl("mtp_step", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(mtp_core::mtp_step_cpu)));
  // MTP Eagle's drafting alone (mtp_step_cpu.cpp): rows whose newly valid positions' tokens (x_{q+1}) and main
  // hidden states come from another forward (a prompt's prefill, the general path): forward 1 over them from
  // start[b], then the chain -> drafts [B, max num_drafts] int64, -1 padded (the drafter's, exactly).
  m.def(
      "eagle_draft(__torch__.torch.classes.mtp_core.DecodeWeights weights, Tensor ids, Tensor hidden, "
      "Tensor query_start, Tensor start, Tensor block_tables, Tensor num_drafts, Tensor(a!)[] caches, "
      "Tensor rope_cos, Tensor rope_sin, int mtp_layer) -> Tensor");
  m.impl("eagle_draft", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(mtp_core::eagle_draft_cpu)));
  // mtp_step's strict verification alone, on given logits [T, V] and rules (tests feed it hand-checked tables).
  m.def(
      "verify_greedy(Tensor logits, Tensor ids, Tensor query_start, Tensor? accept_cap=None, "
      "Tensor? rule_start=None, Tensor? rule_ids=None, Tensor? rule_vals=None, Tensor? mask_of=None, "
      "Tensor? masks=None) -> Tensor");
  m.impl("verify_greedy", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(mtp_core::verify_greedy_cpu)));
  // The rules' processing alone: logits [T, V] -> the processed, masked logits verify_greedy chooses from.
  m.def(
      "apply_logits_rules(Tensor logits, Tensor rule_start, Tensor rule_ids, Tensor rule_vals, Tensor? mask_of=None, "
      "Tensor? masks=None) -> Tensor");
  m.impl("apply_logits_rules", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(mtp_core::apply_logits_rules_cpu)));
  m.impl("decode_forward", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(mtp_core::decode_forward_cpu)));
  m.impl("decode_logits", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(mtp_core::decode_logits_cpu)));
  m.impl("mat_gemm", torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(mtp_core::mat_gemm_cpu)));
}

// The MTP Eagle decode step in one native call (mtp_core::mtp_step): the CPU twin of the static (CUDA-graph)
// step of mtp_core/engine/graph_runner.py, with the same contract, for greedy strict rows:
//
//   target  = model([t, d_1..d_k])       row b feeds k_b drafts at positions start..start+k_b (main KV written)
//   m       = accepted drafts            d_{i+1} == argmax(logits_i), first index on ties (torch's argmax)
//   emitted = [d_1..d_m, argmax at m]    n = m + 1 tokens
//   g       = MTP(emitted, target hidden)   Eagle forward 1 over positions start..start+m (MTP KV written)
//   D_1     = argmax head(g at start+m);  D_j = MTP(D_{j-1}, g) at start+m+j-1, for j <= num_drafts[b]
//
// Rows may carry different numbers of drafts in and out (k_b, num_drafts[b] up to K). Python sees one call
// and one small tensor per step: [B, 1 + (kmax + 1) + dmax] int64 = (n, emitted padded with -1, drafts padded
// with -1), with the target's hidden states [T, H] (what a drafter outside the call needs: MTP Vanilla, rows
// that draft later). Every forward is the batch-invariant native forward, so the tokens are the eager engine's.
#include <algorithm>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include "decode_forward.h"
#include "decode_weights.h"

namespace mtp_core {
namespace {

int64_t argmax_row(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

// Positions, slots and context lengths of rows that feed `len[b]` tokens from position `first[b]`.
struct RowsAt {
  std::vector<int64_t> positions, slots;
  std::vector<int32_t> qstart, ctx;
  Batch batch;

  RowsAt(const std::vector<int64_t>& first, const std::vector<int64_t>& len, const int32_t* tables, int64_t max_blocks,
         int64_t page, const float* cos, const float* sin) {
    const int64_t B = static_cast<int64_t>(first.size());
    qstart.assign(1, 0);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < len[b]; ++i) {
        const int64_t p = first[b] + i;
        positions.push_back(p);
        slots.push_back(static_cast<int64_t>(tables[b * max_blocks + p / page]) * page + p % page);
        batch.row_of.push_back(static_cast<int32_t>(b));
      }
      qstart.push_back(static_cast<int32_t>(positions.size()));
      ctx.push_back(static_cast<int32_t>(first[b] + len[b]));
      batch.max_ctx = std::max<int64_t>(batch.max_ctx, first[b] + len[b]);
    }
    batch.T = static_cast<int64_t>(positions.size());
    batch.B = B;
    batch.max_blocks = max_blocks;
    batch.page = page;
    batch.positions = positions.data();
    batch.slots = slots.data();
    batch.qstart = qstart.data();
    batch.tables = tables;
    batch.ctx = ctx.data();
    batch.cos = cos;
    batch.sin = sin;
  }
};

}  // namespace

std::tuple<at::Tensor, at::Tensor> mtp_step_cpu(const c10::intrusive_ptr<DecodeWeights>& weights, const at::Tensor& ids,
                        const at::Tensor& query_start, const at::Tensor& start, const at::Tensor& block_tables,
                        const at::Tensor& num_drafts, at::TensorList caches, const at::Tensor& rope_cos,
                        const at::Tensor& rope_sin, int64_t mtp_layer) {
  const DecodeWeights& W = *weights;
  const DecodeDims& d = W.dims();
  const int64_t L = d.num_main, H = d.H, V = d.vocab;
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 1,
              "mtp_step: ids must be contiguous int64 [T]");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.is_contiguous() &&
                  start.scalar_type() == at::kLong && start.is_contiguous() &&
                  num_drafts.scalar_type() == at::kInt && num_drafts.is_contiguous() &&
                  block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2,
              "mtp_step: query_start / num_drafts int32, start int64, block_tables int32 [B, max_blocks]");
  const int64_t B = block_tables.size(0), max_blocks = block_tables.size(1), T = ids.numel();
  TORCH_CHECK(query_start.numel() == B + 1 && start.numel() == B && num_drafts.numel() == B,
              "mtp_step: query_start [B+1], start [B], num_drafts [B]");
  const bool drafting = mtp_layer >= 0;   // -1: no MTP (nextn = 0): the target step and its verification only
  TORCH_CHECK(!drafting || (mtp_layer >= L && mtp_layer < W.num_layers() && W.layers()[mtp_layer].eh_proj.defined() &&
                            static_cast<int64_t>(caches.size()) > mtp_layer),
              "mtp_step: mtp_layer must be an MTP module with a cache, or -1");
  TORCH_CHECK(static_cast<int64_t>(caches.size()) >= L, "mtp_step: a cache per main layer is needed");
  TORCH_CHECK(rope_cos.scalar_type() == at::kFloat && rope_cos.is_contiguous() && rope_sin.is_contiguous() &&
                  rope_cos.dim() == 2 && rope_cos.size(1) * 2 == d.P && rope_sin.sizes() == rope_cos.sizes(),
              "mtp_step: rope tables must be contiguous float32 [max_pos, rope/2]");
  for (int64_t l : {int64_t{0}, drafting ? mtp_layer : int64_t{0}}) {
    const at::Tensor& c = caches[l];
    TORCH_CHECK(c.dim() == 3 && c.size(2) == d.R + d.P && c.is_contiguous() &&
                    (c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16 ||
                     c.scalar_type() == at::kFloat8_e4m3fn) &&
                    c.sizes() == caches[0].sizes() && c.scalar_type() == caches[0].scalar_type(),
                "mtp_step: caches must be contiguous [blocks, page, R+P] float32/bfloat16/float8_e4m3fn, all alike");
  }
  for (int64_t l = 1; l < L; ++l)
    TORCH_CHECK(caches[l].sizes() == caches[0].sizes() && caches[l].scalar_type() == caches[0].scalar_type() &&
                    caches[l].is_contiguous(),
                "mtp_step: caches must all be alike");
  const int64_t page = caches[0].size(1), num_blocks = caches[0].size(0);
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int64_t* st = start.data_ptr<int64_t>();
  const int32_t* nd = num_drafts.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* tok = ids.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[B] == T, "mtp_step: query_start must run from 0 to T");
  int64_t kmax = 0, dmax = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = qs[b + 1] - qs[b];
    TORCH_CHECK(nq >= 1 && nd[b] >= 0 && st[b] >= 0 && (drafting || nd[b] == 0), "mtp_step: row ", b, " feeds ", nq,
                " tokens, wants ", nd[b], " drafts");
    kmax = std::max(kmax, nq - 1);
    dmax = std::max<int64_t>(dmax, nd[b]);
    // every position this step writes (target, forward 1, the chain) must be a cache slot of the row's table
    const int64_t last = st[b] + std::max<int64_t>(nq - 1, nq - 1 + std::max<int64_t>(nd[b] - 1, 0));
    TORCH_CHECK(last < rope_cos.size(0) && (last / page) < max_blocks, "mtp_step: row ", b, " reaches position ",
                last, " beyond its block table or the rope table");
    for (int64_t i = 0; i <= last / page; ++i) {
      const int32_t blk = tables[b * max_blocks + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "mtp_step: block_tables[", b, ", ", i, "] = ", blk,
                  " is not a cache block");
    }
    for (int64_t t = qs[b]; t < qs[b + 1]; ++t)
      TORCH_CHECK(tok[t] >= 0 && tok[t] < V, "mtp_step: token id ", tok[t], " outside the vocabulary");
  }
  const std::vector<at::Tensor> main_caches(caches.begin(), caches.begin() + L);
  const std::vector<at::Tensor> mtp_cache{caches[drafting ? mtp_layer : 0]};
  const float* cos = rope_cos.data_ptr<float>();
  const float* sin = rope_sin.data_ptr<float>();

  // 1. the target over [t, d_1..d_k] of every row, and its logits at every position
  std::vector<int64_t> first(st, st + B), len(B);
  for (int64_t b = 0; b < B; ++b) len[b] = qs[b + 1] - qs[b];
  const RowsAt target(first, len, tables, max_blocks, page, cos, sin);
  at::Tensor hidden_t = at::empty({T, H}, ids.options().dtype(at::kFloat));
  float* hidden = hidden_t.data_ptr<float>();
  std::vector<float> logits(T * V);
  forward_layers(W, 0, L, tok, nullptr, main_caches, target.batch, true, hidden);
  lm_head(W, hidden, T, logits.data());

  // 2. strict verification
  at::Tensor out = at::full({B, 1 + (kmax + 1) + dmax}, -1, ids.options());
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t ld = out.size(1);
  std::vector<int64_t> m(B), emitted, h_rows;
  for (int64_t b = 0; b < B; ++b) {
    int64_t a = 0;
    while (a < len[b] - 1 && tok[qs[b] + 1 + a] == argmax_row(&logits[(qs[b] + a) * V], V)) ++a;
    m[b] = a;
    const int64_t bonus = argmax_row(&logits[(qs[b] + a) * V], V);
    o[b * ld] = a + 1;
    for (int64_t i = 0; i < a; ++i) o[b * ld + 1 + i] = tok[qs[b] + 1 + i];
    o[b * ld + 1 + a] = bonus;
    for (int64_t i = 0; i <= a; ++i) {     // forward 1's inputs: (x_{q+1}, h_q) for q = start .. start+m
      emitted.push_back(o[b * ld + 1 + i]);
      h_rows.push_back(qs[b] + i);
    }
  }
  if (!drafting) return {out, hidden_t};
  // 3. Eagle forward 1 over the newly valid positions of every row (also for rows that want no drafts: their
  // MTP caches stay up to date, so nothing lags)
  std::vector<int64_t> len1(B);
  for (int64_t b = 0; b < B; ++b) len1[b] = m[b] + 1;
  const RowsAt fwd1(first, len1, tables, max_blocks, page, cos, sin);
  const int64_t T1 = fwd1.batch.T;
  std::vector<float> h1(T1 * H), g1(T1 * H);
  for (int64_t i = 0; i < T1; ++i) std::copy_n(hidden + h_rows[i] * H, H, &h1[i * H]);
  forward_layers(W, mtp_layer, 1, emitted.data(), h1.data(), mtp_cache, fwd1.batch, false, g1.data());

  // 4. the draft chain: rows that want j more drafts
  std::vector<int64_t> rows, prev(B);
  std::vector<float> g(B * H), lg;
  for (int64_t b = 0, off = 0; b < B; off += len1[b], ++b) {
    std::copy_n(&g1[(off + m[b]) * H], H, &g[b * H]);     // g at q = start + m
    if (nd[b] > 0) rows.push_back(b);
  }
  for (int64_t j = 0; !rows.empty(); ++j) {
    const int64_t n = static_cast<int64_t>(rows.size());
    std::vector<float> gx(n * H);
    for (int64_t r = 0; r < n; ++r) std::copy_n(&g[rows[r] * H], H, &gx[r * H]);
    lg.resize(n * V);
    lm_head(W, gx.data(), n, lg.data());
    std::vector<int64_t> next;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t b = rows[r], dj = argmax_row(&lg[r * V], V);
      o[b * ld + 1 + (kmax + 1) + j] = dj;
      prev[b] = dj;
      if (j + 1 < nd[b]) next.push_back(b);
    }
    if (next.empty()) break;
    // D_{j+2} needs MTP(D_{j+1}, g) at start + m + j + 1
    const int64_t nn = static_cast<int64_t>(next.size());
    std::vector<int64_t> f(nn), l1(nn, 1), idn(nn);
    std::vector<int32_t> tab(nn * max_blocks);
    std::vector<float> hn(nn * H), gn(nn * H);
    for (int64_t r = 0; r < nn; ++r) {
      const int64_t b = next[r];
      f[r] = st[b] + m[b] + j + 1;
      idn[r] = prev[b];
      std::copy_n(tables + b * max_blocks, max_blocks, &tab[r * max_blocks]);
      std::copy_n(&g[b * H], H, &hn[r * H]);
    }
    const RowsAt chain(f, l1, tab.data(), max_blocks, page, cos, sin);
    forward_layers(W, mtp_layer, 1, idn.data(), hn.data(), mtp_cache, chain.batch, false, gn.data());
    for (int64_t r = 0; r < nn; ++r) std::copy_n(&gn[r * H], H, &g[next[r] * H]);
    rows = next;
  }
  return {out, hidden_t};
}

}  // namespace mtp_core

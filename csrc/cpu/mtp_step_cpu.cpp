// The MTP decode step in one native call (mtp_core::mtp_step): the CPU twin of the static (CUDA-graph)
// step of mtp_core/engine/static_step.py, with the same contract, for greedy strict rows. MTP Eagle:
//
//   target  = model([t, d_1..d_k])       row b feeds k_b drafts at positions start..start+k_b (main KV written)
//   m       = accepted drafts            d_{i+1} == argmax(logits_i), first index on ties (torch's argmax)
//   emitted = [d_1..d_m, argmax at m]    n = m + 1 tokens
//   g       = MTP(emitted, target hidden)   Eagle forward 1 over positions mtp_valid..start+m (MTP KV written)
//   D_1     = argmax head(g at start+m);  D_j = MTP(D_{j-1}, g) at start+m+j-1, for j <= num_drafts[b]
//             (head: the drafts' head, over the draft vocabulary when the weights carry one: draft_head)
//
// MTP Vanilla (num_modules = K > 1) replaces the last two lines with the K modules' windows (vanilla_chain).
// Rows may carry different numbers of drafts in and out (k_b, num_drafts[b] up to K). A row that wants no
// drafts runs no MTP forward at all (its MTP caches lag: the engine keeps its hidden states), so a step
// without drafts costs what decoding without MTP costs; a row whose caches lag (mtp_valid < start) brings the
// lagging positions' tokens and hidden states as its window and catches up inside the call. Python sees one
// call and one small tensor per step: [B, 1 + (kmax + 1) + dmax] int64 = (n, emitted padded with -1, drafts
// padded with -1), with the target's hidden states [T, H] (what the engine keeps for rows that lag, and what a
// drafter outside the call needs). Every forward is the batch-invariant native forward, so the tokens are the
// eager engine's.
//
// Rows that need their logits stay in the call too (engine/native_step.py prepares what they need along their
// drafts before it): the penalties, logit_bias and min_tokens of process_logits as per-token entries at each of
// the row's positions, a grammar's allowed-token mask at each position and the most drafts the grammar lets it
// accept (LogitsRules: verification takes the argmax of the processed, masked logits), and for a row that wants
// logprobs the log-softmax of its emitted positions' raw logits (the emitted token's and the top N), computed by
// the same ATen kernels as the general path's token_logprobs.
#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log_softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "decode_forward.h"
#include "decode_weights.h"

namespace mtp_core {
namespace {

// The first index of the largest value (torch.argmax on finite logits; a NaN never wins, as `x[i] > x[best]`
// would have it: x[0] NaN gives 0). Two passes, the first in 8 independent chains (one chain of dependent
// compares costs ~1 ns per value).
int64_t argmax_row(const float* x, int64_t n) {
  if (x[0] != x[0]) return 0;
  float m[8];
  for (float& v : m) v = x[0];
  int64_t i = 1;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j)
      if (x[i + j] > m[j]) m[j] = x[i + j];
  for (; i < n; ++i)
    if (x[i] > m[0]) m[0] = x[i];
  float top = m[0];
  for (int j = 1; j < 8; ++j)
    if (m[j] > top) top = m[j];
  for (i = 0; x[i] != top; ++i) {
  }
  return i;
}

// The logits processing of the rows that ask for it, prepared by Python along each row's drafts
// (engine/native_step.py, sampling.logits_rules, structured.guided_masks): at position t of the batch (row b's
// position i continues the output and the drafts d_1..d_i) process_logits' penalties, logit_bias and min_tokens
// as entries, one per token they touch, applied in process_logits' order with the same float32 operations
//
//   y = bias == -inf ? -inf : x + bias       (min_tokens masks the stop tokens; logit_bias)
//   y = y > 0 ? y / rep : y * rep            (repetition: rep 1 for a token not seen yet)
//   y = y - freq;  y = y - pres              (freq = float32(penalty) * count, pres = penalty or 0, both float32)
//
// (so y equals process_logits' value, the sign of a zero aside), then the grammar's mask (tokens whose bit is clear
// become -inf, as xgrammar's apply_token_bitmask_inplace). The grammar also caps the drafts a row may accept: past
// a draft it rejects, a stop token or the grammar's end there is no next mask (structured.verify_guided_row stops
// there). Worked example (tests/test_verifier.py): raw logits [0, 3, 5, 0] at both positions of [t, d1 = 2],
// frequency 1.5 over output [2]: position 0's entry for token 2 has freq 1.5 -> [0, 3, 3.5, 0]: 2 = d1 accepted;
// position 1's has freq 3.0 -> [0, 3, 2, 0]: the bonus is 1.
struct LogitsRules {
  const int32_t* cap = nullptr;       // [B]: the most drafts row b may accept; null: all of them
  const int32_t* start = nullptr;     // [T + 1]: position t's entries are start[t] .. start[t + 1); null: none
  const int64_t* ids = nullptr;       // [E]: token ids, each at most once per position
  const float* vals = nullptr;        // [E, 4]: (bias, rep, freq, pres)
  const int32_t* mask_of = nullptr;   // [T]: position t's row of masks, or -1; null: no masks
  const int32_t* masks = nullptr;     // [M, words]: bit v % 32 of word v / 32 set = token v allowed
  int64_t words = 0;

  bool touches(int64_t t) const { return (start && start[t + 1] > start[t]) || (mask_of && mask_of[t] >= 0); }

  // position t's raw logits x [V] -> y [V], processed and masked
  void apply(const float* x, int64_t V, int64_t t, float* y) const {
    std::copy_n(x, V, y);
    for (int64_t e = start ? start[t] : 0; start && e < start[t + 1]; ++e) {
      const float* v = vals + e * 4;
      float z = y[ids[e]];
      z = v[0] == -INFINITY ? -INFINITY : z + v[0];
      z = z > 0.f ? z / v[1] : z * v[1];
      z = z - v[2];
      z = z - v[3];
      y[ids[e]] = z;
    }
    if (mask_of && mask_of[t] >= 0) {
      const int32_t* bits = masks + mask_of[t] * words;
      for (int64_t i = 0; i < V; ++i)
        if (!((static_cast<uint32_t>(bits[i >> 5]) >> (i & 31)) & 1u)) y[i] = -INFINITY;
    }
  }

  // the target's choice at position t: the argmax of the processed, masked logits (first index on ties)
  int64_t choose(const float* x, int64_t V, int64_t t, std::vector<float>& scratch) const {
    if (!touches(t)) return argmax_row(x, V);
    if (start && start[t + 1] > start[t]) {
      scratch.resize(V);
      apply(x, V, t, scratch.data());
      return argmax_row(scratch.data(), V);
    }
    // a mask alone: the first allowed token of the largest value, in one pass over the allowed ones; when every
    // allowed one is -inf (or none is allowed) every masked value is -inf too, and argmax_row's answer is 0
    const int32_t* bits = masks + mask_of[t] * words;
    int64_t best = -1;
    for (int64_t w = 0; w < words; ++w)
      for (uint32_t m = static_cast<uint32_t>(bits[w]); m; m &= m - 1) {
        const int64_t i = w * 32 + __builtin_ctz(m);
        if (i < V && (best < 0 || x[i] > x[best])) best = i;
      }
    return best < 0 || x[best] == -INFINITY ? 0 : best;
  }
};

// The rules' tensors, checked ("op" names the op in messages); every one absent: no rules (nullopt).
std::optional<LogitsRules> rules_from(const char* op, int64_t B, int64_t T, int64_t V,
                                      const std::optional<at::Tensor>& accept_cap,
                                      const std::optional<at::Tensor>& rule_start,
                                      const std::optional<at::Tensor>& rule_ids,
                                      const std::optional<at::Tensor>& rule_vals,
                                      const std::optional<at::Tensor>& mask_of, const std::optional<at::Tensor>& masks) {
  if (!accept_cap && !rule_start && !rule_ids && !rule_vals && !mask_of && !masks) return std::nullopt;
  LogitsRules r;
  if (accept_cap) {
    const at::Tensor& c = *accept_cap;
    TORCH_CHECK(c.scalar_type() == at::kInt && c.is_contiguous() && c.dim() == 1 && c.numel() == B, op,
                ": accept_cap must be int32 [B]");
    r.cap = c.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(r.cap[b] >= 0, op, ": accept_cap[", b, "] = ", r.cap[b]);
  }
  TORCH_CHECK(!rule_start == !rule_ids && !rule_start == !rule_vals, op,
              ": rule_start, rule_ids and rule_vals go together");
  if (rule_start) {
    const at::Tensor &s = *rule_start, &i = *rule_ids, &v = *rule_vals;
    TORCH_CHECK(s.scalar_type() == at::kInt && s.is_contiguous() && s.dim() == 1 && s.numel() == T + 1 &&
                    i.scalar_type() == at::kLong && i.is_contiguous() && i.dim() == 1 &&
                    v.scalar_type() == at::kFloat && v.is_contiguous() && v.dim() == 2 && v.size(1) == 4 &&
                    v.size(0) == i.numel(),
                op, ": rule_start int32 [T + 1], rule_ids int64 [E], rule_vals float32 [E, 4]");
    r.start = s.data_ptr<int32_t>();
    r.ids = i.data_ptr<int64_t>();
    r.vals = v.data_ptr<float>();
    TORCH_CHECK(r.start[0] == 0 && r.start[T] == i.numel(), op, ": rule_start must run from 0 to ", i.numel());
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(r.start[t + 1] >= r.start[t], op, ": rule_start must not decrease");
    for (int64_t e = 0; e < i.numel(); ++e)
      TORCH_CHECK(r.ids[e] >= 0 && r.ids[e] < V, op, ": rule token id ", r.ids[e], " outside the vocabulary");
  }
  TORCH_CHECK(!mask_of == !masks, op, ": mask_of and masks go together");
  if (mask_of) {
    const at::Tensor &o = *mask_of, &m = *masks;
    r.words = (V + 31) / 32;
    TORCH_CHECK(o.scalar_type() == at::kInt && o.is_contiguous() && o.dim() == 1 && o.numel() == T &&
                    m.scalar_type() == at::kInt && m.is_contiguous() && m.dim() == 2 && m.size(1) == r.words,
                op, ": mask_of int32 [T], masks int32 [M, ceil(vocab / 32) = ", r.words, "]");
    r.mask_of = o.data_ptr<int32_t>();
    r.masks = m.data_ptr<int32_t>();
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(r.mask_of[t] >= -1 && r.mask_of[t] < m.size(0), op, ": mask_of[", t, "] = ", r.mask_of[t],
                  " is not a row of masks");
  }
  return r;
}

// Strict greedy verification of B rows, the one place of it in the native code: row b fed tokens
// tok[qs[b] .. qs[b+1]) (its token t, then its drafts), logits [T, V] the target's at those positions. Draft i + 1
// (tok[qs[b] + 1 + i]) is accepted while it equals the target's choice at position i (the argmax, first index on
// ties; of the processed logits where `rules` touch the position) and the row's cap allows; the row emits its m
// accepted drafts and the choice at position m (the bonus). Writes row b of o ([B, ld], ld >= 1 + (kmax + 1)):
// o[b][0] = m + 1, o[b][1 .. m + 1] = the emitted tokens; m[b] = m. Only a row's own positions are compared: the
// loop stops before its last one.
void verify_greedy_rows(const float* logits, int64_t V, const int64_t* tok, const int32_t* qs, int64_t B,
                        int64_t* o, int64_t ld, std::vector<int64_t>& m, const LogitsRules* rules = nullptr) {
  m.assign(B, 0);
  std::vector<float> scratch;
  auto choice = [&](int64_t t) {
    return rules ? rules->choose(logits + t * V, V, t, scratch) : argmax_row(logits + t * V, V);
  };
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = qs[b + 1] - qs[b];
    const int64_t limit = rules && rules->cap ? std::min<int64_t>(len - 1, rules->cap[b]) : len - 1;
    int64_t a = 0, target = choice(qs[b]);
    while (a < limit && tok[qs[b] + 1 + a] == target) target = choice(qs[b] + ++a);
    m[b] = a;
    o[b * ld] = a + 1;
    for (int64_t i = 0; i < a; ++i) o[b * ld + 1 + i] = tok[qs[b] + 1 + i];
    o[b * ld + 1 + a] = target;
  }
}

// The top n of x [V] (n <= V) as torch.topk(x, n) selects them, ordered by value then id, into top; false when a
// tie straddles the n-th place or x holds a NaN: which of the tied values torch keeps is up to its selection
// algorithm, so the caller asks torch then. Otherwise the set is determined (every value above the n-th, every one
// equal to it), whatever algorithm selects it.
bool top_n(const float* x, int64_t V, int64_t n, std::vector<std::pair<float, int64_t>>& top) {
  // blocks of 32 values: their maxima first (and a NaN check), then only the blocks that can hold a top value
  constexpr int64_t kB = 32;
  const int64_t nb = (V + kB - 1) / kB;
  thread_local std::vector<float> bmax;
  bmax.resize(nb);
  bool nan = false;
  for (int64_t b = 0; b < nb; ++b) {
    float m = -INFINITY;
    for (int64_t i = b * kB; i < std::min(V, (b + 1) * kB); ++i) {
      nan |= x[i] != x[i];
      m = x[i] > m ? x[i] : m;
    }
    bmax[b] = m;
  }
  if (nan) return false;
  top.clear();
  for (int64_t b = 0; b < nb; ++b) {
    if (static_cast<int64_t>(top.size()) == n && !(bmax[b] > top.back().first)) continue;
    for (int64_t i = b * kB; i < std::min(V, (b + 1) * kB); ++i) {
      const float v = x[i];
      if (static_cast<int64_t>(top.size()) == n && !(v > top.back().first)) continue;
      auto at = std::upper_bound(top.begin(), top.end(), v, [](float a, const auto& e) { return a > e.first; });
      top.insert(at, {v, i});             // after the equal ones: they have lower ids
      if (static_cast<int64_t>(top.size()) > n) top.pop_back();
    }
  }
  const float last = top.back().first;
  int64_t kept = 0, all = 0;
  for (const auto& e : top) kept += e.first == last;
  for (int64_t b = 0; b < nb; ++b)
    if (!(bmax[b] < last))
      for (int64_t i = b * kB; i < std::min(V, (b + 1) * kB); ++i) all += x[i] == last;
  return kept == all;
}

// The general path's token_logprobs (sampling.py) of rows that ask: row b's emitted tokens scored by the raw
// logits at its positions (log-softmax in float32 over the row's n emitted positions, by ATen's kernel as there),
// its top N as torch's topk selects them (top_n, or topk itself where a tie straddles the N-th place), ordered by
// value then id. -> (vals [R, 1 + Nmax] float32: the emitted token's log-probability, then the top N values; ids
// [R, Nmax] int64: their ids, -1 padded), R = the asking rows' emitted tokens in row order.
std::tuple<at::Tensor, at::Tensor> emitted_logprobs(const float* logits, int64_t V, const int32_t* qs, int64_t B,
                                                    const int64_t* o, int64_t ld, const int32_t* top,
                                                    const at::TensorOptions& f32, const at::TensorOptions& i64) {
  int64_t R = 0, nmax = 0;
  for (int64_t b = 0; b < B; ++b)
    if (top[b] >= 0) {
      R += o[b * ld];
      nmax = std::max<int64_t>(nmax, std::min<int64_t>(top[b], V));
    }
  at::Tensor vals = at::empty({R, 1 + nmax}, f32), ids = at::empty({R, nmax}, i64);
  float* pv = vals.data_ptr<float>();
  int64_t* pi = ids.data_ptr<int64_t>();
  std::fill_n(pv, R * (1 + nmax), 0.f);
  std::fill_n(pi, R * nmax, int64_t{-1});
  std::vector<std::pair<float, int64_t>> pairs;
  for (int64_t b = 0, r = 0; b < B; ++b) {
    if (top[b] < 0) continue;
    const int64_t n = o[b * ld], N = std::min<int64_t>(top[b], V);
    // the row's first n positions, as token_logprobs' logits[:len(tokens)]
    const at::Tensor raw = at::from_blob(const_cast<float*>(logits + qs[b] * V), {n, V}, f32);
    const at::Tensor lp = at::log_softmax(raw, -1);
    const float* l = lp.data_ptr<float>();
    for (int64_t j = 0; j < n; ++j) {
      pv[(r + j) * (1 + nmax)] = l[j * V + o[b * ld + 1 + j]];
      if (!N) continue;
      if (!top_n(l + j * V, V, N, pairs)) {
        const auto [tv, ti] = at::topk(lp[j], N, -1, true, true);
        pairs.clear();
        for (int64_t k = 0; k < N; ++k) pairs.emplace_back(tv.data_ptr<float>()[k], ti.data_ptr<int64_t>()[k]);
        std::sort(pairs.begin(), pairs.end(), [](const auto& x, const auto& y) {
          return x.first > y.first || (x.first == y.first && x.second < y.second);
        });
      }
      for (int64_t k = 0; k < N; ++k) {
        pv[(r + j) * (1 + nmax) + 1 + k] = pairs[k].first;
        pi[(r + j) * nmax + k] = pairs[k].second;
      }
    }
    r += n;
  }
  return {vals, ids};
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

// The block tables of rows `rows` (indices into tables [B, max_blocks]), packed in that order.
std::vector<int32_t> tables_of(const std::vector<int64_t>& rows, const int32_t* tables, int64_t max_blocks) {
  std::vector<int32_t> out(rows.size() * max_blocks);
  for (size_t r = 0; r < rows.size(); ++r)
    std::copy_n(tables + rows[r] * max_blocks, max_blocks, &out[r * max_blocks]);
  return out;
}

// One row's stored positions before `start` that an MTP forward re-feeds: tokens x_{q+1}, main hidden h_q.
struct Window {
  const int64_t* ids = nullptr;
  const float* hidden = nullptr;
  std::vector<int64_t> off;          // row b's entries: [off[b], off[b + 1]), the last ones end at start - 1
  std::vector<int64_t> mtp_valid;    // row b's MTP caches hold positions 0 .. mtp_valid[b] - 1

  // row b's last n entries, appended to toks / hids
  void tail(int64_t b, int64_t n, int64_t H, std::vector<int64_t>& toks, std::vector<float>& hids) const {
    const int64_t w0 = off[b + 1] - n;
    toks.insert(toks.end(), ids + w0, ids + off[b + 1]);
    hids.insert(hids.end(), hidden + w0 * H, hidden + off[b + 1] * H);
  }
};

// The confidence gate (speculative_config.draft_confidence_threshold, drafter.py): a row's chain stops before
// the first draft at which the running product of the drafts' probabilities under the MTP head (softmax of
// its logits, no temperature) falls below the threshold. Off at threshold 0.
struct Gate {
  double threshold = 0.0;
  std::vector<double> conf;     // per run row
  std::vector<char> stopped;

  Gate(double thr, int64_t rows) : threshold(thr), conf(rows, 1.0), stopped(rows, 0) {}

  // row r's next draft has logits x [n]: true when it is taken
  bool pass(int64_t r, const float* x, int64_t n) {
    if (threshold <= 0.0) return true;
    float mx = x[0];
    for (int64_t i = 1; i < n; ++i) mx = std::max(mx, x[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) sum += std::exp(x[i] - mx);
    conf[r] *= static_cast<double>(1.f / sum);      // the largest probability: exp(0) / sum
    if (conf[r] < threshold) stopped[r] = 1;
    return !stopped[r];
  }
};

// MTP Vanilla after verification (drafter.py's VanillaDrafter, the same numbers), for the rows `run` (those
// that want drafts): row b's window is positions s_b .. V_b - 1 with V_b = start + m + 1 and
// s_b = max(min(V_b - K, mtp_valid), 0), fed as (x_{q+1}, main h_q); module k runs over the window plus the row's
// first min(k, nd_b) drafts (D_j, g_j) at V_b .., and its output at the last position gives D_{k+1} (g_{k+1})
// while k < nd_b. Every module runs over every such row's window, so none of their caches lags. Returns the new
// windows: the main hidden states of each row's last min(K, V_b - s_b) valid positions, right-aligned in
// [B, K, H] (zero for rows not run).
at::Tensor vanilla_chain(const DecodeWeights& W, int64_t mtp_layer, int64_t K, at::TensorList caches,
                         const std::vector<int64_t>& run, const float* hidden, const int32_t* qs, const int64_t* st,
                         const int32_t* nd, const std::vector<int64_t>& m, int64_t* o, int64_t ld, int64_t kmax,
                         const Window& win, const int32_t* tables, int64_t max_blocks, int64_t page, const float* cos,
                         const float* sin, double confidence) {
  const int64_t B = static_cast<int64_t>(m.size()), R = static_cast<int64_t>(run.size());
  Gate gate(confidence, R);
  const int64_t H = W.dims().H, V = W.draft_vocab();    // drafts are scored over the draft vocabulary
  std::vector<int64_t> s(R), base(R);
  std::vector<std::vector<int64_t>> toks(R);    // per run row: the window's tokens, then its drafts
  std::vector<std::vector<float>> hids(R);      // their hidden states [n, H]
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = run[r], valid = st[b] + m[b] + 1;
    s[r] = std::max<int64_t>(std::min<int64_t>(valid - K, win.mtp_valid[b]), 0);
    win.tail(b, st[b] - s[r], H, toks[r], hids[r]);                 // the stored positions the window re-reads
    for (int64_t i = 0; i <= m[b]; ++i) toks[r].push_back(o[b * ld + 1 + i]);
    hids[r].insert(hids[r].end(), hidden + qs[b] * H, hidden + (qs[b] + m[b] + 1) * H);
    base[r] = static_cast<int64_t>(toks[r].size());
  }
  at::Tensor window = at::zeros({B, K, H}, at::TensorOptions().dtype(at::kFloat));
  float* wout = window.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = std::min(K, base[r]);
    std::copy_n(hids[r].data() + (base[r] - n) * H, n * H, wout + (run[r] * K + K - n) * H);
  }
  const std::vector<int32_t> tab = tables_of(run, tables, max_blocks);
  std::vector<float> lg;
  for (int64_t k = 0; k < K; ++k) {
    std::vector<int64_t> len(R), ids;
    std::vector<float> hin;
    for (int64_t r = 0; r < R; ++r) {
      len[r] = static_cast<int64_t>(toks[r].size());
      ids.insert(ids.end(), toks[r].begin(), toks[r].end());
      hin.insert(hin.end(), hids[r].begin(), hids[r].end());
    }
    const RowsAt rows(s, len, tab.data(), max_blocks, page, cos, sin);
    std::vector<float> g(R * H);                  // the module's output at each row's last position
    forward_layers(W, mtp_layer + k, 1, ids.data(), hin.data(), {caches[mtp_layer + k]}, rows.batch, false,
                   g.data(), Outputs::kLast);
    std::vector<int64_t> active;                  // run rows (indices r) that may take a draft from module k
    for (int64_t r = 0; r < R; ++r)
      if (k < nd[run[r]] && !gate.stopped[r]) active.push_back(r);
    if (active.empty()) continue;
    const int64_t n = static_cast<int64_t>(active.size());
    std::vector<float> last(n * H);
    for (int64_t a = 0; a < n; ++a)
      std::copy_n(&g[active[a] * H], H, &last[a * H]);
    lg.resize(n * V);
    draft_logits(W, last.data(), n, lg.data());
    for (int64_t a = 0; a < n; ++a) {
      const int64_t r = active[a], dk = W.draft_id(argmax_row(&lg[a * V], V));
      if (!gate.pass(r, &lg[a * V], V)) continue;      // no draft from here on; the modules still run its window
      o[run[r] * ld + 1 + (kmax + 1) + k] = dk;
      if (k + 1 < K) {          // the next modules see this draft
        toks[r].push_back(dk);
        hids[r].insert(hids[r].end(), &last[a * H], &last[a * H] + H);
      }
    }
  }
  return window;
}

// MTP Eagle after verification for the rows `run`: forward 1 over positions mtp_valid .. start + m (the lagging
// positions from the window, then the newly valid ones), D_1 from its output at start + m, then the chain.
void eagle_chain(const DecodeWeights& W, int64_t mtp_layer, at::TensorList caches, const std::vector<int64_t>& run,
                 const float* hidden, const int32_t* qs, const int64_t* st, const int32_t* nd,
                 const std::vector<int64_t>& m, int64_t* o, int64_t ld, int64_t kmax, const Window& win,
                 const int32_t* tables, int64_t max_blocks, int64_t page, const float* cos, const float* sin,
                 double confidence) {
  const int64_t R = static_cast<int64_t>(run.size()), H = W.dims().H, V = W.draft_vocab();
  Gate gate(confidence, R);
  const std::vector<at::Tensor> cache{caches[mtp_layer]};
  const std::vector<int32_t> tab = tables_of(run, tables, max_blocks);
  std::vector<int64_t> first(R), len1(R), tok1;
  std::vector<float> h1;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = run[r];
    first[r] = win.mtp_valid[b];
    win.tail(b, st[b] - first[r], H, tok1, h1);
    for (int64_t i = 0; i <= m[b]; ++i) tok1.push_back(o[b * ld + 1 + i]);
    h1.insert(h1.end(), hidden + qs[b] * H, hidden + (qs[b] + m[b] + 1) * H);
    len1[r] = st[b] + m[b] + 1 - first[r];
  }
  const RowsAt fwd1(first, len1, tab.data(), max_blocks, page, cos, sin);
  std::vector<float> g(R * H), lg;    // g: each row's output at q = start + m (the positions before it: KV only)
  forward_layers(W, mtp_layer, 1, tok1.data(), h1.data(), cache, fwd1.batch, false, g.data(), Outputs::kLast);

  // the draft chain: run rows (indices r) that want j more drafts
  std::vector<int64_t> rows(R), prev(R);
  for (int64_t r = 0; r < R; ++r) rows[r] = r;
  for (int64_t j = 0; !rows.empty(); ++j) {
    const int64_t n = static_cast<int64_t>(rows.size());
    std::vector<float> gx(n * H);
    for (int64_t a = 0; a < n; ++a) std::copy_n(&g[rows[a] * H], H, &gx[a * H]);
    lg.resize(n * V);
    draft_logits(W, gx.data(), n, lg.data());
    std::vector<int64_t> next;
    for (int64_t a = 0; a < n; ++a) {
      const int64_t r = rows[a], dj = W.draft_id(argmax_row(&lg[a * V], V));
      if (!gate.pass(r, &lg[a * V], V)) continue;      // the chain of row r stops here
      o[run[r] * ld + 1 + (kmax + 1) + j] = dj;
      prev[r] = dj;
      if (j + 1 < nd[run[r]]) next.push_back(r);
    }
    if (next.empty()) break;
    // D_{j+2} needs MTP(D_{j+1}, g) at start + m + j + 1
    const int64_t nn = static_cast<int64_t>(next.size());
    std::vector<int64_t> f(nn), l1(nn, 1), idn(nn), nb(nn);
    std::vector<float> hn(nn * H), gn(nn * H);
    for (int64_t a = 0; a < nn; ++a) {
      const int64_t r = next[a], b = run[r];
      f[a] = st[b] + m[b] + j + 1;
      idn[a] = prev[r];
      nb[a] = b;
      std::copy_n(&g[r * H], H, &hn[a * H]);
    }
    const std::vector<int32_t> tn = tables_of(nb, tables, max_blocks);
    const RowsAt chain(f, l1, tn.data(), max_blocks, page, cos, sin);
    forward_layers(W, mtp_layer, 1, idn.data(), hn.data(), cache, chain.batch, false, gn.data());
    for (int64_t a = 0; a < nn; ++a) std::copy_n(&gn[a * H], H, &g[next[a] * H]);
    rows = next;
  }
}

// The rope tables an op reads (op names it in messages): contiguous float32 [max_pos, rope / 2], cos and sin alike.
void check_rope(const char* op, const at::Tensor& cos, const at::Tensor& sin, int64_t rope_dim) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) * 2 == rope_dim && sin.sizes() == cos.sizes(),
              op, ": rope tables must be contiguous float32 [max_pos, rope/2]");
}

// Row b of an op's batch: every position it writes, up to `last`, is a cache slot of its table and a row of the
// rope tables, and the tokens it feeds, tok[t0 .. t1), are in the vocabulary.
void check_row(const char* op, int64_t b, int64_t last, const int32_t* tables, int64_t max_blocks, int64_t page,
               int64_t num_blocks, int64_t rope_len, const int64_t* tok, int64_t t0, int64_t t1, int64_t V) {
  TORCH_CHECK(last < rope_len && (last / page) < max_blocks, op, ": row ", b, " reaches position ", last,
              " beyond its block table or the rope table");
  for (int64_t i = 0; i <= last / page; ++i) {
    const int32_t blk = tables[b * max_blocks + i];
    TORCH_CHECK(blk >= 0 && blk < num_blocks, op, ": block_tables[", b, ", ", i, "] = ", blk, " is not a cache block");
  }
  for (int64_t t = t0; t < t1; ++t)
    TORCH_CHECK(tok[t] >= 0 && tok[t] < V, op, ": token id ", tok[t], " outside the vocabulary");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> mtp_step_cpu(
    const c10::intrusive_ptr<DecodeWeights>& weights, const at::Tensor& ids, const at::Tensor& query_start,
    const at::Tensor& start, const at::Tensor& block_tables, const at::Tensor& num_drafts, at::TensorList caches,
    const at::Tensor& rope_cos, const at::Tensor& rope_sin, int64_t mtp_layer, int64_t num_modules,
    const std::optional<at::Tensor>& window_ids, const std::optional<at::Tensor>& window_hidden,
    const std::optional<at::Tensor>& window_len, const std::optional<at::Tensor>& mtp_valid, double confidence,
    const std::optional<at::Tensor>& accept_cap, const std::optional<at::Tensor>& rule_start,
    const std::optional<at::Tensor>& rule_ids, const std::optional<at::Tensor>& rule_vals,
    const std::optional<at::Tensor>& mask_of, const std::optional<at::Tensor>& masks,
    const std::optional<at::Tensor>& top_logprobs) {
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
  const bool vanilla = drafting && num_modules > 1;   // modules mtp_layer .. mtp_layer + num_modules - 1
  TORCH_CHECK(num_modules >= 1, "mtp_step: num_modules must be >= 1");
  TORCH_CHECK(confidence >= 0.0 && confidence < 1.0, "mtp_step: confidence must be in [0, 1)");
  for (int64_t k = 0; drafting && k < num_modules; ++k)
    TORCH_CHECK(mtp_layer >= L && mtp_layer + k < W.num_layers() && W.layers()[mtp_layer + k].eh_proj.defined() &&
                    static_cast<int64_t>(caches.size()) > mtp_layer + k,
                "mtp_step: mtp_layer .. mtp_layer + num_modules - 1 must be MTP modules with caches, or mtp_layer -1");
  TORCH_CHECK(static_cast<int64_t>(caches.size()) >= L, "mtp_step: a cache per main layer is needed");
  check_rope("mtp_step", rope_cos, rope_sin, d.P);
  std::vector<int64_t> checked{0};       // main layer 0 and every MTP module this step runs, alike
  for (int64_t k = 0; drafting && k < num_modules; ++k) checked.push_back(mtp_layer + k);
  for (int64_t l : checked) {
    const at::Tensor& c = caches[l];
    TORCH_CHECK(c.dim() == 3 && c.size(2) == d.cache_row() && c.is_contiguous() &&
                    (c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16 ||
                     c.scalar_type() == at::kFloat8_e4m3fn) &&
                    c.sizes() == caches[0].sizes() && c.scalar_type() == caches[0].scalar_type(),
                "mtp_step: caches must be contiguous [blocks, page, R+P (+ the index key on DeepSeek-V3.2)] "
                "float32/bfloat16/float8_e4m3fn, all alike");
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
    TORCH_CHECK(!vanilla || nd[b] <= num_modules, "mtp_step: row ", b, " wants ", nd[b], " drafts from ",
                num_modules, " MTP Vanilla modules");
    kmax = std::max(kmax, nq - 1);
    dmax = std::max<int64_t>(dmax, nd[b]);
    // every position this step writes (target, forward 1 or the windows, the chain) must be a cache slot of the
    // row's table: Eagle's chain ends at start + m + nd - 1, Vanilla's (module k: min(k, nd) drafts past the valid
    // length) at start + m + min(K - 1, nd)
    const int64_t chain = vanilla ? std::min<int64_t>(num_modules - 1, nd[b]) : std::max<int64_t>(nd[b] - 1, 0);
    check_row("mtp_step", b, st[b] + nq - 1 + chain, tables, max_blocks, page, num_blocks, rope_cos.size(0), tok,
              qs[b], qs[b + 1], V);
  }
  // the rows' windows: window_len[b] stored positions before start (token x_{q+1}, main hidden h_q) for the rows
  // that draft: at least the lagging ones (mtp_valid .. start - 1) and, for Vanilla, min(K - 1, start) (its
  // window reaches up to K - 1 positions back). Absent: no row lags.
  Window win;
  win.off.assign(B + 1, 0);
  win.mtp_valid.assign(st, st + B);
  if (drafting && (window_len || window_ids || window_hidden || mtp_valid)) {
    TORCH_CHECK(window_ids && window_hidden && window_len && mtp_valid,
                "mtp_step: window_ids, window_hidden, window_len and mtp_valid go together");
    const at::Tensor &wi = *window_ids, &wh = *window_hidden, &wl = *window_len, &mv = *mtp_valid;
    TORCH_CHECK(wl.scalar_type() == at::kInt && wl.is_contiguous() && wl.numel() == B &&
                    mv.scalar_type() == at::kLong && mv.is_contiguous() && mv.numel() == B &&
                    wi.scalar_type() == at::kLong && wi.is_contiguous() && wi.dim() == 1 &&
                    wh.scalar_type() == at::kFloat && wh.is_contiguous() && wh.dim() == 2 && wh.size(1) == H &&
                    wh.size(0) == wi.numel(),
                "mtp_step: window_len int32 [B], mtp_valid int64 [B], window_ids int64 [W], window_hidden float32 "
                "[W, hidden]");
    const int32_t* w = wl.data_ptr<int32_t>();
    const int64_t* v = mv.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t need = nd[b] == 0 ? 0 : std::max<int64_t>(st[b] - v[b], vanilla ? std::min(num_modules - 1, st[b]) : 0);
      TORCH_CHECK(v[b] >= 0 && v[b] <= st[b] && w[b] >= need && w[b] <= st[b], "mtp_step: row ", b,
                  " brings a window of ", w[b], " positions before position ", st[b], " (MTP caches valid up to ",
                  v[b], ")");
      win.off[b + 1] = win.off[b] + w[b];
      win.mtp_valid[b] = v[b];
    }
    TORCH_CHECK(win.off[B] == wi.numel(), "mtp_step: window_ids holds ", wi.numel(), " tokens, window_len sums to ",
                win.off[B]);
    win.ids = wi.data_ptr<int64_t>();
    win.hidden = wh.data_ptr<float>();
    for (int64_t i = 0; i < win.off[B]; ++i)
      TORCH_CHECK(win.ids[i] >= 0 && win.ids[i] < V, "mtp_step: window token id ", win.ids[i],
                  " outside the vocabulary");
  } else {
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(!vanilla || nd[b] == 0 || st[b] == 0, "mtp_step: MTP Vanilla needs the rows' windows");
  }
  const std::optional<LogitsRules> rules =
      rules_from("mtp_step", B, T, V, accept_cap, rule_start, rule_ids, rule_vals, mask_of, masks);
  const int32_t* top = nullptr;
  if (top_logprobs) {
    const at::Tensor& tl = *top_logprobs;
    TORCH_CHECK(tl.scalar_type() == at::kInt && tl.is_contiguous() && tl.dim() == 1 && tl.numel() == B,
                "mtp_step: top_logprobs must be int32 [B]");
    top = tl.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(top[b] >= -1, "mtp_step: top_logprobs[", b, "] = ", top[b], " (-1: no logprobs)");
  }
  const std::vector<at::Tensor> main_caches(caches.begin(), caches.begin() + L);
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

  // 2. strict verification (of the processed, masked logits where rules touch a position), the logprobs asked for
  at::Tensor out = at::full({B, 1 + (kmax + 1) + dmax}, -1, ids.options());
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t ld = out.size(1);
  std::vector<int64_t> m, run;
  verify_greedy_rows(logits.data(), V, tok, qs, B, o, ld, m, rules ? &*rules : nullptr);
  at::Tensor lp_vals = at::empty({0, 1}, hidden_t.options()), lp_ids = at::empty({0, 0}, ids.options());
  if (top) std::tie(lp_vals, lp_ids) = emitted_logprobs(logits.data(), V, qs, B, o, ld, top, hidden_t.options(),
                                                        ids.options());
  for (int64_t b = 0; b < B; ++b)
    if (nd[b] > 0) run.push_back(b);     // 3. the MTP forwards, for the rows that want drafts
  at::Tensor window = at::empty({0}, hidden_t.options());
  if (run.empty()) return {out, hidden_t, window, lp_vals, lp_ids};
  if (vanilla)
    window = vanilla_chain(W, mtp_layer, num_modules, caches, run, hidden, qs, st, nd, m, o, ld, kmax, win, tables,
                           max_blocks, page, cos, sin, confidence);
  else
    eagle_chain(W, mtp_layer, caches, run, hidden, qs, st, nd, m, o, ld, kmax, win, tables, max_blocks, page, cos,
                sin, confidence);
  return {out, hidden_t, window, lp_vals, lp_ids};
}

// MTP Eagle's drafting alone (drafter.py's EagleDrafter.propose, the same numbers), for rows whose newly valid
// positions come from elsewhere (a prompt's prefill, the general path's target forward, a catch-up): row b fed
// ids[qs[b] .. qs[b+1]) (x_{q+1} for its positions start[b] ..) with the main hidden states hidden[qs[b] ..
// qs[b+1]); forward 1 writes their MTP KV, and D_1 .. D_{num_drafts[b]} follow by the chain, as in mtp_step
// (eagle_chain: the row is a row that accepted every fed token, whose MTP caches hold positions before start[b])
// -> [B, max num_drafts] int64, -1 padded. Every row drafts at least one token.
at::Tensor eagle_draft_cpu(const c10::intrusive_ptr<DecodeWeights>& weights, const at::Tensor& ids,
                           const at::Tensor& hidden, const at::Tensor& query_start, const at::Tensor& start,
                           const at::Tensor& block_tables, const at::Tensor& num_drafts, at::TensorList caches,
                           const at::Tensor& rope_cos, const at::Tensor& rope_sin, int64_t mtp_layer) {
  const DecodeWeights& W = *weights;
  const DecodeDims& d = W.dims();
  const int64_t H = d.H, V = d.vocab;
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous() && ids.dim() == 1 &&
                  hidden.scalar_type() == at::kFloat && hidden.is_contiguous() && hidden.dim() == 2 &&
                  hidden.size(0) == ids.numel() && hidden.size(1) == H,
              "eagle_draft: ids int64 [T], hidden float32 [T, hidden]");
  TORCH_CHECK(query_start.scalar_type() == at::kInt && query_start.is_contiguous() &&
                  start.scalar_type() == at::kLong && start.is_contiguous() &&
                  num_drafts.scalar_type() == at::kInt && num_drafts.is_contiguous() &&
                  block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2,
              "eagle_draft: query_start / num_drafts int32, start int64, block_tables int32 [B, max_blocks]");
  const int64_t B = block_tables.size(0), max_blocks = block_tables.size(1), T = ids.numel();
  TORCH_CHECK(B >= 1 && query_start.numel() == B + 1 && start.numel() == B && num_drafts.numel() == B,
              "eagle_draft: query_start [B+1], start [B], num_drafts [B]");
  TORCH_CHECK(mtp_layer >= d.num_main && mtp_layer < W.num_layers() && W.layers()[mtp_layer].eh_proj.defined() &&
                  static_cast<int64_t>(caches.size()) > mtp_layer,
              "eagle_draft: mtp_layer must be an MTP module with a cache");
  const at::Tensor& c = caches[mtp_layer];
  TORCH_CHECK(c.dim() == 3 && c.size(2) == d.cache_row() && c.is_contiguous() &&
                  (c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16 ||
                   c.scalar_type() == at::kFloat8_e4m3fn),
              "eagle_draft: the MTP cache must be contiguous [blocks, page, R+P] float32/bfloat16/float8_e4m3fn");
  check_rope("eagle_draft", rope_cos, rope_sin, d.P);
  const int64_t page = c.size(1), num_blocks = c.size(0);
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int64_t* st = start.data_ptr<int64_t>();
  const int32_t* nd = num_drafts.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* tok = ids.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[B] == T, "eagle_draft: query_start must run from 0 to T");
  int64_t kmax = 0, dmax = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qs[b + 1] - qs[b];
    TORCH_CHECK(n >= 1 && nd[b] >= 1 && st[b] >= 0, "eagle_draft: row ", b, " feeds ", n, " tokens, wants ", nd[b],
                " drafts");
    kmax = std::max(kmax, n - 1);
    dmax = std::max<int64_t>(dmax, nd[b]);
    check_row("eagle_draft", b, st[b] + n - 1 + nd[b] - 1, tables, max_blocks, page, num_blocks, rope_cos.size(0),
              tok, qs[b], qs[b + 1], V);     // up to the chain's last position
  }
  // each row as mtp_step sees a row that accepted all it fed: n tokens emitted at start .. start + n - 1
  const int64_t ld = 1 + (kmax + 1) + dmax;
  std::vector<int64_t> o(B * ld, -1), m(B), run(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = qs[b + 1] - qs[b];
    o[b * ld] = n;
    std::copy_n(tok + qs[b], n, &o[b * ld + 1]);
    m[b] = n - 1;
    run[b] = b;
  }
  Window win;
  win.off.assign(B + 1, 0);
  win.mtp_valid.assign(st, st + B);
  eagle_chain(W, mtp_layer, caches, run, hidden.data_ptr<float>(), qs, st, nd, m, o.data(), ld, kmax, win, tables,
              max_blocks, page, rope_cos.data_ptr<float>(), rope_sin.data_ptr<float>(), 0.0);
  at::Tensor out = at::empty({B, dmax}, ids.options());
  int64_t* po = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) std::copy_n(&o[b * ld + 1 + (kmax + 1)], dmax, po + b * dmax);
  return out;
}

// The step's verification alone, on given logits (tests feed it hand-checked tables): logits [T, V] float32,
// ids [T] int64 (each row's token then its drafts), query_start [B + 1] int32, and optionally the rows' rules as
// mtp_step takes them -> [B, 1 + max row length] int64: (n, emitted tokens, -1 padded), as mtp_step's first columns.
at::Tensor verify_greedy_cpu(const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& query_start,
                             const std::optional<at::Tensor>& accept_cap, const std::optional<at::Tensor>& rule_start,
                             const std::optional<at::Tensor>& rule_ids, const std::optional<at::Tensor>& rule_vals,
                             const std::optional<at::Tensor>& mask_of, const std::optional<at::Tensor>& masks) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous() &&
                  ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous() &&
                  query_start.scalar_type() == at::kInt && query_start.dim() == 1 && query_start.is_contiguous() &&
                  query_start.numel() >= 2 && logits.size(0) == ids.numel(),
              "verify_greedy: logits float32 [T, V], ids int64 [T], query_start int32 [B + 1]");
  const int64_t B = query_start.numel() - 1, T = ids.numel(), V = logits.size(1);
  const int32_t* qs = query_start.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[B] == T, "verify_greedy: query_start must run from 0 to T");
  int64_t width = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qs[b + 1] > qs[b], "verify_greedy: row ", b, " feeds no token");
    width = std::max<int64_t>(width, qs[b + 1] - qs[b]);
  }
  const std::optional<LogitsRules> rules =
      rules_from("verify_greedy", B, T, V, accept_cap, rule_start, rule_ids, rule_vals, mask_of, masks);
  at::Tensor out = at::full({B, 1 + width}, -1, ids.options());
  std::vector<int64_t> m;
  verify_greedy_rows(logits.data_ptr<float>(), V, ids.data_ptr<int64_t>(), qs, B, out.data_ptr<int64_t>(), 1 + width,
                     m, rules ? &*rules : nullptr);
  return out;
}

// The rules' processing alone (tests hold it to process_logits and the grammar mask value by value): logits [T, V]
// float32 -> the processed, masked logits [T, V] that verify_greedy takes its choices from.
at::Tensor apply_logits_rules_cpu(const at::Tensor& logits, const at::Tensor& rule_start, const at::Tensor& rule_ids,
                                  const at::Tensor& rule_vals, const std::optional<at::Tensor>& mask_of,
                                  const std::optional<at::Tensor>& masks) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "apply_logits_rules: logits must be contiguous float32 [T, V]");
  const int64_t T = logits.size(0), V = logits.size(1);
  const LogitsRules rules =
      *rules_from("apply_logits_rules", 0, T, V, std::nullopt, rule_start, rule_ids, rule_vals, mask_of, masks);
  at::Tensor out = at::empty_like(logits);
  for (int64_t t = 0; t < T; ++t)
    rules.apply(logits.data_ptr<float>() + t * V, V, t, out.data_ptr<float>() + t * V);
  return out;
}

}  // namespace mtp_core

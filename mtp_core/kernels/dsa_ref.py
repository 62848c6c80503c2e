"""Torch reference of DeepSeek Sparse Attention's selection (DSA, DeepSeek-V3.2): the lightning indexer's scores
and the top-k keys they choose, the maths csrc/cpu/dsa_cpu.cpp runs natively.

    score(s, t) = sum_h w_h * relu(q_h . k_t * Di^-0.5)      q [heads, Di] and w [heads] of query s, k_t [Di]

The indexer's projections that make q, w and k are the model's (mtp_core/model/dsa.py: Indexer); the torch
attention (model/mla.py) and the native forward's reference (native_ref.py) both select with these two
functions. Ties: keys with equal scores are taken lower position first (a stable descending sort), here and in
the native forward, so a selection never depends on how a batch is laid out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# scores are accumulated over head groups so that [Q, heads, L] is never materialised at once
_SCORE_CHUNK_FLOATS = 1 << 24


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [..., Q, heads, Di], w [..., Q, heads], keys [..., L, Di] -> float32 [..., Q, L]:
    sum_h w_h * relu(q_h . k * Di^-0.5)."""
    q, w, keys = q.float(), w.float(), keys.float()
    nh, di = q.shape[-2], q.shape[-1]
    out = None
    step = max(1, _SCORE_CHUNK_FLOATS // max(1, q.shape[-3] * keys.shape[-2]))
    for h0 in range(0, nh, step):
        h1 = min(nh, h0 + step)
        s = torch.einsum("...qhd,...ld->...qhl", q[..., h0:h1, :], keys) * di ** -0.5   # [..., Q, h, L]
        part = (F.relu(s) * w[..., h0:h1, None]).sum(-2)
        out = part if out is None else out + part
    return out


def select_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., Q, L], visible [..., Q, L] bool -> bool [..., Q, L]: the k best visible keys of each query
    (every visible key when at most k are visible); equal scores go to the lower position first."""
    if scores.shape[-1] <= k:
        return visible
    scores = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = torch.zeros_like(visible).scatter_(-1, order, True)
    return chosen & visible

"""DeepSeek MoE: sigmoid router with group-limited top-k (noaux_tc), routed + shared experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_core.config import ModelConfig
from mtp_core.model.layers import MLP


class Gate(nn.Module):
    """Router. Selection uses sigmoid scores + e_score_correction_bias; the mixing weights use the
    un-biased scores (normalised over the chosen experts if norm_topk_prob) x routed_scaling_factor."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = int(cfg.n_routed_experts)
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()              # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)              # [T, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(x.shape[0], -1)
        idx = choice.topk(self.top_k, dim=-1).indices                            # [T, k]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.routed_scaling_factor, idx


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(int(cfg.n_routed_experts)))
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden]. Each expert runs only on the tokens routed to it."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.gate(x)                                               # [T, k]
        if self.training:   # expert loads, for aux-loss-free balancing of e_score_correction_bias
            self.load_counts = torch.bincount(idx.flatten(), minlength=len(self.experts)).detach()
        out = self.routed(x, weights, idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        flat_idx = idx.flatten()                                                  # [T*k]
        order = flat_idx.argsort(stable=True)
        counts = torch.bincount(flat_idx, minlength=len(self.experts)).tolist()
        token_of = order // idx.shape[1]                                          # [T*k] token per slot
        w_sorted = weights.flatten()[order].to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start:start + n]
            y = self.experts[e](x[tok]) * w_sorted[start:start + n, None]
            out.index_add_(0, tok, y)
            start += n
        return out

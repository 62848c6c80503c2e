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


def _plain_mlp(m: nn.Module) -> bool:
    """An MLP of plain nn.Linear weights (not quantized or replaced), whose weights can be stacked."""
    return type(m) is MLP and all(type(l) is nn.Linear for l in (m.gate_proj, m.up_proj, m.down_proj))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(int(cfg.n_routed_experts)))
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None   # set by fuse_for_decode()

    # Batches of at most this many tokens run every expert densely when fused (see fuse_for_decode), if
    # they pick at least half the experts' worth of (token, expert) pairs (a single token's 2 of 8 experts
    # read fewer bytes the sparse way).
    DENSE_MAX_TOKENS = 16
    # ... and only when all expert weights together are at most this many bytes.
    DENSE_MAX_BYTES = 16 << 20

    @torch.no_grad()
    def fuse_for_decode(self) -> bool:
        """Stacks the routed experts (and a same-sized shared expert as one more) into
        W13 [(E+1) * 2I, H] (gate | up per expert) and W2 [E+1, H, I]; the experts' own weights become views
        of these, so memory does not grow. A small batch (decode, verification, MTP drafts) then runs all
        experts at once in 2 matmuls + 1 batched matmul, with the router weights (0 for unchosen experts,
        1 for the shared one) applied before the down projection, instead of ~8 small ops per chosen
        expert. The dense work reads every expert's weights, so it is only used while they are small
        (DENSE_MAX_BYTES): a tiny model's step is dominated by per-op cost, not bytes."""
        mlps = [*self.experts, *([self.shared_experts] if self.shared_experts is not None else [])]
        if type(self) is not MoE or not all(map(_plain_mlp, mlps)):
            return False
        inter = self.experts[0].gate_proj.weight.shape[0]
        if self.shared_experts is not None and self.shared_experts.gate_proj.weight.shape[0] != inter:
            return False
        w = self.experts[0].gate_proj.weight
        if len(mlps) * 3 * w.numel() * w.element_size() > self.DENSE_MAX_BYTES:
            return False
        w13 = torch.stack([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in mlps])   # [E+1, 2I, H]
        w2 = torch.stack([m.down_proj.weight for m in mlps])                                   # [E+1, H, I]
        for e, m in enumerate(mlps):
            m.gate_proj.weight = nn.Parameter(w13[e, :inter], requires_grad=False)
            m.up_proj.weight = nn.Parameter(w13[e, inter:], requires_grad=False)
            m.down_proj.weight = nn.Parameter(w2[e], requires_grad=False)
        self.stacked = (w13.view(-1, w13.shape[-1]), w2)
        return True

    def forward_static(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] through every expert (the dense path whatever T): fixed shapes and no host sync, as the
        CUDA-graph step needs. Only for a fused MoE (fuse_for_decode returned True)."""
        weights, idx = self.gate(x)                                               # [T, k]
        return self.dense(x, weights, idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden]. Each expert runs only on the tokens routed to it."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.gate(x)                                               # [T, k]
        # the dense path serves the paged engine's [T, hidden] batches; the reference / training layout
        # [B, S, hidden] always takes the routed loop (so it stays the unfused reference)
        serving = len(shape) == 2 and self.stacked is not None and not self.training
        if serving and x.shape[0] <= self.DENSE_MAX_TOKENS and 2 * idx.numel() >= len(self.experts):
            return self.dense(x, weights, idx).view(shape)
        if self.training:   # expert loads, for aux-loss-free balancing of e_score_correction_bias
            self.load_counts = torch.bincount(idx.flatten(), minlength=len(self.experts)).detach()
        grouped = (self.training and torch.is_grad_enabled() and type(self) is MoE
                   and all(map(_plain_mlp, self.experts)))
        out = self.grouped(x, weights, idx) if grouped else self.routed(x, weights, idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)

    def dense(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, mixed by the router weights (0 where unchosen): same result as
        routed() + shared, with static shapes (no host sync)."""
        w13, w2 = self.stacked
        n, inter = w2.shape[0], w2.shape[2]
        mix = torch.zeros(x.shape[0], n, dtype=x.dtype, device=x.device)
        mix.scatter_(1, idx, weights.to(x.dtype))
        if self.shared_experts is not None:
            mix[:, -1] = 1.0
        h = F.linear(x, w13).view(x.shape[0], n, 2, inter)
        a = F.silu(h[:, :, 0]) * h[:, :, 1] * mix.unsqueeze(-1)                  # [T, E+1, I]
        return torch.bmm(a.transpose(0, 1), w2.transpose(1, 2)).sum(0)           # [T, H]

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

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The training path: routed()'s maths as three batched matmuls over an [experts, capacity, hidden]
        layout (capacity = the busiest expert's token count; the rest of each expert's rows are zeros),
        instead of three small matmuls per expert forward and six backward. A trained router spreads the
        tokens over all 8 experts, and the per-expert loop's small matmuls then dominated the training step:
        this path makes a step of the shipped model 1.27-1.40x faster on 2 CPU threads (BENCHMARKS.md)."""
        T, k = idx.shape
        E = len(self.experts)
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=E)
        cap = int(counts.max())
        expert_of = flat[order]
        rank = torch.arange(T * k, device=x.device) - (torch.cumsum(counts, 0) - counts)[expert_of]
        dest = expert_of * cap + rank                                             # row in [E * cap]
        tok = order // k
        xs = x.new_zeros(E * cap, x.shape[1]).index_copy(0, dest, x[tok]).view(E, cap, -1)
        w1 = torch.stack([m.gate_proj.weight for m in self.experts]).transpose(1, 2)   # [E, hidden, inter]
        w3 = torch.stack([m.up_proj.weight for m in self.experts]).transpose(1, 2)
        w2 = torch.stack([m.down_proj.weight for m in self.experts]).transpose(1, 2)   # [E, inter, hidden]
        h = F.silu(torch.bmm(xs, w1)) * torch.bmm(xs, w3)
        y = torch.bmm(h, w2).reshape(E * cap, -1)[dest].to(x.dtype)
        y = y * weights.flatten()[order].to(x.dtype)[:, None]
        return torch.zeros_like(x).index_add_(0, tok, y)

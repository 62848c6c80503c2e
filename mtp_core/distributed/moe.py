"""Expert-parallel DeepSeek MoE: dispatch by all-gather, combine by all-reduce.

Every rank holds the same (replicated) input and router, so every rank routes every token the same
way; it then runs only its own experts (`experts` is a ModuleDict keyed by the global expert id,
so parameter names stay `mlp.experts.{e}.*`), and one all-reduce sums the partial outputs.

Worked example, 8 experts, ep_size 2, moe_tp_size 1, a token routed to experts 2 and 5 with
weights w2, w5: rank 0 (experts 0-3) contributes w2*E2(x), rank 1 (experts 4-7) w5*E5(x); the
all-reduce gives w2*E2(x) + w5*E5(x), the same sum single-process `MoE.routed` computes. With
top-2 routing the floating-point additions are even the same ones: 0 + a + b == (0 + a) + (0 + b).

Shared experts are tensor parallel over all ranks when tp_size > 1 (their partial output joins the
same all-reduce) and replicated otherwise (added after it).
"""
from __future__ import annotations

import torch
from torch import nn

from mtp_core.config import ModelConfig
from mtp_core.distributed.layers import TensorParallelMLP
from mtp_core.distributed.parallel_state import ParallelState, split_range
from mtp_core.model.layers import MLP
from mtp_core.model.moe import MoE


class ExpertParallelMoE(MoE):
    def __init__(self, cfg: ModelConfig, par: ParallelState) -> None:
        super().__init__(cfg)             # on the meta device: the full expert list costs nothing
        self.par = par
        self.num_experts = int(cfg.n_routed_experts)
        lo, hi = split_range(self.num_experts, par.ep_size, par.ep_rank)
        h, mi = cfg.hidden_size, cfg.moe_intermediate_size

        def expert() -> nn.Module:
            if par.moe_tp_size == 1:
                return MLP(h, mi)
            return TensorParallelMLP(h, mi, par, par.moe_tp_size, par.moe_tp_rank, reduce=False)

        self.experts = nn.ModuleDict({str(e): expert() for e in range(lo, hi)})  # type: ignore[assignment]
        self.shared_is_partial = par.tp_size > 1 and cfg.n_shared_experts > 0
        if self.shared_is_partial:
            self.shared_experts = TensorParallelMLP(h, mi * cfg.n_shared_experts, par, par.tp_size, par.tp_rank,
                                                    reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden], identical on every rank."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, idx = self.gate(x)                                               # [T, k]
        if self.training:
            self.load_counts = torch.bincount(idx.flatten(), minlength=self.num_experts).detach()
        out = self.routed(x, weights, idx)                                        # this rank's partial sum
        if self.shared_experts is not None and self.shared_is_partial:
            out = self.par.all_reduce(out + self.shared_experts(x))
        else:
            out = self.par.all_reduce(out)
            if self.shared_experts is not None:
                out = out + self.shared_experts(x)
        return out.view(shape)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights/idx [T, k] -> [T, hidden]: the weighted outputs of the local experts
        only, accumulated in the same order as MoE.routed."""
        flat_idx = idx.flatten()                                                  # [T*k]
        order = flat_idx.argsort(stable=True)
        counts = torch.bincount(flat_idx, minlength=self.num_experts).tolist()
        token_of = order // idx.shape[1]
        w_sorted = weights.flatten()[order].to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            key = str(e)
            if n and key in self.experts:
                tok = token_of[start:start + n]
                out.index_add_(0, tok, self.experts[key](x[tok]) * w_sorted[start:start + n, None])
            start += n
        return out

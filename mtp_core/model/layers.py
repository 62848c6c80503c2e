"""Small building blocks shared by the main layers and the MTP modules."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_core import kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)   # fp32 arithmetic, HF DeepSeek-V3's formula


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Used dense, as an expert and as shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None   # [2I, H], set by fuse_for_decode()

    @torch.no_grad()
    def fuse_for_decode(self) -> bool:
        """One [2I, H] matmul for gate and up (their weights become views of it) in inference."""
        if type(self) is not MLP or type(self.gate_proj) is not nn.Linear or type(self.up_proj) is not nn.Linear:
            return False
        inter = self.gate_proj.weight.shape[0]
        w = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self.gate_proj.weight = nn.Parameter(w[:inter], requires_grad=False)
        self.up_proj.weight = nn.Parameter(w[inter:], requires_grad=False)
        self.gate_up = w
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and not self.training:
            g, u = F.linear(x, self.gate_up).chunk(2, dim=-1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): the lightning indexer, the module that scores keys.

Every attention layer (the MTP modules' too) carries an indexer with its own small projections, Hugging Face
names under `self_attn.indexer.`:

    q_h  = rope_half(wq_b(q_c))_h            [heads, Di]   q_c = q_a_layernorm(q_a_proj(x)), MLA's query latent
    k_t  = rope_half(k_norm(wk(x_t)))        [Di]          LayerNorm with bias; cached beside the latent
    w_h  = weights_proj(x_s)_h * heads^-0.5                 one weight per indexer head, fp32
    score(s, t) = sum_h w_h * relu(q_h . k_t * Di^-0.5)

`rope_half` rotates the first qk_rope_head_dim dims in the non-interleaved (half-split) form; MLA itself uses
the interleaved one. Query s then attends (MLA, unchanged) only to the `index_topk` visible keys with the best
scores: every visible key while there are at most index_topk of them (dense attention plus the indexer's work),
a fixed number above that, so the attention cost per token stops growing with the context.

The scores and the top-k selection are pure maths, in mtp_core/kernels/dsa_ref.py (`index_scores`, `select_topk`),
shared with the native forward's reference. Ties: keys with equal scores are taken lower position first (a
stable descending sort), there and in the native forward (csrc/cpu/dsa_cpu.cpp), so a selection never depends
on how a batch is laid out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_core.config import ModelConfig
from mtp_core.model.rope import RotaryEmbedding


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = int(cfg.index_n_heads)
        self.head_dim = int(cfg.index_head_dim)
        self.rope_dim = cfg.qk_rope_head_dim
        self.topk = int(cfg.index_topk)
        self.wq_b = nn.Linear(int(cfg.q_lora_rank), self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def _rope(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
              has_heads: bool) -> torch.Tensor:
        r = self.rope_dim
        return torch.cat([rope.apply(x[..., :r], cos, sin, has_heads, interleave=False), x[..., r:]], dim=-1)

    def keys(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, hidden] -> the cached index keys [..., T, Di]."""
        k = self.wk(x)
        n = self.k_norm
        k = F.layer_norm(k.float(), (self.head_dim,), n.weight.float(), n.bias.float(), n.eps).to(k.dtype)
        return self._rope(k, rope, cos, sin, has_heads=False)

    def queries(self, q_c: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
                ) -> torch.Tensor:
        """q_c [..., T, q_lora_rank] -> [..., T, heads, Di]."""
        q = self.wq_b(q_c).view(*q_c.shape[:-1], self.n_heads, self.head_dim)
        return self._rope(q, rope, cos, sin, has_heads=True)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., T, hidden] -> [..., T, heads] float32 (weights_proj is kept in fp32, as transformers does)."""
        w = self.weights_proj.weight
        x = x.to(w.dtype) if w.dtype in (torch.float32, torch.bfloat16, torch.float16) else x
        return self.weights_proj(x).float() * self.n_heads ** -0.5


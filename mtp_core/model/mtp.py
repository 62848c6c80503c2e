"""MTP (NextN) module: predicts one token further from a token and the previous stage's hidden state.

    x = eh_proj(concat[enorm(embed(token)), hnorm(h)])     # embedding first, as DeepSeek-V3
    x = decoder_layer(x)                                   # its own MLA (own KV cache) + MoE/MLP
    h_out = shared_head.norm(x);  logits = lm_head(h_out)  # embedding and head shared with the main model

`h` from the main model is taken after its final norm; the module returns h_out (after
shared_head.norm), and that is what a following draft step (Eagle recursion, Vanilla chain) feeds back.
"""
from __future__ import annotations

import torch
from torch import nn

from mtp_core.config import ModelConfig
from mtp_core.model.attention_metadata import AttentionMetadata
from mtp_core.model.decoder_layer import DecoderLayer
from mtp_core.model.layers import RMSNorm
from mtp_core.model.rope import RotaryEmbedding


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPModule(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, rope: RotaryEmbedding,
                cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata | None,
                kv_cache: torch.Tensor | None) -> torch.Tensor:
        """token_embeds, hidden [..., hidden] -> h_out [..., hidden] (after shared_head.norm)."""
        x = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(self.block(x, rope, cos, sin, meta, kv_cache))

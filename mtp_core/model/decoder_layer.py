"""One transformer block: pre-norm MLA + pre-norm dense MLP or MoE."""
from __future__ import annotations

import torch
from torch import nn

from mtp_core.config import ModelConfig
from mtp_core.model.attention_metadata import AttentionMetadata
from mtp_core.model.layers import MLP, RMSNorm
from mtp_core.model.mla import MLAttention
from mtp_core.model.moe import MoE
from mtp_core.model.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = MLAttention(cfg)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def block(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
              meta: AttentionMetadata | None, kv_cache: torch.Tensor | None) -> torch.Tensor:
        """x [T, hidden] with a cache (serving) or [B, S, hidden] without (training)."""
        h = self.input_layernorm(x)
        if meta is None:
            h = self.self_attn.forward_dense(h, rope, cos, sin)
        else:
            h = self.self_attn(h, rope, cos, sin, meta, kv_cache)
        x = x + h
        h = self.post_attention_layernorm(x)
        if meta is not None and meta.static_shapes and isinstance(self.mlp, MoE):
            return x + self.mlp.forward_static(h)      # the captured step: every expert, fixed shapes
        return x + self.mlp(h)

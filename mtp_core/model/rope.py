"""Rotary embedding on the qk_rope_head_dim slice, with DeepSeek's YaRN scaling.

Matches Hugging Face's DeepSeek-V3: YaRN blends interpolated and extrapolated frequencies with a linear
ramp between the beta_fast / beta_slow correction dims, and multiplies cos/sin by
mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1.0 for DeepSeek-V3's released config). The
softmax-scale part of YaRN lives in ModelConfig.softmax_scale.
"""
from __future__ import annotations

import math

import torch

from mtp_core import kernels
from mtp_core.config import ModelConfig, yarn_get_mscale


def _yarn_inv_freq(dim: int, base: float, rs: dict) -> tuple[torch.Tensor, float]:
    factor = float(rs["factor"])
    orig = float(rs["original_max_position_embeddings"])
    beta_fast = float(rs.get("beta_fast") or 32)
    beta_slow = float(rs.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep_extrapolation = 1 - ramp
    inv_freq = interpolation * (1 - keep_extrapolation) + extrapolation * keep_extrapolation
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    if mscale and mscale_all:
        attn_factor = yarn_get_mscale(factor, float(mscale)) / yarn_get_mscale(factor, float(mscale_all))
    else:
        attn_factor = yarn_get_mscale(factor)
    return inv_freq, float(attn_factor)


class RotaryEmbedding:
    def __init__(self, cfg: ModelConfig) -> None:
        dim = cfg.qk_rope_head_dim
        rs = cfg.rope_scaling
        if rs and rs.get("type", rs.get("rope_type")) == "yarn":
            self.inv_freq, self.attn_factor = _yarn_inv_freq(dim, float(cfg.rope_theta), rs)
        else:
            self.inv_freq = 1.0 / (float(cfg.rope_theta) ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
            self.attn_factor = 1.0
        self.interleave = bool(cfg.rope_interleave)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., dim/2] (float32)."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        return freqs.cos() * self.attn_factor, freqs.sin() * self.attn_factor

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, has_heads: bool,
              interleave: bool | None = None) -> torch.Tensor:
        """x [..., T, heads, dim] (has_heads) or [..., T, dim]; cos/sin [T, dim/2].

        Interleaved checkpoints pair (x0, x1), (x2, x3), ...; the result is laid out as
        [rotated evens | rotated odds], as Hugging Face does. q and k get the same layout, so dot
        products are unchanged and the cache stores keys in that layout. interleave: the checkpoint's
        form (None), or this one (DeepSeek-V3.2's indexer is always half-split).
        """
        interleave = self.interleave if interleave is None else interleave
        if x.dim() == (3 if has_heads else 2) and cos.dim() == 2:   # serving layout: [T, (heads,) dim]
            return kernels.rope(x, cos, sin, interleave)
        if has_heads:
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

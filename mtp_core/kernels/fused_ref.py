"""Torch references of the fused CPU ops (mtp_core::rms_norm, mtp_core::rope): the oracles their
parity tests compare against, and what runs where the native op is absent or autograd is needed."""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), in fp32 arithmetic (Hugging Face's DeepSeek-V3)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, ..., D], cos/sin [T, D/2] -> [x1*c - x2*s | x2*c + x1*s], (x1, x2) = evens/odds when
    interleaved, else the two halves; products in x's dtype."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.reshape(shape).to(x.dtype), sin.reshape(shape).to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

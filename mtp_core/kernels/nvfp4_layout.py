"""The NVFP4 code order the native CPU kernels read (csrc/cpu/decode_kernels.h: kRows, kNVFP4).

A checkpoint packs two e2m1 codes per byte in input order (byte j: inputs 2j low nibble, 2j+1 high). The
kernels want one 16-byte load to decode into two vectors of 16 consecutive inputs, each a whole scale
group, so within every chunk of 32 inputs byte j holds inputs j (low) and j + 16 (high); a trailing chunk
of 16 inputs holds j and j + 8. Same bytes, same shape [N, K/2]: a permutation within each row.
"""
from __future__ import annotations

import torch


def _codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)   # [N, K]


def interleave(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint order [N, K/2] uint8 -> kernel order."""
    codes = _codes(packed)                                                      # [N, K]
    n, k = codes.shape
    full = k // 32 * 32
    body = codes[:, :full].reshape(n, -1, 2, 16)                                # [N, chunks, (first, next), 16]
    parts = [(body[:, :, 0] | (body[:, :, 1] << 4)).reshape(n, -1)]
    if k > full:                                                                # a trailing chunk of 16
        tail = codes[:, full:].reshape(n, 2, 8)
        parts.append(tail[:, 0] | (tail[:, 1] << 4))
    return torch.cat(parts, dim=1).contiguous()


def deinterleave(packed: torch.Tensor) -> torch.Tensor:
    """Kernel order [N, K/2] uint8 -> checkpoint order."""
    n, half = packed.shape
    full = (2 * half) // 32 * 16                                                # bytes of the full chunks
    body = packed[:, :full].reshape(n, -1, 1, 16)
    codes = [torch.cat([body & 0x0F, body >> 4], dim=2).reshape(n, -1)]
    if half > full:
        tail = packed[:, full:].reshape(n, 1, 8)
        codes.append(torch.cat([tail & 0x0F, tail >> 4], dim=1).reshape(n, -1))
    pairs = torch.cat(codes, dim=1).reshape(n, -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def make_interleaved(module: torch.nn.Module) -> None:
    """Rewrite an Nvfp4Linear's codes into kernel order in place (once; it dequantizes either order)."""
    if getattr(module, "interleaved", False):
        return
    module.weight_packed.copy_(interleave(module.weight_packed))
    module.interleaved = True

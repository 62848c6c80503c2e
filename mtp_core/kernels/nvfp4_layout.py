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


def _chunks(k: int) -> list[tuple[int, int]]:
    """(start, length) of each chunk of a row of k inputs (k a multiple of 16)."""
    full = k // 32 * 32
    return [(s, 32) for s in range(0, full, 32)] + ([(full, 16)] if k % 32 else [])


def interleave(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint order [N, K/2] uint8 -> kernel order."""
    codes = _codes(packed)
    out = torch.empty_like(packed)
    for s, n in _chunks(codes.shape[1]):
        half = n // 2
        out[:, s // 2: s // 2 + half] = codes[:, s:s + half] | (codes[:, s + half:s + n] << 4)
    return out


def deinterleave(packed: torch.Tensor) -> torch.Tensor:
    """Kernel order [N, K/2] uint8 -> checkpoint order."""
    k = packed.shape[1] * 2
    codes = torch.empty(packed.shape[0], k, dtype=torch.uint8)
    for s, n in _chunks(k):
        half = n // 2
        b = packed[:, s // 2: s // 2 + half]
        codes[:, s:s + half], codes[:, s + half:s + n] = b & 0x0F, b >> 4
    pairs = codes.view(codes.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def make_interleaved(module: torch.nn.Module) -> None:
    """Rewrite an Nvfp4Linear's codes into kernel order in place (once; it dequantizes either order)."""
    if getattr(module, "interleaved", False):
        return
    module.weight_packed.copy_(interleave(module.weight_packed))
    module.interleaved = True

"""The NVFP4 code order the native CPU kernels read (csrc/cpu/decode_kernels.h: kRows, kNVFP4).

A checkpoint packs two e2m1 codes per byte in input order (byte j: inputs 2j low nibble, 2j+1 high), so every
4 bytes (a dword) hold 8 consecutive inputs, half of one 16-input scale group. The kernels keep the dwords and
change only their order: within every block of 256 inputs (16 groups, 32 dwords) the first halves of the 16
groups come first, then the second halves ([group][half] -> [half][group]). A row's last, partial block of G
groups is transposed the same way ([G][2] -> [2][G]). Then a 64-byte load holds one dword of each of 16
groups, and the bf16 dot-product kernel (csrc/cpu/dot_gemm.cpp) gives each fp32 lane one group, so a block
needs one vector of group scales instead of one per 64 inputs. Same bytes, same shape [N, K/2]: a
permutation within each row.
"""
from __future__ import annotations

import torch

_BLOCK_BYTES = 128   # 256 inputs


def _permute(packed: torch.Tensor, forward: bool) -> torch.Tensor:
    n, half = packed.shape
    if half % 8:
        raise ValueError(f"NVFP4 rows need a multiple of 16 inputs, got {2 * half}")
    full = half // _BLOCK_BYTES * _BLOCK_BYTES
    parts = []
    if full:
        body = packed[:, :full].reshape(n, -1, *((16, 2, 4) if forward else (2, 16, 4)))
        parts.append(body.transpose(2, 3).reshape(n, full))
    if half > full:
        g = (half - full) // 8
        tail = packed[:, full:].reshape(n, *((g, 2, 4) if forward else (2, g, 4)))
        parts.append(tail.transpose(1, 2).reshape(n, half - full))
    return torch.cat(parts, dim=1).contiguous() if parts else packed.clone()


def interleave(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint order [N, K/2] uint8 -> kernel order."""
    return _permute(packed, True)


def deinterleave(packed: torch.Tensor) -> torch.Tensor:
    """Kernel order [N, K/2] uint8 -> checkpoint order."""
    return _permute(packed, False)


def make_interleaved(module: torch.nn.Module) -> None:
    """Rewrite an Nvfp4Linear's codes into kernel order in place (once; it dequantizes either order)."""
    if getattr(module, "interleaved", False):
        return
    module.weight_packed.copy_(interleave(module.weight_packed))
    module.interleaved = True

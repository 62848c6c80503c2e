"""Torch references of the NVFP4 ops (ModelOpt NVFP4, group size 16).

Layout: ``weight`` uint8 [N, K/2] holds two e2m1 codes per byte, the low nibble first (even k);
``weight_scale`` float8_e4m3fn [N, K/16] scales each run of 16 k; ``weight_scale_2`` is a float32
scalar; real weight = e2m1 * weight_scale * weight_scale_2. Activations (W4A4, Blackwell) use the
same block format with ``input_scale`` as their per-tensor scale.

e2m1 code: sign | 2-bit exponent (bias 1) | 1-bit mantissa, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6.
Example: byte 0x71 holds codes 1 (k even, +0.5) and 7 (k odd, +6.0); with block scale 2.0 and
scale_2 0.5 they decode to 0.5 and 6.0.
"""
from __future__ import annotations

import torch

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Integer e2m1 codes (0..15) -> float32 values (E2M1_VALUES[code], -0.0 for code 8), computed with device
    arithmetic only: no host tensor is built, so it may run while a CUDA graph is being captured."""
    codes = codes.to(torch.int32)
    exp, man = ((codes >> 1) & 3).float(), (codes & 1).float()
    mag = torch.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * torch.exp2(exp - 1.0))
    return torch.where((codes & 8) != 0, -mag, mag)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> float32 [..., 2n]; element 2i is the low nibble of byte i."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)           # [..., 2n]
    return e2m1_decode(codes)


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor) -> torch.Tensor:
    """weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 [] or [1] -> fp32 [N, K]."""
    values = unpack_e2m1(weight)                                                       # [N, K]
    scales = weight_scale.float().repeat_interleave(BLOCK_SIZE, dim=-1)                # [N, K]
    return values * scales * weight_scale_2.float().reshape(())


def nvfp4_gemm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Weight-only NVFP4 GEMM: x [M, K] @ dequant(weight)^T -> [M, N] in x's dtype (fp32 math)."""
    return (x.float() @ dequantize_nvfp4(weight, weight_scale, weight_scale_2).T).to(x.dtype)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value, ties to the even code, saturating at 6 -> uint8 codes.

    Ties: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0.
    """
    a = values.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
            + (a >= 3.5) + (a > 5.0))
    return code.to(torch.uint8) | ((values < 0).to(torch.uint8) << 3)


def quantize_nvfp4_ref(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 16 == 0), global_scale [] or [1] (the per-tensor decode scale)
    -> (packed uint8 [M, K/2], block scales float8_e4m3fn [M, K/16]).

    block_scale = e4m3(min(amax / (6 * global_scale), 448)); code = e2m1(x / (block_scale * global_scale)).
    NaN: a block holding a NaN (amax is NaN) gets the e4m3 NaN scale (0x7F) and all-zero codes, so it
    dequantizes to NaN (the NaN stays visible instead of becoming a finite 448-scaled block); +-inf
    saturates: scale 448, code +-6 for the inf, the block's finite values round to +-0.
    """
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // BLOCK_SIZE, BLOCK_SIZE)                    # [M, K/16, 16]
    gs = global_scale.float().reshape(())
    amax = blocks.abs().amax(dim=-1)                                                     # [M, K/16]
    scale = (amax / (6.0 * gs)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)              # [M, K/16]
    decode = scale.float() * gs
    inv = torch.where(decode > 0, torch.ones_like(decode) / decode, torch.zeros_like(decode))
    codes = e2m1_codes(blocks * inv[..., None]).reshape(rows, cols)                      # [M, K]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)                                      # [M, K/2]
    return packed, scale


def nvfp4_w4a4_gemm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Emulated W4A4: x quantized to NVFP4 with input_scale, both operands dequantized, fp32 matmul.
    x [M, K] -> [M, N] in x's dtype."""
    x_packed, x_scale = quantize_nvfp4_ref(x, input_scale)
    x_real = dequantize_nvfp4(x_packed, x_scale, input_scale)                             # [M, K]
    return (x_real @ dequantize_nvfp4(weight, weight_scale, weight_scale_2).T).to(x.dtype)


def swizzle_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales [rows, cols] -> the flat 128x4-tile layout that Blackwell block-scaled GEMMs read.

    Rows pad to 128 and columns to 4; tiles are stored row-major; inside a tile, the scale of
    (row r, column c) sits at (r % 32) * 16 + (r // 32) * 4 + c.
    Example: in a single tile, (r=33, c=2) lands at 16 + 4 + 2 = 22.
    """
    rows, cols = scale.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    raw = scale.view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else scale
    padded = raw.new_zeros(padded_rows, padded_cols)
    padded[:rows, :cols] = raw
    tiles = padded.view(padded_rows // 128, 4, 32, padded_cols // 4, 4)    # (tile_r, r//32, r%32, tile_c, c)
    flat = tiles.permute(0, 3, 2, 1, 4).reshape(-1)                        # (tile_r, tile_c, r%32, r//32, c)
    return flat.view(scale.dtype) if scale.dtype == torch.float8_e4m3fn else flat

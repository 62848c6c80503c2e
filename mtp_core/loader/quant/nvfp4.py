"""ModelOpt NVFP4: e2m1 values packed two per byte (low nibble = even column), one float8_e4m3fn
`weight_scale` per 16 columns, one float32 `weight_scale_2` per tensor (and an `input_scale` for
activations that CPU dequantization does not need). Real weight = e2m1 x weight_scale x weight_scale_2.

e2m1 code (4 bits) = sign | exponent (2) | mantissa (1):
    code  0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6;   code 8..15 -> the same values negated.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from mtp_core.loader.quant.base import (QuantFormat, check_expected_shape, dense_weight, expect_scalar,
                                        expect_tensor)

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
FP8_E4M3_MAX = 448.0
# Midpoints between neighbouring magnitudes. At an exact tie round-to-nearest-even picks the code
# with mantissa bit 0 (even code): 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def e2m1_table() -> torch.Tensor:
    """[16] float32: value of every e2m1 code."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags])


def e2m1_pair_table(device: torch.device | str | None = None) -> torch.Tensor:
    """[256, 2] float32 on `device`: the two values (low nibble, high nibble) of every packed byte. Built with
    device arithmetic (no host-to-device copy), so it is safe inside a CUDA graph capture."""
    from mtp_core.kernels.nvfp4_gemm_ref import e2m1_decode
    codes = torch.arange(256, device=device)
    return torch.stack([e2m1_decode(codes & 0x0F), e2m1_decode(codes >> 4)], dim=1)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] uint8 codes; byte j holds column 2j (low nibble) and 2j+1 (high)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] uint8 codes (K even) -> [N, K/2] uint8, low nibble first."""
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x float (already divided by its scale) -> uint8 codes, round-to-nearest-even, saturating at
    +-6. Zero and values that round to zero get code 0 (never -0)."""
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8)
    for i, mid in enumerate(_MIDPOINTS):
        # Lower neighbour of midpoint i is code i: on a tie stay there when i is even.
        code += (mag > mid) if i % 2 == 0 else (mag >= mid)
    negative = (x < 0) & (code > 0)
    return code | (negative.to(torch.uint8) << 3)


def dequantize_nvfp4(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                     group: int = 16) -> torch.Tensor:
    """weight [N, K/2] uint8, weight_scale [N, K/group] float8_e4m3fn, weight_scale_2 [] float32
    -> [N, K] float32. e2m1 x e4m3 is exact in fp32, so the single rounding is the final x scale_2."""
    n, half_k = weight.shape
    pairs = e2m1_pair_table(weight.device)[weight.to(torch.int32)]  # [N, K/2, 2]: (low, high) nibble values
    values = pairs.view(n, -1, group)  # [N, K/group, group]
    values.mul_(weight_scale.to(torch.float32)[:, :, None]).mul_(weight_scale_2.to(torch.float32))
    return values.view(n, 2 * half_k)


def quantize_nvfp4(w: torch.Tensor, group: int = 16
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float (K % group == 0) -> (weight [N, K/2] uint8, weight_scale [N, K/group]
    float8_e4m3fn, weight_scale_2 [] float32), ModelOpt's recipe:
    scale_2 = amax(|w|) / (448 * 6); block scale = e4m3(amax(|block|) / 6 / scale_2);
    codes = e2m1(w / (block scale * scale_2)). An all-zero tensor gets scale_2 = 1."""
    n, k = w.shape
    wf = w.to(torch.float32)
    amax = wf.abs().amax()
    scale_2 = amax / (FP8_E4M3_MAX * E2M1_MAX) if amax > 0 else torch.tensor(1.0)
    blocks = wf.view(n, k // group, group)
    block_amax = blocks.abs().amax(dim=2)  # [N, K/group]
    scale = (block_amax / E2M1_MAX / scale_2).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    denom = scale.to(torch.float32) * scale_2  # [N, K/group]; 0 where the block is all zero
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    scaled = torch.where(denom[:, :, None] > 0, blocks / safe[:, :, None], torch.zeros_like(blocks))
    codes = round_to_e2m1(scaled.view(n, k))
    return pack_e2m1(codes), scale.contiguous(), scale_2.to(torch.float32).reshape(())


def matches_any(module: str, patterns: list[str] | tuple[str, ...]) -> bool:
    """ModelOpt exclude_modules semantics: fnmatch wildcards ('model.layers.0.self_attn*') or names."""
    return any(module == p or fnmatch.fnmatchcase(module, p) for p in patterns)


@dataclass(frozen=True)
class Nvfp4Format(QuantFormat):
    """ModelOpt NVFP4 (hf_quant_config.json quantization.quant_algo NVFP4, group_size 16)."""

    name: str = "nvfp4"
    group_size: int = 16
    exclude_modules: tuple[str, ...] = field(default_factory=tuple)
    kv_cache_quant_algo: str | None = None

    @classmethod
    def from_modelopt_section(cls, section: dict, source: str) -> "Nvfp4Format":
        group = section.get("group_size", 16)
        if group != 16:
            raise ValueError(f"{source}: NVFP4 group_size {group!r} is not supported (supported: 16)")
        exclude = section.get("exclude_modules", section.get("ignore", []))
        if not isinstance(exclude, list) or not all(isinstance(p, str) for p in exclude):
            raise ValueError(f"{source}: exclude_modules must be a list of strings")
        return cls(group_size=16, exclude_modules=tuple(exclude),
                   kv_cache_quant_algo=section.get("kv_cache_quant_algo"))

    @staticmethod
    def companion_names(weight_name: str) -> tuple[str, str, str]:
        """(weight_scale, weight_scale_2, input_scale) names for 'x.weight'."""
        base = weight_name.removesuffix(".weight")
        return weight_name + "_scale", weight_name + "_scale_2", base + ".input_scale"

    def is_excluded(self, weight_name: str) -> bool:
        """Listed in exclude_modules (informative: the loader trusts the tensors present)."""
        return matches_any(weight_name.removesuffix(".weight"), self.exclude_modules)

    def is_quantized(self, weight_name: str, available: set[str]) -> bool:
        scale, scale_2, _ = self.companion_names(weight_name)
        return scale in available or scale_2 in available

    def tensor_names(self, weight_name: str, available: set[str]) -> list[str]:
        if not self.is_quantized(weight_name, available):
            return [weight_name]
        scale, scale_2, input_scale = self.companion_names(weight_name)
        return [weight_name, scale, scale_2] + ([input_scale] if input_scale in available else [])

    def packed(self, weight_name: str, tensors: dict[str, torch.Tensor],
               expected_shape: tuple[int, int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """Validated (weight u8 [N, K/2], scale e4m3 [N, K/16], scale_2 [], input_scale [] | None),
        or None when the weight is not quantized."""
        n, k = check_expected_shape(weight_name, expected_shape)
        scale_name, scale_2_name, input_name = self.companion_names(weight_name)
        if scale_name not in tensors and scale_2_name not in tensors:
            return None
        if k % self.group_size:
            raise ValueError(f"{weight_name}: in_features {k} is not a multiple of the NVFP4 group "
                             f"size {self.group_size}, so it cannot be NVFP4-quantized")
        weight = expect_tensor(weight_name, tensors, (n, k // 2), (torch.uint8,
                                                                   torch.float4_e2m1fn_x2))
        scale = expect_tensor(scale_name, tensors, (n, k // self.group_size), (torch.float8_e4m3fn,))
        scale_2 = expect_scalar(scale_2_name, tensors)
        input_scale = expect_scalar(input_name, tensors) if input_name in tensors else None
        return weight.view(torch.uint8), scale, scale_2, input_scale

    def dequantize(self, weight_name: str, tensors: dict[str, torch.Tensor],
                   expected_shape: tuple[int, int]) -> torch.Tensor:
        packed = self.packed(weight_name, tensors, expected_shape)
        if packed is None:
            return dense_weight(weight_name, tensors, expected_shape,
                                self.companion_names(weight_name)[0])
        return dequantize_nvfp4(packed[0], packed[1], packed[2], self.group_size)

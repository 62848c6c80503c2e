"""DeepSeek FP8 block quantization: float8_e4m3fn weights with one float32 `weight_scale_inv` per
128x128 block; real weight = fp8 value x block scale. Edge blocks may be partial: a [130, 200]
weight has a [2, 2] scale grid whose last row/column of blocks covers 2 rows / 72 columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mtp_core.loader.quant.base import (QuantFormat, check_expected_shape, dense_weight, expect_tensor)

FP8_E4M3_MAX = 448.0
ACT_AMAX_FLOOR = 1e-4  # per-token activation groups that are all zero still get a finite scale


def block_scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32 -> [N, K] float32.
    One fp32 multiply per element: the e4m3 value is exact in fp32, so this is the exact product
    rounded once (what DeepSeek's weight_dequant computes)."""
    out = weight.to(torch.float32)  # [N, K]
    scale = scale_inv.to(torch.float32)
    # One block-row at a time: the temporary is a [K] scale vector, not a full [N, K] scale tensor.
    for i in range(scale.shape[0]):
        row_scale = scale[i].repeat_interleave(block[1])[: out.shape[1]]  # [K]
        out[i * block[0]:(i + 1) * block[0]].mul_(row_scale)
    return out


def _pad_to_blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = w.shape
    nb, kb = block_scale_shape((n, k), block)
    return torch.nn.functional.pad(w, (0, kb * block[1] - k, 0, nb * block[0] - n))


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (weight [N, K] float8_e4m3fn, scale_inv [ceil(N/bn), ceil(K/bk)] float32).
    scale_inv = amax(|block|) / 448 (1.0 for an all-zero block); weight = clamp(w / scale_inv)
    rounded to nearest-even e4m3."""
    n, k = w.shape
    nb, kb = block_scale_shape((n, k), block)
    padded = _pad_to_blocks(w.to(torch.float32), block).view(nb, block[0], kb, block[1])
    amax = padded.abs().amax(dim=(1, 3))  # [nb, kb]
    scale_inv = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (padded / scale_inv[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.view(nb * block[0], kb * block[1])[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale_inv.contiguous()


def quantize_activation_per_token_group(x: torch.Tensor, group: int = 128
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K] float8_e4m3fn, scale [M, ceil(K/group)] float32): the 1x128
    activation scaling of DeepSeek-V3 / DeepGEMM. scale = max(amax, 1e-4) / 448 per token per group."""
    m, k = x.shape
    num_groups = math.ceil(k / group)
    xf = torch.nn.functional.pad(x.to(torch.float32), (0, num_groups * group - k))
    xg = xf.view(m, num_groups, group)
    scale = xg.abs().amax(dim=2).clamp(min=ACT_AMAX_FLOOR) / FP8_E4M3_MAX  # [M, G]
    q = (xg / scale[:, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).view(m, -1)[:, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def fp8_block_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                               block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """x [M, K] -> [M, N] float32: the maths an FP8 GEMM with 1x128 activation and 128x128 weight
    scaling performs (activations quantized, products accumulated in fp32). Reference for DeepGEMM."""
    xq, xs = quantize_activation_per_token_group(x, block[1])
    m, k = x.shape
    x_deq = xq.to(torch.float32) * xs.repeat_interleave(block[1], dim=1)[:, :k]
    return x_deq @ dequantize_fp8_block(weight, scale_inv, block).t()


@dataclass(frozen=True)
class Fp8BlockFormat(QuantFormat):
    """DeepSeek-V3/R1 FP8: config.json quantization_config {quant_method: fp8, fmt: e4m3,
    activation_scheme: dynamic, weight_block_size: [128, 128]}."""

    name: str = "fp8_block"
    block_size: tuple[int, int] = (128, 128)

    @classmethod
    def from_quantization_config(cls, qc: dict) -> "Fp8BlockFormat":
        where = "config.json quantization_config"
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"{where}: fmt {fmt!r} is not supported (supported: e4m3)")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"{where}: activation_scheme {scheme!r} is not supported "
                             f"(supported: dynamic)")
        block = qc.get("weight_block_size")
        if block is None:
            raise ValueError(f"{where}: fp8 without weight_block_size (per-tensor FP8) is not "
                             f"supported; only block-scaled DeepSeek FP8 is")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{where}: weight_block_size must be two positive integers, "
                             f"got {block!r}")
        return cls(block_size=(block[0], block[1]))

    def to_quantization_config(self) -> dict:
        """The config.json entry DeepSeek's checkpoints carry (key order as in DeepSeek-V3)."""
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": list(self.block_size)}

    @staticmethod
    def scale_name(weight_name: str) -> str:
        return weight_name + "_scale_inv"

    def is_quantized(self, weight_name: str, available: set[str]) -> bool:
        return self.scale_name(weight_name) in available

    def tensor_names(self, weight_name: str, available: set[str]) -> list[str]:
        if self.is_quantized(weight_name, available):
            return [weight_name, self.scale_name(weight_name)]
        return [weight_name]

    def packed(self, weight_name: str, tensors: dict[str, torch.Tensor],
               expected_shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(weight [N, K] e4m3, scale_inv [nb, kb] f32) validated, or None when not quantized."""
        shape = check_expected_shape(weight_name, expected_shape)
        scale_name = self.scale_name(weight_name)
        if scale_name not in tensors:
            return None
        weight = expect_tensor(weight_name, tensors, shape, (torch.float8_e4m3fn,))
        scale = expect_tensor(scale_name, tensors, block_scale_shape(shape, self.block_size),
                              (torch.float32,))
        return weight, scale

    def dequantize(self, weight_name: str, tensors: dict[str, torch.Tensor],
                   expected_shape: tuple[int, int]) -> torch.Tensor:
        packed = self.packed(weight_name, tensors, expected_shape)
        if packed is None:
            return dense_weight(weight_name, tensors, expected_shape, self.scale_name(weight_name))
        return dequantize_fp8_block(packed[0], packed[1], self.block_size)

"""Keep-quantized linear modules: they hold the checkpoint's packed tensors (about 1/4 of fp32 for
FP8, 1/7 for NVFP4) and dequantize per forward, giving exactly F.linear(x, dequantized.to(x.dtype)).

Packed tensors are stored as integer bit-views (uint8 / int32) so that `model.to(torch.bfloat16)`,
which casts every floating-point buffer, cannot silently round an FP8 weight or a float32 scale;
`.to(device)` still moves them.

On Hopper with DeepGEMM installed, FP8 linears can instead run DeepGEMM's FP8 GEMM with per-token
per-128-channel activation quantization (not bit-identical to dequantization: activations lose
precision). That path needs CUDA and has not been run in this project's CPU-only development.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch
import torch.nn.functional as F

from mtp_core.loader.quant.fp8 import dequantize_fp8_block, quantize_activation_per_token_group
from mtp_core.loader.quant.nvfp4 import dequantize_nvfp4

logger = logging.getLogger(__name__)


class Fp8BlockLinear(torch.nn.Module):
    """y [..., N] = x [..., K] @ dequantize(weight [N, K] e4m3, weight_scale_inv [nb, kb]).T"""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                 block_size: tuple[int, int] = (128, 128)) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.block_size = block_size
        self.register_buffer("weight_bits", weight.contiguous().view(torch.uint8))
        self.register_buffer("scale_inv_bits", weight_scale_inv.contiguous().view(torch.int32))

    @property
    def weight_fp8(self) -> torch.Tensor:  # [N, K] float8_e4m3fn, as in the checkpoint
        return self.weight_bits.view(torch.float8_e4m3fn)

    @property
    def weight_scale_inv(self) -> torch.Tensor:  # [ceil(N/bn), ceil(K/bk)] float32
        return self.scale_inv_bits.view(torch.float32)

    @property
    def weight(self) -> torch.Tensor:  # [N, K] float32, dequantized on each access
        """The real weight, so model code that reads `linear.weight` directly (absorbed MLA's
        kv_b_proj) gets correct values rather than raw FP8 codes."""
        return dequantize_fp8_block(self.weight_fp8, self.weight_scale_inv, self.block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_block"


class Fp8DeepGemmLinear(Fp8BlockLinear):
    """FP8 x FP8 -> bf16 GEMM through DeepGEMM (Hopper). Activations are quantized per token per
    128 channels (scale = amax/448), weights keep their 128x128 block scales. Requires CUDA,
    block 128x128, K % 128 == 0 and N % 64 == 0 (checked by `deep_gemm_supported`)."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                 block_size: tuple[int, int], deep_gemm: ModuleType) -> None:
        super().__init__(weight, weight_scale_inv, block_size)
        # v2 names the dense NT GEMM fp8_gemm_nt; v1 named it gemm_fp8_fp8_bf16_nt. Same arguments:
        # (lhs fp8 [M, K], lhs scales f32 [M, K/128]), (rhs fp8 [N, K], rhs scales f32 [N/128, K/128]), out.
        self._gemm = getattr(deep_gemm, "fp8_gemm_nt", None) or deep_gemm.gemm_fp8_fp8_bf16_nt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        x_fp8, x_scale = quantize_activation_per_token_group(x2, self.block_size[1])
        out = torch.empty(x2.shape[0], self.out_features, dtype=torch.bfloat16, device=x.device)
        self._gemm((x_fp8, x_scale), (self.weight_fp8, self.weight_scale_inv), out)
        return out.to(x.dtype).reshape(*lead, self.out_features)


class Nvfp4Linear(torch.nn.Module):
    """y [..., N] = x [..., K] @ dequantize_nvfp4(weight [N, K/2], weight_scale [N, K/16], scale_2).T"""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, input_scale: torch.Tensor | None = None,
                 group: int = 16) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1]) * 2
        self.group = group
        self.register_buffer("weight_packed", weight.contiguous().view(torch.uint8))  # [N, K/2]
        self.register_buffer("weight_scale_bits", weight_scale.contiguous().view(torch.uint8))
        self.register_buffer("weight_scale_2_bits", weight_scale_2.reshape(1).view(torch.int32))
        # Kept for a native FP4 path (activation global scale); CPU dequantization ignores it.
        self.register_buffer("input_scale_bits", None if input_scale is None
                             else input_scale.reshape(1).view(torch.int32))
        self.interleaved = False   # codes in the native CPU kernels' order (kernels/nvfp4_layout.py)

    @property
    def weight_scale(self) -> torch.Tensor:  # [N, K/16] float8_e4m3fn
        return self.weight_scale_bits.view(torch.float8_e4m3fn)

    @property
    def weight_scale_2(self) -> torch.Tensor:  # [] float32
        return self.weight_scale_2_bits.view(torch.float32).reshape(())

    @property
    def weight_codes(self) -> torch.Tensor:  # [N, K/2] uint8 in the checkpoint's order
        if self.interleaved:
            from mtp_core.kernels.nvfp4_layout import deinterleave
            return deinterleave(self.weight_packed)
        return self.weight_packed

    @property
    def weight(self) -> torch.Tensor:  # [N, K] float32, dequantized on each access
        return dequantize_nvfp4(self.weight_codes, self.weight_scale, self.weight_scale_2, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4"


def dense_linear(weight: torch.Tensor, device: torch.device | str | None = None) -> torch.nn.Linear:
    """A bias-free nn.Linear holding weight [N, K] (a weight the checkpoint left unquantized)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight.to(device) if device is not None else weight,
                                       requires_grad=False)
    return linear


@functools.lru_cache(maxsize=1)
def load_deep_gemm() -> ModuleType | None:
    """The deep_gemm module, or None (logged once) when it is not installed or fails to import."""
    try:
        import deep_gemm  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or a broken CUDA/JIT setup inside the package
        logger.warning("DeepGEMM not available (%s: %s); FP8 linears dequantize their weights "
                       "instead of running FP8 GEMMs", type(e).__name__, e)
        return None
    return deep_gemm


def deep_gemm_supported(device: torch.device, shape: tuple[int, int],
                        block_size: tuple[int, int]) -> str | None:
    """None when DeepGEMM can run this FP8 linear on this device, else the reason it cannot."""
    if device.type != "cuda":
        return f"device is {device.type}, DeepGEMM needs CUDA"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"GPU is sm_{major}{minor}, the FP8 GEMM path targets Hopper (sm_90)"
    if tuple(block_size) != (128, 128):
        return f"weight_block_size {list(block_size)} is not [128, 128]"
    if shape[1] % 128 or shape[0] % 64:
        return f"shape {list(shape)} needs in_features % 128 == 0 and out_features % 64 == 0"
    if load_deep_gemm() is None:
        return "deep_gemm could not be imported (see the warning logged above)"
    return None


def make_fp8_linear(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                    block_size: tuple[int, int], device: torch.device | str | None = None,
                    use_deep_gemm: bool | None = None) -> torch.nn.Module:
    """Fp8DeepGemmLinear when use_deep_gemm is True (ValueError if impossible) or None and supported;
    Fp8BlockLinear (dequantize per forward) otherwise. The choice is made here, once."""
    dev = torch.device(device) if device is not None else weight.device
    if use_deep_gemm is not False:
        reason = deep_gemm_supported(dev, (weight.shape[0], weight.shape[1]), block_size)
        if reason is None:
            module: torch.nn.Module = Fp8DeepGemmLinear(weight, weight_scale_inv, block_size,
                                                        load_deep_gemm())
            return module.to(dev)
        if use_deep_gemm:
            raise ValueError(f"DeepGEMM FP8 GEMM requested but unavailable: {reason}")
    return Fp8BlockLinear(weight, weight_scale_inv, block_size).to(dev)

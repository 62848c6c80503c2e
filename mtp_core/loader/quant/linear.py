"""Keep-quantized linear modules: they hold the checkpoint's packed tensors (about 1/4 of fp32 for
FP8, 1/7 for NVFP4) and dequantize per forward, giving exactly F.linear(x, dequantized.to(x.dtype)).

Packed tensors are stored as integer bit-views (uint8 / int32) so that `model.to(torch.bfloat16)`,
which casts every floating-point buffer, cannot silently round an FP8 weight or a float32 scale;
`.to(device)` still moves them.

On a GPU the forward runs the kernel that `mtp_core.kernels.dispatch.choose_linear_kernel` picks (the one
decision, made once per device and activation dtype and kept in `.kernel`): NVFP4 through mtp_core's
weight-only NVFP4 GEMM (Hopper) or W4A4 FP4 tensor cores (Blackwell), FP8 block through DeepGEMM when
installed (Hopper) or torch's block-scaled FP8 matmul; these quantize activations or round to bf16, so
they are not bit-identical to dequantization. The GPU paths have not been run in this project's CPU-only
development (scripts/gpu_check.sh runs their tests on a GPU).

`make_linear(fmt, ...)` builds the module for one checkpoint weight of a format (fp8.py, nvfp4.py): this
module imports the formats' maths and validation, and the formats know nothing of the modules.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
import torch.nn.functional as F

from mtp_core.loader.quant.base import QuantFormat
from mtp_core.loader.quant.fp8 import Fp8BlockFormat, dequantize_fp8_block, quantize_activation_per_token_group
from mtp_core.loader.quant.nvfp4 import Nvfp4Format, dequantize_nvfp4

logger = logging.getLogger(__name__)


class _KernelChoice:
    """Per (device, activation dtype): the kernel choose_linear_kernel picked, made once (mixin)."""

    kernel: str | None = None          # the latest choice, for logs and tests
    kernel_reason: str | None = None

    def _choose(self, x: torch.Tensor) -> str:
        key = (x.device, x.dtype)
        cache = self.__dict__.setdefault("_choices", {})
        if key not in cache:
            from mtp_core.kernels import dispatch
            cache[key] = self._decide(x.dtype, dispatch.linear_target(x.device))
            logger.debug("%s on %s %s: %s (%s)", self.extra_repr(), x.device, x.dtype, *cache[key])
        if self.__dict__.get("kernel") != cache[key][0] or self.__dict__.get("kernel_reason") != cache[key][1]:
            self.kernel, self.kernel_reason = cache[key]
        return cache[key][0]

    def _decide(self, x_dtype: torch.dtype, target) -> tuple[str, str]:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):      # .to(device) / .cuda(): decide again on the new device
        self.__dict__.pop("_choices", None)
        self.__dict__.pop("_swizzled", None)
        return super()._apply(fn, recurse)


class Fp8BlockLinear(_KernelChoice, torch.nn.Module):
    """y [..., N] = x [..., K] @ dequantize(weight [N, K] e4m3, weight_scale_inv [nb, kb]).T on a CPU; on a GPU
    the FP8 GEMM choose_linear_kernel picks (DeepGEMM, torch's block-scaled matmul) where one applies."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                 block_size: tuple[int, int] = (128, 128), allow_deep_gemm: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.block_size = block_size
        self.allow_deep_gemm = allow_deep_gemm
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

    def _decide(self, x_dtype: torch.dtype, target) -> tuple[str, str]:
        from mtp_core.kernels.dispatch import choose_linear_kernel
        return choose_linear_kernel("fp8_block", self.out_features, self.in_features, x_dtype, target,
                                    block_size=tuple(self.block_size), deep_gemm=self.allow_deep_gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._choose(x)
        if kernel == "dequant":
            return F.linear(x, self.weight.to(x.dtype))
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        # per token per 128 channels, scale = max(amax, 1e-4) / 448 (DeepSeek-V3 / DeepGEMM's recipe)
        x_fp8, x_scale = quantize_activation_per_token_group(x2, self.block_size[1])     # [M, K], [M, K/128]
        if kernel == "fp8_deep_gemm":
            from mtp_core.kernels.dispatch import load_deep_gemm
            out = torch.empty(x2.shape[0], self.out_features, dtype=torch.bfloat16, device=x.device)
            _deep_gemm_nt(load_deep_gemm())((x_fp8, x_scale), (self.weight_fp8, self.weight_scale_inv), out)
        else:   # fp8_scaled_mm: cuBLASLt block scaling; 1x128 scales outer-dim-major, 128x128 as [K/128, N/128]
            try:
                out = F.scaled_mm(x_fp8, self.weight_fp8.t(),
                                  scale_a=x_scale.t().contiguous().t(), scale_recipe_a=F.ScalingType.BlockWise1x128,
                                  scale_b=self.weight_scale_inv.t(), scale_recipe_b=F.ScalingType.BlockWise128x128,
                                  output_dtype=torch.bfloat16)
            except RuntimeError as e:   # this torch / cuBLASLt refuses the recipe: say so, dequantize from now on
                if x.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise
                why = f"F.scaled_mm refused the block-scaled FP8 recipe ({str(e).splitlines()[0]})"
                logger.warning("%s: %s; dequantizing instead", self.extra_repr(), why)
                self.__dict__["_choices"][(x.device, x.dtype)] = ("dequant", why)
                self.kernel, self.kernel_reason = "dequant", why
                return F.linear(x, self.weight.to(x.dtype))
        return out.to(x.dtype).reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8_block"


def _deep_gemm_nt(deep_gemm: ModuleType):
    """DeepGEMM's dense NT FP8 GEMM: v2 names it fp8_gemm_nt, v1 gemm_fp8_fp8_bf16_nt. Same arguments:
    (lhs fp8 [M, K], lhs scales f32 [M, K/128]), (rhs fp8 [N, K], rhs scales f32 [N/128, K/128]), out."""
    return getattr(deep_gemm, "fp8_gemm_nt", None) or deep_gemm.gemm_fp8_fp8_bf16_nt


class Fp8DeepGemmLinear(Fp8BlockLinear):
    """An Fp8BlockLinear that make_fp8_linear(use_deep_gemm=True) returned: DeepGEMM was checked to serve it
    (Hopper, deep_gemm installed, block 128x128, K % 128 == 0, N % 64 == 0)."""


class Nvfp4Linear(_KernelChoice, torch.nn.Module):
    """y [..., N] = x [..., K] @ dequantize_nvfp4(weight [N, K/2], weight_scale [N, K/16], scale_2).T on a CPU;
    on a GPU mtp_core's NVFP4 GEMM (weight-only) or, on Blackwell with an input_scale, the W4A4 FP4 GEMM."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, input_scale: torch.Tensor | None = None,
                 group: int = 16) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1]) * 2
        self.group = group
        self.register_buffer("weight_packed", weight.contiguous().view(torch.uint8))  # [N, K/2]
        self.register_buffer("weight_scale_bits", weight_scale.contiguous().view(torch.uint8))
        self.register_buffer("weight_scale_2_bits", weight_scale_2.reshape(1).view(torch.int32))
        # The activations' global scale of the W4A4 path (Blackwell); dequantization ignores it.
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
    def input_scale(self) -> torch.Tensor | None:  # [] float32
        return None if self.input_scale_bits is None else self.input_scale_bits.view(torch.float32).reshape(())

    @property
    def weight(self) -> torch.Tensor:  # [N, K] float32, dequantized on each access
        return dequantize_nvfp4(self.weight_codes, self.weight_scale, self.weight_scale_2, self.group)

    def _decide(self, x_dtype: torch.dtype, target) -> tuple[str, str]:
        from mtp_core.kernels.dispatch import choose_linear_kernel
        return choose_linear_kernel("nvfp4", self.out_features, self.in_features, x_dtype, target,
                                    has_input_scale=self.input_scale_bits is not None,
                                    cpu_layout=self.interleaved)

    def swizzled_weight_scale(self) -> torch.Tensor:
        """The block scales in the 128x4 layout of the W4A4 GEMM, computed once (not while a CUDA graph is
        being captured: a tensor made there would hold nothing until the first replay)."""
        cached = self.__dict__.get("_swizzled")
        if cached is not None:
            return cached
        from mtp_core.kernels import swizzle_block_scales
        swizzled = swizzle_block_scales(self.weight_scale)
        if not (self.weight_scale_bits.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.__dict__["_swizzled"] = swizzled
        return swizzled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._choose(x)
        if kernel == "dequant":
            return F.linear(x, self.weight.to(x.dtype))
        from mtp_core import kernels
        if kernel == "nvfp4_w4a4":
            return kernels.nvfp4_w4a4_gemm(x, self.weight_packed, self.weight_scale, self.weight_scale_2,
                                           self.input_scale, self.swizzled_weight_scale())
        out = kernels.nvfp4_gemm(x.to(torch.bfloat16), self.weight_packed, self.weight_scale,
                                 self.weight_scale_2)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nvfp4"


def dense_linear(weight: torch.Tensor, device: torch.device | str | None = None) -> torch.nn.Linear:
    """A bias-free nn.Linear holding weight [N, K] (a weight the checkpoint left unquantized)."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight.to(device) if device is not None else weight,
                                       requires_grad=False)
    return linear


def deep_gemm_supported(device: torch.device, shape: tuple[int, int],
                        block_size: tuple[int, int], x_dtype: torch.dtype = torch.bfloat16) -> str | None:
    """None when DeepGEMM serves this FP8 linear on this device (choose_linear_kernel's decision), else why not."""
    from mtp_core.kernels.dispatch import choose_linear_kernel, linear_target
    device = torch.device(device)
    if device.type != "cuda":
        return f"device is {device.type}, DeepGEMM needs CUDA"
    kernel, why = choose_linear_kernel("fp8_block", shape[0], shape[1], x_dtype, linear_target(device),
                                       block_size=tuple(block_size))
    return None if kernel == "fp8_deep_gemm" else why


def make_fp8_linear(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                    block_size: tuple[int, int], device: torch.device | str | None = None,
                    use_deep_gemm: bool | None = None) -> torch.nn.Module:
    """An Fp8BlockLinear whose forward runs the kernel choose_linear_kernel picks. use_deep_gemm True: DeepGEMM
    must serve it (ValueError naming why not); False: never DeepGEMM; None: whatever the decision says."""
    dev = torch.device(device) if device is not None else weight.device
    if use_deep_gemm:
        reason = deep_gemm_supported(dev, (weight.shape[0], weight.shape[1]), block_size)
        if reason is not None:
            raise ValueError(f"DeepGEMM FP8 GEMM requested but unavailable: {reason}")
        return Fp8DeepGemmLinear(weight, weight_scale_inv, block_size).to(dev)
    return Fp8BlockLinear(weight, weight_scale_inv, block_size, allow_deep_gemm=use_deep_gemm is None).to(dev)


def make_linear(fmt: QuantFormat, weight_name: str, tensors: dict[str, torch.Tensor],
                expected_shape: tuple[int, int], device: torch.device | str | None = None,
                use_deep_gemm: bool | None = None) -> torch.nn.Module:
    """A bias-free linear [..., K] -> [..., N] for one weight of a checkpoint in format `fmt` that keeps the packed
    tensors and dequantizes in forward; output equals F.linear(x, fmt.dequantize(...).to(x.dtype)) bit for bit
    (except the optional DeepGEMM FP8 path, which quantizes activations). Its `.weight` is the dequantized float32
    [N, K] weight (computed per access), for model code that reads weights directly. A weight the checkpoint left
    unquantized gives a plain nn.Linear. use_deep_gemm: as make_fp8_linear (FP8 only)."""
    if isinstance(fmt, Nvfp4Format) and use_deep_gemm:
        raise ValueError(f"{weight_name}: DeepGEMM applies to FP8 checkpoints, not NVFP4")
    packed = fmt.packed(weight_name, tensors, expected_shape)
    if packed is None:
        return dense_linear(fmt.dequantize(weight_name, tensors, expected_shape), device)
    if isinstance(fmt, Fp8BlockFormat):
        return make_fp8_linear(packed[0], packed[1], fmt.block_size, device, use_deep_gemm)
    if isinstance(fmt, Nvfp4Format):
        module = Nvfp4Linear(*packed, group=fmt.group_size)
        return module.to(device) if device is not None else module
    raise ValueError(f"{weight_name}: no keep-quantized linear for the {fmt.name} format")

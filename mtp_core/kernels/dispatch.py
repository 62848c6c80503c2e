"""The one place that chooses between a native kernel and its torch reference.

`native_ops()` is resolved once, on first use (runtime.kernels = auto|reference), and logged. Each op then
checks its input contract (ValueError on misuse) and runs the native kernel when one exists for
these tensors (device, dtypes, fixed GPU shapes), the torch reference otherwise.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from mtp_core.config import runtime
from mtp_core.kernels.native_ref import mat_gemm_ref
from mtp_core.kernels.fused_ref import rms_norm_ref, rope_ref
from mtp_core.kernels.mla_decode_ref import mla_decode_ref
from mtp_core.kernels.native import native_ops, note_fallback
from mtp_core.kernels.nvfp4_gemm_ref import (
    BLOCK_SIZE, nvfp4_gemm_ref, nvfp4_w4a4_gemm_ref, quantize_nvfp4_ref, swizzle_block_scales)

log = logging.getLogger("mtp_core.kernels")

_CPU_Q_DTYPES = (torch.float32, torch.bfloat16)
_CPU_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
_GPU_MLA_SHAPE = (512, 64, 64)          # latent dim R, rope dim P, page size


def _check_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               cache_seqlens: torch.Tensor, kv_scale: Optional[torch.Tensor]) -> None:
    if q_lat.dim() != 4 or q_pe.dim() != 4 or q_lat.shape[:3] != q_pe.shape[:3]:
        raise ValueError(f"mla_decode: q_lat {tuple(q_lat.shape)} and q_pe {tuple(q_pe.shape)} must be "
                         "[B, Q, H, R] and [B, Q, H, P]")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != q_lat.shape[3] + q_pe.shape[3]:
        raise ValueError(f"mla_decode: kv_cache {tuple(kv_cache.shape)} must be [num_blocks, page_size, "
                         f"{q_lat.shape[3] + q_pe.shape[3]}] (R + P)")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != q_lat.shape[0]:
        raise ValueError(f"mla_decode: block_table must be int32 [B={q_lat.shape[0]}, max_blocks], "
                         f"got {block_table.dtype} {tuple(block_table.shape)}")
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (q_lat.shape[0],):
        raise ValueError(f"mla_decode: cache_seqlens must be int32 [B={q_lat.shape[0]}], "
                         f"got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
    if kv_scale is not None and kv_scale.numel() != 1:
        raise ValueError("mla_decode: kv_scale must be a per-tensor scale with one element")
    devices = {t.device for t in (q_lat, q_pe, kv_cache, block_table, cache_seqlens)}
    if len(devices) != 1:
        raise ValueError(f"mla_decode: all tensors must be on one device, got {sorted(map(str, devices))}")


def _mla_native_reason(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor) -> Optional[str]:
    """None when the native kernel takes these inputs, else why not."""
    if q_lat.device.type == "cpu":
        if not native_ops().cpu:
            return "no native CPU ops"
        if q_lat.dtype not in _CPU_Q_DTYPES or q_pe.dtype != q_lat.dtype or kv_cache.dtype not in _CPU_CACHE_DTYPES:
            return f"CPU kernel takes fp32/bf16 queries, got {q_lat.dtype}/{q_pe.dtype} with a {kv_cache.dtype} cache"
        return None
    if q_lat.device.type != "cuda" or not native_ops().cuda_ok(q_lat.device):
        return f"no native kernel for {q_lat.device}"
    if q_lat.dtype != torch.bfloat16 or q_pe.dtype != torch.bfloat16 or kv_cache.dtype != torch.float8_e4m3fn:
        return f"GPU kernel takes bf16 queries and a float8_e4m3fn cache, got {q_lat.dtype} / {kv_cache.dtype}"
    if (q_lat.shape[3], q_pe.shape[3], kv_cache.shape[1]) != _GPU_MLA_SHAPE or not kv_cache.is_contiguous():
        return "GPU kernel takes R=512, P=64, page size 64 and a contiguous cache"
    return None


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               cache_seqlens: torch.Tensor, softmax_scale: float,
               kv_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode with Q = K+1 causal query tokens per sequence (contract: mla_decode_ref.py).

    q_lat [B, Q, H, R], q_pe [B, Q, H, P], kv_cache [num_blocks, page_size, R + P],
    block_table int32 [B, max_blocks], cache_seqlens int32 [B] (including the Q new tokens),
    kv_scale float32 [1] for an fp8 cache -> (out [B, Q, H, R], lse float32 [B, H, Q]).
    """
    _check_mla(q_lat, q_pe, kv_cache, block_table, cache_seqlens, kv_scale)
    reason = _mla_native_reason(q_lat, q_pe, kv_cache)
    if reason is None:
        return torch.ops.mtp_core.mla_decode(q_lat, q_pe, kv_cache, block_table, cache_seqlens,
                                             float(softmax_scale), kv_scale)
    note_fallback("mla_decode", reason)
    return mla_decode_ref(q_lat, q_pe, kv_cache, block_table, cache_seqlens, softmax_scale, kv_scale)


def _check_nvfp4_weight(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor) -> None:
    k = x.shape[-1]
    if k % BLOCK_SIZE or weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] * 2 != k:
        raise ValueError(f"nvfp4: weight must be uint8 [N, K/2] with K={k} a multiple of 16, "
                         f"got {weight.dtype} {tuple(weight.shape)}")
    if weight_scale.dtype != torch.float8_e4m3fn or weight_scale.shape != (weight.shape[0], k // BLOCK_SIZE):
        raise ValueError(f"nvfp4: weight_scale must be float8_e4m3fn [{weight.shape[0]}, {k // BLOCK_SIZE}], "
                         f"got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if weight_scale_2.numel() != 1:
        raise ValueError("nvfp4: weight_scale_2 must be a scalar tensor")


def nvfp4_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Weight-only NVFP4 GEMM: x [..., K] @ dequant(weight)^T -> [..., N] in x's dtype.

    Native on sm_90a / sm_100a GPUs for bf16 x with K % 64 == 0 (in-kernel dequant to bf16);
    the torch reference dequantizes and multiplies in fp32 everywhere else.
    """
    _check_nvfp4_weight(x, weight, weight_scale, weight_scale_2)
    x2 = x.reshape(-1, x.shape[-1])                                                     # [M, K]
    if x.is_cuda and native_ops().cuda_ok(x.device) and x.dtype == torch.bfloat16 and x.shape[-1] % 64 == 0:
        out = torch.ops.mtp_core.nvfp4_gemm(x2, weight, weight_scale, weight_scale_2.float().reshape(1))
    else:
        note_fallback("nvfp4_gemm", f"{x.device} {x.dtype} K={x.shape[-1]}")
        out = nvfp4_gemm_ref(x2, weight, weight_scale, weight_scale_2)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (packed e2m1 uint8 [M, K/2], float8_e4m3fn block scales [M, K/16]).
    global_scale is the per-tensor decode scale (ModelOpt input_scale)."""
    if x.dim() != 2 or x.shape[1] % BLOCK_SIZE or global_scale.numel() != 1:
        raise ValueError(f"nvfp4_quantize: x must be [M, K] with K a multiple of 16 and global_scale a scalar, "
                         f"got {tuple(x.shape)}")
    if x.is_cuda and native_ops().cuda_ok(x.device) and x.dtype == torch.bfloat16:
        return torch.ops.mtp_core.nvfp4_quantize(x, global_scale.float().reshape(1))
    note_fallback("nvfp4_quantize", f"{x.device} {x.dtype}")
    return quantize_nvfp4_ref(x, global_scale)


def nvfp4_w4a4_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    weight_scale_2: torch.Tensor, input_scale: torch.Tensor,
                    weight_scale_swizzled: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W4A4 NVFP4 GEMM: x quantized to NVFP4 with input_scale, times the NVFP4 weight -> [..., N].

    Blackwell (compute capability 10.x): block-scaled FP4 tensor cores through cuBLASLt
    (F.scaled_mm, BlockWise1x16 + TensorWise scales, 128x4-swizzled block scales). Elsewhere the
    same quantization is emulated in fp32 (nvfp4_w4a4_gemm_ref). weight_scale_swizzled:
    swizzle_block_scales(weight_scale), computed once by the caller (Nvfp4Linear caches it).
    """
    _check_nvfp4_weight(x, weight, weight_scale, weight_scale_2)
    x2 = x.reshape(-1, x.shape[-1])                                                     # [M, K]
    if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 10:
        gs_x, gs_w = input_scale.float().reshape(1), weight_scale_2.float().reshape(1)
        x_packed, x_scale = nvfp4_quantize(x2.to(torch.bfloat16), gs_x)
        if weight_scale_swizzled is None:
            weight_scale_swizzled = swizzle_block_scales(weight_scale)
        out = F.scaled_mm(
            x_packed.view(torch.float4_e2m1fn_x2), weight.view(torch.float4_e2m1fn_x2).t(),
            scale_a=[swizzle_block_scales(x_scale), gs_x],
            scale_recipe_a=[F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise],
            scale_b=[weight_scale_swizzled, gs_w],
            scale_recipe_b=[F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise],
            swizzle_a=[F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE],
            swizzle_b=[F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE],
            output_dtype=torch.bfloat16).to(x.dtype)
    else:
        note_fallback("nvfp4_w4a4_gemm", f"{x.device}: no FP4 tensor cores")
        out = nvfp4_w4a4_gemm_ref(x2, weight, weight_scale, weight_scale_2, input_scale)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _native_cpu_elementwise(*tensors: torch.Tensor) -> bool:
    """The fused CPU ops take fp32/bf16 CPU tensors and have no autograd formula."""
    x = tensors[0]
    return (native_ops().cpu and x.device.type == "cpu" and x.dtype in _CPU_Q_DTYPES
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype) over the last dim (contract: fused_ref.py)."""
    if weight.dtype == x.dtype and _native_cpu_elementwise(x, weight):
        return torch.ops.mtp_core.rms_norm(x, weight, float(eps))
    return rms_norm_ref(x, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary embedding of x [T, ..., D] with cos/sin [T, D/2] (contract: fused_ref.py)."""
    if (cos.dim() == 2 and x.dim() >= 2 and x.shape[0] == cos.shape[0] and cos.dtype == sin.dtype == torch.float32
            and _native_cpu_elementwise(x)):
        return torch.ops.mtp_core.rope(x, cos, sin, interleave)
    return rope_ref(x, cos, sin, interleave)


def cpu_amx() -> bool:
    """AMX tiles are usable (CPU, kernel permission) and not capped off by runtime.cpu_isa (env MTP_CORE_CPU_ISA;
    avx512, avx512f, avx2 or generic turn them off; auto and amx keep them): the native forward then runs bf16
    weights' GEMMs on them."""
    if not native_ops().cpu or runtime.cpu_isa() not in ("auto", "amx"):
        return False
    import mtp_core._C as _C
    return bool(_C.cpu_amx())


def cpu_bf16_dot() -> bool:
    """The CPU has AVX512-BF16 dot products (and VBMI) and runtime.cpu_isa does not cap them off (auto, amx
    and avx512 keep them; avx512f, avx2 and generic turn them off): the native forward then runs the direct
    layout's bf16 / FP8 / NVFP4 row-wise matrices that AMX does not take on them, with bf16 activations."""
    if not native_ops().cpu or runtime.cpu_isa() not in ("auto", "amx", "avx512"):
        return False
    import mtp_core._C as _C
    return bool(_C.cpu_bf16_dot())


def cpu_isa() -> str:
    """The instruction set of the native CPU decode kernels (avx512 / avx2 / generic; runtime.cpu_isa caps
    it), or "reference" when the native ops are not loaded."""
    if not native_ops().cpu:
        return "reference"
    import mtp_core._C as _C
    return _C.cpu_isa()


def mat_gemm(x: torch.Tensor, m, amx: bool = False, dot: bool = False) -> torch.Tensor:
    """x [T, m.k] @ W^T (+ bias) -> float32 [T, m.n] for a native.native_weights.Matrix of any layout / format, with
    the native forward's kernels on CPU (batch-invariant: each output reduced in an order independent of T).
    amx: the AMX tile GEMM (bf16 row-wise weights; x rounded to bf16), where cpu_amx(); dot: the AVX512-BF16
    dot-product GEMM (row-wise bf16 / FP8 / NVFP4 weights; x rounded to bf16), where cpu_bf16_dot()."""
    if x.dim() != 2 or x.shape[1] != m.k:
        raise ValueError(f"mat_gemm: x must be [T, {m.k}], got {tuple(x.shape)}")
    if native_ops().cpu and x.device.type == "cpu":
        return torch.ops.mtp_core.mat_gemm(x, m.data, m.scale, m.gscale, m.bias, m.layout, m.fmt, m.n, m.k,
                                           m.scale_r0, m.gscale2, amx, dot)
    note_fallback("mat_gemm", f"{x.device}: no native op")
    return mat_gemm_ref(x, m, amx, dot)


# ---- which kernel serves a quantized linear ---------------------------------------------------
LINEAR_KERNELS = ("dequant", "nvfp4_gemm", "nvfp4_w4a4", "fp8_deep_gemm", "fp8_scaled_mm")


@dataclass(frozen=True)
class LinearTarget:
    """What a device offers the quantized linears: passed to choose_linear_kernel so that the decision can
    be tested on a CPU for CUDA-like devices (linear_target() fills it in for a real device)."""
    device_type: str                                # "cpu", "cuda", ...
    capability: Optional[tuple[int, int]] = None    # CUDA compute capability, e.g. (9, 0) for H100/H200
    native_cuda: bool = False                       # mtp_core._C_cuda was built for this device
    deep_gemm: bool = False                         # the deep_gemm package imports
    scaled_mm: bool = False                         # torch has F.scaled_mm with block-wise FP8 / FP4 recipes


def linear_target(device: torch.device) -> LinearTarget:
    """The LinearTarget of a real device (queried once per device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return LinearTarget(device.type)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _cuda_linear_target(device.index)


@functools.lru_cache(maxsize=1)
def load_deep_gemm() -> ModuleType | None:
    """The deep_gemm module, or None (logged once) when it is not installed or fails to import."""
    try:
        import deep_gemm  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or a broken CUDA/JIT setup inside the package
        log.warning("DeepGEMM not available (%s: %s); FP8 linears dequantize their weights "
                       "instead of running FP8 GEMMs", type(e).__name__, e)
        return None
    return deep_gemm


@functools.cache
def _cuda_linear_target(index: int) -> LinearTarget:
    capability = tuple(torch.cuda.get_device_capability(index))
    scaled_mm = hasattr(F, "scaled_mm") and hasattr(F, "ScalingType") and all(
        hasattr(F.ScalingType, n) for n in ("BlockWise1x128", "BlockWise128x128", "BlockWise1x16"))
    deep_gemm = capability[0] == 9 and load_deep_gemm() is not None
    return LinearTarget("cuda", capability, native_ops().cuda_ok(torch.device("cuda", index)), deep_gemm, scaled_mm)


def choose_linear_kernel(fmt: str, out_features: int, in_features: int, x_dtype: torch.dtype,
                         target: LinearTarget, *, block_size: Optional[tuple[int, int]] = None,
                         has_input_scale: bool = False, cpu_layout: bool = False,
                         deep_gemm: bool = True) -> tuple[str, str]:
    """The one decision "which kernel serves this quantized weight": -> (kernel, why), kernel in LINEAR_KERNELS.

    fmt "nvfp4" (ModelOpt, group 16) or "fp8_block" (DeepSeek, block_size); x_dtype is the activations' dtype.
      nvfp4_w4a4     Blackwell (sm_100): activations quantized to NVFP4 with the checkpoint's input_scale,
                     FP4 tensor cores through F.scaled_mm (cuBLASLt); K % 32, N % 16.
      nvfp4_gemm     the project's weight-only NVFP4 GEMM (sm_90a / sm_100a build of mtp_core._C_cuda),
                     K % 64; x runs in bf16.
      fp8_deep_gemm  DeepGEMM's FP8 GEMM on Hopper when installed (block 128x128, K % 128, N % 64).
      fp8_scaled_mm  torch's block-scaled FP8 matmul (1x128 activations, 128x128 weights; sm_90 / sm_100,
                     K % 128, N % 128).
      dequant        F.linear on the dequantized weight (CPUs, where the native CPU forward reads the packed
                     weights itself, and any case above that does not apply).
    cpu_layout: the NVFP4 codes were reordered for the CPU kernels (only the dequantizing path reads them);
    deep_gemm=False refuses DeepGEMM (make_fp8_linear's use_deep_gemm=False).
    """
    if fmt not in ("nvfp4", "fp8_block"):
        raise ValueError(f"choose_linear_kernel: fmt must be 'nvfp4' or 'fp8_block', got {fmt!r}")
    n, k = int(out_features), int(in_features)
    if target.device_type != "cuda" or target.capability is None:
        return "dequant", f"{target.device_type}: no GPU GEMM (the module dequantizes; the native CPU forward " \
                          "reads the packed weights)"
    major, minor = target.capability
    arch = f"sm_{major}{minor}"
    if x_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return "dequant", f"activations in {x_dtype}"
    if fmt == "nvfp4":
        if cpu_layout:
            return "dequant", "NVFP4 codes are in the CPU kernels' order"
        if major == 10 and target.scaled_mm and has_input_scale and k % 32 == 0 and n % 16 == 0:
            return "nvfp4_w4a4", f"{arch}: FP4 tensor cores (W4A4 with the checkpoint's input_scale)"
        if target.native_cuda and k % 64 == 0:
            why = "no input_scale for W4A4" if major == 10 and not has_input_scale else "weight-only"
            return "nvfp4_gemm", f"{arch}: mtp_core's NVFP4 GEMM ({why})"
        if not target.native_cuda:
            return "dequant", f"{arch}: mtp_core._C_cuda has no kernels for this GPU"
        return "dequant", f"in_features {k} is not a multiple of 64"
    if tuple(block_size or ()) != (128, 128):
        return "dequant", f"FP8 block {list(block_size or ())} is not [128, 128]"
    if k % 128:
        return "dequant", f"in_features {k} is not a multiple of 128"
    if major == 9 and deep_gemm and target.deep_gemm and n % 64 == 0:
        return "fp8_deep_gemm", f"{arch}: DeepGEMM FP8 GEMM"
    if major in (9, 10) and target.scaled_mm and n % 128 == 0:
        return "fp8_scaled_mm", f"{arch}: torch's block-scaled FP8 matmul"
    return "dequant", f"{arch}: no FP8 GEMM for out_features {n} (needs a multiple of 128)"

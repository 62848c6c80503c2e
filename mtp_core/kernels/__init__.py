"""Kernels of mtp_core: one dispatch point per op (native extension if present, else torch reference).

    from mtp_core.kernels import mla_decode
    out, lse = mla_decode(q_lat, q_pe, kv_cache, block_table, cache_seqlens, softmax_scale, kv_scale)

`native_ops()` says what was loaded (decided once, on first use; runtime.kernels: reference, or env
MTP_CORE_KERNELS=reference, forces the torch references). The *_ref functions are the plain-torch oracles the
native kernels are tested against.
"""
from mtp_core.kernels.dispatch import (
    cpu_amx, cpu_bf16_dot, cpu_isa, mat_gemm, mla_decode, nvfp4_gemm, nvfp4_quantize, nvfp4_w4a4_gemm, rms_norm, rope)
from mtp_core.kernels.fused_ref import rms_norm_ref, rope_ref
from mtp_core.kernels.mla_decode_ref import mla_decode_ref
from mtp_core.kernels.native import NativeOps, native_ops
from mtp_core.kernels.nvfp4_gemm_ref import (
    dequantize_nvfp4, nvfp4_gemm_ref, nvfp4_w4a4_gemm_ref, quantize_nvfp4_ref, swizzle_block_scales,
    unpack_e2m1)

__all__ = [
    "NativeOps", "native_ops", "cpu_amx", "cpu_bf16_dot", "cpu_isa", "mat_gemm", "mla_decode", "mla_decode_ref", "rms_norm", "rms_norm_ref",
    "rope", "rope_ref", "nvfp4_gemm", "nvfp4_gemm_ref", "nvfp4_quantize",
    "quantize_nvfp4_ref", "nvfp4_w4a4_gemm", "nvfp4_w4a4_gemm_ref", "dequantize_nvfp4", "unpack_e2m1",
    "swizzle_block_scales",
]

"""The matrices the native CPU kernels read (csrc/cpu/decode_kernels.h: Mat): the codes of their formats and
layouts, and which GEMM takes which matrix.

A matrix here is anything with the fields of `mtp_core.native.native_weights.Matrix` (layout, fmt, n, k, data,
scale, ...): `kernels.mat_gemm` multiplies one, `native_ref.py` is its torch reference, and both need to know,
as the kernels do, when the activations are rounded to bf16 (`bf16_acts`).
"""
from __future__ import annotations

F32, BF16, FP8, NVFP4 = 0, 1, 2, 3          # csrc/cpu/decode_kernels.h: Fmt
ROWS, COLS, PANEL, PAIRS = 0, 1, 2, 3        # csrc/cpu/decode_kernels.h: Layout


def amx_takes(m) -> bool:
    """csrc/cpu/amx_gemm.h: amx_takes."""
    return m.layout == ROWS and m.fmt == BF16 and m.k % 32 == 0


def dot_takes(m) -> bool:
    """csrc/cpu/dot_gemm.h: dot_takes."""
    return m.layout == ROWS and m.fmt in (BF16, FP8, NVFP4)


def bf16_acts(m, dims: dict) -> bool:
    """Whether the native forward rounds this matrix's activations to bf16: it runs on the AMX tiles
    (dims["amx"]) or on the AVX512-BF16 dot products (dims["bf16_dot"], and every matrix packed in input pairs);
    every other matrix sees fp32."""
    return bool(m.layout == PAIRS or (dims.get("amx") and amx_takes(m)) or (dims.get("bf16_dot") and dot_takes(m)))

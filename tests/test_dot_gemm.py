"""The bf16 dot-product GEMM (csrc/cpu/dot_gemm.cpp: AVX512-BF16 `vdpbf16ps`, activations rounded to bf16) for
row-wise bf16, FP8-block and NVFP4 weights, against the dequantized weights times the bf16-rounded activations in
float64, over every tail length of its steps (K mod 64, FP8's K mod 128 blocks, NVFP4's 16-input groups in every
position of a 64-input step), T = 1..9 and row counts that leave every tile remainder; each output bitwise the
same whatever the token count, the row split and the thread count.

A kernel bug that drops or misplaces a part of a step (a tail's second vector, one group's scale, a block scale
applied to the wrong block) moves an output by the size of a product, which these tolerances (the fp32 rounding
of the sum, ~1e-6 of the absolute sum) catch on every K; tests/test_native_decode.py runs whole models on it.
"""
from __future__ import annotations

import os

import pytest
import torch

from mtp_core import kernels
from mtp_core.kernels import nvfp4_layout
from mtp_core.kernels.mat import BF16, FP8, NVFP4, ROWS
from mtp_core.loader.quant.fp8 import dequantize_fp8_block, quantize_fp8_block
from mtp_core.loader.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from mtp_core.native.native_weights import Matrix, _fp8_scale

if not kernels.native_ops().cpu and os.environ.get("MTP_CORE_REQUIRE_NATIVE") == "1":
    raise RuntimeError(f"MTP_CORE_REQUIRE_NATIVE=1 but {kernels.native_ops().summary}")
pytestmark = pytest.mark.skipif(not kernels.cpu_bf16_dot(),
                                reason="no AVX512-BF16 on this CPU (or capped by MTP_CORE_CPU_ISA)")

N = 21   # one 8-row tile + 5 rows (one token); five 4-row tiles + 1 (several tokens)


def matrix(fmt: int, n: int, k: int, g: torch.Generator, bias: bool = False) -> tuple[Matrix, torch.Tensor]:
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    if fmt == BF16:
        wb = w.bfloat16()
        return Matrix(ROWS, BF16, n, k, wb, bias=b), wb.float()
    if fmt == FP8:
        # scales vary per 128 x 128 block, and small weights reach e4m3's denormals
        w = w * torch.logspace(-3, 1, k).view(1, k)
        q, s = quantize_fp8_block(w)
        return Matrix(ROWS, FP8, n, k, q.view(torch.uint8), scale=_fp8_scale(s), bias=b), dequantize_fp8_block(q, s)
    w = w * torch.logspace(-2, 1, k).view(1, k)
    p, sc, s2 = quantize_nvfp4(w)
    m = Matrix(ROWS, NVFP4, n, k, nvfp4_layout.interleave(p), gscale=sc.view(torch.uint8), gscale2=float(s2), bias=b)
    return m, dequantize_nvfp4(p, sc, s2)


def check(m: Matrix, dense: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = kernels.mat_gemm(x, m, dot=True)
    xb = x.bfloat16().double()
    ref = xb @ dense.double().T + (m.bias.double() if m.bias is not None else 0)
    bound = xb.abs() @ dense.double().abs().T
    err = (y.double() - ref).abs()
    assert (err <= 2e-6 * bound + 1e-30).all(), f"max err {err.max().item():.3g}, bound {bound.max().item():.3g}"
    return y


def ks(fmt: int) -> list[int]:
    if fmt == NVFP4:   # every count of 16-input groups (1..16) in a row's last 256-input block, after 0 and 1 whole blocks
        return list(range(16, 529, 16))
    # every K mod 64 with one and two steps, every K mod 128 across FP8 blocks, and three blocks
    return list(range(1, 130)) + [191, 192, 193, 255, 256, 257, 300, 383, 384, 385]


@pytest.mark.parametrize("fmt", [BF16, FP8, NVFP4], ids=["bf16", "fp8", "nvfp4"])
def test_every_tail_and_token_count_matches_the_dequantized_product(fmt) -> None:
    g = torch.Generator().manual_seed(fmt)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for k in ks(fmt):
            m, dense = matrix(fmt, N, k, g, bias=k % 3 == 0)
            x = torch.randn(9, k, generator=g)
            ys = [check(m, dense, x[:T]) for T in range(1, 10)]
            for T, y in enumerate(ys, 1):   # each token's output bitwise the same whatever shares the call
                assert torch.equal(y, ys[-1][:T]), (k, T)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("fmt", [BF16, FP8, NVFP4], ids=["bf16", "fp8", "nvfp4"])
def test_prefill_sizes_threads_and_gathered_rows(fmt) -> None:
    """Many tokens (the token blocks and the 6- / 3-token register tiles with their remainders), 1 vs 2 threads
    bitwise, and real widths' K (2048 and DeepSeek-V3's 7168 inputs, Moonlight's 1408-wide experts)."""
    g = torch.Generator().manual_seed(10 + fmt)
    old = torch.get_num_threads()
    try:
        for k, T in ((2048, 37), (1408, 64), (7168, 13), (336, 200)):
            m, dense = matrix(fmt, 70, k, g, bias=True)
            x = torch.randn(T, k, generator=g)
            torch.set_num_threads(1)
            y1 = check(m, dense, x)
            torch.set_num_threads(2)
            y2 = kernels.mat_gemm(x, m, dot=True)
            assert torch.equal(y1, y2)
            single = torch.cat([kernels.mat_gemm(x[i:i + 1], m, dot=True) for i in range(0, T, 7)])
            assert torch.equal(single, y1[::7])
    finally:
        torch.set_num_threads(old)


def test_fp8_denormals_and_signs_decode_exactly() -> None:
    """Every e4m3 byte but the NaNs as a weight, one at a time (a row of 256 inputs, one hot activation):
    the output is the byte's value times its block scale, exactly."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    n = codes.numel()
    data = torch.zeros(n, 128, dtype=torch.uint8)
    data[torch.arange(n), torch.arange(n) % 128] = codes
    scale = torch.full(((n + 127) // 128, 1), 0.5)
    m = Matrix(ROWS, FP8, n, 128, data, scale=_fp8_scale(scale))
    x = torch.zeros(n, 128)
    x[torch.arange(n), torch.arange(n) % 128] = 1.0
    y = kernels.mat_gemm(x, m, dot=True).diagonal()
    want = codes.view(torch.float8_e4m3fn).float() * 0.5
    assert torch.equal(y, want)


def test_refused_where_it_does_not_apply() -> None:
    with pytest.raises(RuntimeError, match="dot"):
        kernels.mat_gemm(torch.randn(2, 40), Matrix(ROWS, 0, 8, 40, torch.randn(8, 40)), dot=True)


def test_input_pairs_layout_every_tail_and_token_count() -> None:
    """bf16 weights packed in 16-row blocks of input pairs (the packed layout on CPUs with bf16 dot products):
    every row count past a block (N mod 16), odd K (a half pair), T = 1..9 (the 8-block one-token tiles, the
    4-block x 1..6-token tiles and their remainders), bias; bitwise the same whatever shares the call."""
    from mtp_core.kernels.mat import PAIRS
    from mtp_core.native.native_weights import pack_pairs
    g = torch.Generator().manual_seed(21)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n, k in ((1, 2), (15, 31), (16, 64), (17, 33), (130, 256), (200, 7), (260, 160)):
            w = torch.randn(n, k, generator=g).bfloat16()
            m = Matrix(PAIRS, BF16, n, k, pack_pairs(w), bias=torch.randn(n, generator=g) if n % 2 else None)
            assert torch.equal(m.dense(), w.float())
            x = torch.randn(9, k, generator=g)
            ys = [check(m, w.float(), x[:T]) for T in range(1, 10)]
            for T, y in enumerate(ys, 1):
                assert torch.equal(y, ys[-1][:T]), (n, k, T)
    finally:
        torch.set_num_threads(old)

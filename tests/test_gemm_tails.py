"""The fp32-activation row GEMM of every ISA build (csrc/cpu/decode_kernels_impl.h: avx512f, avx2, generic) over
every tail of its 32-input chunks and 16-lane vectors (K mod 32 from 1 to 130 inputs, FP8's 128-input blocks,
NVFP4's 16-input groups), T = 1..9 tokens (the 8-row one-token tiles, the 4-row x 1..4-token tiles, and the
rows decoded once for more than 4 tokens), against float64 products of the same values; each token's output
bitwise the same whatever shares the call.

This is the exact reference path (MTP_CORE_CPU_ISA=avx512f on an AVX-512 CPU): a kernel that drops a tail's
second vector or a block's scale is off by a whole product on some K, far outside the fp32 rounding allowed here.
Each ISA runs in its own process (the kernel table is chosen once per process).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp_core import kernels
from mtp_core.kernels import nvfp4_layout
from mtp_core.kernels.mat import BF16, F32, FP8, NVFP4, ROWS
from mtp_core.loader.quant.fp8 import dequantize_fp8_block, quantize_fp8_block
from mtp_core.loader.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from mtp_core.native.native_weights import Matrix, _fp8_scale

ROOT = Path(__file__).resolve().parent.parent
if not kernels.native_ops().cpu and os.environ.get("MTP_CORE_REQUIRE_NATIVE") == "1":
    raise RuntimeError(f"MTP_CORE_REQUIRE_NATIVE=1 but {kernels.native_ops().summary}")
pytestmark = pytest.mark.skipif(not kernels.native_ops().cpu, reason=kernels.native_ops().summary)

N = 21   # two 8-row tiles + 5 rows at one token; five 4-row tiles + 1 at several


def matrix(fmt: int, n: int, k: int, g: torch.Generator) -> tuple[Matrix, torch.Tensor]:
    w = torch.randn(n, k, generator=g)
    if fmt == F32:
        return Matrix(ROWS, F32, n, k, w), w
    if fmt == BF16:
        return Matrix(ROWS, BF16, n, k, w.bfloat16()), w.bfloat16().float()
    if fmt == FP8:
        q, s = quantize_fp8_block(w * torch.logspace(-3, 1, k).view(1, k))
        return Matrix(ROWS, FP8, n, k, q.view(torch.uint8), scale=_fp8_scale(s)), dequantize_fp8_block(q, s)
    p, sc, s2 = quantize_nvfp4(w * torch.logspace(-2, 1, k).view(1, k))
    return (Matrix(ROWS, NVFP4, n, k, nvfp4_layout.interleave(p), gscale=sc.view(torch.uint8), gscale2=float(s2)),
            dequantize_nvfp4(p, sc, s2))


def check_all() -> int:
    """Every format, K and T on the kernel table of this process; returns the number of cases."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(7)
    cases = 0
    for fmt in (F32, BF16, FP8, NVFP4):
        ks = range(16, 529, 16) if fmt == NVFP4 else list(range(1, 131)) + [255, 256, 257, 300]
        for k in ks:
            m, dense = matrix(fmt, N, k, g)
            x = torch.randn(9, k, generator=g)
            ref = x.double() @ dense.double().T
            bound = x.double().abs() @ dense.double().abs().T
            full = kernels.mat_gemm(x, m)
            for T in range(1, 10):
                y = kernels.mat_gemm(x[:T], m)
                err = (y.double() - ref[:T]).abs()
                assert (err <= 1e-6 * bound[:T] + 1e-30).all(), (fmt, k, T, err.max().item())
                assert torch.equal(y, full[:T]), (fmt, k, T)
                cases += 1
    return cases


@pytest.mark.parametrize("isa", ["avx512f", "avx2", "generic"])
def test_every_tail_of_every_isa_build(isa) -> None:
    code = ("import sys; sys.path.insert(0, 'tests'); from test_gemm_tails import check_all;"
            "from mtp_core import kernels; print(kernels.cpu_isa(), check_all())")
    env = dict(os.environ, MTP_CORE_CPU_ISA=isa)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got, cases = res.stdout.split()[-2:]
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    want = {"avx512f": "avx512" if "avx512f" in cpu else "avx2" if "avx2" in cpu else "generic",
            "avx2": "avx2" if "avx2" in cpu else "generic", "generic": "generic"}[isa]
    assert got == want and int(cases) == 9 * (3 * 134 + 33)   # every (format, K, T) ran

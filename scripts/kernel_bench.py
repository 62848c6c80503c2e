"""One matrix through the native CPU GEMM kernels, alone: read bandwidth at one token (decode) and multiply-adds
per second at many (prefill), for each weight format and kernel path (fp32 FMAs vs bf16 dot products / AMX),
beside the read bandwidth of an fp32 sum over initialised memory in the same process.

    python3 scripts/kernel_bench.py [--n 16384] [--k 2048] [--threads 1,2] [--tokens 1,4,512] [--reps 5]

The matrix is random, in place in its stored format (bf16 [n, k]; FP8 e4m3 + 128x128 block scales; NVFP4
codes + group scales), large enough (default 64 MB of bf16) that decode reads it from memory every call.
Prints one JSON line per (format, path, threads, tokens): best-of-reps seconds, GB/s of weight bytes, GMAC/s.
`--formats bf16_packed` times the packed layout's copy of the bf16 matrix (input-pair panels on bf16-dot CPUs,
64-row panels elsewhere: what models up to 64 MB get) beside the weights read in place.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from mtp_core import kernels
from mtp_core.kernels import nvfp4_layout
from mtp_core.kernels.mat import BF16, FP8, NVFP4, ROWS
from mtp_core.loader.quant.fp8 import quantize_fp8_block
from mtp_core.loader.quant.nvfp4 import quantize_nvfp4
from mtp_core.native.native_weights import Matrix, _fp8_scale, panel
from scale_bench import read_bandwidth    # (scripts/ is this script's directory)


def matrices(n: int, k: int) -> dict[str, Matrix]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.05
    q, s = quantize_fp8_block(w)
    p, sc, s2 = quantize_nvfp4(w)
    return {"bf16": Matrix(ROWS, BF16, n, k, w.bfloat16()),
            "bf16_packed": panel(w.bfloat16(), pairs=kernels.cpu_bf16_dot()),     # the packed layout's copy
            "fp8": Matrix(ROWS, FP8, n, k, q.view(torch.uint8), scale=_fp8_scale(s)),
            "nvfp4": Matrix(ROWS, NVFP4, n, k, nvfp4_layout.interleave(p), gscale=sc.view(torch.uint8),
                            gscale2=float(s2))}


def time_one(m: Matrix, x: torch.Tensor, dot: bool, reps: int) -> float:
    kernels.mat_gemm(x, m, dot=dot)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        kernels.mat_gemm(x, m, dot=dot)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", default="1,4,512")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--formats", default="bf16,fp8,nvfp4")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    print(json.dumps({"isa": kernels.cpu_isa(), "bf16_dot": kernels.cpu_bf16_dot(), "amx": kernels.cpu_amx(),
                      "read_GBps": {t: round(read_bandwidth(t), 2) for t in threads}}), flush=True)
    mats = matrices(a.n, a.k)
    paths = ["fp32"] + (["dot"] if kernels.cpu_bf16_dot() else [])
    for fmt in a.formats.split(","):
        m = mats[fmt]
        for path in paths:
            for t in threads:
                torch.set_num_threads(t)
                for T in (int(v) for v in a.tokens.split(",")):
                    x = torch.randn(T, a.k)
                    reps = a.reps if T < 64 else max(1, a.reps // 2)
                    s = time_one(m, x, path == "dot", reps)
                    print(json.dumps({"fmt": fmt, "path": path, "threads": t, "tokens": T, "ms": round(s * 1e3, 3),
                                      "GBps": round(m.nbytes / s / 1e9, 2),
                                      "GMACps": round(a.n * a.k * T / s / 1e9, 1)}), flush=True)


if __name__ == "__main__":
    main()

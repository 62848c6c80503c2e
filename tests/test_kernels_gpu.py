"""GPU parity tests of the CUDA kernels against the torch references (marker `gpu`).

Skipped without CUDA (never counted as passed). On a GPU the kernels target (sm_90a: H100/H200,
sm_100a: B200) a missing mtp_core._C_cuda is a failure, not a skip: build it first
(scripts/gpu_check.sh does). The W4A4 test needs Blackwell and is skipped on Hopper.
"""
from __future__ import annotations

import math

import pytest
import torch

from mtp_core.kernels import (
    native_ops, mla_decode, mla_decode_ref, nvfp4_gemm, nvfp4_gemm_ref, nvfp4_quantize, nvfp4_w4a4_gemm,
    nvfp4_w4a4_gemm_ref, quantize_nvfp4_ref)

torch.set_num_threads(1)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
TARGETS = ("90a", "100a")


@pytest.fixture(scope="module")
def device() -> torch.device:
    dev = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(dev)
    if f"{major}{minor}a" not in TARGETS:
        pytest.skip(f"the CUDA kernels target sm_90a / sm_100a, this GPU is sm_{major}{minor}")
    if not native_ops().cuda_ok(dev):
        pytest.fail(f"mtp_core._C_cuda is not usable here: {native_ops().summary}")
    return dev


def mla_case(device, batch: int, num_q: int, heads: int, seqlens: list[int], seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    page, latent, rope = 64, 512, 64
    max_blocks = max(-(-s // page) for s in seqlens) + 2
    num_blocks = batch * max_blocks + 5
    kv_scale = torch.tensor([0.05])
    cache = (torch.randn(num_blocks, page, latent + rope, generator=g) / kv_scale).to(torch.float8_e4m3fn)
    table = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].reshape(batch, max_blocks).int()
    for b, n in enumerate(seqlens):          # the slots after the last token hold fp8 NaN (0x7F)
        if n % page:
            cache[table[b, n // page], n % page:] = float("nan")
    q_lat = torch.randn(batch, num_q, heads, latent, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(batch, num_q, heads, rope, generator=g).to(torch.bfloat16)
    lens = torch.tensor(seqlens, dtype=torch.int32)
    tensors = [t.to(device) for t in (q_lat, q_pe, cache, table, lens)]
    return (*tensors, 1.0 / math.sqrt(192), kv_scale.to(device))


@pytest.mark.parametrize("batch,num_q,heads,seqlens", [
    (1, 1, 16, [1]),                          # one key, one 16-row CTA
    (1, 2, 16, [4000]),                       # many KV splits + combine
    (3, 4, 16, [4, 64, 129]),                 # 64 rows, page boundaries, Q=4 causal
    (2, 3, 10, [0, 777]),                     # 30 rows (32-row CTA), a padded slot with seqlen 0
    (2, 1, 128, [300, 1000]),                 # 128 rows = two 64-row CTAs
    (64, 2, 128, [257] * 63 + [1500]),        # enough CTAs for a single split (direct epilogue)
    (1, 1, 16, [20000]),                      # batch 1: one split per SM (more than the old cap of 64)
    (4, 1, 16, [3, 9000, 64, 0]),             # short rows beside a long one: their unneeded splits exit at once
    (2, 2, 128, [65, 2000]),                  # 64-row CTAs: at least 4 pages per split
])
def test_mla_decode_cuda_matches_ref(device, batch, num_q, heads, seqlens) -> None:
    args = mla_case(device, batch, num_q, heads, seqlens)
    out, lse = mla_decode(*args)
    want_out, want_lse = mla_decode_ref(*args)
    assert out.dtype == torch.bfloat16 and out.shape == want_out.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=1e-3)


def test_mla_decode_cuda_clamps_as_the_reference(device) -> None:
    """Block ids outside the cache are clamped into it and a row never reads past its block table's width,
    as mla_decode_ref clamps them (the kernel cannot raise)."""
    q_lat, q_pe, cache, table, lens, scale, kv_scale = mla_case(device, 3, 2, 16, [200, 130, 64])
    raw = cache.view(torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0                      # no NaN slots: a clamped id may land on any block
    table[0, 1] = -7                                   # a negative id -> block 0
    table[1, 2] = cache.shape[0] + 1000                # past the cache -> the last block
    lens[2] = table.shape[1] * 64 + 500                # longer than the table: only the table's pages count
    out, lse = mla_decode(q_lat, q_pe, cache, table, lens, scale, kv_scale)
    want_out, want_lse = mla_decode_ref(q_lat, q_pe, cache, table, lens, scale, kv_scale)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=1e-3)


def test_mla_decode_cuda_graph_replay(device) -> None:
    q_lat, q_pe, cache, table, lens, scale, kv_scale = mla_case(device, 4, 2, 16, [100, 200, 65, 3])
    mla_decode(q_lat, q_pe, cache, table, lens, scale, kv_scale)            # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mla_decode(q_lat, q_pe, cache, table, lens, scale, kv_scale)
    lens.copy_(torch.tensor([150, 2, 64, 190], dtype=torch.int32))
    q_lat.normal_()
    graph.replay()
    want_out, want_lse = mla_decode_ref(q_lat, q_pe, cache, table, lens, scale, kv_scale)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=1e-3)


def nvfp4_case(device, m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    weight = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    weight_scale = (torch.rand(n, k // 16, generator=g) * 2 + 0.1).to(torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return x.to(device), weight.to(device), weight_scale.to(device), torch.tensor([0.02], device=device)


@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (7, 200, 1024), (64, 2048, 7168), (130, 96, 256), (4, 7168, 2048)])
def test_nvfp4_gemm_cuda_matches_ref(device, m, n, k) -> None:
    x, weight, scale, scale_2 = nvfp4_case(device, m, n, k)
    got = nvfp4_gemm(x, weight, scale, scale_2)
    want = nvfp4_gemm_ref(x, weight, scale, scale_2)
    # The dequantized weight is exact in bf16: only accumulation order and the bf16 output differ.
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * want.abs().max().item(), rtol=1e-2)


def test_nvfp4_quantize_cuda_is_bitwise_ref(device) -> None:
    g = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(37, 512, generator=g) * torch.logspace(-3, 3, 37)[:, None]).to(torch.bfloat16).to(device)
    x[3] = 0.0
    x[5, 17] = float("nan")                        # the reference's NaN contract: scale 0x7F, codes 0
    x[6, 40] = float("inf")
    x[7, 100] = float("-inf")
    global_scale = (x.float().abs().nan_to_num(0.0, 0.0, 0.0).amax() / (6.0 * 448.0)).reshape(1)
    packed, scale = nvfp4_quantize(x, global_scale)
    want_packed, want_scale = quantize_nvfp4_ref(x, global_scale)
    assert torch.equal(packed, want_packed)
    assert torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))


def test_nvfp4_w4a4_blackwell_matches_emulation(device) -> None:
    if torch.cuda.get_device_capability(device)[0] != 10:
        pytest.skip("W4A4 FP4 tensor cores need Blackwell (sm_100); compiled, not run here")
    x, weight, scale, scale_2 = nvfp4_case(device, 32, 256, 1024)
    input_scale = (x.float().abs().amax() / (6.0 * 448.0)).reshape(1)
    got = nvfp4_w4a4_gemm(x, weight, scale, scale_2, input_scale)
    want = nvfp4_w4a4_gemm_ref(x, weight, scale, scale_2, input_scale)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * want.abs().max().item(), rtol=1e-2)

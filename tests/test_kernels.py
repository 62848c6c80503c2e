"""CPU tests of mtp_core.kernels: hand-computed cases for the torch references, and parity of the
native CPU MLA decode kernel (mtp_core._C) with the reference.

Native tests skip when mtp_core._C is not built; set MTP_CORE_REQUIRE_NATIVE=1 (CI after
`pip install -e .`) to turn that skip into a failure.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import mtp_core.kernels as kernels
from mtp_core.kernels import (
    dequantize_nvfp4, mla_decode, mla_decode_ref, nvfp4_gemm, nvfp4_gemm_ref, nvfp4_w4a4_gemm_ref,
    quantize_nvfp4_ref, swizzle_block_scales, unpack_e2m1)
from mtp_core.kernels.native import load_native_ops

torch.set_num_threads(1)

if not kernels.native_ops().cpu and os.environ.get("MTP_CORE_REQUIRE_NATIVE") == "1":
    raise RuntimeError(f"MTP_CORE_REQUIRE_NATIVE=1 but {kernels.native_ops().summary}")
needs_native = pytest.mark.skipif(not kernels.native_ops().cpu, reason=kernels.native_ops().summary)


def native_mla(*args):
    return torch.ops.mtp_core.mla_decode(*args)


IMPLS = [pytest.param(mla_decode_ref, id="ref"), pytest.param(native_mla, id="native", marks=needs_native)]


def hand_cache() -> tuple[torch.Tensor, torch.Tensor]:
    """R=2, P=1, page 2. Positions 0, 1 live in block 2, position 2 in block 0; block 1 and the
    slot after position 2 are NaN garbage that must not leak into any result.
    Keys: pos0 = [1, 0 | 0], pos1 = [0, 1 | 0], pos2 = [0, 0 | 1]."""
    cache = torch.full((3, 2, 3), float("nan"))             # [num_blocks, page, R + P]
    cache[2, 0] = torch.tensor([1.0, 0.0, 0.0])
    cache[2, 1] = torch.tensor([0.0, 1.0, 0.0])
    cache[0, 0] = torch.tensor([0.0, 0.0, 1.0])
    return cache, torch.tensor([[2, 0]], dtype=torch.int32)


@pytest.mark.parametrize("impl", IMPLS)
def test_mla_hand_example_causal(impl) -> None:
    cache, table = hand_cache()
    # Two query tokens with the same query: q_lat = [ln 2, 0], q_pe = [ln 4], softmax_scale 1.
    q_lat = torch.tensor([math.log(2.0), 0.0]).expand(1, 2, 1, 2).contiguous()
    q_pe = torch.tensor([math.log(4.0)]).expand(1, 2, 1, 1).contiguous()
    out, lse = impl(q_lat, q_pe, cache, table, torch.tensor([3], dtype=torch.int32), 1.0, None)
    # Token 0 sits at position 1: scores [ln2, 0] -> p = [2/3, 1/3]; out = 2/3 k0 + 1/3 k1.
    # Token 1 sits at position 2: scores [ln2, 0, ln4] -> p = [2/7, 1/7, 4/7]; k2's latent is 0.
    torch.testing.assert_close(out[0, :, 0], torch.tensor([[2 / 3, 1 / 3], [2 / 7, 1 / 7]]))
    torch.testing.assert_close(lse[0, 0], torch.tensor([math.log(3.0), math.log(7.0)]))


@pytest.mark.parametrize("impl", IMPLS)
def test_mla_rows_without_keys(impl) -> None:
    cache, table = hand_cache()
    table = torch.cat([torch.tensor([[1, 1]], dtype=torch.int32), table])   # row 0 points at garbage
    q_lat = torch.ones(2, 2, 1, 2)
    q_pe = torch.ones(2, 2, 1, 1)
    # Row 0: padded slot, seqlen 0. Row 1: seqlen 1 < Q = 2, token 0 sits at position -1.
    out, lse = impl(q_lat, q_pe, cache, table, torch.tensor([0, 1], dtype=torch.int32), 0.5, None)
    assert torch.equal(out[0], torch.zeros(2, 1, 2)) and torch.equal(out[1, 0], torch.zeros(1, 2))
    assert torch.isneginf(lse[0]).all() and torch.isneginf(lse[1, 0, 0])
    # Token 1 of row 1 sees only key 0 = [1, 0 | 0]: out = [1, 0], lse = score = 0.5 * 1.
    torch.testing.assert_close(out[1, 1, 0], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(lse[1, 0, 1], torch.tensor(0.5))


def random_case(batch: int, num_q: int, heads: int, page: int, seqlens: list[int], cache_dtype: torch.dtype,
                q_dtype: torch.dtype = torch.float32, latent: int = 32, rope: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // page) for s in seqlens) + 1
    num_blocks = batch * max_blocks + 3
    cache = torch.randn(num_blocks, page, latent + rope, generator=g)
    kv_scale = None
    if cache_dtype == torch.float8_e4m3fn:
        kv_scale = torch.tensor([0.05])
        cache = (cache / kv_scale).to(torch.float8_e4m3fn)
    else:
        cache = cache.to(cache_dtype)
    table = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].reshape(batch, max_blocks).int()
    q_lat = torch.randn(batch, num_q, heads, latent, generator=g).to(q_dtype)
    q_pe = torch.randn(batch, num_q, heads, rope, generator=g).to(q_dtype)
    lens = torch.tensor(seqlens, dtype=torch.int32)
    return q_lat, q_pe, cache, table, lens, 1.0 / math.sqrt(latent + rope), kv_scale


def loop_reference(q_lat, q_pe, cache, table, lens, scale, kv_scale):
    """Row by row, key by key: independent of mla_decode_ref's vectorized gather."""
    batch, num_q, heads, latent = q_lat.shape
    page = cache.shape[1]
    out = torch.zeros(batch, num_q, heads, latent)
    lse = torch.full((batch, heads, num_q), float("-inf"))
    factor = 1.0 if kv_scale is None else float(kv_scale)
    for b in range(batch):
        keys = torch.stack([cache[table[b, p // page], p % page].float() * factor for p in range(int(lens[b]))]
                           or [torch.zeros(cache.shape[2])])
        for i in range(num_q):
            n = int(lens[b]) - num_q + i + 1
            for h in range(heads):
                if n <= 0:
                    continue
                q = torch.cat([q_lat[b, i, h], q_pe[b, i, h]]).float()
                scores = keys[:n] @ q * scale
                out[b, i, h] = torch.softmax(scores, 0) @ keys[:n, :latent]
                lse[b, h, i] = torch.logsumexp(scores, 0)
    return out, lse


def test_mla_ref_matches_row_loop() -> None:
    args = random_case(3, 3, 2, 4, [5, 12, 3], torch.float32)
    out, lse = mla_decode_ref(*args)
    want_out, want_lse = loop_reference(*args)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("page", [4, 16, 64])
@pytest.mark.parametrize("num_q", [1, 4])
@pytest.mark.parametrize("q_dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn)])
def test_mla_native_cpu_matches_ref(page, num_q, q_dtype, cache_dtype) -> None:
    args = random_case(4, num_q, 3, page, [1 + num_q, 70, 130, 9][:4], cache_dtype, q_dtype, seed=page + num_q)
    out, lse = native_mla(*args)
    want_out, want_lse = mla_decode_ref(*args)
    assert out.dtype == q_dtype and lse.dtype == torch.float32
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


@needs_native
def test_mla_native_rejects_missing_block() -> None:
    q_lat, q_pe, cache, table, lens, scale, _ = random_case(1, 1, 1, 4, [6], torch.float32)
    table[0, 1] = cache.shape[0]                                    # position 4 points past the cache
    with pytest.raises(RuntimeError, match="is not a cache block"):
        native_mla(q_lat, q_pe, cache, table, lens, scale, None)


@needs_native
def test_mla_dispatch_uses_native_and_opcheck() -> None:
    args = random_case(2, 2, 2, 8, [5, 17], torch.bfloat16)
    assert torch.equal(mla_decode(*args)[0], native_mla(*args)[0])
    torch.library.opcheck(torch.ops.mtp_core.mla_decode.default, args)


def test_mla_dispatch_rejects_bad_inputs() -> None:
    q_lat, q_pe, cache, table, lens, scale, _ = random_case(2, 1, 1, 4, [3, 4], torch.float32)
    with pytest.raises(ValueError, match="block_table must be int32"):
        mla_decode(q_lat, q_pe, cache, table.long(), lens, scale)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_decode(q_lat, q_pe, cache[..., :-1], table, lens, scale)
    with pytest.raises(ValueError, match="cache_seqlens"):
        mla_decode(q_lat, q_pe, cache, table, lens[:1], scale)


def test_backend_modes() -> None:
    ops = load_native_ops("reference")
    assert not ops.cpu and ops.cuda_archs == () and "reference" in ops.summary
    with pytest.raises(ValueError, match="MTP_CORE_KERNELS"):
        load_native_ops("fast")


def test_importing_the_engine_loads_no_kernels_and_reads_no_setting() -> None:
    """The kernel choice is made on first use, not at import: importing every engine module leaves the native
    extension unloaded, and a bad MTP_CORE_KERNELS only fails once a kernel is asked for."""
    code = ("import sys, mtp_core.llm, mtp_core.kernels as k\n"
            "assert 'mtp_core._C' not in sys.modules, 'imported at import time'\n"
            "assert k.native_ops.cache_info().currsize == 0\n"
            "try:\n    k.native_ops()\nexcept ValueError as e:\n    print('refused:', e)\n")
    env = dict(os.environ, MTP_CORE_KERNELS="fast")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "refused: MTP_CORE_KERNELS='fast'" in r.stdout


# ---- fused CPU elementwise ops (rms_norm, rope) ------------------------------------------------

def test_rms_norm_and_rope_refs_by_hand() -> None:
    x = torch.tensor([[3.0, 4.0]])                                   # mean square 12.5
    got = kernels.rms_norm_ref(x, torch.tensor([1.0, 2.0]), 0.0)
    assert torch.allclose(got, torch.tensor([[3.0, 8.0]]) / math.sqrt(12.5))
    # one pair rotated by 90 degrees: (x1, x2) = (1, 2) -> (-2, 1)
    c, s = torch.tensor([[0.0]]), torch.tensor([[1.0]])
    assert kernels.rope_ref(torch.tensor([[1.0, 2.0]]), c, s, True).tolist() == [[-2.0, 1.0]]
    # interleaved [a0, b0, a1, b1] -> [rot a | rot b]; halves [a0, a1, b0, b1] -> same
    x4 = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    c2, s2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    assert kernels.rope_ref(x4, c2, s2, True).tolist() == [[1.0, -4.0, 2.0, 3.0]]
    assert kernels.rope_ref(x4, c2, s2, False).tolist() == [[1.0, -4.0, 3.0, 2.0]]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
def test_fused_cpu_ops_match_refs(dtype, interleave) -> None:
    """rope is bitwise the reference; rms_norm sums the squares in its own order (one rounding step)."""
    g = torch.Generator().manual_seed(3)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    for shape in [(1, 192), (5, 64), (3, 7, 33)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        w = torch.randn(shape[-1], generator=g).to(dtype)
        got, want = torch.ops.mtp_core.rms_norm(x, w, 1e-6), kernels.rms_norm_ref(x, w, 1e-6)
        assert got.dtype == dtype and torch.allclose(got.float(), want.float(), **tol), shape
    for shape in [(4, 16), (4, 3, 16), (1, 128, 64)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        c, s = torch.randn(shape[0], shape[-1] // 2, generator=g), torch.randn(shape[0], shape[-1] // 2, generator=g)
        assert torch.equal(torch.ops.mtp_core.rope(x, c, s, interleave), kernels.rope_ref(x, c, s, interleave)), shape
    torch.library.opcheck(torch.ops.mtp_core.rms_norm.default, (x[:, 0], torch.ones(64, dtype=dtype), 1e-6))
    # empty tensors: no work, no crash
    assert torch.ops.mtp_core.rope(torch.zeros(3, 0, dtype=dtype), torch.zeros(3, 0), torch.zeros(3, 0),
                                   interleave).shape == (3, 0)
    assert torch.ops.mtp_core.rms_norm(torch.zeros(0, 8, dtype=dtype), torch.ones(8, dtype=dtype), 1e-6).shape == (0, 8)
    torch.library.opcheck(torch.ops.mtp_core.rope.default, (x, c, s, interleave))


@needs_native
def test_fused_cpu_ops_dispatch_and_autograd_fallback() -> None:
    x, w = torch.randn(3, 8), torch.randn(8)
    with torch.inference_mode():
        assert torch.equal(kernels.rms_norm(x, w, 1e-6), torch.ops.mtp_core.rms_norm(x, w, 1e-6))
    wg = w.clone().requires_grad_()
    kernels.rms_norm(x, wg, 1e-6).sum().backward()                 # needs grad: the reference runs
    assert wg.grad is not None
    with pytest.raises(RuntimeError, match="cos and sin must be float32"):
        torch.ops.mtp_core.rope(torch.randn(2, 8), torch.randn(3, 4), torch.randn(3, 4), True)


# ---- NVFP4 ------------------------------------------------------------------------------------

def test_unpack_e2m1_low_nibble_first() -> None:
    packed = torch.tensor([[0x71, 0x8F, 0x2A]], dtype=torch.uint8)
    # 0x71: codes 1 (+0.5), 7 (+6); 0x8F: codes 15 (-6), 8 (-0); 0x2A: codes 10 (-1), 2 (+1).
    assert unpack_e2m1(packed).tolist() == [[0.5, 6.0, -6.0, -0.0, -1.0, 1.0]]


def test_dequantize_and_gemm_ref_by_hand() -> None:
    weight = torch.tensor([[0x71] * 8, [0x22] * 8], dtype=torch.uint8)       # N=2, K=16
    scale = torch.tensor([[2.0], [0.5]]).to(torch.float8_e4m3fn)
    real = dequantize_nvfp4(weight, scale, torch.tensor(0.5))
    # Row 0: (0.5, 6) * 2 * 0.5 = (0.5, 6). Row 1: codes 2, 2 = 1.0 -> 1 * 0.5 * 0.5 = 0.25.
    assert real[0].tolist() == [0.5, 6.0] * 8 and real[1].tolist() == [0.25] * 16
    x = torch.ones(1, 16)
    assert nvfp4_gemm_ref(x, weight, scale, torch.tensor(0.5)).tolist() == [[52.0, 4.0]]
    assert nvfp4_gemm(x.expand(3, 1, 16), weight, scale, torch.tensor([0.5])).shape == (3, 1, 2)


def test_quantize_ref_rounding_by_hand() -> None:
    values = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.26, -1.0, 0.0, 0.1, 3.0, -6.0, 4.4, 0.5]
    packed, scale = quantize_nvfp4_ref(torch.tensor([values]), torch.tensor([1.0]))
    # amax 6, global 1 -> block scale 1.0 (e4m3 0x38); ties go to the even code.
    assert scale.view(torch.uint8).tolist() == [[0x38]]
    assert packed.tolist() == [[0x20, 0x42, 0x64, 0x76, 0xA9, 0x00, 0xF5, 0x16]]
    # amax 3, global 0.5: block scale 3 / (6 * 0.5) = 1.0, decode scale 0.5 -> 3.0 is code 7 (6.0).
    packed, scale = quantize_nvfp4_ref(torch.tensor([[3.0] + [0.0] * 15]), torch.tensor(0.5))
    assert scale.float().tolist() == [[1.0]] and packed[0, 0].item() == 0x07
    # A zero block has scale 0 and codes 0; a tiny global scale saturates the block scale at 448.
    packed, scale = quantize_nvfp4_ref(torch.tensor([[0.0] * 16, [1.0] * 16]), torch.tensor(1e-6))
    assert scale.float().tolist() == [[0.0], [448.0]] and packed[0].tolist() == [0] * 8


def test_quantize_ref_nan_and_inf() -> None:
    """The NaN contract the CUDA nvfp4_quantize matches bit for bit: a block holding a NaN gets the e4m3 NaN
    scale 0x7F and all-zero codes (it dequantizes to NaN; it never becomes a finite 448-scaled block), the
    other block of the row is untouched; +-inf saturates to scale 448 and code +-6."""
    x = torch.ones(2, 32)
    x[0, 3] = float("nan")
    x[1, 16], x[1, 17] = float("inf"), -1.0
    packed, scale = quantize_nvfp4_ref(x, torch.tensor(1.0 / 6.0))
    assert scale.view(torch.uint8).tolist() == [[0x7F, 0x38], [0x38, 0x7E]]     # NaN, 1.0 / 1.0, 448
    assert packed[0, :8].tolist() == [0] * 8 and packed[0, 8:].tolist() == [0x77] * 8   # 1.0 = 6.0 x 1 x 1/6
    assert packed[1, 8].item() == 0x87                                           # inf -> +6, -1 / 448 -> -0
    deq = dequantize_nvfp4(packed, scale, torch.tensor(1.0 / 6.0))
    assert deq[0, :16].isnan().all() and torch.equal(deq[0, 16:], torch.ones(16))
    assert deq[1, 16].item() == 448.0 and not deq[1].isnan().any()


def test_w4a4_ref_exact_on_representable_inputs() -> None:
    x = torch.tensor([[6.0, -3.0, 1.5, 0.5] * 4])            # on the e2m1 grid with block scale 1
    weight = torch.tensor([[0x71] * 8], dtype=torch.uint8)
    scale = torch.tensor([[1.0]]).to(torch.float8_e4m3fn)
    got = nvfp4_w4a4_gemm_ref(x, weight, scale, torch.tensor(1.0), torch.tensor(1.0))
    # Weight row = (0.5, 6) repeated: 4 * (6*0.5 - 3*6 + 1.5*0.5 + 0.5*6) = 4 * (-11.25) = -45.
    assert got.tolist() == [[-45.0]]


def test_swizzle_block_scales_offsets() -> None:
    scale = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    flat = swizzle_block_scales(scale)
    assert flat.numel() == 128 * 4 and flat[22].item() == scale[33, 2].item()     # 16 + 4 + 2
    scale = torch.arange(130 * 8, dtype=torch.float32).reshape(130, 8)
    flat = swizzle_block_scales(scale)
    assert flat.numel() == 256 * 8
    assert flat[512].item() == scale[0, 4].item()                    # tile (0, 1) starts at 512
    assert flat[1537].item() == scale[128, 5].item()                 # tile (1, 1) at 1536, inner 1
    e4m3 = torch.tensor([[2.0]]).to(torch.float8_e4m3fn)
    assert swizzle_block_scales(e4m3).dtype == torch.float8_e4m3fn

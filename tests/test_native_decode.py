"""The native CPU decode forward (mtp_core::decode_forward, decode_logits, mat_gemm) against its torch
reference (mtp_core/kernels/native_ref.py) over the same typed weights, in both weight layouts (direct:
read in place with run-time MLA absorption; packed: repacked panels, pre-absorbed) and every weight format
(fp32, bf16, FP8 block, NVFP4); its batch invariance and thread-count invariance; and the engine on it.

The engine-level losslessness tests elsewhere (test_mtp_decoding.py, test_engine_batching.py) run on
the native path too: it is the default on CPU whenever the extension is built (checked below).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, greedy, make_engine, reference, run_to_end
from mtp_core import kernels
from mtp_core.config import ModelConfig
from mtp_core.kernels import nvfp4_layout
from mtp_core.kernels.mat import COLS, FP8, NVFP4, ROWS
from mtp_core.kernels.native_ref import decode_forward_ref, decode_logits_ref
from mtp_core.loader.quant.fp8 import dequantize_fp8_block, quantize_fp8_block
from mtp_core.loader.quant.linear import Fp8BlockLinear, Nvfp4Linear
from mtp_core.loader.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4
from mtp_core.model import AttentionMetadata, DeepseekV3ForCausalLM
from mtp_core.native.native_decode import NativeDecoder
from mtp_core.native.native_weights import Matrix, _fp8_scale, choose_layout
from mtp_core.tiny import tiny_config_dict

ROOT = Path(__file__).resolve().parent.parent
if not kernels.native_ops().cpu and os.environ.get("MTP_CORE_REQUIRE_NATIVE") == "1":
    raise RuntimeError(f"MTP_CORE_REQUIRE_NATIVE=1 but {kernels.native_ops().summary}")
pytestmark = pytest.mark.skipif(not kernels.native_ops().cpu, reason=kernels.native_ops().summary)

PAGE = 4
LAYOUTS = ("direct", "packed")
# Which kernels serve the direct layout's bf16 / FP8 / NVFP4 matrices: "fp32" the fp32 FMA kernels (the exact
# reference, MTP_CORE_CPU_ISA=avx512f), "bf16" the best bf16-activation kernels the CPU has (AVX512-BF16 dot
# products, AMX tiles), compared with the reference that rounds the same activations: a flip of one rounding
# moves an output by ~2^-9 of one product, hence the looser tolerance.
ACTS = ["fp32", pytest.param("bf16", marks=pytest.mark.skipif(
    not (kernels.cpu_bf16_dot() or kernels.cpu_amx()), reason="no bf16 dot products or AMX on this CPU"))]
TOL = {"fp32": 1e-4, "bf16": 2e-3}


def assert_close_acts(out: torch.Tensor, ref: torch.Tensor, acts: str, scale: float = 1.0) -> None:
    """fp32 kernels: elementwise within TOL. bf16 activations: a near-tie of one rounding (or of one expert
    choice) in an early layer moves that token, and through attention the later tokens of its row, by up to
    ~1e-2, so the check is on the bulk: mean error below TOL and at most 2% of the values beyond 10x TOL.
    A wrong weight, scale or tail moves every output of a matrix, far beyond both."""
    if acts == "fp32":
        torch.testing.assert_close(out, ref, rtol=TOL[acts] * scale, atol=TOL[acts] * scale)
        return
    err = (out.float() - ref.float()).abs()
    tol = TOL[acts] * scale
    assert err.mean().item() < tol and (err > 10 * tol).float().mean().item() < 0.02, \
        f"mean error {err.mean().item():.3g}, {(err > 10 * tol).float().mean().item():.1%} beyond {10 * tol:g}"


@pytest.fixture
def acts(request, monkeypatch) -> str:
    """The kernel path of the test's `acts` parameter (see ACTS)."""
    if request.param == "fp32":
        monkeypatch.setenv("MTP_CORE_CPU_ISA", "avx512f" if "avx512" in kernels.cpu_isa() else kernels.cpu_isa())
    return request.param


def tiny_model(dtype=torch.float32, seed=0, **cfg_kw) -> DeepseekV3ForCausalLM:
    cfg = ModelConfig.from_dict(tiny_config_dict(vocab_size=96, **cfg_kw))
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    return model.to(dtype).eval()


def quantize_linears(model: DeepseekV3ForCausalLM, fmt: str) -> DeepseekV3ForCausalLM:
    """Every projection and expert (not router, embedding, lm_head) replaced by a keep-quantized module, as
    the loader builds them from an FP8-block / NVFP4 checkpoint."""
    for name, mod in list(model.named_modules()):
        if type(mod) is not torch.nn.Linear or name in ("lm_head",) or name.endswith("mlp.gate"):
            continue
        w = mod.weight.detach().float()
        if fmt == "fp8":
            q = Fp8BlockLinear(*quantize_fp8_block(w))
        else:
            q = Nvfp4Linear(*quantize_nvfp4(w))
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, q)
    return model


def batch(rows: list[tuple[int, int]], num_blocks: int = 64) -> AttentionMetadata:
    """rows: (context length after the call, queries); each row gets its own blocks, in a shuffled order."""
    g = torch.Generator().manual_seed(len(rows))
    free = torch.randperm(num_blocks, generator=g).tolist()
    positions, tables = [], []
    for ctx, nq in rows:
        n = (ctx + PAGE - 1) // PAGE
        tables.append([free.pop() for _ in range(n)])
        positions.append(list(range(ctx - nq, ctx)))
    return AttentionMetadata.build(positions, tables, PAGE, use_absorbed=True)


def run_both(nd: NativeDecoder, cfg: ModelConfig, first: int, num: int, rows, mtp=False, cache_dtype=torch.float32,
             final=True, seed=0, num_blocks=64):
    """The native op and its reference on the same random batch and caches."""
    D = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    meta = batch(rows, num_blocks)
    T = meta.positions.numel()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, cfg.vocab_size, (T,), generator=g)
    caches = [torch.randn(num_blocks, PAGE, D, generator=g).to(cache_dtype) for _ in range(num)]
    hidden = torch.randn(T, cfg.hidden_size, generator=g) if mtp else None
    tail = (nd.rope_cos, nd.rope_sin, meta.positions, meta.slot_mapping, meta.query_start_i32,
            meta.block_tables_i32, meta.seqlens_i32, final)
    c_nat, c_ref = [c.clone() for c in caches], [c.clone() for c in caches]
    out = torch.ops.mtp_core.decode_forward(nd.handle, first, num, ids, hidden, c_nat, *tail)
    ref = decode_forward_ref(nd.weights, first, num, ids, hidden, c_ref, *tail)
    return out, ref, c_nat, c_ref


CONFIGS = {
    "q_lora": dict(q_lora_rank=32, n_group=2),
    "no_q_lora": dict(q_lora_rank=None, n_group=2),
    "n_group1": dict(n_group=1),
    "n_group4": dict(n_group=4),
    "odd_hidden": dict(hidden_size=72, n_group=2),          # 72: every dot product has a masked tail
    "no_interleave": dict(rope_interleave=False),
    "yarn": dict(yarn=True, n_group=2),
}
ROWS_ = {
    "one": [(9, 1)],
    "verify": [(13, 4)],
    "ragged": [(5, 1), (17, 3), (2, 2), (30, 6)],
    "batch8": [(3 + 4 * b, 1) for b in range(8)],
    "prefill": [(23, 23), (9, 9)],                          # > 4 tokens a call: weights decoded once per tile
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("rows", list(ROWS_))
def test_main_stack_matches_reference(layout, cfg, rows) -> None:
    model = tiny_model(num_layers=3, num_mtp=1, **CONFIGS[cfg])
    nd = NativeDecoder.build(model, layout)
    assert nd.weights.layout == layout
    out, ref, c_nat, c_ref = run_both(nd, model.config, 0, 3, ROWS_[rows])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(c_nat, c_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nd.logits(out), decode_logits_ref(nd.weights, out), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", ["one", "ragged"])
def test_mtp_module_matches_reference(layout, rows) -> None:
    model = tiny_model(num_layers=2, num_mtp=3)
    nd = NativeDecoder.build(model, layout)
    for k in range(3):
        out, ref, *_ = run_both(nd, model.config, 2 + k, 1, ROWS_[rows], mtp=True, final=False, seed=k)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("acts", ACTS, indirect=True)
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("cfg", ["q_lora", "no_q_lora"])
@pytest.mark.parametrize("rows", ["one", "ragged", "prefill"])
def test_quantized_weights_match_reference(fmt, cfg, rows, acts) -> None:
    """FP8-block and NVFP4 weights read in place (dequantized in registers) against the reference on the
    loader's dequantized values (Matrix.dense), on the fp32 kernels and on the bf16-activation ones."""
    model = quantize_linears(tiny_model(num_layers=3, num_mtp=1, **CONFIGS[cfg]), fmt)
    assert choose_layout(model) == "direct"
    nd = NativeDecoder.build(model)
    assert bool(nd.weights.dims["bf16_dot"]) == (acts == "bf16" and kernels.cpu_bf16_dot())
    want = FP8 if fmt == "fp8" else NVFP4
    assert nd.weights.layers[1].experts[0].down.fmt == want and nd.weights.layers[0].q_in.fmt == want
    out, ref, c_nat, c_ref = run_both(nd, model.config, 0, 3, ROWS_[rows])
    assert_close_acts(out, ref, acts)
    for a, b in zip(c_nat, c_ref):
        assert_close_acts(a, b, acts, 0.1)
    # the reference's weights are the quantized modules' own dequantized weights
    lin = model.model.layers[1].mlp.experts[0].down_proj
    torch.testing.assert_close(nd.weights.layers[1].experts[0].down.dense(), lin.weight, rtol=0, atol=0)


def test_bf16_weights_and_cache_match_reference() -> None:
    model = tiny_model(dtype=torch.bfloat16, num_layers=2, num_mtp=1)
    for layout in LAYOUTS:
        nd = NativeDecoder.build(model, layout)
        out, ref, c_nat, c_ref = run_both(nd, model.config, 0, 2, ROWS_["ragged"], cache_dtype=torch.bfloat16)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        for a, b in zip(c_nat, c_ref):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_deepseek_v3_attention_widths() -> None:
    """DeepSeek-V3's own attention widths (128 heads, q_lora 1536, kv_lora 512, nope/rope/v 128/64/128) on a
    narrow hidden size, one layer: the run-time-absorbed attention against the reference."""
    from mtp_core.scale_model import scale_config_dict
    d = scale_config_dict("deepseek-v3", num_layers=1, num_mtp=0, vocab_size=64, n_routed_experts=8)
    d.update(hidden_size=128, intermediate_size=64, moe_intermediate_size=32, n_group=1, topk_group=1,
             num_experts_per_tok=2, first_k_dense_replace=1)
    cfg = ModelConfig.from_dict(d)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if name.endswith("norm.weight") else torch.randn_like(p) * p.shape[-1] ** -0.5)
    model = model.bfloat16().eval()
    assert choose_layout(model) == "direct"
    nd = NativeDecoder.build(model)
    assert len(nd.weights.layers[0].uk) == 128
    out, ref, *_ = run_both(nd, cfg, 0, 1, [(7, 3), (2, 1)], cache_dtype=torch.bfloat16, num_blocks=8)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_a_wrong_kernel_is_caught() -> None:
    """The parity check can fail: a reference fed another routing scale disagrees."""
    model = tiny_model(num_layers=2, num_mtp=1)
    nd = NativeDecoder.build(model, "direct")
    out, *_ = run_both(nd, model.config, 0, 2, ROWS_["verify"])
    nd.weights.params["routed_scale"] *= 1.01
    _, ref, *_ = run_both(nd, model.config, 0, 2, ROWS_["verify"])
    assert not torch.allclose(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout,quant", [("direct", "none"), ("packed", "none"), ("direct", "fp8"),
                                          ("direct", "nvfp4")])   # quantized weights: read in place only
def test_batch_invariance_is_bitwise(layout, quant) -> None:
    """A token decoded alone and the same token verified among 3 drafts get bitwise equal hidden states
    and logits: the property that makes greedy MTP exactly equal to greedy without it."""
    model = tiny_model(num_layers=3, num_mtp=1)
    if quant != "none":
        model = quantize_linears(model, quant)
    nd = NativeDecoder.build(model, layout)
    D = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    g = torch.Generator().manual_seed(3)
    prefix = torch.randn(64, PAGE, D, generator=g)
    ids = torch.randint(7, 96, (6,), generator=g)
    table = [[5, 9, 2, 11]]
    caches_a = [prefix.clone() for _ in range(3)]
    caches_b = [prefix.clone() for _ in range(3)]
    with torch.inference_mode():
        one_by_one = []
        for i in range(6):   # positions 8..13, one token per call
            meta = AttentionMetadata.build([[8 + i]], table, PAGE, use_absorbed=True)
            one_by_one.append(nd.forward(ids[i:i + 1], meta, caches_a))
        meta = AttentionMetadata.build([list(range(8, 14))], table, PAGE, use_absorbed=True)
        together = nd.forward(ids, meta, caches_b)       # 6 tokens: the decoded-tile path
        assert torch.equal(torch.cat(one_by_one), together)
        assert torch.equal(nd.logits(torch.cat(one_by_one)), nd.logits(together))
        assert all(torch.equal(a, b) for a, b in zip(caches_a, caches_b))


def test_a_batch_over_the_call_limit_runs_as_several_calls_with_the_same_result() -> None:
    """A forward of more tokens than one native call takes (max_tokens) is cut into consecutive calls, a row
    possibly in two (its second part reads the first part's cache entries, as a chunked prefill does): hidden
    states and caches bitwise those of one call, for the target forward and an MTP module."""
    model = tiny_model(num_layers=2, num_mtp=1)
    whole = NativeDecoder.build(model, "direct")
    cut = NativeDecoder(model, whole.weights, max_tokens=4)
    D = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    g = torch.Generator().manual_seed(5)
    prefix = torch.randn(64, PAGE, D, generator=g)
    rows, tables = [list(range(0, 7)), list(range(9, 12)), [20]], [[5, 9], [2, 11, 3], [7, 1, 4, 6, 8, 10]]
    ids = torch.randint(7, 96, (11,), generator=g)
    hidden = torch.randn(11, model.config.hidden_size, generator=g)
    with torch.inference_mode():
        for call in (lambda nd, m, c: nd.forward(ids, m, c), lambda nd, m, c: nd.mtp_forward(0, ids, hidden, m, c)):
            caches_a = [prefix.clone() for _ in range(3)]
            caches_b = [prefix.clone() for _ in range(3)]
            a = call(whole, AttentionMetadata.build(rows, tables, PAGE, use_absorbed=False), caches_a)
            b = call(cut, AttentionMetadata.build(rows, tables, PAGE, use_absorbed=False), caches_b)
            assert a.shape == b.shape == (11, model.config.hidden_size)
            assert torch.equal(a, b)
            assert all(torch.equal(x, y) for x, y in zip(caches_a, caches_b))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("max_tokens", [4, 64])
def test_outputs_left_out_change_no_kept_output_and_no_cache_entry(layout, max_tokens) -> None:
    """A forward asked for each row's last output only ("last") or for none ("none") runs the last layer past
    its KV write only where an output is kept: the kept outputs and every cache entry are bitwise those of the
    forward of every output, for the target (its last layer cut) and an MTP module, whole or cut into calls of 4
    tokens (a row in two: its first part's last token is no output of it)."""
    model = tiny_model(num_layers=2, num_mtp=1)
    nd = NativeDecoder.build(model, layout)
    nd = NativeDecoder(model, nd.weights, max_tokens=max_tokens)
    D = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    g = torch.Generator().manual_seed(6)
    prefix = torch.randn(64, PAGE, D, generator=g)
    rows, tables = [list(range(0, 7)), [20], list(range(9, 12)), [5, 6]], [[5, 9], [7, 1, 4, 6, 8, 10], [2, 11, 3],
                                                                        [12, 13]]
    ids = torch.randint(7, 96, (13,), generator=g)
    hidden = torch.randn(13, model.config.hidden_size, generator=g)
    ends = [6, 7, 10, 12]
    with torch.inference_mode():
        for mtp in (False, True):
            got = {}
            for outputs in ("all", "last", "none"):
                caches = [prefix.clone() for _ in range(3)]
                meta = AttentionMetadata.build(rows, tables, PAGE, use_absorbed=layout == "packed")
                if mtp:
                    out = nd.mtp_forward(0, ids, hidden, meta, caches, outputs)
                else:
                    out = nd._call(0, 2, ids, None, caches[:2], meta, True, outputs)
                got[outputs] = (out, caches)
            assert got["all"][0].shape == (13, model.config.hidden_size)
            assert torch.equal(got["last"][0], got["all"][0][ends]) and got["none"][0] is None
            for outputs in ("last", "none"):
                assert all(torch.equal(a, b) for a, b in zip(got[outputs][1], got["all"][1]))
            assert not torch.equal(got["all"][1][2 if mtp else 1], prefix)     # the last layer wrote its entries


def test_the_op_refuses_last_outputs_of_a_row_without_tokens() -> None:
    model = tiny_model(num_layers=2, num_mtp=1)
    nd = NativeDecoder.build(model, "direct")
    D = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    caches = [torch.zeros(16, PAGE, D) for _ in range(2)]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)
    i64 = lambda v: torch.tensor(v, dtype=torch.long)
    with pytest.raises(RuntimeError, match="row 1 feeds none"):
        nd.forward_op(nd.handle, 0, 2, i64([9, 10]), None, caches, nd.rope_cos, nd.rope_sin, i64([0, 1]),
                      i64([0, 1]), i32([0, 2, 2]), i32([[0], [1]]), i32([2, 1]), True, 1)
    with pytest.raises(RuntimeError, match="outputs must be 0"):
        nd.forward_op(nd.handle, 0, 2, i64([9, 10]), None, caches, nd.rope_cos, nd.rope_sin, i64([0, 1]),
                      i64([0, 1]), i32([0, 2]), i32([[0]]), i32([2]), True, 3)


@pytest.mark.parametrize("acts", ACTS, indirect=True)
@pytest.mark.parametrize("quant", ["none", "bf16", "fp8", "nvfp4"])
def test_two_threads_give_bitwise_the_same_result(quant, acts) -> None:
    """The thread team splits every op's outputs; each output is computed whole by one member, so 2 threads
    give bitwise what 1 thread gives (projections, experts, attention items, the LM head)."""
    model = tiny_model(dtype=torch.bfloat16 if quant == "bf16" else torch.float32, num_layers=2, num_mtp=1)
    if quant in ("fp8", "nvfp4"):
        model = quantize_linears(model, quant)
    rows = [(3 + b % 9, 1 + b % 3) for b in range(24)]
    old = torch.get_num_threads()
    outs = {}
    try:
        for layout in (("direct",) if quant != "none" else LAYOUTS):
            nd = NativeDecoder.build(model, layout)
            for nt in (1, 2):
                torch.set_num_threads(nt)
                out, ref, c_nat, _ = run_both(nd, model.config, 0, 2, rows, num_blocks=256)
                outs[layout, nt] = (out, nd.logits(out), c_nat)
                assert_close_acts(out, ref, acts, 10 if quant == "bf16" else 1)   # bf16 norms and embeddings
            one, two = outs[layout, 1], outs[layout, 2]
            assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
            assert all(torch.equal(a, b) for a, b in zip(one[2], two[2]))
    finally:
        torch.set_num_threads(old)


# ---- one matrix: the kernels of every layout and format ------------------------------------------
SHAPES = [(1, 16), (7, 48), (64, 128), (130, 272), (257, 1040), (33, 80)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_mat_gemm_formats_match_dequantized_weights(n, k) -> None:
    """FP8-block (row-wise, and column-wise from a row offset inside a 128-row block, as run-time absorption
    reads kv_b_proj) and NVFP4 against the dequantized weights, for tail tiles, odd sizes and T = 1..17; and
    each bitwise batch-invariant."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    q, s = quantize_fp8_block(w)
    cases = [(Matrix(ROWS, FP8, n, k, q.view(torch.uint8), scale=_fp8_scale(s)), dequantize_fp8_block(q, s))]
    r0 = 40
    src = torch.randn(r0 + k, n, generator=g)
    qs, ss = quantize_fp8_block(src)
    cases.append((Matrix(COLS, FP8, n, k, qs.view(torch.uint8)[r0:], scale=_fp8_scale(ss), scale_r0=r0),
                  dequantize_fp8_block(qs, ss)[r0:].t()))
    cases.append((Matrix(ROWS, 0, n, k, w), w))
    cases.append((Matrix(COLS, 1, n, k, w.t().contiguous().bfloat16()), w.bfloat16().float()))
    if k % 16 == 0:
        p, sc, s2 = quantize_nvfp4(w)
        cases.append((Matrix(ROWS, NVFP4, n, k, nvfp4_layout.interleave(p), gscale=sc.view(torch.uint8),
                             gscale2=float(s2)), dequantize_nvfp4(p, sc, s2)))
    for m, dense in cases:
        assert torch.equal(m.dense(), dense)
        for T in (1, 2, 3, 4, 5, 9, 17):
            x = torch.randn(T, k, generator=g)
            y = kernels.mat_gemm(x, m)
            torch.testing.assert_close(y, x @ dense.T, rtol=1e-4, atol=1e-4 * (1 + dense.abs().max().item()))
            assert torch.equal(y, torch.cat([kernels.mat_gemm(x[i:i + 1], m) for i in range(T)]))
    torch.library.opcheck(torch.ops.mtp_core.mat_gemm.default,
                          (torch.randn(3, k), w, None, None, None, ROWS, 0, n, k, 0, 1.0))


def test_nvfp4_interleave_round_trips() -> None:
    for k in (16, 32, 48, 96, 256, 272, 384, 400, 512 + 240):
        p = torch.randint(0, 256, (5, k // 2), dtype=torch.uint8)
        assert torch.equal(nvfp4_layout.deinterleave(nvfp4_layout.interleave(p)), p)


@pytest.mark.parametrize("k", [256, 512 + 16 * 5, 256 + 16 * 12])
def test_nvfp4_kernel_order_puts_each_groups_halves_in_place(k: int) -> None:
    # byte i of a checkpoint row holds inputs 2i, 2i+1; in kernel order the dword of inputs [16g + 8h, +8) of
    # a block with G groups is dword h * G + g of that block (decode_kernels.h)
    p = (torch.arange(k // 2) % 251).to(torch.uint8).view(1, -1)
    q = nvfp4_layout.interleave(p)[0]
    for b in range((k + 255) // 256):
        G = min(16, k // 16 - 16 * b)
        for g in range(G):
            for h in range(2):
                src = 128 * b + 4 * (2 * g + h)            # the checkpoint's dword of (g, h)
                dst = 128 * b + 4 * (h * G + g)
                assert torch.equal(q[dst:dst + 4], p[0, src:src + 4]), (b, g, h)


def test_bad_inputs_are_refused() -> None:
    model = tiny_model(num_layers=2, num_mtp=1)
    nd = NativeDecoder.build(model, "direct")
    meta = batch(ROWS_["verify"])
    ids = torch.randint(7, 96, (4,))
    tail = (nd.rope_cos, nd.rope_sin, meta.positions, meta.slot_mapping, meta.query_start_i32,
            meta.block_tables_i32, meta.seqlens_i32, True)
    small = [torch.zeros(2, PAGE, 40), torch.zeros(2, PAGE, 40)]       # slots / blocks past the cache
    with pytest.raises(RuntimeError, match="outside the cache|not a cache block"):
        torch.ops.mtp_core.decode_forward(nd.handle, 0, 2, ids, None, small, *tail)
    with pytest.raises(RuntimeError, match="caches"):
        torch.ops.mtp_core.decode_forward(nd.handle, 0, 2, ids, None, small[:1], *tail)
    with pytest.raises(RuntimeError, match="vocabulary"):
        torch.ops.mtp_core.decode_forward(nd.handle, 0, 2, ids + 1000, None, [torch.zeros(64, PAGE, 40)] * 2, *tail)
    tensors, ints, floats = nd.weights.dictionaries()
    ints["layers.0.q_in.n"] += 1
    with pytest.raises(RuntimeError, match="q_in"):
        torch.classes.mtp_core.DecodeWeights(tensors, ints, floats)
    tensors, ints, floats = nd.weights.dictionaries()
    del tensors["layers.1.kv_norm"]
    with pytest.raises(RuntimeError, match="kv_norm"):
        torch.classes.mtp_core.DecodeWeights(tensors, ints, floats)


def test_empty_batch() -> None:
    model = tiny_model(num_layers=2, num_mtp=1)
    nd = NativeDecoder.build(model, "direct")
    empty = torch.ops.mtp_core.decode_forward(
        nd.handle, 0, 2, torch.empty(0, dtype=torch.long), None, [torch.zeros(4, PAGE, 40)] * 2, nd.rope_cos,
        nd.rope_sin, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
        torch.zeros(1, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), True)
    assert empty.shape == (0, model.config.hidden_size)


# ---- the engine on it ---------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_engine_runs_native_and_matches_the_torch_path(tiny3_dir, monkeypatch, layout) -> None:
    """Greedy text on the native path equals the torch reference path's, MTP on and off."""
    from mtp_core.loader import load_model
    monkeypatch.setenv("MTP_CORE_NATIVE_LAYOUT", layout)
    native_model = load_model(tiny3_dir, "float32", make_model=DeepseekV3ForCausalLM)[0]
    monkeypatch.setenv("MTP_CORE_NATIVE_DECODE", "0")
    torch_model = load_model(tiny3_dir, "float32", make_model=DeepseekV3ForCausalLM)[0]
    make_engine(torch_model)
    assert torch_model.native is None
    monkeypatch.delenv("MTP_CORE_NATIVE_DECODE")
    make_engine(native_model)
    assert native_model.native is not None and native_model.native.weights.layout == layout
    for nextn, mode in ((0, "auto"), (3, "eagle"), (3, "vanilla")):
        outs = {}
        for name, model in (("native", native_model), ("torch", torch_model)):
            eng = make_engine(model, nextn=nextn, mode=mode, max_batch_size=8)
            outs[name] = [s.output_ids for s in run_to_end(eng, PROMPTS, greedy(24))]
        assert outs["native"] == outs["torch"], (nextn, mode)


@pytest.mark.parametrize("mode,K", [("eagle", 1), ("eagle", 2), ("eagle", 3), ("eagle", 5), ("vanilla", 1),
                                    ("vanilla", 2), ("vanilla", 3)])   # Vanilla: one module per draft (3 here)
def test_native_greedy_mtp_equals_plain_greedy(tiny3_model, mode, K) -> None:
    eng = make_engine(tiny3_model, nextn=K, mode=mode, max_batch_size=8)
    assert tiny3_model.native is not None
    seqs = run_to_end(eng, PROMPTS, greedy(32))
    assert [s.output_ids for s in seqs] == [reference(tiny3_model, p, 32) for p in PROMPTS]
    assert eng.stats.num_draft_accepted > 0       # drafts were accepted: the verify path really ran


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "nvfp4_attn"])
def test_greedy_mtp_equals_plain_greedy_on_packed_formats(tiny3_dir, tmp_path, fmt) -> None:
    """The backbone invariant on bf16 weights and on FP8 / NVFP4 checkpoints kept packed (read in place), with
    2 threads: greedy MTP (Eagle and Vanilla) == greedy without MTP, token for token. nvfp4_attn: the attention
    projections quantized too (`mtp quantize --quantize_attention`)."""
    from mtp_core.loader import load_model
    from mtp_core.quantize import quantize_checkpoint
    src = tiny3_dir
    if fmt != "bf16":
        src = tmp_path / fmt
        quantize_checkpoint(tiny3_dir, src, fmt.removesuffix("_attn"), quantize_attention=fmt == "nvfp4_attn")
        fmt = fmt.removesuffix("_attn")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = load_model(src, "bfloat16" if fmt == "bf16" else "auto", make_model=DeepseekV3ForCausalLM)[0]
        base = make_engine(model, max_batch_size=8)
        assert model.native is not None
        if fmt != "bf16":
            assert model.native.weights.layout == "direct"
            assert fmt in model.native.weights.formats()
            o_fmt = model.native.weights.layers[0].o.fmt
            assert (o_fmt == NVFP4) == (src.name == "nvfp4_attn"), o_fmt
        want = [s.output_ids for s in run_to_end(base, PROMPTS, greedy(24))]
        for nextn, mode in ((3, "eagle"), (3, "vanilla")):
            eng = make_engine(model, nextn=nextn, mode=mode, max_batch_size=8)
            assert [s.output_ids for s in run_to_end(eng, PROMPTS, greedy(24))] == want, (nextn, mode)
            assert eng.stats.num_draft_accepted > 0
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_lower_isa_builds_agree(isa) -> None:
    """MTP_CORE_CPU_ISA caps the kernels' instruction set (the fallback a CPU without AVX-512 gets): same
    result within rounding, and the choice is reported."""
    code = (
        "import torch, sys; sys.path.insert(0, 'tests');"
        "from test_native_decode import tiny_model, quantize_linears, run_both, ROWS_, NativeDecoder;"
        "from mtp_core import kernels; print(kernels.cpu_isa());"
        "m = tiny_model(num_layers=2, num_mtp=1)\n"
        "for q in ('none', 'fp8', 'nvfp4'):\n"
        "    mm = m if q == 'none' else quantize_linears(tiny_model(num_layers=2, num_mtp=1), q)\n"
        "    for layout in (('direct', 'packed') if q == 'none' else ('direct',)):\n"
        "        nd = NativeDecoder.build(mm, layout); out, ref, *_ = run_both(nd, mm.config, 0, 2, ROWS_['ragged'])\n"
        "        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)\n"
        "print('ok')")
    env = dict(os.environ, MTP_CORE_CPU_ISA=isa)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.split()
    assert lines[-1] == "ok"
    have_avx2 = "avx2" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    assert lines[0] == (isa if isa == "generic" or have_avx2 else "generic")


def test_layout_choice_and_why_not(monkeypatch) -> None:
    model = tiny_model(num_layers=2, num_mtp=1)
    assert NativeDecoder.why_not(model) is None
    assert choose_layout(model) == "packed"                       # small, plain: repacked, pre-absorbed
    monkeypatch.setenv("MTP_CORE_NATIVE_LAYOUT", "direct")
    assert choose_layout(model) == "direct"
    monkeypatch.setenv("MTP_CORE_NATIVE_LAYOUT", "fast")
    with pytest.raises(ValueError, match="MTP_CORE_NATIVE_LAYOUT"):
        choose_layout(model)
    monkeypatch.delenv("MTP_CORE_NATIVE_LAYOUT")
    monkeypatch.setattr("mtp_core.native.native_weights.PACKED_MAX_BYTES", 1000)
    assert choose_layout(model) == "direct"                       # too large to repack: read in place
    monkeypatch.setenv("MTP_CORE_NATIVE_DECODE", "0")
    assert NativeDecoder.why_not(model) == "MTP_CORE_NATIVE_DECODE=0"


def test_direct_layout_reads_the_models_own_tensors() -> None:
    """One copy of the weights: every matrix of the direct layout is (a view of) a tensor the model holds."""
    model = quantize_linears(tiny_model(dtype=torch.bfloat16, num_layers=2, num_mtp=1), "fp8")
    nd = NativeDecoder.build(model, "direct")
    owned = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    for layer in nd.weights.layers:
        for m in layer.matrices():
            if m is not layer.router:
                assert m.data.untyped_storage().data_ptr() in owned


def test_bf16_native_greedy_mtp_equals_plain_greedy(tiny3_dir) -> None:
    """bf16 weights (half the bytes, fp32 activations): its own greedy-equality with and without MTP."""
    from mtp_core.loader import load_model
    model = load_model(tiny3_dir, "bfloat16", make_model=DeepseekV3ForCausalLM)[0]
    base = make_engine(model, max_batch_size=8)
    assert model.native is not None and model.native.weights.embed.dtype == torch.bfloat16
    want = [s.output_ids for s in run_to_end(base, PROMPTS, greedy(24))]
    for nextn, mode in ((2, "eagle"), (3, "vanilla")):
        eng = make_engine(model, nextn=nextn, mode=mode, max_batch_size=8)
        assert [s.output_ids for s in run_to_end(eng, PROMPTS, greedy(24))] == want, (nextn, mode)


def test_a_copy_of_a_model_builds_its_own_decoder(tiny1_dir) -> None:
    """The native decoder is built from the weights: a deep copy drops it, so changing the copy's weights
    and then serving it gives what a fresh model with those weights gives."""
    from mtp_core.loader import load_model
    model = load_model(tiny1_dir, "float32", make_model=DeepseekV3ForCausalLM)[0]
    make_engine(model)
    assert model.native is not None
    twin = copy.deepcopy(model)
    assert twin.native is None and not twin.decode_fused
    fresh = load_model(tiny1_dir, "float32", make_model=DeepseekV3ForCausalLM)[0]
    with torch.no_grad():
        for m in (twin, fresh):
            m.model.layers[1].post_attention_layernorm.weight.mul_(-3.0)
    prompts = PROMPTS[:4]
    out = {name: [s.output_ids for s in run_to_end(make_engine(m, max_batch_size=4), prompts, greedy(16))]
           for name, m in (("twin", twin), ("fresh", fresh), ("original", model))}
    assert twin.native is not None
    assert out["twin"] == out["fresh"] != out["original"]


# ---- AMX tiles (bf16 weights on Sapphire Rapids and later) -----------------------------------------
needs_amx = pytest.mark.skipif(not kernels.cpu_amx(), reason="no AMX on this CPU (or capped by MTP_CORE_CPU_ISA)")


@needs_amx
def test_amx_gemm_is_bitwise_batch_invariant_and_matches_bf16_activations() -> None:
    g = torch.Generator().manual_seed(5)
    for n, k in ((16, 32), (37, 64), (130, 2048)):
        w = torch.randn(n, k, generator=g).bfloat16()
        m = Matrix(ROWS, 1, n, k, w, bias=torch.randn(n, generator=g))
        for T in (1, 3, 16, 17, 40):
            x = torch.randn(T, k, generator=g)
            y = kernels.mat_gemm(x, m, amx=True)
            want = x.bfloat16().float() @ w.float().T + m.bias
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * k ** 0.5)
            assert torch.equal(y, torch.cat([kernels.mat_gemm(x[i:i + 1], m, amx=True) for i in range(T)]))
    with pytest.raises(RuntimeError, match="amx"):
        kernels.mat_gemm(torch.randn(2, 40), Matrix(ROWS, 1, 8, 40, torch.randn(8, 40).bfloat16()), amx=True)


@needs_amx
def test_amx_forward_matches_reference_and_stays_batch_invariant(monkeypatch) -> None:
    """bf16 weights in the direct layout run on AMX tiles (bf16 activations) for every token count: close to
    the reference that rounds the same activations, and bitwise the same one token at a time or six at once;
    MTP_CORE_CPU_ISA=avx512 turns the tiles off."""
    model = tiny_model(dtype=torch.bfloat16, num_layers=3, num_mtp=1, q_lora_rank=None, hidden_size=128)
    nd = NativeDecoder.build(model, "direct")
    assert nd.weights.dims["amx"] == 1 and "AMX" in nd.handle.summary()
    out, ref, *_ = run_both(nd, model.config, 0, 3, ROWS_["ragged"], cache_dtype=torch.bfloat16)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    D = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    prefix = torch.randn(64, PAGE, D).bfloat16()
    ids = torch.randint(7, 96, (6,))
    table = [[5, 9, 2, 11]]
    ca, cb = [prefix.clone() for _ in range(3)], [prefix.clone() for _ in range(3)]
    with torch.inference_mode():
        one = torch.cat([nd.forward(ids[i:i + 1], AttentionMetadata.build([[8 + i]], table, PAGE, True), ca)
                         for i in range(6)])
        six = nd.forward(ids, AttentionMetadata.build([list(range(8, 14))], table, PAGE, True), cb)
    assert torch.equal(one, six) and torch.equal(nd.logits(one), nd.logits(six))
    monkeypatch.setenv("MTP_CORE_CPU_ISA", "avx512")
    assert not kernels.cpu_amx()
    assert NativeDecoder.build(model, "direct").weights.dims["amx"] == 0


# ---- FP8 (e4m3) KV cache ----------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_kv_cache_matches_reference_and_stays_batch_invariant(layout) -> None:
    """The latents written as e4m3 (torch's rounding, bit for bit the reference's cache) and read back by the
    native attention; a token one at a time or among others gets bitwise the same hidden state."""
    model = tiny_model(num_layers=3, num_mtp=1)
    nd = NativeDecoder.build(model, layout)
    out, ref, c_nat, c_ref = run_both(nd, model.config, 0, 3, ROWS_["ragged"], cache_dtype=torch.float8_e4m3fn)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(c_nat, c_ref))
    D = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    prefix = torch.randn(64, PAGE, D).to(torch.float8_e4m3fn)
    ids = torch.randint(7, 96, (5,))
    ca, cb = [prefix.clone() for _ in range(3)], [prefix.clone() for _ in range(3)]
    with torch.inference_mode():
        one = torch.cat([nd.forward(ids[i:i + 1], AttentionMetadata.build([[9 + i]], [[4, 7, 1, 3]], PAGE, True), ca)
                         for i in range(5)])
        five = nd.forward(ids, AttentionMetadata.build([list(range(9, 14))], [[4, 7, 1, 3]], PAGE, True), cb)
    assert torch.equal(one, five)


def test_fp8_kv_cache_greedy_mtp_equals_plain_greedy(tiny3_dir, monkeypatch) -> None:
    """--kv_cache_dtype fp8 on the CPU: half the bytes per token of bf16, and the backbone invariant (Eagle through
    the native step, Vanilla through the general path), on the native path and on the torch path."""
    from mtp_core.kv_cache.mla_cache import bytes_per_token
    from mtp_core.loader import load_model
    cfg = load_model(tiny3_dir, "float32", make_model=DeepseekV3ForCausalLM)[0].config
    assert 2 * bytes_per_token(cfg, 6, torch.float8_e4m3fn) == bytes_per_token(cfg, 6, torch.bfloat16)
    for native in ("1", "0"):
        monkeypatch.setenv("MTP_CORE_NATIVE_DECODE", native)
        model = load_model(tiny3_dir, "bfloat16" if native == "1" else "float32", make_model=DeepseekV3ForCausalLM)[0]
        outs = []
        for nextn, mode in ((0, "auto"), (3, "eagle"), (3, "vanilla")):
            eng = make_engine(model, nextn=nextn, mode=mode, max_batch_size=8, kv_dtype="fp8",
                              overlap_scheduler_on_cpu=False)
            assert eng.caches[0].dtype == torch.float8_e4m3fn and (model.native is not None) == (native == "1")
            outs.append([s.output_ids for s in run_to_end(eng, PROMPTS, greedy(20))])
            if nextn:
                assert eng.stats.num_draft_accepted > 0
        assert outs[0] == outs[1] == outs[2], native

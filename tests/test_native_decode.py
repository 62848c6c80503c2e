"""The native CPU decode forward (mtp_core::decode_forward, mtp_core::linear_bi) against its torch
reference (mtp_core/kernels/decode_ref.py), its batch invariance, and the engine on it.

The engine-level losslessness tests elsewhere (test_mtp_decoding.py, test_engine_batching.py) run on
the native path too: it is the default on CPU whenever the extension is built (checked below).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, greedy, make_engine, reference, run_to_end
from mtp_core import kernels
from mtp_core.config import ModelConfig
from mtp_core.kernels.decode_ref import WEIGHT_SLOTS, decode_forward_ref, linear_bi_ref, pack_weight, unpack_weight
from mtp_core.model import AttentionMetadata, DeepseekV3ForCausalLM
from mtp_core.model.native_decode import NativeDecoder
from mtp_core.tiny import tiny_config_dict

ROOT = Path(__file__).resolve().parent.parent
if not kernels.NATIVE.cpu and os.environ.get("MTP_CORE_REQUIRE_NATIVE") == "1":
    raise RuntimeError(f"MTP_CORE_REQUIRE_NATIVE=1 but {kernels.NATIVE.summary}")
pytestmark = pytest.mark.skipif(not kernels.NATIVE.cpu, reason=kernels.NATIVE.summary)

PAGE = 4


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
    model = model.to(dtype).eval()
    model.ensure_decode_fused()
    return model


def batch(rows: list[tuple[int, int]], num_blocks: int = 64) -> tuple[AttentionMetadata, list[list[int]]]:
    """rows: (context length after the call, queries); each row gets its own blocks, in a shuffled order."""
    g = torch.Generator().manual_seed(len(rows))
    free = torch.randperm(num_blocks, generator=g).tolist()
    positions, tables = [], []
    for ctx, nq in rows:
        n = (ctx + PAGE - 1) // PAGE
        tables.append([free.pop() for _ in range(n)])
        positions.append(list(range(ctx - nq, ctx)))
    return AttentionMetadata.build(positions, tables, PAGE, use_absorbed=True), tables


def run_both(model, layer_ids, rows, mtp=False, dtype=torch.float32, cache_dtype=None, final=True, seed=0,
             num_blocks=64):
    cfg = model.config
    D = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    meta, _ = batch(rows, num_blocks)
    T = meta.positions.numel()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, cfg.vocab_size, (T,), generator=g)
    cache_dtype = cache_dtype or dtype
    caches = [torch.randn(num_blocks, PAGE, D, generator=g).to(cache_dtype) for _ in layer_ids]
    hidden = torch.randn(T, cfg.hidden_size, generator=g).to(dtype) if mtp else None
    nd = model.native
    weights = [w for i in layer_ids for w in nd.layer_weights[i]]
    qs = torch.tensor(meta.query_start, dtype=torch.int32)
    args = lambda cs: (ids, nd.embed, hidden, weights, nd.dims, nd.fparams, cs, nd.rope_cos, nd.rope_sin,  # noqa: E731
                       meta.positions, meta.slot_mapping, qs, meta.block_tables_i32, meta.seqlens_i32,
                       nd.final_norm if final else None)
    c_nat, c_ref = [c.clone() for c in caches], [c.clone() for c in caches]
    out = torch.ops.mtp_core.decode_forward(*args(c_nat))
    ref = decode_forward_ref(*args(c_ref))
    return out, ref, c_nat, c_ref, args


CONFIGS = {
    "q_lora": dict(q_lora_rank=32, n_group=2),
    "no_q_lora": dict(q_lora_rank=None, n_group=2),
    "n_group1": dict(n_group=1),
    "n_group4": dict(n_group=4),
    "odd_hidden": dict(hidden_size=72, n_group=2),          # 72: every dot product has a masked tail
    "no_interleave": dict(rope_interleave=False),
    "yarn": dict(yarn=True, n_group=2),
}
ROWS = {
    "one": [(9, 1)],
    "verify": [(13, 4)],
    "ragged": [(5, 1), (17, 3), (2, 2), (30, 6)],
    "batch8": [(3 + 4 * b, 1) for b in range(8)],
}


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("rows", list(ROWS))
def test_main_stack_matches_reference(cfg, rows) -> None:
    model = tiny_model(num_layers=3, num_mtp=1, **CONFIGS[cfg])
    out, ref, c_nat, c_ref, _ = run_both(model, [0, 1, 2], ROWS[rows])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(c_nat, c_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ["one", "ragged"])
def test_mtp_module_matches_reference(rows) -> None:
    model = tiny_model(num_layers=2, num_mtp=3)
    for k in range(3):
        out, ref, *_ = run_both(model, [2 + k], ROWS[rows], mtp=True, final=False, seed=k)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_bf16_weights_and_cache_match_reference() -> None:
    model = tiny_model(dtype=torch.bfloat16, num_layers=2, num_mtp=1)
    out, ref, c_nat, c_ref, _ = run_both(model, [0, 1], ROWS["ragged"], dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for a, b in zip(c_nat, c_ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_a_wrong_kernel_is_caught() -> None:
    """The parity check can fail: a reference fed other routing scale disagrees."""
    model = tiny_model(num_layers=2, num_mtp=1)
    out, _, _, _, args = run_both(model, [0, 1], ROWS["verify"])
    nd = model.native
    bad = list(args([torch.zeros(64, PAGE, 40), torch.zeros(64, PAGE, 40)]))
    bad[5] = [nd.fparams[0], nd.fparams[1], nd.fparams[2] * 1.01]
    assert not torch.allclose(out, decode_forward_ref(*bad), rtol=1e-4, atol=1e-4)


def test_batch_invariance_is_bitwise() -> None:
    """A token decoded alone and the same token verified among 3 drafts get bitwise equal hidden states
    and logits: the property that makes greedy MTP exactly equal to greedy without it."""
    model = tiny_model(num_layers=3, num_mtp=1)
    nd = model.native
    D = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    g = torch.Generator().manual_seed(3)
    prefix = torch.randn(64, PAGE, D, generator=g)
    ids = torch.randint(7, 96, (4,), generator=g)
    table = [[5, 9, 2, 11]]
    caches_a = [prefix.clone() for _ in range(3)]
    caches_b = [prefix.clone() for _ in range(3)]
    with torch.inference_mode():
        one_by_one = []
        for i in range(4):   # positions 10..13, one token per call
            meta = AttentionMetadata.build([[10 + i]], table, PAGE, use_absorbed=True)
            one_by_one.append(nd.forward(ids[i:i + 1], meta, caches_a))
        meta = AttentionMetadata.build([[10, 11, 12, 13]], table, PAGE, use_absorbed=True)
        together = nd.forward(ids, meta, caches_b)
        assert torch.equal(torch.cat(one_by_one), together)
        assert torch.equal(nd.logits(torch.cat(one_by_one)), nd.logits(together))
        assert all(torch.equal(a, b) for a, b in zip(caches_a, caches_b))


def test_two_threads_give_bitwise_the_same_result() -> None:
    """Work large enough to be split across threads (projection panels, experts, attention rows) gives
    bitwise what one thread gives."""
    model = tiny_model(num_layers=2, num_mtp=1)
    rows = [(3 + b % 9, 1 + b % 3) for b in range(96)]          # 96 rows, 192 tokens: every split kicks in
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, ref, *_ = run_both(model, [0, 1], rows, num_blocks=512)
        torch.set_num_threads(2)
        two, *_ = run_both(model, [0, 1], rows, num_blocks=512)
        g = torch.Generator().manual_seed(1)
        x, wp = torch.randn(64, 1024, generator=g), pack_weight(torch.randn(256, 1024, generator=g))
        big_two = kernels.linear_bi(x, wp, 256)
        torch.set_num_threads(1)
        big_one = kernels.linear_bi(x, wp, 256)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two) and torch.equal(big_one, big_two)
    torch.testing.assert_close(one, ref, rtol=1e-4, atol=1e-4)


def test_linear_bi_matches_and_opcheck() -> None:
    g = torch.Generator().manual_seed(0)
    for T, K, N in ((1, 192, 1024), (5, 72, 33), (17, 16, 4), (6, 40, 130)):
        x, w = torch.randn(T, K, generator=g), torch.randn(N, K, generator=g)
        wp = pack_weight(w)
        assert wp.shape == (-(-N // 64), K, 64) and torch.equal(unpack_weight(wp, N), w)
        want = x @ w.T
        torch.testing.assert_close(kernels.linear_bi(x, wp, N), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(linear_bi_ref(x, wp, N), want, rtol=1e-4, atol=1e-4)
        wb = w.bfloat16()
        torch.testing.assert_close(kernels.linear_bi(x, pack_weight(wb), N), x @ wb.float().T, rtol=1e-4, atol=1e-4)
        torch.library.opcheck(torch.ops.mtp_core.linear_bi.default, (x, wp, N))
        rows = torch.cat([kernels.linear_bi(x[i:i + 1], wp, N) for i in range(T)])
        assert torch.equal(rows, kernels.linear_bi(x, wp, N))          # batch-invariant, bitwise
    empty = kernels.linear_bi(torch.empty(0, 8), pack_weight(torch.randn(3, 8)), 3)
    assert empty.shape == (0, 3)


def test_decode_forward_opcheck_and_empty_batch() -> None:
    model = tiny_model(num_layers=2, num_mtp=1)
    *_, args = run_both(model, [0, 1], ROWS["ragged"])
    caches = [torch.zeros(64, PAGE, 40), torch.zeros(64, PAGE, 40)]
    torch.library.opcheck(torch.ops.mtp_core.decode_forward.default, args(caches),
                          test_utils=("test_schema", "test_faketensor"))
    nd = model.native
    empty = torch.ops.mtp_core.decode_forward(
        torch.empty(0, dtype=torch.long), nd.embed, None, nd.main_weights, nd.dims, nd.fparams,
        [torch.zeros(4, PAGE, 40), torch.zeros(4, PAGE, 40)], nd.rope_cos, nd.rope_sin,
        torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), nd.final_norm)
    assert empty.shape == (0, model.config.hidden_size)


def test_bad_inputs_are_refused() -> None:
    model = tiny_model(num_layers=2, num_mtp=1)
    *_, args = run_both(model, [0, 1], ROWS["verify"])
    a = list(args([torch.zeros(64, PAGE, 40), torch.zeros(64, PAGE, 40)]))
    small = list(a)
    small[6] = [torch.zeros(2, PAGE, 40), torch.zeros(2, PAGE, 40)]       # slots / blocks past the cache
    with pytest.raises(RuntimeError, match="outside the cache|not a cache block"):
        torch.ops.mtp_core.decode_forward(*small)
    short = list(a)
    short[3] = a[3][:-1]
    with pytest.raises(RuntimeError, match="weights"):
        torch.ops.mtp_core.decode_forward(*short)


def test_engine_runs_native_and_matches_the_torch_path(tiny3_dir, monkeypatch) -> None:
    """Greedy text on the native path equals the torch reference path's, MTP on and off."""
    from mtp_core.loader import load_model
    native_model = load_model(tiny3_dir, "float32")[0]
    monkeypatch.setenv("MTP_CORE_NATIVE_DECODE", "0")
    torch_model = load_model(tiny3_dir, "float32")[0]
    make_engine(torch_model)
    assert torch_model.native is None
    monkeypatch.delenv("MTP_CORE_NATIVE_DECODE")
    make_engine(native_model)
    assert native_model.native is not None
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


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_lower_isa_builds_agree(isa) -> None:
    """MTP_CORE_CPU_ISA caps the kernels' instruction set (the fallback a CPU without AVX-512 gets): same
    result within rounding, and the choice is reported."""
    code = (
        "import torch, sys; sys.path.insert(0, 'tests');"
        "from test_native_decode import tiny_model, run_both, ROWS;"
        "from mtp_core import kernels; print(kernels.cpu_isa());"
        "m = tiny_model(num_layers=2, num_mtp=1); out, ref, *_ = run_both(m, [0, 1], ROWS['ragged']);"
        "torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4); print('ok')")
    env = dict(os.environ, MTP_CORE_CPU_ISA=isa)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.split()
    assert lines[-1] == "ok"
    have_avx2 = "avx2" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    assert lines[0] == (isa if isa == "generic" or have_avx2 else "generic")


def test_why_not_reports_reasons(monkeypatch) -> None:
    model = tiny_model(num_layers=2, num_mtp=1)
    assert NativeDecoder.why_not(model) is None
    monkeypatch.setenv("MTP_CORE_NATIVE_DECODE", "0")
    assert NativeDecoder.why_not(model) == "MTP_CORE_NATIVE_DECODE=0"
    assert len(WEIGHT_SLOTS) == 20


def test_bf16_native_greedy_mtp_equals_plain_greedy(tiny3_dir) -> None:
    """bf16 weights (half the bytes, fp32 activations): its own greedy-equality with and without MTP."""
    from mtp_core.loader import load_model
    model = load_model(tiny3_dir, "bfloat16")[0]
    base = make_engine(model, max_batch_size=8)
    assert model.native is not None and model.native.embed.dtype == torch.bfloat16
    want = [s.output_ids for s in run_to_end(base, PROMPTS, greedy(24))]
    for nextn, mode in ((2, "eagle"), (3, "vanilla")):
        eng = make_engine(model, nextn=nextn, mode=mode, max_batch_size=8)
        assert [s.output_ids for s in run_to_end(eng, PROMPTS, greedy(24))] == want, (nextn, mode)


def test_a_copy_of_a_fused_model_packs_its_own_weights(tiny1_dir) -> None:
    """The native decoder is a snapshot of the weights: a deep copy drops it (and the decode fusion), so
    changing the copy's weights and then serving it gives what a fresh model with those weights gives."""
    import copy

    from mtp_core.loader import load_model
    model = load_model(tiny1_dir, "float32")[0]
    make_engine(model)
    assert model.native is not None
    twin = copy.deepcopy(model)
    assert twin.native is None and not twin.decode_fused
    fresh = load_model(tiny1_dir, "float32")[0]
    with torch.no_grad():
        for m in (twin, fresh):
            m.model.layers[1].post_attention_layernorm.weight.mul_(-3.0)
    prompts = PROMPTS[:4]
    out = {name: [s.output_ids for s in run_to_end(make_engine(m, max_batch_size=4), prompts, greedy(16))]
           for name, m in (("twin", twin), ("fresh", fresh), ("original", model))}
    assert twin.native is not None
    assert out["twin"] == out["fresh"] != out["original"]

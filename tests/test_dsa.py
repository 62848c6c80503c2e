"""DeepSeek-V3.2 (DeepSeek Sparse Attention): the model against transformers' DeepseekV32ForCausalLM, the
indexer key cache in the engine (paged, rewound with the drafts, prefix-cached, copied), greedy MTP == greedy
without it on the torch and native paths, and the native forward against its reference.

Checkpoints written by transformers use 16 indexer heads (so that an all-zero relu, which ties scores, is
rare: transformers' topk breaks ties its own way) and index_topk below the prompt length, so the selection
decides the output (checked: the same model attending densely gives other logits).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import PROMPTS, _sharpen, greedy, make_engine, reference, run_to_end
from mtp_core import kernels
from mtp_core.config import ModelConfig
from mtp_core.kernels.dsa_ref import select_topk
from mtp_core.loader import load_model
from mtp_core.model import AttentionMetadata, DeepseekV3ForCausalLM
from mtp_core.native.forward_path import prepare_decode
from mtp_core.tiny import make_tiny_checkpoint, tiny_config_dict

torch.set_num_threads(1)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

VOCAB = 160
STD = 0.1
TOL = 1e-4
NATIVE = pytest.mark.skipif(not kernels.native_ops().cpu, reason=kernels.native_ops().summary)
PATHS = ["torch", pytest.param("native", marks=NATIVE)]


# ---- checkpoints -----------------------------------------------------------------------------------

def hf_v32_dir(d: Path, rope_parameters: dict | None = None, index_topk: int = 5, num_mtp: int = 0,
               seed: int = 1) -> tuple[Path, object]:
    """A DeepseekV32ForCausalLM written by transformers' save_pretrained (std 0.1 weights); num_mtp > 0 adds
    MTP layers (ours, random) to the safetensors and num_nextn_predict_layers to config.json."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
    cfg = DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256, index_topk=index_topk,
        index_head_dim=16, index_n_heads=16, bos_token_id=0, eos_token_id=1,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    hf = DeepseekV32ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name and not name.endswith("bias") else STD * noise)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    hf.save_pretrained(str(d))
    if num_mtp:
        conf = json.loads((d / "config.json").read_text())
        conf["num_nextn_predict_layers"] = num_mtp
        from mtp_core.model import DeepseekV3ForCausalLM
        from mtp_core.tiny import init_weights
        ours = DeepseekV3ForCausalLM(ModelConfig.from_dict(conf))
        init_weights(ours, seed, std=STD)
        state = load_file(str(d / "model.safetensors"))
        L = conf["num_hidden_layers"]
        state.update({k: v for k, v in ours.state_dict().items() if k.startswith(tuple(
            f"model.layers.{L + k}." for k in range(num_mtp)))})
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(conf))
    return d, hf


def load_as(d: Path, path: str, monkeypatch, dtype: str = "float32"):
    """Our model on the torch path (MTP_CORE_NATIVE_DECODE=0) or the native one, decoder prepared."""
    if path == "torch":
        monkeypatch.setenv("MTP_CORE_NATIVE_DECODE", "0")
    model = load_model(d, dtype, make_model=DeepseekV3ForCausalLM)[0]
    prepare_decode(model)
    monkeypatch.delenv("MTP_CORE_NATIVE_DECODE", raising=False)
    assert (model.native is not None) == (path == "native")
    return model


def v32_tiny(d: Path, num_layers: int, num_mtp: int, seed: int) -> Path:
    """The engine tests' checkpoint: make-tiny --arch v32 (index_topk 8, prompts up to 23 tokens and 24-32
    generated ones), sharpened like conftest's so that drafts are accepted part of the time."""
    make_tiny_checkpoint(d, seed=seed, num_layers=num_layers, num_mtp=num_mtp, arch="v32")
    _sharpen(d, num_layers, num_mtp)
    return d


@pytest.fixture(scope="module")
def v32_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v32")
    return {"tiny1": v32_tiny(root / "tiny1", 2, 1, 0), "tiny3": v32_tiny(root / "tiny3", 2, 3, 1)}


_MODELS: dict[tuple, object] = {}


def v32_model(v32_dirs, name: str, path: str):
    """Session-shared loaded models (each its own decoder: native or torch)."""
    key = (name, path)
    if key not in _MODELS:
        old = os.environ.pop("MTP_CORE_NATIVE_DECODE", None)
        if path == "torch":
            os.environ["MTP_CORE_NATIVE_DECODE"] = "0"
        try:
            model = load_model(v32_dirs[name], "float32", make_model=DeepseekV3ForCausalLM)[0]
            prepare_decode(model)
        finally:
            os.environ.pop("MTP_CORE_NATIVE_DECODE", None)
            if old is not None:
                os.environ["MTP_CORE_NATIVE_DECODE"] = old
        assert (model.native is not None) == (path == "native")
        _MODELS[key] = model
    return _MODELS[key]


# ---- config ----------------------------------------------------------------------------------------

def test_config_reads_dsa_fields_and_refuses_bad_ones() -> None:
    cfg = ModelConfig.from_dict(tiny_config_dict(VOCAB, arch="v32", index_topk=6))
    assert cfg.is_dsa and (cfg.index_topk, cfg.index_head_dim, cfg.index_n_heads) == (6, 16, 4)
    assert cfg.kv_cache_dim == 32 + 8 + 16                   # [c_kv | k_pe | index key]
    assert not ModelConfig.from_dict(tiny_config_dict(VOCAB)).is_dsa
    bare = {k: v for k, v in tiny_config_dict(VOCAB, arch="v32").items() if not k.startswith("index_")}
    cfg = ModelConfig.from_dict(bare)                        # model_type deepseek_v32: transformers' defaults
    assert (cfg.index_topk, cfg.index_head_dim, cfg.index_n_heads) == (2048, 128, 64)
    bad = [({"q_lora_rank": None}, "needs q_lora_rank"), ({"index_head_dim": 6}, "index_head_dim=6"),
           ({"index_topk": 0}, "index_topk must be a positive integer"),
           ({"mlp_layer_types": ["sparse", "sparse"]}, "mlp_layer_types")]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            ModelConfig.from_dict({**tiny_config_dict(VOCAB, arch="v32"), **change})
    with pytest.raises(ValueError, match="needs q_lora_rank"):
        tiny_config_dict(VOCAB, arch="v32", q_lora_rank=None)


def test_selection_takes_the_best_and_breaks_ties_by_lower_position() -> None:
    # scores of keys 0..5 (# marks the invisible one)
    scores = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0, 9.0]])
    visible = torch.tensor([[True, True, True, True, True, False]])              # key 5 is in the future
    def chosen(k):
        return select_topk(scores, visible, k)[0].nonzero()[:, 0].tolist()
    assert chosen(1) == [0]             # three 3.0s: the lowest position
    assert chosen(2) == [0, 2]
    assert chosen(3) == [0, 2, 4]
    assert chosen(4) == [0, 2, 3, 4]    # then the 2.0
    assert chosen(6) == [0, 1, 2, 3, 4]  # every visible key (never the invisible 9.0)


# ---- the model against transformers ---------------------------------------------------------------

@torch.no_grad()
def paged_greedy(model, prompt: list[int], steps: int, page: int = 4):
    """Prefill (naive MLA), then greedy decode steps (absorbed) on a reversed block table, NaN-filled cache;
    -> prompt logits [P, V], per-step logits, ids."""
    cfg = model.config
    n_blocks = (len(prompt) + steps) // page + 2
    table = list(range(n_blocks))[::-1]
    caches = [torch.full((n_blocks, page, cfg.kv_cache_dim), float("nan")) for _ in range(len(model.model.layers))]
    meta = AttentionMetadata.build([list(range(len(prompt)))], [table], page, use_absorbed=False)
    prompt_logits = model.compute_logits(model(torch.tensor(prompt), meta, caches))
    logits, out = [prompt_logits[-1]], [int(prompt_logits[-1].argmax())]
    for i in range(steps - 1):
        meta = AttentionMetadata.build([[len(prompt) + i]], [table], page, use_absorbed=True)
        step = model.compute_logits(model(torch.tensor([out[-1]]), meta, caches))[0]
        logits.append(step)
        out.append(int(step.argmax()))
    return prompt_logits, logits, out


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
             "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0},
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_transformers_checkpoint_loads_and_matches_its_logits(tmp_path: Path, rope: str) -> None:
    d, hf = hf_v32_dir(tmp_path, ROPES[rope])
    names = set(load_file(str(d / "model.safetensors")))
    assert "model.layers.0.self_attn.indexer.k_norm.bias" in names       # the "unexpected tensor"
    ours, _ = load_model(d, "float32", make_model=DeepseekV3ForCausalLM)
    assert ours.config.is_dsa and ours.model.layers[1].self_attn.indexer.topk == 5
    prompt = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(7))
    steps = 8
    with torch.no_grad():
        ref = hf(prompt).logits[0]
        gen = hf.generate(prompt, max_new_tokens=steps, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        dense = ours.compute_logits(ours.forward_dense(prompt))[0]
    assert (dense - ref).abs().max() <= TOL
    p_logits, s_logits, ids = paged_greedy(ours, prompt[0].tolist(), steps)
    assert (p_logits - ref).abs().max() <= TOL
    assert ids == gen.sequences[0, prompt.shape[1]:].tolist()
    for mine, theirs in zip(s_logits, gen.logits):
        assert (mine - theirs[0]).abs().max() <= TOL
    # the selection is live: attending to every key instead moves the logits far beyond TOL
    for layer in ours.model.layers:
        layer.self_attn.indexer.topk = 10_000
    with torch.no_grad():
        assert (ours.compute_logits(ours.forward_dense(prompt))[0] - ref).abs().max() > 100 * TOL


@pytest.mark.parametrize("path", PATHS)
def test_engine_greedy_equals_transformers_with_and_without_mtp(tmp_path: Path, monkeypatch, path: str) -> None:
    """A transformers-written V3.2 checkpoint (plus an MTP module) through the engine: greedy ids equal
    transformers' generate, without MTP and with Eagle K=1..3, batch 1 and 4."""
    d, hf = hf_v32_dir(tmp_path, num_mtp=1)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (6, 14, 19, 9)]
    n_new = 12
    want = []
    with torch.no_grad():
        for p in prompts:
            seq = hf.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False, pad_token_id=0,
                              eos_token_id=None)
            want.append(seq[0, len(p):].tolist())
    model = load_as(d, path, monkeypatch)
    for K in (0, 1, 2, 3):
        for bs in (1, 4):
            eng = make_engine(model, eos=(1,), think_ids=None, nextn=K, mode="eagle", max_batch_size=bs)
            got = [s.output_ids for s in run_to_end(eng, prompts, greedy(n_new))]
            assert got == want, (K, bs)


# ---- the engine: greedy MTP == plain, caches ----------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ckpt,mode,K", [("tiny1", "eagle", 1), ("tiny1", "eagle", 2), ("tiny1", "eagle", 3),
                                         ("tiny3", "vanilla", 1), ("tiny3", "vanilla", 3)])
def test_greedy_mtp_equals_plain_greedy(v32_dirs, path, ckpt, mode, K) -> None:
    model = v32_model(v32_dirs, ckpt, path)
    want = [reference(model, p, 28) for p in PROMPTS]
    for bs, overlap in ((1, False), (4, False), (4, True)):
        eng = make_engine(model, nextn=K, mode=mode, max_batch_size=bs, overlap_scheduler_on_cpu=overlap)
        # without the overlap scheduler the native path runs every decode step of a greedy batch as one mtp_step
        # call (DSA inside it); with it (or on the torch path), the general path
        assert (eng.paths.native_step is not None) == (path == "native" and not overlap) and eng.paths.graphs is None
        assert [s.output_ids for s in run_to_end(eng, PROMPTS, greedy(28))] == want, (bs, overlap)
        assert eng.stats.num_draft_accepted > 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ckpt,mode", [("tiny1", "eagle"), ("tiny3", "vanilla")])
def test_cost_policy_keeps_greedy_mtp_equal_to_plain(v32_dirs, path, ckpt, mode) -> None:
    """draft_len_policy cost (the default: 0..K drafts per step from measured step costs) on V3.2 (native: the
    one-call step, rows at 0 drafts lagging and catching up inside it): whatever counts it picks, the text is plain
    greedy's."""
    model = v32_model(v32_dirs, ckpt, path)
    eng = make_engine(model, nextn=3, mode=mode, max_batch_size=4, spec={"draft_len_policy": "cost"},
                      overlap_scheduler_on_cpu=False)
    assert eng.spec.policy.policy == "cost"
    assert [s.output_ids for s in run_to_end(eng, PROMPTS, greedy(28))] == [reference(model, p, 28) for p in PROMPTS]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunked", [False, True])
def test_a_deferred_prompt_leaves_its_last_layer_for_later_bitwise(v32_dirs, path, chunked) -> None:
    """V3.2 under the cost policy's deferred prompts: the prefill split before its last layer (DSA's index keys
    written at prefill, the layer's rest when the request drafts) gives the outputs, and every step's drafts and,
    after the catch-up, the MTP layer's cache rows over the prompts of an engine that keeps every prompt hidden
    state: bitwise on the native path, within float32 rounding on the torch path, whose GEMMs are not
    batch-invariant (test_policy.py has the same on V3)."""
    from mtp_core.request.mtp_state import Unfinished
    from test_policy import scripted

    model = v32_model(v32_dirs, "tiny1", path)
    runs = {}
    for split in (True, False):
        eng = scripted(make_engine(model, nextn=3, mode="eagle", max_batch_size=2, tokens_per_block=4,
                                   block_reuse=False, enable_chunked_prefill=chunked,
                                   max_num_tokens=8 if chunked else 8192, spec={"draft_len_policy": "cost"},
                                   overlap_scheduler_on_cpu=False),
                       [(0, True)] * 4 + [(3, True), (1, True), (0, True), (2, True)], defer_prompts=True)
        if not split:
            eng.paths.runner.split_prompts = None
        seqs = [eng.add_request(p, greedy(28)) for p in (PROMPTS[3], PROMPTS[5])]
        drafts, unfinished, mtp_rows = [], 0, None
        while eng.has_unfinished():
            eng.step()
            unfinished += sum(any(isinstance(h, Unfinished) for h in s.mtp.pending or ()) for s in seqs)
            drafts.append([list(s.mtp.drafts) for s in seqs])
            if mtp_rows is None and all(s.stats.num_draft_proposed and s.mtp.pending is None for s in seqs):
                # after the catch-up: the MTP layer's cache rows over the prompt (the finished states fed them)
                cache, page = eng.caches[model.num_main_layers], eng.blocks.tokens_per_block
                mtp_rows = [torch.stack([cache[s.kv.block_table[i // page], i % page] for i in range(len(p))])
                            for s, p in zip(seqs, (PROMPTS[3], PROMPTS[5]))]
        assert [s.output_ids for s in seqs] == [reference(model, p, 28) for p in (PROMPTS[3], PROMPTS[5])]
        assert (unfinished > 0) == split and eng.stats.num_draft_proposed > 0 and mtp_rows is not None
        runs[split] = drafts, mtp_rows
    if path == "native":           # batch-invariant: the same numbers whatever the calls' shapes
        assert runs[True][0] == runs[False][0]
        assert all(torch.equal(a, b) for a, b in zip(runs[True][1], runs[False][1]))
    else:                          # torch's GEMMs round by their shapes: ~5e-7 apart here
        for a, b in zip(runs[True][1], runs[False][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_fp8_kv_cache_greedy_mtp_equals_plain(v32_dirs, path) -> None:
    """An e4m3 cache (--kv_cache_dtype fp8) holds the index keys too: greedy MTP == plain greedy on it."""
    model = v32_model(v32_dirs, "tiny1", path)
    base = make_engine(model, max_batch_size=4, kv_dtype="fp8")
    assert base.caches[0].dtype == torch.float8_e4m3fn and base.caches[0].shape[-1] == model.config.kv_cache_dim
    want = [s.output_ids for s in run_to_end(base, PROMPTS, greedy(24))]
    eng = make_engine(model, nextn=3, mode="eagle", max_batch_size=4, kv_dtype="fp8")
    assert [s.output_ids for s in run_to_end(eng, PROMPTS, greedy(24))] == want
    assert eng.stats.num_draft_accepted > 0


@pytest.mark.parametrize("path", PATHS)
def test_relaxed_acceptance_with_zero_delta_equals_strict(v32_dirs, path) -> None:
    """Relaxed acceptance on thinking prompts (<think> = id 5): delta 0 must equal strict greedy."""
    model = v32_model(v32_dirs, "tiny1", path)
    prompts = [p + [5] for p in PROMPTS[:4]]
    want = [reference(model, p, 24) for p in prompts]
    eng = make_engine(model, nextn=3, mode="eagle", max_batch_size=4,
                      spec={"use_relaxed_acceptance_for_thinking": True, "relaxed_topk": 10, "relaxed_delta": 0.0})
    assert [s.output_ids for s in run_to_end(eng, prompts, greedy(24))] == want


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ckpt,mode,K", [("tiny1", "eagle", 3), ("tiny3", "vanilla", 2)])
def test_rewind_keeps_every_cache_row_equal_to_a_fresh_prefill(v32_dirs, path, ckpt, mode, K) -> None:
    """After every step, each running request's cache rows (latent and index key, main and MTP layers) equal
    a fresh prefill's and the dense definition (test_mtp_decoding._check_caches)."""
    from test_mtp_decoding import _check_caches
    model = v32_model(v32_dirs, ckpt, path)
    eng = make_engine(model, nextn=K, mode=mode, tokens_per_block=4, max_batch_size=4)
    seqs = [eng.add_request(p, greedy(30)) for p in (PROMPTS[2], PROMPTS[4], PROMPTS[5])]
    for _ in range(10):
        eng.step()
        _check_caches(model, eng, seqs, mode, K)
    assert eng.stats.num_draft_accepted > 0 and eng.stats.num_draft_proposed > eng.stats.num_draft_accepted


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ckpt,mode,K", [("tiny1", "eagle", 2), ("tiny3", "vanilla", 3), ("tiny1", "vanilla", 0)])
def test_prefix_cache_reuses_index_keys_and_n_copies(v32_dirs, path, ckpt, mode, K) -> None:
    """Requests sharing a prefix (and n=3 copies of one prompt, as the server's n > 1 sends them) reuse the
    registered blocks, index keys included, and copy the boundary block on write; outputs equal the plain
    reference, every cache row equals a fresh prefill after every step, registered blocks are never written."""
    from test_prefix_cache import BASE, TAIL_A, TAIL_B, drive
    model = v32_model(v32_dirs, ckpt, path)
    eng = make_engine(model, nextn=K, mode=mode, tokens_per_block=4, max_batch_size=4)
    shared = BASE[:13]
    drive(eng, model, mode, K, {0: [(shared + TAIL_A, 10)], 1: [(shared + TAIL_B, 10)],
                                3: [(shared + TAIL_A, 8)] * 3})
    assert eng.blocks.stats.hit_blocks >= 3 * 4


# ---- the native forward -------------------------------------------------------------------------------

def _native_pair(model, rows, cache_dtype=torch.float32, seed=0):
    """decode_forward and its reference (kernels/native_ref.py) on one random batch."""
    from test_native_decode import batch
    from mtp_core.kernels.native_ref import decode_forward_ref
    nd = model.native
    cfg = model.config
    meta = batch(rows, 64)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, cfg.vocab_size, (meta.positions.numel(),), generator=g)
    n = cfg.num_hidden_layers
    caches = [torch.randn(64, 4, cfg.kv_cache_dim, generator=g).to(cache_dtype) for _ in range(n)]
    tail = (nd.rope_cos, nd.rope_sin, meta.positions, meta.slot_mapping, meta.query_start_i32,
            meta.block_tables_i32, meta.seqlens_i32, True)
    c_nat, c_ref = [c.clone() for c in caches], [c.clone() for c in caches]
    out = torch.ops.mtp_core.decode_forward(nd.handle, 0, n, ids, None, c_nat, *tail)
    ref = decode_forward_ref(nd.weights, 0, n, ids, None, c_ref, *tail)
    return out, ref, c_nat, c_ref, (ids, meta, caches)


def _v32_random(**kw):
    from test_native_decode import tiny_model
    model = tiny_model(num_layers=2, num_mtp=1, arch="v32", index_topk=5, **kw)
    prepare_decode(model)
    return model


# up to 64 tokens a call the indexer's scores are split by key chunks across threads, beyond it by tokens
ROWS = {"one": [(9, 1)], "verify": [(13, 4)], "ragged": [(5, 1), (17, 3), (2, 2), (30, 6)],
        "prefill": [(23, 23), (9, 9)], "long_prefill": [(75, 70)]}


@NATIVE
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("cache", ["float32", "bfloat16", "fp8"])
def test_native_forward_matches_its_reference(rows, cache, monkeypatch) -> None:
    monkeypatch.setenv("MTP_CORE_CPU_ISA", "avx512f" if "avx512" in kernels.cpu_isa() else kernels.cpu_isa())
    model = _v32_random()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[cache]
    out, ref, c_nat, c_ref, _ = _native_pair(model, ROWS[rows], dtype)
    tol = 1e-4 if cache == "float32" else 2e-3
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    # the cache rows: equal up to one step of the cache's format (a value within 1e-7 of a rounding boundary)
    step = {"float32": 1e-4, "bfloat16": 2 ** -7, "fp8": 2 ** -3}[cache]
    for a, b in zip(c_nat, c_ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=step, atol=2 ** -9 if cache == "fp8" else tol)


@NATIVE
def test_native_selection_breaks_ties_by_lower_position(monkeypatch) -> None:
    """wq_b = 0 makes every indexer score 0: each query must attend to its index_topk lowest positions (the
    reference's rule), and a reference choosing the highest tied positions instead must disagree."""
    import mtp_core.kernels.native_ref as native_ref   # the selection the reference calls (kernels/dsa_ref.py)
    model = _v32_random()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.indexer.wq_b.weight.zero_()
    out, ref, *_ = _native_pair(model, [(17, 3), (11, 1)])
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    lower_first = native_ref.select_topk

    def last_first(scores, visible, k):
        return lower_first(scores.flip(-1), visible.flip(-1), k).flip(-1)
    monkeypatch.setattr(native_ref, "select_topk", last_first)
    _, other, *_ = _native_pair(model, [(17, 3), (11, 1)])
    assert (out - other).abs().max() > 1e-2


@NATIVE
@pytest.mark.parametrize("quant", ["none", "fp8", "nvfp4"])
def test_native_is_bitwise_batch_and_thread_invariant(quant) -> None:
    """One token at a time (each its own call) vs all rows in one call, and 1 vs 2 threads: bitwise equal."""
    from test_native_decode import quantize_linears
    model = _v32_random()
    if quant != "none":
        model = quantize_linears(model, quant)
        model.native = None
        model.decode_fused = False
        prepare_decode(model)
    rows = [(9, 1), (14, 3), (21, 2), (80, 66)]          # 72 tokens: the by-token split; one each: by keys
    whole, _, c_whole, _, (ids, meta, caches) = _native_pair(model, rows)
    nd, n = model.native, model.config.num_hidden_layers
    parts, c_one = [], [c.clone() for c in caches]
    for b, (ctx, nq) in enumerate(rows):     # token by token, each row's tokens in order, same tables
        for i in range(nq):
            t = meta.query_start[b] + i
            m1 = AttentionMetadata.build([[ctx - nq + i]], [meta.block_tables[b]], 4, use_absorbed=True)
            parts.append(torch.ops.mtp_core.decode_forward(
                nd.handle, 0, n, ids[t:t + 1], None, c_one, nd.rope_cos, nd.rope_sin, m1.positions, m1.slot_mapping,
                m1.query_start_i32, m1.block_tables_i32, m1.seqlens_i32, True))
    assert torch.equal(torch.cat(parts), whole)
    for a, b in zip(c_one, c_whole):
        assert torch.equal(a, b)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two, *_ = _native_pair(model, rows)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(two, whole)


@NATIVE
def test_native_outputs_left_out_keep_the_index_keys_and_kept_outputs() -> None:
    """decode_forward asked for each row's last output (outputs=1) or none (2): the index keys and latents its
    last layer writes, and the outputs it keeps, are bitwise those of the whole forward (outputs=0), for the
    target and the MTP module (a DSA layer)."""
    model = _v32_random()
    rows = [(9, 1), (14, 3), (21, 2), (80, 66)]
    _, _, _, _, (ids, meta, caches) = _native_pair(model, rows)
    nd, n = model.native, model.config.num_hidden_layers
    tail = (nd.rope_cos, nd.rope_sin, meta.positions, meta.slot_mapping, meta.query_start_i32, meta.block_tables_i32,
            meta.seqlens_i32)
    ends = [e - 1 for e in meta.query_start[1:]]
    hidden = torch.randn(len(ids), model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for first, num, hid, start in ((0, n, None, caches), (n, 1, hidden, caches[:1])):
        got = {}
        for outputs in (0, 1, 2):
            c = [x.clone() for x in start]
            got[outputs] = (torch.ops.mtp_core.decode_forward(nd.handle, first, num, ids, hid, c, *tail,
                                                              hid is None, outputs), c)
        assert got[0][0].shape[0] == len(ids) and got[2][0].shape[0] == 0
        assert torch.equal(got[1][0], got[0][0][ends])
        assert not torch.equal(got[0][1][-1], start[-1])          # the last layer wrote its entries
        for outputs in (1, 2):
            assert all(torch.equal(a, b) for a, b in zip(got[outputs][1], got[0][1]))


# ---- quantized twins, the checkpoint writers ------------------------------------------------------------

@NATIVE
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_twins_keep_the_indexer_as_deepseek_does_and_stay_lossless(v32_dirs, tmp_path, fmt) -> None:
    """`mtp quantize`: FP8 writes the indexer's wq_b / wk as e4m3 blocks with weight_scale_inv and keeps
    weights_proj in high precision (DeepSeek's V3.2 FP8 release); NVFP4 keeps the whole indexer (attention).
    The loader reads them packed, and greedy MTP == plain greedy on them (native, 2 threads)."""
    from safetensors import safe_open
    from mtp_core.quantize import quantize_checkpoint
    out = tmp_path / fmt
    quantize_checkpoint(v32_dirs["tiny1"], out, fmt)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for layer in (0, 2):                     # a main layer and the MTP module's
            p = f"model.layers.{layer}.self_attn.indexer."
            packed = f.get_tensor(p + "wq_b.weight").dtype
            if fmt == "fp8":
                assert packed == torch.float8_e4m3fn and f.get_tensor(p + "wk.weight").dtype == torch.float8_e4m3fn
                assert {p + "wq_b.weight_scale_inv", p + "wk.weight_scale_inv"} <= names
            else:
                assert packed == torch.float32 and p + "wq_b.weight_scale" not in names
            assert f.get_tensor(p + "weights_proj.weight").dtype == torch.float32
            assert not any(n.startswith(p + "weights_proj.weight_") for n in names)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = load_model(out, "auto", make_model=DeepseekV3ForCausalLM)[0]
        base = make_engine(model, max_batch_size=4)
        assert model.native is not None and fmt in model.native.weights.formats()
        idx = model.model.layers[0].self_attn.indexer
        assert idx.weights_proj.weight.dtype == torch.float32 and (type(idx.wq_b).__name__ != "Linear") == (fmt == "fp8")
        want = [s.output_ids for s in run_to_end(base, PROMPTS, greedy(24))]
        eng = make_engine(model, nextn=3, mode="eagle", max_batch_size=4)
        assert [s.output_ids for s in run_to_end(eng, PROMPTS, greedy(24))] == want
        assert eng.stats.num_draft_accepted > 0
    finally:
        torch.set_num_threads(old)


def test_make_tiny_and_make_scale_write_v32(tmp_path: Path) -> None:
    from typer.testing import CliRunner
    from cli.app import app
    from mtp_core.scale_model import scale_config_dict
    r = CliRunner().invoke(app, ["make-tiny", str(tmp_path / "t"), "--arch", "v32", "--index_topk", "6"])
    assert r.exit_code == 0, r.output
    conf = json.loads((tmp_path / "t" / "config.json").read_text())
    assert conf["model_type"] == "deepseek_v32" and conf["index_topk"] == 6
    assert "model.layers.2.self_attn.indexer.wq_b.weight" in load_file(str(tmp_path / "t" / "model.safetensors"))
    full = scale_config_dict("deepseek-v3", num_layers=61, arch="v32")
    assert (full["index_n_heads"], full["index_head_dim"], full["index_topk"]) == (64, 128, 2048)
    assert full["hidden_size"] == 7168 and full["max_position_embeddings"] == 163840
    r = CliRunner().invoke(app, ["make-scale", str(tmp_path / "s"), "--arch", "v32", "--num_layers", "2",
                                 "--width_divisor", "16", "--vocab_size", "512", "--n_routed_experts", "16"])
    assert r.exit_code == 0, r.output
    model = load_model(tmp_path / "s", "float32", make_model=DeepseekV3ForCausalLM)[0]
    assert model.config.is_dsa and model.config.n_routed_experts == 16 and model.num_mtp_modules == 1
    r = CliRunner().invoke(app, ["make-scale", str(tmp_path / "m"), "--arch", "v32", "--shape", "moonlight"])
    assert r.exit_code == 2 and "use --shape deepseek-v3" in r.output
    r = CliRunner().invoke(app, ["make-tiny", str(tmp_path / "q"), "--arch", "v32", "--q_lora_rank", "0"])
    assert r.exit_code == 2 and "needs q_lora_rank" in r.output


@NATIVE
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_v32_widths_bf16_and_fp8_greedy_mtp_equals_plain(tmp_path: Path, fmt: str) -> None:
    """make-scale --arch v32 at 1/16 of V3.2's widths (8 heads, 4 indexer heads of 8, 16 experts of 128 in 8
    groups), index_topk 12 under 30-70-token contexts, bf16 weights (the bf16-activation kernels where the CPU has
    them) or their FP8 twin, 2 threads: greedy MTP (Eagle K=1, 3) == greedy without it, batch 1 and 3."""
    from mtp_core.quantize import quantize_checkpoint
    from mtp_core.scale_model import write_scale_checkpoint
    src = write_scale_checkpoint(tmp_path / "v32", "deepseek-v3", num_layers=2, num_mtp=1, width_divisor=16,
                                 vocab_size=512, n_routed_experts=16, arch="v32", overrides={"index_topk": 12})
    if fmt == "fp8":
        quantize_checkpoint(src, tmp_path / "fp8", "fp8")
        src = tmp_path / "fp8"
    prompts = [[20 + i + 7 * j for j in range(30 + 13 * i)] for i in range(3)]
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = load_model(src, "auto", make_model=DeepseekV3ForCausalLM)[0]
        base = make_engine(model, max_batch_size=3)
        assert model.native is not None and model.native.weights.dims["index_topk"] == 12
        want = [s.output_ids for s in run_to_end(base, prompts, greedy(16))]
        for K in (1, 3):
            for bs in (1, 3):
                eng = make_engine(model, nextn=K, mode="eagle", max_batch_size=bs)
                assert [s.output_ids for s in run_to_end(eng, prompts, greedy(16))] == want, (K, bs)
    finally:
        torch.set_num_threads(old)

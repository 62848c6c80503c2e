"""MTP speculative decoding end to end: losslessness, forced drafters, Vanilla windows, rewind, thinking.

Ground truth is always the greedy nextn=0 run of one request alone (`conftest.reference`). Forced drafters
(`OracleDrafter`) take the target's own future tokens from that run, so acceptance lengths and emitted
blocks are known in advance and checked against hand-computed numbers.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import (
    PROMPTS, THINK_IDS, OracleDrafter, greedy, llm_config, make_engine, reference, run_to_end,
)
from mtp_core.engine.engine import Engine
from mtp_core.sampling import SamplingParams

torch.set_num_threads(1)

MAX_TOKENS = 20


class ControlledDrafter:
    """Runs the real MTP drafter (so every MTP cache is written exactly as in production) but returns the
    oracle's drafts, so the acceptance pattern of each step is chosen by the test."""

    def __init__(self, inner, oracle: OracleDrafter) -> None:
        self.inner, self.oracle = inner, oracle
        self.num_draft_tokens = inner.num_draft_tokens

    def propose(self, rows):
        self.inner.propose(rows)
        return self.oracle.propose(rows)


def cycling(pattern: list[int]):
    """num_right callback: the i-th proposal for a request gets pattern[i % len] right drafts."""
    counts: dict[int, int] = {}

    def num_right(seq) -> int:
        i = counts.get(seq.request_id, 0)
        counts[seq.request_id] = i + 1
        return pattern[i % len(pattern)]
    return num_right


# ---- lossless greedy -------------------------------------------------------------------------

LOSSLESS = [("tiny1", "eagle", k) for k in range(1, 6)] + [("tiny3", "eagle", k) for k in range(1, 6)] \
    + [("tiny3", "vanilla", k) for k in range(1, 4)]


@pytest.mark.parametrize("ckpt,mode,K", LOSSLESS)
def test_greedy_mtp_is_token_exact(models, ckpt, mode, K):
    model = models[ckpt]
    eng = make_engine(model, nextn=K, mode=mode)
    seqs = run_to_end(eng, PROMPTS, greedy(MAX_TOKENS))
    for p, s in zip(PROMPTS, seqs):
        assert s.output_ids == reference(model, p, MAX_TOKENS), f"prompt of length {len(p)}"
        assert s.finish_reason == "length"
    st = eng.stats
    # both verification branches ran: some drafts accepted, some rejected
    assert 0 < st.num_draft_accepted < st.num_draft_proposed
    assert st.num_output_tokens == MAX_TOKENS * len(PROMPTS)
    assert st.acceptance_length > 1.0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_vanilla_needs_one_module_per_draft(tiny1_model):
    with pytest.raises(ValueError, match="one module per draft token"):
        make_engine(tiny1_model, nextn=2, mode="vanilla")


def test_mtp_on_a_checkpoint_without_mtp_modules_is_refused(tmp_path):
    from mtp_core.loader import load_model
    from mtp_core.model import DeepseekV3ForCausalLM
    from mtp_core.tiny import make_tiny_checkpoint
    model = load_model(make_tiny_checkpoint(tmp_path / "no_mtp", num_mtp=0), "float32",
                       make_model=DeepseekV3ForCausalLM)[0]
    with pytest.raises(ValueError, match="num_nextn_predict_layers = 0"):
        make_engine(model, nextn=1)
    assert len(run_to_end(make_engine(model), [PROMPTS[1]], greedy(3))[0].output_ids) == 3


@pytest.mark.parametrize("ckpt,mode,K", [("tiny1", "eagle", 3), ("tiny3", "vanilla", 3)])
def test_eos_inside_accepted_blocks_matches_baseline(models, ckpt, mode, K):
    """EOS = tokens the model emits mid-sequence; with EOS honoured both runs stop at the same place."""
    model = models[ckpt]
    refs = [reference(model, p, MAX_TOKENS) for p in PROMPTS]
    eos = tuple(sorted({r[7] for r in refs} | {r[11] for r in refs}))
    expected = []
    for r in refs:
        cut = next(i for i, t in enumerate(r) if t in eos)
        expected.append(r[:cut])
    base = run_to_end(make_engine(model, eos=eos), PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [s.output_ids for s in base] == expected
    eng = make_engine(model, eos=eos, nextn=K, mode=mode)
    seqs = run_to_end(eng, PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [s.output_ids for s in seqs] == expected
    assert all(s.finish_reason == "stop" for s in seqs)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def _oracle_engine(model, K: int, **kw) -> tuple[Engine, OracleDrafter]:
    oracle = OracleDrafter(K, model.config.vocab_size, kw.pop("num_right", None))
    eng = make_engine(model, nextn=K, mode="eagle", drafter=oracle, **kw)
    return eng, oracle


def _run_oracle(eng: Engine, oracle: OracleDrafter, prompt: list[int], horizon: list[int], params):
    seq = eng.add_request(prompt, params)
    oracle.futures[seq.request_id] = prompt + horizon
    while eng.has_unfinished():
        eng.step()
    return seq


def test_eos_in_the_middle_of_a_fully_accepted_block(tiny1_model):
    """Oracle K=3: prefill emits r0, then blocks r1..r4, r5..r8, ... EOS at r6 (2nd token of the 3rd
    step's block): the output is r0..r5, three steps, the last emitting 1 token."""
    prompt = PROMPTS[3]
    ref = reference(tiny1_model, prompt, MAX_TOKENS)
    j = next(i for i in (6, 7, 10, 11, 14, 15) if ref[i] not in ref[:i])
    eng, oracle = _oracle_engine(tiny1_model, 3, eos=(ref[j],))
    seq = _run_oracle(eng, oracle, prompt, ref, SamplingParams(max_tokens=MAX_TOKENS))
    assert seq.output_ids == ref[:j] and seq.finish_reason == "stop"
    steps = 1 + (j - 1) // 4 + 1
    assert seq.stats.num_steps == steps
    assert seq.stats.num_output_tokens == j


@pytest.mark.parametrize("max_tokens,steps", [(1, 1), (2, 2), (5, 2), (6, 3), (7, 3), (9, 3), (10, 4)])
def test_max_tokens_cuts_a_block(tiny1_model, max_tokens, steps):
    """Oracle K=3: tokens after each step are 1, 5, 9, 13, ...; max_tokens cuts the block it falls in."""
    prompt = PROMPTS[2]
    ref = reference(tiny1_model, prompt, 16)
    eng, oracle = _oracle_engine(tiny1_model, 3)
    seq = _run_oracle(eng, oracle, prompt, ref, greedy(max_tokens))
    assert seq.output_ids == ref[:max_tokens] and seq.finish_reason == "length"
    assert seq.stats.num_steps == steps
    assert oracle.calls == steps - 1            # no drafts are proposed for a finished request
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("ckpt,mode", [("tiny1", "eagle"), ("tiny3", "vanilla")])
def test_max_tokens_one_and_max_seq_len_with_real_mtp(models, ckpt, mode):
    model = models[ckpt]
    eng = make_engine(model, nextn=3, mode=mode)
    seqs = run_to_end(eng, PROMPTS, greedy(1))
    assert [s.output_ids for s in seqs] == [reference(model, p, MAX_TOKENS)[:1] for p in PROMPTS]
    assert eng.num_steps == 1
    # max_seq_len cuts inside a block: prompt of 9 + 10 generated = 19
    eng = make_engine(model, nextn=3, mode=mode, max_seq_len=19)
    seq = run_to_end(eng, [PROMPTS[3]], greedy(MAX_TOKENS))[0]
    assert seq.output_ids == reference(model, PROMPTS[3], MAX_TOKENS)[:10] and seq.finish_reason == "length"
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


# ---- forced drafters -------------------------------------------------------------------------

@pytest.mark.parametrize("K,steps", [(1, 7), (3, 4), (5, 3)])
def test_oracle_drafter_gives_al_k_plus_one(tiny1_model, K, steps):
    """13 tokens: prefill emits 1, each decode step K+1 -> steps = 1 + ceil(12 / (K+1))."""
    prompt = PROMPTS[4]
    ref = reference(tiny1_model, prompt, 13 + 6)                 # drafts past the end are right too
    eng, oracle = _oracle_engine(tiny1_model, K)
    seq = _run_oracle(eng, oracle, prompt, ref, greedy(13))
    assert seq.output_ids == ref[:13]
    st = seq.stats
    assert st.num_steps == steps
    assert st.acceptance_length == pytest.approx(13 / steps)
    assert st.num_draft_proposed == K * (steps - 1) and st.draft_acceptance_rate == 1.0
    assert st.acceptance_per_position == [1.0] * K


@pytest.mark.parametrize("K", [1, 4])
def test_always_wrong_drafter_gives_al_one_and_the_same_text(tiny1_model, K):
    prompt = PROMPTS[5]
    ref = reference(tiny1_model, prompt, 12)
    eng, oracle = _oracle_engine(tiny1_model, K, num_right=lambda seq: 0)
    seq = _run_oracle(eng, oracle, prompt, ref, greedy(12))
    assert seq.output_ids == ref
    assert seq.stats.acceptance_length == 1.0 and seq.stats.num_steps == 12
    assert seq.stats.num_draft_accepted == 0 and seq.stats.num_draft_proposed == 11 * K


def test_partial_acceptance_pattern_statistics(tiny1_model):
    """K=3, right drafts per step cycle 0,1,2,3 -> emitted 1,2,3,4: 11 tokens in 1 + 4 steps.
    Per position accepted: pos0 in 3 of 4 steps, pos1 in 2, pos2 in 1."""
    prompt = PROMPTS[1]
    ref = reference(tiny1_model, prompt, 11)
    eng, oracle = _oracle_engine(tiny1_model, 3, num_right=cycling([0, 1, 2, 3]))
    seq = _run_oracle(eng, oracle, prompt, ref, greedy(11))
    assert seq.output_ids == ref
    st = seq.stats
    assert st.num_steps == 5 and st.acceptance_length == pytest.approx(11 / 5)
    assert (st.num_draft_proposed, st.num_draft_accepted) == (12, 6)
    assert st.acceptance_per_position == pytest.approx([0.75, 0.5, 0.25])


# ---- Vanilla windows -------------------------------------------------------------------------

def _dense_hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.forward_dense(torch.tensor([ids]))[0]           # [S, H]


def _window_tokens(seq) -> list[int]:
    """The tokens at the positions whose main hidden states the Vanilla window holds (the last valid ones)."""
    nc = seq.kv.num_cached
    return seq.all_ids[nc - len(seq.mtp.window_hidden):nc]


@pytest.mark.parametrize("K,accepted,window", [
    # prompt 5 6 7 8 9, outputs o0 o1 o2 ...; window after the first decode step with `accepted` drafts
    (1, 0, ["o0"]), (1, 1, ["o1"]),
    (3, 0, [8, 9, "o0"]), (3, 1, [9, "o0", "o1"]), (3, 2, ["o0", "o1", "o2"]), (3, 3, ["o1", "o2", "o3"]),
    (2, 2, ["o1", "o2"]),
])
def test_vanilla_window_table(tiny3_model, K, accepted, window):
    model, prompt = tiny3_model, [5, 6, 7, 8, 9]
    ref = reference(model, prompt, 12)
    name = {f"o{i}": t for i, t in enumerate(ref)}
    eng = make_engine(model, nextn=K, mode="vanilla")
    oracle = OracleDrafter(K, model.config.vocab_size, lambda seq: accepted)
    eng.spec.drafter = ControlledDrafter(eng.spec.drafter, oracle)
    seq = eng.add_request(prompt, greedy(12))
    oracle.futures[seq.request_id] = prompt + ref
    eng.step()                                                        # prefill
    assert _window_tokens(seq) == prompt[-K:]                         # K=1: [9], K=3: [7, 8, 9]
    dense = _dense_hidden(model, prompt)
    assert torch.allclose(seq.mtp.window_hidden, dense[-K:], atol=1e-5)
    eng.step()                                                        # decode with `accepted` right drafts
    assert seq.kv.num_cached == len(prompt) + accepted + 1
    assert _window_tokens(seq) == [name[t] if isinstance(t, str) else t for t in window]
    nc = seq.kv.num_cached
    dense = _dense_hidden(model, seq.all_ids[:nc])
    assert torch.allclose(seq.mtp.window_hidden, dense[nc - K:nc], atol=1e-5)


# ---- rewind: every cache equals a fresh recompute of the accepted prefix ----------------------

def _gather(eng: Engine, seq, n: int) -> list[torch.Tensor]:
    bs = eng.blocks.tokens_per_block
    slots = torch.tensor([seq.kv.block_table[q // bs] * bs + q % bs for q in range(n)])
    return [c.view(-1, c.shape[-1])[slots] for c in eng.caches]      # per layer [n, D]


def _definition(model, ids: list[int], n: int, num_mtp: int) -> list[torch.Tensor]:
    """Independent dense recompute of what every cache must hold at positions 0..n-1 (per layer [n, D]):
    main layer i: the latent [c_kv | roped k_pe] (DSA: + the index key) of layer i's input; MTP module k: that of its
    input built from (token ids[q+1], final-normed main hidden h_q)."""
    rope = model.rope
    with torch.inference_mode():
        cos, sin = rope.cos_sin(torch.arange(n))
        x = model.model.embed_tokens(torch.tensor([ids[:n]]))                       # [1, n, H]
        out = []
        for i in range(model.num_main_layers):
            layer = model.model.layers[i]
            out.append(layer.self_attn.cache_row(layer.input_layernorm(x), rope, cos, sin)[0])
            x = layer.block(x, rope, cos, sin, None, None)
        h = model.model.norm(x)                                                     # [1, n, H]
        e = model.model.embed_tokens(torch.tensor([ids[1:n + 1]]))
        for k in range(num_mtp):
            m = model.mtp_module(k)
            xm = m.eh_proj(torch.cat([m.enorm(e), m.hnorm(h)], dim=-1))
            out.append(m.self_attn.cache_row(m.input_layernorm(xm), rope, cos, sin)[0])
    return out


def _check_caches(model, eng: Engine, seqs, mode: str, K: int) -> None:
    """Every cache of every unfinished sequence, positions 0..num_cached-1, equals (a) a fresh engine's
    prefill of the same tokens and (b) the dense recompute from the definition."""
    num_mtp = 1 if mode == "eagle" else K
    for s in seqs:
        nc = s.kv.num_cached
        if s.is_finished or nc == 0:
            continue
        fresh = make_engine(model, nextn=K, mode=mode, tokens_per_block=4)
        f = fresh.add_request(s.all_ids[:nc], greedy(2))
        fresh.step()
        if nc == s.kv.prefill_target and s.output_ids:                 # prefill done: same bonus token
            assert f.output_ids == [s.all_ids[nc]]
        cached = _gather(eng, s, nc)
        if len(s.all_ids) > nc and f.output_ids == [s.all_ids[nc]]:
            for layer, (a, b) in enumerate(zip(cached, _gather(fresh, f, nc))):
                assert torch.allclose(a, b, atol=1e-5), f"layer {layer}: max diff {(a - b).abs().max():.2e}"
        for layer, want in enumerate(_definition(model, s.all_ids, nc, num_mtp)):
            a = cached[layer]
            assert torch.allclose(a, want, atol=1e-5), f"layer {layer}: max diff {(a - want).abs().max():.2e}"


@pytest.mark.parametrize("ckpt,mode,K,pattern,budget", [
    ("tiny1", "eagle", 3, None, None),
    ("tiny1", "eagle", 3, [2, 0, 3, 1], 12),
    ("tiny1", "eagle", 1, [0, 1, 1, 0], None),
    ("tiny3", "vanilla", 3, None, None),
    ("tiny3", "vanilla", 3, [1, 3, 0, 2], 12),
    ("tiny3", "vanilla", 3, [3, 1, 2, 0], 6),       # prefill chunks shorter than K
    ("tiny3", "vanilla", 2, [2, 0, 1], None),
])
@pytest.mark.parametrize("overlap", [False, True])
def test_rewind_leaves_caches_equal_to_a_fresh_prefill(models, ckpt, mode, K, pattern, budget, overlap):
    model = models[ckpt]
    eng = make_engine(model, nextn=K, mode=mode, tokens_per_block=4, enable_chunked_prefill=budget is not None,
                      max_num_tokens=budget or 8192, disable_overlap_scheduler=not overlap)
    prompts = [PROMPTS[2], PROMPTS[4], PROMPTS[0]]
    oracle = None
    if pattern is not None:
        oracle = OracleDrafter(K, model.config.vocab_size, cycling(pattern))
        eng.spec.drafter = ControlledDrafter(eng.spec.drafter, oracle)
    seqs = [eng.add_request(p, greedy(40)) for p in prompts]
    if oracle:
        for p, s in zip(prompts, seqs):
            oracle.futures[s.request_id] = p + reference(model, p, 60)
    for _ in range(8):
        eng.step()
        for s in seqs:
            if not overlap:
                assert len(s.kv.block_table) == eng.blocks.blocks_for(s.kv.num_cached)   # rewind returned the tail
            else:
                # overlap: the tail may stay reserved for the next step (K+1 slots + K-1 overshoot), never more
                kv = s.kv
                assert eng.blocks.blocks_for(kv.num_cached) <= len(kv.block_table) \
                    <= eng.blocks.blocks_for(max(kv.num_cached + 2 * K, kv.num_prefilled + budget + K if budget else 0))
    assert any(s.stats.num_draft_accepted for s in seqs)
    assert any(s.stats.num_draft_accepted < s.stats.num_draft_proposed for s in seqs)
    assert seqs[0].kv.num_cached > len(prompts[0]) and not any(s.is_finished for s in seqs)
    _check_caches(model, eng, seqs, mode, K)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vanilla=st.booleans(), K=st.integers(1, 3), pattern=st.lists(st.integers(0, 3), min_size=1, max_size=5),
       budget=st.sampled_from([None, 5, 9]), steps=st.integers(2, 9), first=st.integers(0, len(PROMPTS) - 1))
def test_random_acceptance_patterns_keep_every_cache_exact(models, vanilla, K, pattern, budget, steps, first):
    mode, model = ("vanilla", models["tiny3"]) if vanilla else ("eagle", models["tiny1"])
    eng = make_engine(model, nextn=K, mode=mode, tokens_per_block=4, enable_chunked_prefill=budget is not None,
                      max_num_tokens=budget or 8192)
    oracle = OracleDrafter(K, model.config.vocab_size, cycling(pattern))
    eng.spec.drafter = ControlledDrafter(eng.spec.drafter, oracle)
    prompts = [PROMPTS[first], PROMPTS[(first + 3) % len(PROMPTS)]]
    seqs = [eng.add_request(p, greedy(30)) for p in prompts]
    for p, s in zip(prompts, seqs):
        oracle.futures[s.request_id] = p + reference(model, p, 40)
    for _ in range(steps):
        eng.step()
    for p, s in zip(prompts, seqs):
        assert s.output_ids == reference(model, p, 40)[: len(s.output_ids)]
    _check_caches(model, eng, seqs, mode, K)


# ---- relaxed acceptance through the engine (thinking phase) ----------------------------------

X = 300       # a forced draft token


class FixedDrafter:
    def __init__(self, drafts: list[int]) -> None:
        self.drafts, self.num_draft_tokens = drafts, len(drafts)

    def propose(self, rows):
        return [list(self.drafts) if r.needs_drafts else [] for r in rows]


def _relaxed_engine(model, drafts: list[int], think_ids=THINK_IDS) -> Engine:
    # top-V with delta 1.0 counts every token: in thinking every draft is accepted
    spec = dict(use_relaxed_acceptance_for_thinking=True, relaxed_topk=model.config.vocab_size, relaxed_delta=1.0)
    return make_engine(model, think_ids=think_ids, drafter=FixedDrafter(drafts), nextn=len(drafts),
                       mode="eagle", spec=spec)


def test_thinking_entered_by_prompt_and_left_by_emitted_end_token(tiny1_model):
    model, think, end = tiny1_model, THINK_IDS[0], THINK_IDS[1]
    prompt = [120, 220, think]                                         # R1's template ends with <think>
    eng = _relaxed_engine(model, [X, end, X])
    seq = run_to_end(eng, [prompt], greedy(14))[0]
    t0 = reference(model, prompt, 1)[0]
    # step 2 is relaxed: all three drafts accepted, even X after </think> (the change waits a step)
    head = [t0, X, end, X]
    assert seq.output_ids[:4] == head
    # from step 3 on strict: the rest is the greedy continuation of what was emitted
    cont = reference(model, prompt + head, 10)
    assert think not in cont and end not in cont                       # precondition of this prompt
    assert seq.output_ids[4:] == cont
    assert not seq.decoding.in_thinking


def test_thinking_reentered_when_the_model_emits_think(tiny1_model):
    """Same as above with a prompt whose greedy continuation emits <think> itself: decoding is strict
    (lossless) up to and including that token, and the next step is relaxed again."""
    model, think, end = tiny1_model, THINK_IDS[0], THINK_IDS[1]
    prompt = [100, 200, think]
    head = [reference(model, prompt, 1)[0], X, end, X]
    cont = reference(model, prompt + head, 10)
    k = cont.index(think)                                              # the model emits <think> here
    eng = _relaxed_engine(model, [X, end, X])
    seq = run_to_end(eng, [prompt], greedy(4 + k + 4))[0]
    assert seq.output_ids[:4] == head
    assert seq.output_ids[4: 5 + k] == cont[: k + 1]
    assert seq.output_ids[5 + k: 8 + k] == [X, end, X]


@pytest.mark.parametrize("prompt", [[100, 200, 300], [100, THINK_IDS[0], 200, THINK_IDS[1], 300]])
def test_outside_thinking_relaxed_is_not_applied(tiny1_model, prompt):
    eng = _relaxed_engine(tiny1_model, [X, X, X])
    seq = run_to_end(eng, [prompt], greedy(12))[0]
    assert seq.output_ids == reference(tiny1_model, prompt, 12)


def test_thinking_and_non_thinking_rows_in_one_batch(tiny1_model):
    model, think, end = tiny1_model, THINK_IDS[0], THINK_IDS[1]
    thinking, plain = [120, 220, think], [100, 200, 300]
    eng = _relaxed_engine(model, [X, end, X])
    a, b = run_to_end(eng, [thinking, plain], greedy(14))
    head = [reference(model, thinking, 1)[0], X, end, X]
    assert a.output_ids == head + reference(model, thinking + head, 10)
    assert b.output_ids == reference(model, plain, 14)


def test_thinking_entered_by_an_emitted_start_token(tiny1_model):
    """Use as '<think>' a token the greedy run emits at index j: up to j decoding is strict (lossless);
    the step after it is relaxed and accepts all three X drafts."""
    model, prompt = tiny1_model, PROMPTS[3]
    ref = reference(model, prompt, 16)
    assert X not in ref
    j = next(i for i in range(2, 12) if ref[i] not in ref[:i] and ref[i] not in prompt)
    eng = _relaxed_engine(model, [X, X, X], think_ids=(ref[j], THINK_IDS[1]))
    seq = run_to_end(eng, [prompt], greedy(16))[0]
    assert seq.output_ids[: j + 1] == ref[: j + 1]
    assert seq.output_ids[j + 1: j + 4] == [X, X, X]
    assert seq.decoding.in_thinking


def test_relaxed_without_think_tokens_is_refused(tiny1_model, tiny1_dir, tmp_path, make_llm):
    spec = dict(use_relaxed_acceptance_for_thinking=True, relaxed_topk=10, relaxed_delta=0.6)
    with pytest.raises(ValueError, match="think"):
        Engine(tiny1_model, llm_config(nextn=1, spec=spec), [2], None)
    # a checkpoint whose tokenizer has no <think>/</think>
    d = tmp_path / "no_think"
    shutil.copytree(tiny1_dir, d)
    tok = json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
    rename = {"<think>": "<reflect>", "</think>": "</reflect>"}
    for t in tok["added_tokens"]:
        t["content"] = rename.get(t["content"], t["content"])
    tok["model"]["vocab"] = {rename.get(k, k): v for k, v in tok["model"]["vocab"].items()}
    (d / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(ValueError, match="think"):
        make_llm(d, nextn=1, spec=spec)
    assert make_llm(d, nextn=1).tokenizer.think_token_ids() is None    # fine without relaxed


# ---- sampling: seeded runs repeat ------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_sampling_on_cuda(tiny1_dir):
    from mtp_core.loader import load_model
    model = load_model(tiny1_dir, "float32", "cuda", make_model=DeepseekV3ForCausalLM)[0]
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    runs = [run_to_end(make_engine(model, nextn=2, mode="eagle", device="cuda"), [PROMPTS[2]], params)[0]
            for _ in range(2)]
    assert runs[0].output_ids == runs[1].output_ids and len(runs[0].output_ids) == 8


@pytest.mark.parametrize("nextn,mode", [(0, "auto"), (2, "eagle"), (3, "vanilla")])
def test_seeded_sampling_repeats_exactly(tiny3_model, nextn, mode):
    prompts = [PROMPTS[2], PROMPTS[6]]

    def run(seed: int) -> list[list[int]]:
        eng = make_engine(tiny3_model, nextn=nextn, mode=mode)
        params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, seed=seed, ignore_eos=True)
        return [s.output_ids for s in run_to_end(eng, prompts, params)]

    a, b, c = run(11), run(11), run(12)
    assert a == b
    assert a != c
    assert all(len(x) == 16 for x in a)

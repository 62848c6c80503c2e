"""Logprobs and logits processing (penalties, logit_bias, min_tokens, min_p) inside the engine, exact under MTP.

The backbone invariant: greedy decoding with MTP (Eagle and Vanilla) emits token for token what plain decoding
emits, and the logprobs reported for each emitted token are bitwise the same (float32 on the CPU; the forward
is batch-invariant, so an accepted draft's verify logits are the logits plain decoding computes there).
Penalties apply per position of a verify row: position i sees the counts after drafts 1..i; the hand tables
below check that against numbers worked out by hand, with a penalty that rejects a draft.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import EOS_ID, PROMPTS, greedy, make_engine, run_to_end
from mtp_core.sampling import SamplingParams, process_logits, target_probs, token_logprobs
from mtp_core.speculative.verifier import STRICT, verify

MAX_TOKENS = 20
ENGINES = [("tiny1", 0, "auto"), ("tiny1", 2, "eagle"), ("tiny1", 3, "eagle"), ("tiny3", 3, "vanilla")]


def _run(models, ckpt: str, nextn: int, mode: str, params: SamplingParams, prompts=PROMPTS, **kw):
    eng = make_engine(models[ckpt], nextn=nextn, mode=mode, max_batch_size=4, **kw)
    return eng, run_to_end(eng, prompts, params)


# ---- hand tables --------------------------------------------------------------------------------

def test_frequency_penalty_table_sees_the_drafts_before_each_position() -> None:
    # the docstring's worked example: output [2], drafts [2]
    logits = torch.tensor([[1.0, 1.0, 3.0, 0.0], [1.0, 1.0, 3.0, 0.0]])
    p = SamplingParams(frequency_penalty=1.0)
    out = process_logits(logits, p, prompt_ids=[0], output_ids=[2], drafts=[2], stop_ids=[])
    assert out.tolist() == [[1.0, 1.0, 2.0, 0.0], [1.0, 1.0, 1.0, 0.0]]


def test_presence_and_repetition_tables() -> None:
    logits = torch.tensor([[2.0, -1.0, 1.5, 0.5]] * 3)
    # presence 0.75 over the output: position 0 sees {3}, position 1 {3, 0} (draft 1 = 0), position 2 the same
    out = process_logits(logits, SamplingParams(presence_penalty=0.75), [1], [3], [0, 0], [])
    assert out.tolist() == [[2.0, -1.0, 1.5, -0.25], [1.25, -1.0, 1.5, -0.25], [1.25, -1.0, 1.5, -0.25]]
    # repetition 2 over prompt {1} and output: positive logits halve, negative ones double
    out = process_logits(logits, SamplingParams(repetition_penalty=2.0), [1], [], [2, 0], [])
    assert out.tolist() == [[2.0, -2.0, 1.5, 0.5], [2.0, -2.0, 0.75, 0.5], [1.0, -2.0, 0.75, 0.5]]


def test_logit_bias_and_min_tokens_tables() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    out = process_logits(logits, SamplingParams(logit_bias={0: 5.0, 3: -100.0}), [1], [], [2, 2], [])
    assert out.tolist() == [[5.0, 1.0, 2.0, -97.0]] * 3
    # min_tokens 3 with 1 token out already: positions 0 and 1 (tokens 2 and 3) cannot stop; position 2 can
    out = process_logits(logits, SamplingParams(min_tokens=3, max_tokens=8), [1], [0], [1, 1], [3])
    inf = float("-inf")
    assert out.tolist() == [[0.0, 1.0, 2.0, inf], [0.0, 1.0, 2.0, inf], [0.0, 1.0, 2.0, 3.0]]


def test_a_penalty_rejects_a_draft_in_the_verify_row() -> None:
    """Row [t=2, d1=2, d2=2], raw logits [0, 3, 5, 0] at every position: without a penalty the targets are
    2, 2, 2, so both drafts are accepted and the row emits 2, 2, 2. With frequency 1.5 and output [2]:
      position 0 sees {2: 1}: [0, 3, 3.5, 0] -> 2 = d1, accepted
      position 1 sees {2: 2}: [0, 3, 2.0, 0] -> 1 != d2, rejected; the bonus is 1
    so the row emits 2, 1: what plain decoding emits (2, then 1 once the output is [2, 2])."""
    raw = torch.tensor([[[0.0, 3.0, 5.0, 0.0]] * 3])
    drafts = torch.tensor([[2, 2]])
    assert verify(raw, drafts, [STRICT], [None]).tokens == [[2, 2, 2]]
    p = SamplingParams(frequency_penalty=1.5)
    processed = process_logits(raw[0], p, [0], [2], [2, 2], [])
    assert processed.tolist() == [[0.0, 3.0, 3.5, 0.0], [0.0, 3.0, 2.0, 0.0], [0.0, 3.0, 0.5, 0.0]]
    assert verify(processed.unsqueeze(0), drafts, [STRICT], [None]).tokens == [[2, 1]]
    # plain decoding, one position at a time, makes the same two choices
    assert int(process_logits(raw[0, :1], p, [0], [2], [], []).argmax()) == 2
    assert int(process_logits(raw[0, :1], p, [0], [2, 2], [], []).argmax()) == 1


def test_token_logprobs_table() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4]]))
    got = token_logprobs(logits, [1, 3], 2)
    assert [g[0] for g in got] == [1, 3]
    assert abs(got[0][1] - torch.log(torch.tensor(0.25)).item()) < 1e-6
    assert [i for i, _ in got[0][2]] == [0, 1] and [i for i, _ in got[1][2]] == [3, 2]
    assert token_logprobs(logits, [2], 0)[0][2] == []


def test_min_p_drops_the_tail_of_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.25))      # keep p >= 0.125
    assert probs[0, 3].item() == 0.0 and abs(probs[0, :3].sum().item() - 1.0) < 1e-6
    assert abs(probs[0, 0].item() - 0.5 / 0.95) < 1e-6


# ---- the engine: MTP on equals MTP off -------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_logprobs(models):
    _, seqs = _run(models, "tiny1", 0, "auto", greedy(MAX_TOKENS, logprobs=5))
    return seqs


@pytest.mark.parametrize("ckpt,nextn,mode", ENGINES)
def test_greedy_logprobs_identical_with_and_without_mtp(models, ckpt, nextn, mode) -> None:
    ref_eng, ref = _run(models, ckpt, 0, "auto", greedy(MAX_TOKENS, logprobs=5))
    eng, seqs = _run(models, ckpt, nextn, mode, greedy(MAX_TOKENS, logprobs=5))
    for a, b in zip(ref, seqs):
        assert a.output_ids == b.output_ids
        assert len(b.returned.logprobs) == len(b.output_ids) == MAX_TOKENS
        assert a.returned.logprobs == b.returned.logprobs         # bitwise: floats compared exactly
        assert [e[0] for e in b.returned.logprobs] == b.output_ids
        assert all(len(e[2]) == 5 and e[2][0][1] >= e[1] for e in b.returned.logprobs)
    if nextn:
        assert eng.stats.num_draft_accepted > 0                   # drafts were accepted, so verify rows scored them
    # logprobs do not change the tokens
    _, plain = _run(models, ckpt, nextn, mode, greedy(MAX_TOKENS))
    assert [s.output_ids for s in plain] == [s.output_ids for s in seqs]


@pytest.mark.parametrize("ckpt,nextn,mode", ENGINES)
def test_prompt_logprobs_identical_with_and_without_mtp(models, ckpt, nextn, mode) -> None:
    ps = greedy(4, logprobs=2, prompt_logprobs=3)
    _, ref = _run(models, ckpt, 0, "auto", ps, enable_chunked_prefill=True, max_num_tokens=8)
    _, seqs = _run(models, ckpt, nextn, mode, ps)
    for p, a, b in zip(PROMPTS, ref, seqs):
        assert len(b.returned.prompt_logprobs) == len(p) and b.returned.prompt_logprobs[0] is None
        assert [e[0] for e in b.returned.prompt_logprobs[1:]] == p[1:]
        # chunks of 8 tokens or the whole prompt at once: the same logits
        assert a.returned.prompt_logprobs == b.returned.prompt_logprobs and a.returned.logprobs == b.returned.logprobs


def test_prompt_logprobs_skip_the_prefix_cache(models) -> None:
    eng = make_engine(models["tiny1"], nextn=2, mode="eagle", max_batch_size=2)     # block reuse is on
    prompt = list(range(100, 140))
    first = run_to_end(eng, [prompt], greedy(2, prompt_logprobs=0))[0]
    again = run_to_end(eng, [prompt], greedy(2, prompt_logprobs=0))[0]
    assert len(again.returned.prompt_logprobs) == len(prompt)
    assert again.returned.prompt_logprobs == first.returned.prompt_logprobs
    assert eng.blocks.stats.reused_tokens == 0            # every position computed, so every one scored
    plain = run_to_end(eng, [prompt], greedy(2))[0]
    assert plain.output_ids == first.output_ids
    assert eng.blocks.stats.reused_tokens > 0             # ... while a plain request maps the cached prefix


PENALTIES = [
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0),
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=-0.5, presence_penalty=0.5, repetition_penalty=1.3),
    dict(logit_bias={208: -100.0, 453: -100.0, 77: 0.5}),
    dict(min_tokens=10),
]


@pytest.mark.parametrize("ckpt,nextn,mode", ENGINES[1:])
@pytest.mark.parametrize("pen", PENALTIES, ids=[",".join(p) for p in PENALTIES])
def test_greedy_with_penalties_identical_with_and_without_mtp(models, ckpt, nextn, mode, pen) -> None:
    ps = SamplingParams(max_tokens=MAX_TOKENS, logprobs=1, **pen)
    ps.ignore_eos = "min_tokens" not in pen
    _, ref = _run(models, ckpt, 0, "auto", ps)
    eng, seqs = _run(models, ckpt, nextn, mode, ps)
    _, unpenalized = _run(models, ckpt, 0, "auto", replace(ps, **{k: SamplingParams.__dataclass_fields__[k].default
                                                                   for k in pen if k != "logit_bias"},
                                                           logit_bias={}))
    assert [s.output_ids for s in seqs] == [s.output_ids for s in ref]
    assert [s.returned.logprobs for s in seqs] == [s.returned.logprobs for s in ref]
    if "min_tokens" not in pen:          # (min_tokens: test_min_tokens_holds_back_eos)
        assert [s.output_ids for s in seqs] != [s.output_ids for s in unpenalized]     # the penalty changed something
    assert eng.stats.num_draft_accepted > 0


def test_min_tokens_holds_back_eos(models) -> None:
    # a logit_bias that makes EOS the greedy choice everywhere: min_tokens decides the length
    ps = SamplingParams(max_tokens=12, logit_bias={EOS_ID: 100.0}, min_tokens=5)
    for nextn, mode in ((0, "auto"), (2, "eagle")):
        _, seqs = _run(models, "tiny1", nextn, mode, ps)
        assert all(len(s.output_ids) == 5 and s.finish_reason == "stop" for s in seqs)
    _, seqs = _run(models, "tiny1", 2, "eagle", replace(ps, min_tokens=0))
    assert all(len(s.output_ids) == 0 for s in seqs)


def test_logit_bias_forces_a_token(models) -> None:
    ps = greedy(6, logit_bias={321: 100.0})
    _, seqs = _run(models, "tiny1", 2, "eagle", ps)
    assert all(s.output_ids == [321] * 6 for s in seqs)


def test_sampled_penalties_are_seeded_and_reproducible(models) -> None:
    ps = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, ignore_eos=True, frequency_penalty=1.0,
                        min_p=0.05, logprobs=0)
    _, a = _run(models, "tiny1", 2, "eagle", ps)
    _, b = _run(models, "tiny1", 2, "eagle", ps)
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    assert [s.returned.logprobs for s in a] == [s.returned.logprobs for s in b]


@pytest.mark.parametrize("ckpt,nextn,mode", ENGINES[1:])
def test_mixed_batch_keeps_every_request_exact(models, ckpt, nextn, mode) -> None:
    """Requests with logprobs or a penalty take the whole batch off the fused native step: the others' tokens
    do not change (batch invariance), and each request equals its run alone without MTP."""
    kinds = [greedy(MAX_TOKENS), greedy(MAX_TOKENS, logprobs=2), greedy(MAX_TOKENS, frequency_penalty=1.0),
             greedy(MAX_TOKENS, repetition_penalty=1.5, logprobs=0)]
    plist = [kinds[i % 4] for i in range(len(PROMPTS))]
    eng = make_engine(models[ckpt], nextn=nextn, mode=mode, max_batch_size=8)
    mixed = run_to_end(eng, PROMPTS, plist)
    for p, sp, s in zip(PROMPTS, plist, mixed):
        alone = run_to_end(make_engine(models[ckpt], max_batch_size=1), [p], sp)[0]
        assert s.output_ids == alone.output_ids and s.returned.logprobs == alone.returned.logprobs

"""Structured output (xgrammar) exact under MTP: the grammar's mask at every verify position, drafts it
forbids rejected, the matcher rolled back with the row; greedy output with MTP equals greedy output
without it, and always parses and validates."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import llm_config
from test_native_step import on_the_call
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams
from mtp_core.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from mtp_core.structured import GrammarBackend, verify_guided_row  # noqa: E402

N, O, X, Y, NO = 84, 85, 94, 95, 466          # "n", "o", "x", "y", "no" in the tiny tokenizer


@pytest.fixture(scope="module")
def backend(tiny1_dir) -> GrammarBackend:
    tok = Tokenizer.from_dir(tiny1_dir)
    assert [tok.encode(s, add_special_tokens=False) for s in ("n", "o", "x", "y", "no")] == [[N], [O], [X], [Y], [NO]]
    return GrammarBackend(tok, 512, [2], 4, forbid=(5, 6))


def _yes_no_row(backend):
    """The choice grammar {"yes", "no"}, logits over a row [t, d1, d2] that favour "x" everywhere ("n" second at
    position 0, "o" at position 1), and the matcher's first mask (to check the matcher ends where it began)."""
    m = backend.matcher(("choice", json.dumps(["yes", "no"])))
    logits = torch.zeros(3, 512)
    logits[:, X] = 5.0
    logits[0, N] = 3.0
    logits[1, O] = 1.0
    before = backend.new_bitmask()
    m.matcher.fill_next_token_bitmask(before)
    return m, logits, before


def test_a_grammar_mask_rejects_a_draft_in_the_verify_row(backend) -> None:
    """Choice grammar {"yes", "no"}; row [t, d1 = "n", d2 = "x"]; logits favour "x" everywhere:
      position 0: allowed "y", "n", "no", ...; x 5 is masked; n 3 is the masked argmax = d1, accepted
      position 1: after "n" only "o" is allowed; the masked argmax is "o" != d2: the row emits "n", "o"."""
    m, logits, before = _yes_no_row(backend)
    out = verify_guided_row(backend, m, logits, [N, X], SamplingParams(), None, False, None)
    assert out == [N, O]
    assert int(logits[0].argmax()) == X                      # unmasked, the first position would pick "x"
    after = backend.new_bitmask()
    m.matcher.fill_next_token_bitmask(after)
    assert torch.equal(before, after)                        # rolled back: the matcher is where it was
    # both drafts right: "n" then "o" accepted, the bonus is the stop token (the grammar is complete)
    logits2 = torch.zeros(3, 512)
    logits2[0, N], logits2[1, O] = 3.0, 3.0
    assert verify_guided_row(backend, m, logits2, [N, O], SamplingParams(), None, False, None) == [N, O, 2]
    # inside <think> ... </think> the text is free: no mask until </think>
    assert verify_guided_row(backend, m, logits, [X, 6], SamplingParams(), None, True, (5, 6))[0] == X


SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog", "fish"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["ok", "kind", "n", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("ckpt,nextn,mode", [("tiny1", 2, "eagle"), ("tiny1", 3, "eagle"), ("tiny3", 3, "vanilla")])
def test_greedy_json_schema_identical_with_and_without_mtp(tiny1_dir, tiny3_dir, ckpt, nextn, mode) -> None:
    d = tiny1_dir if ckpt == "tiny1" else tiny3_dir
    prompts = ["Hello, my name is", "The capital of France is", "def fib(n):", "1 2 3 4"]
    accepted = 0
    for guided in (("json_schema", json.dumps(SCHEMA)), ("json_object", ""), ("choice", json.dumps(["alpha", "beta"])),
                   ("regex", r"[a-f]{2,5}-[0-9]{1,3}"),
                   ("regex", r"[^{}]*")):         # a loose grammar: the drafts often fit it
        ps = SamplingParams(max_tokens=100, guided=guided, logprobs=1, guided_after_think=True)
        ref = LLM(llm_config(d, 0, max_seq_len=256)).generate(prompts, ps)
        llm = LLM(llm_config(d, nextn, mode=mode, max_seq_len=256))
        out = llm.generate(prompts, ps)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref], guided
        accepted += llm.engine.stats.num_draft_accepted
        for o in out:
            if guided[0] == "json_schema":
                jsonschema.validate(json.loads(o.text), SCHEMA)
            elif guided[0] == "json_object" and o.finish_reason == "stop":
                assert isinstance(json.loads(o.text), dict)
            elif guided[0] == "choice":
                assert o.text in ("alpha", "beta")
            elif guided[0] == "regex":
                import re
                assert re.fullmatch(guided[1], o.text) or o.finish_reason == "length", o.text
    assert accepted > 0                   # drafts were accepted under the masks


def test_a_bad_schema_is_a_value_error(tiny1_dir) -> None:
    llm = LLM(llm_config(tiny1_dir, 2, max_seq_len=64))
    with pytest.raises(ValueError, match="cannot be compiled"):
        llm.engine.add_request([5, 6, 7], SamplingParams(guided=("json_schema", "{not json")))
    with pytest.raises(ValueError, match="ignore_eos"):
        llm.engine.add_request([5, 6, 7], SamplingParams(guided=("json_object", ""), ignore_eos=True))


# ---- the native step: masks prepared along the drafts (guided_masks), verification inside the call -----------------

native = pytest.mark.skipif(not __import__("mtp_core.kernels", fromlist=["x"]).native_ops().cpu,
                            reason="native CPU ops not built")


def native_guided(backend, m, logits: torch.Tensor, t: int, drafts: list[int], thinking: bool = False,
                  think_ids=None) -> list[int]:
    """One row verified as the native step does: guided_masks before, verify_greedy on the masked logits."""
    from mtp_core.engine.native_step import RowLogits, pack_logits_args
    from mtp_core.structured import guided_masks

    args = pack_logits_args([RowLogits(len(drafts) + 1, masks=guided_masks(backend, m, drafts, thinking, think_ids))])
    out = torch.ops.mtp_core.verify_greedy(logits.float().contiguous(), torch.tensor([t] + drafts),
                                           torch.tensor([0, len(drafts) + 1], dtype=torch.int32), **args)[0].tolist()
    return out[1:1 + out[0]]


@native
def test_native_masks_reject_a_draft_as_verify_guided_row(backend) -> None:
    """The choice example inside the native verification: guided_masks walks [n, x]: position 0 has the first
    mask, "n" is accepted (position 1's mask follows it), "x" is rejected after "n", so the row may accept one draft
    at most; the native verification emits "n", "o" as verify_guided_row does, and the matcher is where it was."""
    from mtp_core.structured import guided_masks

    m, logits, before = _yes_no_row(backend)
    masks, has, cap = guided_masks(backend, m, [N, X], False, None)
    assert has == [True, True] and cap == 1
    assert torch.equal(masks[0], before[0] & torch.from_numpy(m.allowed))
    assert native_guided(backend, m, logits, 7, [N, X]) == [N, O] == \
        verify_guided_row(backend, m, logits, [N, X], SamplingParams(), None, False, None)
    after = backend.new_bitmask()
    m.matcher.fill_next_token_bitmask(after)
    assert torch.equal(before, after)
    # <think> (5) is forbidden inside a grammar's text though the regex allows it: its bit is cleared
    loose = backend.matcher(("regex", "[^{}]*"))
    logits = torch.zeros(2, 512)
    logits[:, 5] = 9.0
    logits[:, X] = 1.0
    assert native_guided(backend, loose, logits, 7, [X]) == [X, X] == \
        verify_guided_row(backend, loose, logits, [X], SamplingParams(), None, False, None)


@native
@pytest.mark.parametrize("guided", [("choice", json.dumps(["alpha", "beta", "alphabet"])),
                                    ("regex", r"[a-f]{2,5}-[0-9]{1,3}"), ("json_schema", json.dumps(SCHEMA)),
                                    ("json_object", "")])
def test_native_guided_rows_equal_verify_guided_row_on_random_walks(backend, guided) -> None:
    """Random logits, drafts that follow the masked argmax for a while (then a random token, a stop token or
    <think> / </think>), each row's emitted tokens committed to the matcher as the engine does: the native
    verification emits exactly verify_guided_row's tokens at every step, thinking phases included."""
    import random

    g = random.Random(len(guided[1]))
    think = (5, 6)
    for walk in range(6):
        m = backend.matcher(guided)
        after_think = walk % 2 == 1
        thinking = after_think
        for _ in range(12):
            if not thinking and m.is_terminated():
                break
            k = g.randint(0, 4)
            logits = torch.randn(k + 1, 512, generator=torch.Generator().manual_seed(g.randrange(1 << 30)))
            drafts: list[int] = []
            for i in range(k):
                ref = verify_guided_row(backend, m, logits[:i + 1], drafts, SamplingParams(), None, thinking,
                                        think if after_think else None)
                pick = g.random()
                drafts.append(ref[-1] if pick < 0.75 else g.choice([2, 5, 6]) if pick < 0.85 else g.randrange(512))
            want = verify_guided_row(backend, m, logits, drafts, SamplingParams(), None, thinking,
                                     think if after_think else None)
            got = native_guided(backend, m, logits, 9, drafts, thinking, think if after_think else None)
            assert got == want, (guided, drafts)
            for tok in want:                    # the engine's commit (Sequence.append)
                if tok in backend.stop_ids:
                    break
                if after_think and (thinking or tok in think):
                    thinking = tok == think[0] or (thinking and tok != think[1])
                    continue
                assert m.accept_token(tok)


@native
@pytest.mark.parametrize("ckpt,nextn,mode", [("tiny1", 3, "eagle"), ("tiny3", 3, "vanilla")])
def test_guided_requests_stay_on_the_native_step_and_equal_plain_decoding(tiny1_dir, tiny3_dir, ckpt, nextn,
                                                                          mode) -> None:
    """Grammars (a schema, json_object, choice, a regex, a loose regex) in batches with plain and logprobs requests,
    one prompt starting inside <think> (guided_after_think: its grammar starts after </think>), with the native step:
    every decode step is one native call, and every output (tokens and logprobs) equals the general path's without
    MTP."""
    d = tiny1_dir if ckpt == "tiny1" else tiny3_dir
    prompts = ["Hello, my name is", "The capital of France is", "<think>Let me see", "1 2 3 4"]
    kinds = [SamplingParams(max_tokens=60, guided=g, logprobs=2, guided_after_think=True)
             for g in (("json_schema", json.dumps(SCHEMA)), ("json_object", ""), ("choice", json.dumps(["alpha", "beta"])),
                       ("regex", r"[a-f]{2,5}-[0-9]{1,3}"), ("regex", r"[^{}]*"))]
    kinds += [SamplingParams(max_tokens=60, ignore_eos=True, logprobs=1), SamplingParams(max_tokens=60, ignore_eos=True)]
    plist = [kinds[i % len(kinds)] for i in range(len(kinds) * len(prompts))]
    texts = [prompts[i % len(prompts)] for i in range(len(plist))]
    ref = LLM(llm_config(d, 0, max_seq_len=256, native_step=False)).generate(texts, plist)
    llm = LLM(llm_config(d, nextn, mode=mode, max_seq_len=256, overlap_scheduler_on_cpu=False, max_batch_size=8))
    eng = llm.engine
    general = on_the_call(eng)
    out = llm.generate(texts, plist)
    assert [(o.token_ids, o.logprobs) for o in out] == [(o.token_ids, o.logprobs) for o in ref]
    assert general[0] == 0 and eng.paths.native_step.num_replays > 0 and eng.stats.num_draft_accepted > 0
    assert any(o.finish_reason == "stop" for o in out)

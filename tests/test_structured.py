"""Structured output (xgrammar) exact under MTP: the grammar's mask at every verify position, drafts it
forbids rejected, the matcher rolled back with the row; greedy output with MTP equals greedy output
without it, and always parses and validates."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import llm_config
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


def test_a_grammar_mask_rejects_a_draft_in_the_verify_row(backend) -> None:
    """Choice grammar {"yes", "no"}; row [t, d1 = "n", d2 = "x"]; logits favour "x" everywhere:
      position 0: allowed "y", "n", "no", ...; x 5 is masked; n 3 is the masked argmax = d1, accepted
      position 1: after "n" only "o" is allowed; the masked argmax is "o" != d2: the row emits "n", "o"."""
    m = backend.matcher(("choice", json.dumps(["yes", "no"])))
    logits = torch.zeros(3, 512)
    logits[:, X] = 5.0
    logits[0, N] = 3.0
    logits[1, O] = 1.0
    before = backend.new_bitmask()
    m.matcher.fill_next_token_bitmask(before)
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

"""The OpenAI API surface of `mtp serve` beyond plain text, exact under MTP: logprobs (chat and completions,
streamed, echo with prompt logprobs), n / best_of / prompt lists, penalties, stop_token_ids,
include_stop_str_in_output, role developer, /v1/models/{id}, the accepted-and-ignored fields, structured output
(response_format, structured_outputs), forced tool calls, LangChain's with_structured_output.

Three servers on the tiny checkpoints: MTP Eagle K=2, MTP Vanilla K=3 and no speculation; with
`temperature: 0` every one must give the same text and bitwise the same logprobs (JSON floats round-trip
exactly), through the real `openai` client.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import llm_config
from mtp_core.llm import LLM
from mtp_core.serve.app import build_app
from mtp_core.serve.server import server_in_thread
from mtp_core.serve.tools import MAX_PARALLEL_TOOL_CALLS

PROMPTS = ["Hello, my name is", "The capital of France is", "def fib(n):"]
MAX_SEQ_LEN = 1024                # room for the tool list the chat template renders


@pytest.fixture(scope="module")
def servers(tiny1_dir, tiny3_dir):
    apps = {"plain": build_app(LLM(llm_config(tiny1_dir, 0, max_seq_len=MAX_SEQ_LEN)), "tiny"),
            "eagle": build_app(LLM(llm_config(tiny1_dir, 2, mode="eagle", max_seq_len=MAX_SEQ_LEN)), "tiny"),
            "plain3": build_app(LLM(llm_config(tiny3_dir, 0, max_seq_len=MAX_SEQ_LEN)), "tiny"),
            "vanilla": build_app(LLM(llm_config(tiny3_dir, 3, mode="vanilla", max_seq_len=MAX_SEQ_LEN)), "tiny")}
    with server_in_thread(apps["plain"]) as a, server_in_thread(apps["eagle"]) as b, \
            server_in_thread(apps["plain3"]) as c, server_in_thread(apps["vanilla"]) as d:
        yield {"plain": a, "eagle": b, "plain3": c, "vanilla": d}


PAIRS = [("plain", "eagle"), ("plain3", "vanilla")]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _chat(url: str, **kw):
    return _client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                                **kw)


def _accepted(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("mtp_spec_decode_num_accepted_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no acceptance counter")


# ---- logprobs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("pair", PAIRS, ids=["eagle", "vanilla"])
def test_chat_logprobs_identical_with_and_without_mtp_streamed_or_not(servers, pair) -> None:
    got = {}
    for which in pair:
        url = servers[which]
        r = _chat(url, max_tokens=16, temperature=0, logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == 16
        # the tokens' bytes make the text (a token's own text shows U+FFFD for a piece of a character)
        assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == r.choices[0].message.content
        assert any("\ufffd" in e.token for e in content) or \
            "".join(e.token for e in content) == r.choices[0].message.content
        for e in content:
            assert len(e.top_logprobs) == 4 and e.top_logprobs[0].logprob >= e.logprob
            assert e.top_logprobs[0].token == e.token               # greedy: the top token is the chosen one
            assert e.bytes == list(e.token.encode()) or "\ufffd" in e.token    # (a piece of a character)
        pieces, lps = [], []
        for ev in _chat(url, max_tokens=16, temperature=0, logprobs=True, top_logprobs=4, stream=True,
                        extra_body={"ignore_eos": True}):
            if ev.choices and ev.choices[0].delta.content:
                pieces.append(ev.choices[0].delta.content)
            if ev.choices and ev.choices[0].logprobs:
                lps += ev.choices[0].logprobs.content
        assert "".join(pieces) == r.choices[0].message.content
        assert [e.model_dump() for e in lps] == [e.model_dump() for e in content]
        got[which] = (r.choices[0].message.content, [e.model_dump() for e in content])
    assert got[pair[0]] == got[pair[1]]
    assert _accepted(servers[pair[1]]) > 0


@pytest.mark.parametrize("pair", PAIRS, ids=["eagle", "vanilla"])
def test_completions_logprobs_and_echo_identical_with_and_without_mtp(servers, pair) -> None:
    got = {}
    for which in pair:
        url = servers[which]
        c = _client(url)
        r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=3,
                                 extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
        assert "".join(lp.tokens) == r.choices[0].text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
        # (two ids with the same text share a key)
        assert all(1 <= len(d) <= 4 and max(d.values()) == lp.token_logprobs[i] for i, d in enumerate(lp.top_logprobs))
        stream = list(c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=3,
                                           stream=True, extra_body={"ignore_eos": True}))
        assert "".join(e.choices[0].text for e in stream) == r.choices[0].text
        assert sum((e.choices[0].logprobs.token_logprobs for e in stream if e.choices[0].logprobs), []) \
            == lp.token_logprobs
        # echo: the prompt's tokens first (the first without a logprob), then the completion's
        e = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=3, echo=True,
                                 extra_body={"ignore_eos": True})
        elp = e.choices[0].logprobs
        assert e.choices[0].text == PROMPTS[1] + r.choices[0].text
        n_prompt = e.usage.prompt_tokens
        assert len(elp.tokens) == n_prompt + 12 and elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
        assert elp.token_logprobs[n_prompt:] == lp.token_logprobs
        assert all(isinstance(v, float) for v in elp.token_logprobs[1:])
        # lm-eval-harness's loglikelihood request: echo, max_tokens 0 (or 1), logprobs 1
        z = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=0, temperature=0, logprobs=1, echo=True)
        assert z.choices[0].text == PROMPTS[1] and z.usage.completion_tokens == 0
        assert z.choices[0].logprobs.token_logprobs == elp.token_logprobs[:n_prompt]
        ze = list(c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=0, temperature=0, logprobs=1,
                                       echo=True, stream=True))
        assert "".join(x.choices[0].text for x in ze) == PROMPTS[1]
        assert sum((x.choices[0].logprobs.token_logprobs for x in ze if x.choices[0].logprobs), []) \
            == elp.token_logprobs[:n_prompt]
        got[which] = (r.choices[0].text, lp.token_logprobs, lp.top_logprobs, elp.token_logprobs)
    assert got[pair[0]] == got[pair[1]]


def test_logprob_of_a_prompt_token_equals_the_generated_one(servers) -> None:
    """Echo of (prompt + its greedy continuation) scores the continuation's tokens as the generation did."""
    c = _client(servers["eagle"])
    r = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=6, temperature=0, logprobs=0,
                             extra_body={"ignore_eos": True})
    ids = c.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=1, temperature=0, echo=True,
                               logprobs=0).usage.prompt_tokens
    e = c.completions.create(model="tiny", prompt=PROMPTS[2] + r.choices[0].text, max_tokens=0, echo=True,
                             logprobs=0, temperature=0)
    lps = e.choices[0].logprobs.token_logprobs
    if e.usage.prompt_tokens == ids + 6:           # the text re-tokenizes to the same ids
        assert lps[ids:] == pytest.approx(r.choices[0].logprobs.token_logprobs, abs=1e-5)


# ---- n, best_of, prompt lists ------------------------------------------------------------------------

def test_n_choices_are_seeded_as_vllm_does_and_indexed(servers) -> None:
    url = servers["eagle"]
    c = _client(url)
    kw = dict(model="tiny", max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    r = c.completions.create(prompt=PROMPTS[0], n=3, seed=11, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 30
    singles = [c.completions.create(prompt=PROMPTS[0], seed=11 + j, **kw).choices[0].text for j in range(3)]
    assert [ch.text for ch in r.choices] == singles
    assert len(set(singles)) > 1
    # streamed: every chunk names its choice; each choice's pieces make its text
    texts = {0: "", 1: "", 2: ""}
    reasons = {}
    for ev in c.completions.create(prompt=PROMPTS[0], n=3, seed=11, stream=True, **kw):
        for ch in ev.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    assert [texts[j] for j in range(3)] == singles and reasons == {0: "length", 1: "length", 2: "length"}
    # chat: the same seeds
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    rc = c.chat.completions.create(messages=msgs, n=2, seed=3, **kw)
    sc = [c.chat.completions.create(messages=msgs, seed=3 + j, **kw).choices[0].message.content for j in range(2)]
    assert [ch.message.content for ch in rc.choices] == sc and [ch.index for ch in rc.choices] == [0, 1]


def _hits(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("mtp_prefix_cache_hits_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no prefix cache counter")


@pytest.mark.parametrize("which", ["eagle", "plain"])
def test_the_choices_of_a_prompt_share_its_blocks(servers, which) -> None:
    """n = 4: choices 1..3 wait for choice 0's prefill and map the prompt's full blocks (8 tokens each here)
    from the prefix cache; the texts equal the choices asked for one by one."""
    url = servers[which]
    prompt = [(7 * i + 11) % 500 + 7 for i in range(40)]          # 40 tokens: 4 full blocks before the last one
    kw = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=1.0, seed=42, extra_body={"ignore_eos": True})
    before = _hits(url)
    r = _client(url).completions.create(n=4, **kw)
    assert _hits(url) - before >= 3 * 32
    singles = [_client(url).completions.create(**{**kw, "seed": 42 + j}).choices[0].text for j in range(4)]
    assert [ch.text for ch in r.choices] == singles


def test_a_client_leaving_aborts_every_choice(servers) -> None:
    """A stream of n = 3 closed after its first chunk: every choice, the ones still waiting for the first's
    prefill included, leaves the engine and every KV block returns to the pool."""
    import time

    url = servers["eagle"]
    prompt = list(range(20, 60))
    with httpx.stream("POST", url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "n": 3, "stream": True,
                                                             "max_tokens": 40, "ignore_eos": True}, timeout=60) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 30
    while True:
        m = {line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
             for line in httpx.get(url + "/metrics", timeout=10).text.splitlines() if line and line[0] != "#"}
        if m["mtp_num_requests_running"] == m["mtp_num_requests_waiting"] == 0 \
                and m["mtp_kv_cache_free_blocks"] == m["mtp_kv_cache_total_blocks"]:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    ok = _client(url).completions.create(model="tiny", prompt=prompt, n=2, max_tokens=2)
    assert len(ok.choices) == 2


def test_prompt_lists_of_strings_and_token_ids(servers) -> None:
    url = servers["eagle"]
    c = _client(url)
    kw = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    singles = [c.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]
    r = c.completions.create(prompt=PROMPTS, n=2, **kw)
    # OpenAI's order: prompt k's choices are k * n .. k * n + n - 1
    assert [ch.index for ch in r.choices] == list(range(6))
    assert [ch.text for ch in r.choices] == [t for t in singles for _ in range(2)]
    ids = [c.completions.create(prompt=p, max_tokens=1, temperature=0, echo=True, logprobs=0,
                                model="tiny").usage.prompt_tokens for p in PROMPTS]
    assert r.usage.prompt_tokens == sum(ids) and r.usage.completion_tokens == 6 * 8
    token_lists = [[71, 300, 12], [46, 75, 9, 99]]
    rt = c.completions.create(prompt=token_lists, **kw)
    assert [ch.text for ch in rt.choices] == [c.completions.create(prompt=t, **kw).choices[0].text for t in token_lists]
    bad = _post(url, "/v1/completions", {"model": "tiny", "prompt": ["a", "b", "c"], "n": 100, "max_tokens": 2})
    assert bad.status_code == 400 and "at most 256" in bad.json()["error"]["message"]


def test_best_of_returns_the_most_likely_candidates(servers) -> None:
    url = servers["eagle"]
    c = _client(url)
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    cands = [c.completions.create(seed=5 + j, logprobs=0, **kw).choices[0] for j in range(4)]
    scores = [sum(ch.logprobs.token_logprobs) for ch in cands]
    order = sorted(range(4), key=lambda j: -scores[j])
    r = c.completions.create(seed=5, best_of=4, n=2, **kw)
    assert [ch.text for ch in r.choices] == [cands[j].text for j in order[:2]]
    assert [ch.index for ch in r.choices] == [0, 1] and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 4 * 8
    bad = _post(url, "/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 2, "stream": True})
    assert bad.status_code == 400 and "cannot be streamed" in bad.json()["error"]["message"]


# ---- penalties and the rest ------------------------------------------------------------------------

ID_PROMPTS = [[71], [46, 75], [300, 12, 77, 401, 89]]      # greedy outputs that repeat tokens on tiny1
PENALTIES = [{"frequency_penalty": 1.5}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.8},
             {"logit_bias": {"77": 6}, "min_tokens": 4}, {"min_p": 0.2, "frequency_penalty": 0.7}]


@pytest.mark.parametrize("pair", PAIRS, ids=["eagle", "vanilla"])
def test_penalties_give_the_same_greedy_text_with_and_without_mtp(servers, pair) -> None:
    openai_fields = ("frequency_penalty", "presence_penalty", "logit_bias")
    for pen in PENALTIES:
        got = {}
        for which in pair:
            c = _client(servers[which])
            kw = dict(model="tiny", prompt=ID_PROMPTS, max_tokens=24, temperature=0,
                      extra_body={"ignore_eos": True, **{k: v for k, v in pen.items() if k not in openai_fields}},
                      **{k: v for k, v in pen.items() if k in openai_fields})
            r = c.completions.create(logprobs=1, **kw)
            streamed = ["", "", ""]
            for ev in c.completions.create(stream=True, **kw):
                for ch in ev.choices:
                    streamed[ch.index] += ch.text
            assert streamed == [ch.text for ch in r.choices]
            got[which] = [(ch.text, ch.logprobs.token_logprobs) for ch in r.choices]
        assert got[pair[0]] == got[pair[1]], pen
        plain = _client(servers[pair[0]]).completions.create(model="tiny", prompt=ID_PROMPTS, max_tokens=24,
                                                             temperature=0, extra_body={"ignore_eos": True})
        if set(pen) != {"min_p"}:
            assert [ch.text for ch in plain.choices] != [t for t, _ in got[pair[0]]], pen   # the penalty did something


@pytest.fixture(scope="module")
def greedy_ids(tiny1_dir) -> list[int]:
    """The greedy token ids after PROMPTS[0] on tiny1 (for stop_token_ids), from the offline engine."""
    from mtp_core.sampling import SamplingParams
    llm = LLM(llm_config(tiny1_dir, 0, max_seq_len=MAX_SEQ_LEN))
    return llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids


def test_stop_token_ids_and_include_stop_str(servers, greedy_ids) -> None:
    url = servers["eagle"]
    c = _client(url)
    r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=0,
                             extra_body={"ignore_eos": True})
    text, toks = r.choices[0].text, r.choices[0].logprobs.tokens
    assert len(greedy_ids) == len(toks) == 12
    # stop on the id of the 4th generated token: the tokens before its first occurrence come back
    stop_id = greedy_ids[3]
    first = greedy_ids.index(stop_id)
    for stream in (False, True):
        kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
        if stream:
            evs = list(c.completions.create(stream=True, **kw))
            got, reason = "".join(e.choices[0].text for e in evs), evs[-1].choices[0].finish_reason
        else:
            s = c.completions.create(**kw)
            got, reason = s.choices[0].text, s.choices[0].finish_reason
        assert got == "".join(toks[:first]) and reason == "stop"
    # a stop string, with and without include_stop_str_in_output
    stop = text[5:9]
    a = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    b = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert a.choices[0].text == text[:text.index(stop)] and b.choices[0].text == a.choices[0].text + stop
    bs = "".join(e.choices[0].text for e in c.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True}))
    assert bs == b.choices[0].text


def test_developer_role_is_a_system_message(servers) -> None:
    c = _client(servers["eagle"])
    kw = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    dev = c.chat.completions.create(messages=[{"role": "developer", "content": "Be brief."},
                                              {"role": "user", "content": PROMPTS[0]}], **kw)
    sys_ = c.chat.completions.create(messages=[{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": PROMPTS[0]}], **kw)
    assert dev.choices[0].message.content == sys_.choices[0].message.content
    assert dev.usage.prompt_tokens == sys_.usage.prompt_tokens


def test_models_by_id(servers) -> None:
    url = servers["eagle"]
    m = _client(url).models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model"
    r = httpx.get(url + "/v1/models/other", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_openai_fields_without_meaning_here_are_accepted(servers) -> None:
    url = servers["eagle"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
            "temperature": 0, "user": "u", "store": False, "metadata": {"a": "b"}, "service_tier": "auto",
            "reasoning_effort": "low", "verbosity": "medium", "prompt_cache_key": "k", "safety_identifier": "s",
            "parallel_tool_calls": True, "modalities": ["text"], "tool_choice": "none", "response_format": {"type": "text"},
            "stream_options": None, "top_logprobs": None, "logprobs": False}
    r = _post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None


BAD = [
    ("/v1/chat/completions", {"frobnicate": 1}, "unrecognized request argument: frobnicate"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
    ("/v1/chat/completions", {"n": 0}, "n must be in [1, 128]"),
    ("/v1/chat/completions", {"service_tier": "gold"}, "service_tier must be one of"),
    ("/v1/chat/completions", {"audio": {"voice": "x"}}, "audio output is not supported"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format type 'xml' is not supported"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "needs json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "cannot be compiled"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of json, regex, choice"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar is not supported"),
    ("/v1/completions", {"structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, "ignore_eos cannot be combined"),
    ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty must be in [-2, 2]"),
    ("/v1/chat/completions", {"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias values must be in [-100, 100]"),
    ("/v1/chat/completions", {"logit_bias": {"99999": 1}}, "outside the vocabulary"),
    ("/v1/chat/completions", {"stop_token_ids": [99999]}, "outside the vocabulary"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty must be in (0, 100]"),
    ("/v1/chat/completions", {"min_p": 1.5}, "min_p must be in [0, 1]"),
    ("/v1/chat/completions", {"min_tokens": -1}, "min_tokens must be >= 0"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice needs tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "send response_format or a forced tool_choice"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "naming one of the tools (f)"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name"}}],
                              "tool_choice": "required"}, "tools[0] must be"),
    ("/v1/completions", {"logprobs": 21}, "logprobs must be in [0, 20]"),
    ("/v1/completions", {"best_of": 1, "n": 2}, "best_of (1) must be >= n (2)"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens must be >= 1"),
]


@pytest.mark.parametrize("path,extra,needle", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_values_get_one_line_errors(servers, path, extra, needle) -> None:
    base = {"model": "tiny", "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "x"})
    base.update(extra)
    r = _post(servers["eagle"], path, base)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and "\n" not in err["message"], err
    assert json.dumps(err)


# ---- structured output ---------------------------------------------------------------------------------

def _schema(rng) -> dict:
    props = {}
    for k in range(rng.randint(1, 4)):
        kind = rng.choice(["boolean", "enum", "integer", "string", "array"])
        name = rng.choice(["id", "name", "ok", "size", "tags", "kind", "x", "value"]) + str(k)
        if kind == "boolean":
            props[name] = {"type": "boolean"}
        elif kind == "enum":
            props[name] = {"enum": rng.sample(["red", "green", "blue", "cat", "dog", 1, 2, True], rng.randint(1, 4))}
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            props[name] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
        elif kind == "string":
            props[name] = {"type": "string", "maxLength": rng.randint(1, 6)}
        else:
            props[name] = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": rng.randint(0, 3)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


@pytest.mark.parametrize("pair", PAIRS, ids=["eagle", "vanilla"])
def test_json_schema_identical_with_and_without_mtp_and_valid(servers, pair) -> None:
    import random

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    rng = random.Random(3)
    schemas = [_schema(rng) for _ in range(4)]
    got = {}
    for which in pair:
        c = _client(servers[which])
        texts = []
        for i, schema in enumerate(schemas):
            kw = dict(model="tiny", messages=[{"role": "user", "content": PROMPTS[i % 3]}], max_tokens=80,
                      temperature=0, response_format={"type": "json_schema",
                                                      "json_schema": {"name": "t", "schema": schema, "strict": True}})
            r = c.chat.completions.create(logprobs=True, **kw)
            text = r.choices[0].message.content
            jsonschema.validate(json.loads(text), schema)
            streamed = "".join(ev.choices[0].delta.content or "" for ev in c.chat.completions.create(stream=True, **kw)
                               if ev.choices)
            assert streamed == text
            texts.append((text, [e.logprob for e in r.choices[0].logprobs.content]))
        obj = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=60,
                                        temperature=0, response_format={"type": "json_object"})
        if obj.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(obj.choices[0].message.content), dict)
        texts.append(obj.choices[0].message.content)
        got[which] = texts
    assert got[pair[0]] == got[pair[1]]


def test_regex_and_choice_extensions(servers) -> None:
    import re

    pytest.importorskip("xgrammar")
    c = _client(servers["eagle"])
    for n, temp in ((1, 0), (3, 1.0)):
        r = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, temperature=temp, n=n, seed=1,
                                 extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}})
        assert all(re.fullmatch("[0-9]{3}-[a-z]{2,4}", ch.text) for ch in r.choices), r.choices
        r = c.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=20, temperature=temp, n=n, seed=1,
                                 extra_body={"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}})
        assert all(ch.text in ("Paris", "Lyon", "Nice") and ch.finish_reason == "stop" for ch in r.choices)


def test_100_generated_schemas_at_concurrency_8_all_validate(servers) -> None:
    """The issue's goal: 100 requests with generated JSON schemas, 8 at a time, MTP on: every output parses and
    validates against its schema."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    rng = random.Random(100)
    schemas = [_schema(rng) for _ in range(100)]
    c = _client(servers["eagle"])

    def one(i: int) -> tuple[dict, str, str]:
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[i % 3] + str(i)}],
                                      max_tokens=70, temperature=0.7 if i % 2 else 0, seed=i,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": f"s{i}", "schema": schemas[i]}})
        return schemas[i], r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(100)))
    for schema, text, reason in results:
        assert reason == "stop", text
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise AssertionError(f"{e}: {text!r}") from None
        jsonschema.validate(obj, schema)
    assert _accepted(servers["eagle"]) > 0


# ---- forced tool calls ------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                "unit": {"enum": ["C", "F"]}, "days": {"type": "integer",
                                                                                     "minimum": 1, "maximum": 7}},
                                                "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("pair", PAIRS, ids=["eagle", "vanilla"])
def test_forced_tool_calls_identical_with_and_without_mtp(servers, pair) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    got = {}
    for which in pair:
        c = _client(servers[which])
        out = []
        # (the template renders DeepSeek markup: the grammar writes the calls in it; parallel calls unset: at most
        # MAX_PARALLEL_TOOL_CALLS, then the turn ends)
        for choice, parallel, tools in (({"type": "function", "function": {"name": "get_weather"}}, None, [WEATHER, TIME]),
                                        ("required", False, [WEATHER, TIME]), ("required", False, [TIME]),
                                        ("required", None, [WEATHER, TIME])):
            kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=440,
                      temperature=0, tools=tools, tool_choice=choice)
            if parallel is not None:
                kw["parallel_tool_calls"] = parallel
            r = c.chat.completions.create(**kw)
            ch = r.choices[0]
            assert ch.message.content is None and ch.message.tool_calls, ch
            assert ch.finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
            for call in ch.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            if isinstance(choice, dict):
                assert [t.function.name for t in ch.message.tool_calls] == ["get_weather"]
            assert len(ch.message.tool_calls) == 1 if parallel is False else \
                1 <= len(ch.message.tool_calls) <= MAX_PARALLEL_TOOL_CALLS
            # streamed: the same calls (named: argument deltas after a first one with the id and name)
            calls: dict[int, dict] = {}
            reasons = []
            for ev in c.chat.completions.create(stream=True, **kw):
                for chs in ev.choices:
                    if chs.finish_reason:
                        reasons.append(chs.finish_reason)
                    for tc in chs.delta.tool_calls or []:
                        d = calls.setdefault(tc.index, {"name": None, "arguments": "", "id": None})
                        d["id"] = d["id"] or tc.id
                        d["name"] = d["name"] or (tc.function.name if tc.function else None)
                        d["arguments"] += (tc.function.arguments or "") if tc.function else ""
            assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == \
                [(t.function.name, t.function.arguments) for t in ch.message.tool_calls]
            assert all(d["id"] for d in calls.values()) and reasons == [ch.finish_reason]
            assert len([ev for ev in c.chat.completions.create(stream=True, **kw)]) > len(calls) + 3   # not in one piece
            out.append([(t.function.name, t.function.arguments) for t in ch.message.tool_calls])
        got[which] = out
    assert got[pair[0]] == got[pair[1]]


def test_structured_output_after_the_reasoning_on_the_shipped_model() -> None:
    """The shipped R1-style model with --reasoning_parser deepseek-r1 and MTP K=3: the reasoning is free, the
    answer after </think> follows the schema, and logprobs and tokens equal the offline run without MTP."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    from cli.common import DEFAULT_MODEL_DIR
    from mtp_core.sampling import SamplingParams

    kw = dict(max_seq_len=512, max_batch_size=4, max_tokens_kv=4096, tokens_per_block=16)
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 10000}},
              "required": ["answer"], "additionalProperties": False}
    question = "What is 347 + 285?"
    offline = LLM(llm_config(DEFAULT_MODEL_DIR, 0, **kw))
    want = offline.generate([question], SamplingParams(max_tokens=400, logprobs=0, guided_after_think=True,
                                                       guided=("json_schema", json.dumps(schema))),
                            apply_chat_template=True)[0]
    app = build_app(LLM(llm_config(DEFAULT_MODEL_DIR, 3, **kw)), "tiny-r1", reasoning_parser="deepseek-r1")
    with server_in_thread(app) as url:
        r = _client(url).chat.completions.create(
            model="tiny-r1", messages=[{"role": "user", "content": question}], max_tokens=400, temperature=0,
            logprobs=True, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        assert _accepted(url) > 0
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.reasoning_content.strip()
    jsonschema.validate(json.loads(msg.content), schema)
    assert [e.logprob for e in r.choices[0].logprobs.content] == [e[1] for e in want.logprobs]
    end = offline.tokenizer.think_token_ids()[1]
    assert end in want.token_ids and want.text.endswith(msg.content)


def test_langchain_structured_output_both_methods(servers) -> None:
    """LangChain's ChatOpenAI against the MTP server: with_structured_output by json_schema and by function calling
    (a named tool_choice) both return a validated object, the same as without MTP; bind_tools (tool_choice auto)
    answers (the tool round trip: tests/test_serve_tools.py)."""
    pytest.importorskip("xgrammar")
    lc = pytest.importorskip("langchain_openai")
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog", "fish"]
        age: int = Field(ge=0, le=30)
        indoor: bool

    got = {}
    for which in ("plain", "eagle"):
        llm = lc.ChatOpenAI(base_url=servers[which] + "/v1", api_key="unused", model="tiny", temperature=0,
                            max_tokens=300, max_retries=0, timeout=60)
        out = []
        for method in ("json_schema", "function_calling"):
            pet = llm.with_structured_output(Pet, method=method).invoke("Describe a pet.")
            assert isinstance(pet, Pet)
            out.append(pet.model_dump())
        reply = llm.bind_tools([Pet]).invoke("Describe a pet.")
        out.append((reply.content, reply.tool_calls))
        got[which] = out
    assert got["plain"] == got["eagle"]

"""`mtp serve`: the OpenAI-compatible server, driven over loopback by the real `openai` client and httpx.

Most tests run the server in a background thread of this process on a tiny checkpoint (127.0.0.1, an
ephemeral port); the ground truth is always `LLM.generate` without MTP on a separate engine. The shipped
model serves the 32-client test; the signal tests start `python -m cli serve` as a subprocess.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import llm_config
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams
from mtp_core.serve.app import ServeOptions, build_app
from mtp_core.serve.server import server_in_thread
from mtp_core.serve.text import OutputText

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["Hello, my name is", "The capital of France is", "def fib(n):", "1 2 3 4"]
MAX_TOKENS = 12
MAX_SEQ_LEN = 64


def _llm(model_dir, nextn: int, **kw) -> LLM:
    return LLM(llm_config(model_dir, nextn=nextn, max_seq_len=kw.pop("max_seq_len", MAX_SEQ_LEN), **kw))


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")] = float(value)
    return out


def _wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Polls /metrics until nothing runs or waits and every KV block is free; returns that scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(url)
        if m["mtp_num_requests_running"] == 0 and m["mtp_num_requests_waiting"] == 0 \
                and m["mtp_kv_cache_free_blocks"] == m["mtp_kv_cache_total_blocks"]:
            return m
        assert time.monotonic() < deadline, f"the server did not go idle: {m}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def offline(tiny1_dir) -> dict[str, str]:
    """Greedy LLM.generate texts without MTP (ignore_eos), per prompt: the ground truth."""
    llm = _llm(tiny1_dir, 0)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    chat = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), apply_chat_template=True)
    return {**{p: o.text for p, o in zip(PROMPTS, outs)}, **{"chat:" + p: o.text for p, o in zip(PROMPTS, chat)}}


class _Url(str):
    """The base URL, carrying the server's state (engine, loop) for the tests that inject faults."""
    state: object


@pytest.fixture(scope="module")
def servers(tiny1_dir):
    """{"mtp": url, "plain": url}: MTP Eagle K=2 and no speculation, both max_seq_len 64."""
    out = {}
    apps = {"mtp": build_app(_llm(tiny1_dir, 2), "tiny"), "plain": build_app(_llm(tiny1_dir, 0), "tiny")}
    with server_in_thread(apps["mtp"]) as mtp_url, server_in_thread(apps["plain"]) as plain_url:
        for name, url in (("mtp", mtp_url), ("plain", plain_url)):
            out[name] = _Url(url)
            out[name].state = apps[name].state.mtp
        yield out


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


# ---- texts equal offline greedy ------------------------------------------------------------------

@pytest.mark.parametrize("which", ["mtp", "plain"])
def test_completions_equal_offline_greedy(servers, offline, which) -> None:
    url = servers[which]
    client = _client(url)
    for p in PROMPTS:
        r = client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == offline[p]
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == MAX_TOKENS and r.usage.prompt_tokens > 0
        pieces, reasons, usage = [], [], None
        for ev in client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
            if ev.choices:
                pieces.append(ev.choices[0].text)
                reasons.append(ev.choices[0].finish_reason)
            if ev.usage:
                usage = ev.usage
        assert "".join(pieces) == r.choices[0].text == offline[p]
        assert len(pieces) > 2 and reasons[-1] == "length" and set(reasons[:-1]) == {None}
        assert usage.completion_tokens == MAX_TOKENS
    m = _wait_idle(url)
    assert m["mtp_kv_cache_free_blocks"] == m["mtp_kv_cache_total_blocks"]
    if which == "mtp":
        assert m["mtp_spec_decode_num_draft_tokens_total"] > 0
        assert m['mtp_spec_decode_num_accepted_tokens_per_pos_total{position="1"}'] >= 0
        assert m['mtp_spec_decode_chosen_drafts_total{drafts="2"}'] > 0        # K = 2, fixed policy here
        assert m["mtp_spec_decode_acceptance_length"] >= 1.0
    else:
        assert m["mtp_spec_decode_num_draft_tokens_total"] == 0


def test_chat_equals_offline_chat_template(servers, offline) -> None:
    client = _client(servers["mtp"])
    for p in PROMPTS[:2]:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == offline["chat:" + p] and r.choices[0].message.role == "assistant"
        deltas = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices]
        assert "".join(deltas) == offline["chat:" + p]


def test_stop_string_cuts_the_text_and_frees_the_request(servers, offline) -> None:
    url = servers["mtp"]
    full = offline[PROMPTS[1]]
    stop = full[5:8]                                   # spans whatever token boundary lies there
    want = full[:full.find(stop)]
    client = _client(url)
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == want
    _wait_idle(url)


def test_seeded_sampling_is_reproducible(servers) -> None:
    client = _client(servers["mtp"])
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=7,
              extra_body={"ignore_eos": True, "top_k": 50})
    a, b = client.completions.create(**kw).choices[0].text, client.completions.create(**kw).choices[0].text
    assert a == b and len(a) > 0


def test_prefix_cache_hits_reach_metrics(servers) -> None:
    url = servers["mtp"]
    hits = lambda: float(re.search(r"^mtp_prefix_cache_hits_tokens_total\{[^}]*\} (\S+)$",  # noqa: E731
                                   httpx.get(url + "/metrics").text, re.M).group(1))
    before = hits()
    prompt = list(range(40, 40 + 3 * 8 + 2))          # three full blocks and then some, sent twice
    for _ in range(2):
        _client(url).completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert hits() > before


def test_models_health_and_metrics_format(servers) -> None:
    url = servers["mtp"]
    assert [m.id for m in _client(url).models.list().data] == ["tiny"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    text = httpx.get(url + "/metrics").text
    for name in ("mtp_num_requests_running", "mtp_num_requests_waiting", "mtp_generation_tokens_total",
                 "mtp_engine_step_seconds_count", "mtp_spec_decode_num_drafts_total",
                 "mtp_spec_decode_acceptance_per_position", "mtp_spec_decode_acceptance_length",
                 "mtp_spec_decode_chosen_drafts_total",
                 "mtp_prefix_cache_hits_tokens_total", "mtp_prefix_cache_token_hit_rate"):
        assert f"# TYPE {name.removesuffix('_count')} " in text, name
    for line in text.splitlines():               # every sample line: name{labels} number
        assert line.startswith("#") or re.fullmatch(r'[a-z_][a-z0-9_]*\{[^}]*\} -?[0-9.e+-]+', line), line


# ---- bad input: OpenAI error objects, right status, one line; the server keeps serving -----------

BAD = [   # path, body, status, a piece of the message, param, code
    ("/v1/completions", b'{"model": "tiny", "prompt": "x",', 400, "not valid JSON", None, "invalid_json"),
    ("/v1/completions", b"", 400, "body is empty", None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object", None, "invalid_json"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist", "model", "model_not_found"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be >= 1", "max_tokens",
     "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens must be >= 1", "max_tokens",
     "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "x " * 80}, 400, "shorten the prompt", "prompt",
     "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": list(range(7, 7 + MAX_SEQ_LEN))}, 400, "shorten the prompt", "prompt",
     "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 500}, 400, "lower max_tokens", "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 200}, 400, "n must be in [1, 128]", "n", "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of (2) must be >= n (3)",
     "best_of", "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "frobnicate": 1}, 400,
     "unrecognized request argument: frobnicate", "frobnicate", "unknown_parameter"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": "5"}, 400, "max_tokens must be an integer",
     "max_tokens", "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 5.5}, 400, "max_tokens must be an integer",
     "max_tokens", "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature must be a number",
     "temperature", "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": "yes"}, 400, "stream must be true or false", "stream",
     "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": 42}, 400, "prompt must be a string or a list of token ids", "prompt",
     "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": 3}, 400, "stop must be a string or a list", "stop",
     "invalid_type"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature must be >= 0",
     "temperature", "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p must be in (0, 1]", "top_p",
     "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 99999]}, 400, "outside the vocabulary", "prompt", "invalid_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "   "}, 400, "prompt is empty", "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": "x"}, 400, "missing required argument: model", "model", "missing_required_parameter"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "suffix": "y"}, 400, "suffix (insertion) is not supported",
     "suffix", "unsupported_value"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "structured_outputs": {"regex": "(("}}, 400,
     "the regex cannot be compiled to a grammar: Regex parsing error", "structured_outputs", "invalid_grammar"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages must not be empty", "messages",
     "invalid_value"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages must be a list", "messages",
     "invalid_type"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"content": "hi"}]}, 400, "messages[0].role",
     "messages[0].role", "missing_required_parameter"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "critic", "content": "hi"}]}, 400,
     "unsupported chat role critic", "messages", "invalid_value"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "function", "content": "hi"}]}, 400,
     "role function (deprecated by OpenAI)", "messages[0].role", "invalid_value"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, 400, "only assistant messages carry",
     "messages[0].tool_calls", "invalid_value"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]}, 400, "must be a string",
     "messages[0].tool_calls[0].function.arguments", "invalid_type"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400,
     "n must be in [1, 128]", "n", "invalid_value"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, 400, "tools[0] must be {type: function", "tools[0]",
     "invalid_value"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 0}, 400, "max_tokens must be >= 1", "max_tokens", "invalid_value"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     400, 'the json_schema cannot be compiled to a grammar: Unsupported type "nope"', "response_format",
     "invalid_grammar"),
    ("/v1/nothing", {"model": "tiny"}, 404, "no route", None, "unknown_route"),
]


@pytest.mark.parametrize("path,body,status,needle,param,code", BAD, ids=[f"{i}-{b[3][:24]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_an_openai_error(servers, path, body, status, needle, param, code) -> None:
    """One line that says what to change, no internal path or line number, the field in `param`, a `code`."""
    url = servers["mtp"]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err["message"]
    assert "\n" not in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert not re.search(r"\.(cc|cpp|h|py):\d+|/project/|Traceback", err["message"]), err["message"]
    assert (err["param"], err["code"]) == (param, code), err
    # ... and the server still serves
    ok = _client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def _errors(url: str) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for m in re.finditer(r'^mtp_http_errors_total\{model_name="[^"]*",status="(\d+)",reason="([^"]*)"\} (\d+)$',
                         httpx.get(url + "/metrics", timeout=10).text, re.M):
        out[(m.group(1), m.group(2))] = int(m.group(3))
    return out


def test_every_error_answer_is_counted_by_reason(servers) -> None:
    """Each 4xx of the table, and the ones the middlewares and the router answer (405, a bad X-Request-Id, 413,
    a streamed grammar error), adds one to mtp_http_errors_total{status, reason}."""
    url = servers["mtp"]
    before = _errors(url)
    want: dict[tuple[str, str], int] = {}
    for path, body, status, _, _, code in BAD:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        assert httpx.post(url + path, content=data, timeout=30).status_code == status
        want[(str(status), code)] = want.get((str(status), code), 0) + 1
    assert httpx.get(url + "/v1/completions", timeout=10).status_code == 405
    want[("405", "method_not_allowed")] = 1
    r = httpx.get(url + "/v1/models", headers={"X-Request-Id": "bad id"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_id"
    want[("400", "invalid_request_id")] = 1
    stream = httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "structured_outputs": {"regex": "(("}}).text
    assert '"code": "invalid_grammar"' in stream and '"param": "structured_outputs"' in stream
    want[("400", "invalid_grammar")] += 1
    after = _errors(url)
    got = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert got == want
    assert sum(want.values()) >= 40


def test_refusals_of_the_middlewares_are_counted(tiny1_dir) -> None:
    """401 (no key, on /v1/* and on the tokenizer's routes) and 413 (a body over --max_request_bytes) are counted
    like the route's errors; /health and /metrics stay open."""
    app = build_app(_llm(tiny1_dir, 0), "tiny", options=ServeOptions(api_key="k", max_request_bytes=1024))
    with server_in_thread(app) as url:
        key = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        assert httpx.post(url + "/tokenize", json={"prompt": "x"}, timeout=10).status_code == 401
        assert httpx.post(url + "/tokenize", json={"prompt": "x"}, headers=key, timeout=10).status_code == 200
        r = httpx.post(url + "/v1/completions", content=b"x" * 2048, headers=key, timeout=10)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert _errors(url) == {("401", "invalid_api_key"): 2, ("413", "request_too_large"): 1}


def test_openai_client_raises_typed_errors(servers) -> None:
    client = _client(servers["mtp"])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"n must be in \[1, 128\]"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, n=300)


# ---- cancellation -----------------------------------------------------------------------------

def test_clients_disconnecting_mid_stream_are_aborted(servers, offline, monkeypatch) -> None:
    url = servers["mtp"]
    eng = url.state.engine.llm.engine
    step = eng.step

    def paced_step():
        time.sleep(0.01)                 # a leaver's 40 tokens take >= 0.25 s: it cannot finish before it leaves
        return step()

    monkeypatch.setattr(eng, "step", paced_step)
    before = _metrics(url)
    long_prompt = "1 2 3"

    async def leaver(client: httpx.AsyncClient) -> int:
        body = {"model": "tiny", "prompt": long_prompt, "max_tokens": 50, "temperature": 0, "stream": True,
                "ignore_eos": True}
        got = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    got += 1
                    if got == 2:
                        break                       # leaves: the connection closes mid-stream
        return got

    async def stayer(client: openai.AsyncOpenAI, p: str) -> str:
        parts = []
        async for ev in await client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                        stream=True, extra_body={"ignore_eos": True}):
            parts.append(ev.choices[0].text)
        return "".join(parts)

    async def main():
        async with httpx.AsyncClient(timeout=60) as hc:
            oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            return await asyncio.wait_for(asyncio.gather(*[leaver(hc) for _ in range(8)],
                                                         *[stayer(oc, p) for p in PROMPTS]), 120)

    res = asyncio.run(main())
    assert res[:8] == [2] * 8
    assert res[8:] == [offline[p] for p in PROMPTS]            # the others are unaffected
    m = _wait_idle(url)
    assert m["mtp_kv_cache_free_blocks"] == m["mtp_kv_cache_total_blocks"]
    aborted = m.get('mtp_request_success_total{finished_reason="abort"}', 0) - \
        before.get('mtp_request_success_total{finished_reason="abort"}', 0)
    assert aborted == 8
    # none of the leavers ran to its 50 tokens: far fewer tokens were generated than 8 x 50
    generated = m["mtp_generation_tokens_total"] - before["mtp_generation_tokens_total"]
    assert generated < 8 * 50 * 0.6 + len(PROMPTS) * MAX_TOKENS


def test_non_streaming_client_that_leaves_is_aborted(servers, monkeypatch) -> None:
    url = servers["mtp"]
    eng = url.state.engine.llm.engine
    step = eng.step

    def slow_step():
        time.sleep(0.1)                                # 50 tokens now take well over 2 s
        return step()

    monkeypatch.setattr(eng, "step", slow_step)
    before = _metrics(url)
    body = {"model": "tiny", "prompt": "tick tock", "max_tokens": 50, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    m = _wait_idle(url)
    monkeypatch.setattr(eng, "step", step)
    assert m["mtp_kv_cache_free_blocks"] == m["mtp_kv_cache_total_blocks"]
    assert m['mtp_request_success_total{finished_reason="abort"}'] - \
        before.get('mtp_request_success_total{finished_reason="abort"}', 0) == 1
    assert m["mtp_generation_tokens_total"] - before["mtp_generation_tokens_total"] < 40


# ---- faults: a failing request fails alone -----------------------------------------------------

MARK = "\u0007fault"         # a stop string no output contains; the test's faulty text builder keys on it


def test_request_whose_output_processing_raises_fails_alone(servers, offline, monkeypatch) -> None:
    url = servers["mtp"]
    state = url.state

    class Faulty(OutputText):
        def feed(self, token_ids):
            if self.num_tokens >= 3:
                raise RuntimeError("detokenizer exploded")
            return super().feed(token_ids)

    monkeypatch.setattr(state, "output_text", lambda tok, stops, *a: (Faulty if MARK in stops else OutputText)(
        tok, stops, *a))
    before = _metrics(url)

    async def faulty_stream(hc: httpx.AsyncClient) -> list[dict]:
        body = {"model": "tiny", "prompt": "1 2 3", "max_tokens": 40, "temperature": 0, "stream": True,
                "ignore_eos": True, "stop": [MARK]}
        async with hc.stream("POST", url + "/v1/completions", json=body) as r:
            return [json.loads(x[6:]) for x in [line async for line in r.aiter_lines()] if x.startswith("data: {")]

    async def faulty_plain(hc: httpx.AsyncClient) -> httpx.Response:
        body = {"model": "tiny", "prompt": "1 2 3", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stop": MARK}
        return await hc.post(url + "/v1/completions", json=body)

    async def good(oc: openai.AsyncOpenAI, p: str) -> str:
        r = await oc.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
        return r.choices[0].text

    async def main():
        async with httpx.AsyncClient(timeout=60) as hc:
            oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            return await asyncio.wait_for(asyncio.gather(faulty_stream(hc), faulty_plain(hc),
                                                         *[good(oc, p) for p in PROMPTS]), 120)

    events, plain, *texts = asyncio.run(main())
    assert events[-1]["error"]["message"] == "generation failed: RuntimeError: detokenizer exploded"
    assert plain.status_code == 500 and plain.json()["error"]["message"].endswith("detokenizer exploded")
    assert texts == [offline[p] for p in PROMPTS]
    m = _wait_idle(url)
    assert m["mtp_kv_cache_free_blocks"] == m["mtp_kv_cache_total_blocks"]
    assert m["mtp_request_failure_total"] - before["mtp_request_failure_total"] == 2


def test_engine_step_that_raises_fails_its_requests_and_the_server_goes_on(servers, offline, monkeypatch) -> None:
    url = servers["mtp"]
    runner = url.state.engine.llm.engine.paths.runner
    execute = runner.execute
    armed = [True]

    def boom(*a, **k):
        if armed[0]:
            armed[0] = False
            raise RuntimeError("injected kernel fault")
        return execute(*a, **k)

    monkeypatch.setattr(runner, "execute", boom)
    client = _client(url)
    with pytest.raises(openai.InternalServerError, match="generation failed: RuntimeError: injected kernel fault"):
        client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert httpx.get(url + "/health").status_code == 200
    r = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == offline[PROMPTS[2]]
    m = _wait_idle(url)
    assert m["mtp_kv_cache_free_blocks"] == m["mtp_kv_cache_total_blocks"] and m["mtp_engine_step_failures_total"] >= 1


def test_unexpected_handler_error_is_a_500_object_without_traceback(servers, monkeypatch, caplog) -> None:
    url = servers["mtp"]
    tok = url.state.tokenizer

    def broken(*a, **k):
        raise RuntimeError("template engine on fire")

    monkeypatch.setattr(tok, "apply_chat_template", broken)
    caplog.set_level(logging.DEBUG, logger="mtp")
    r = httpx.post(url + "/v1/chat/completions", timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "internal error: RuntimeError: template engine on fire"
    assert any("unexpected error on /v1/chat/completions" in m for m in caplog.messages)
    monkeypatch.undo()
    ok = _client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


# ---- the text pipeline: reasoning split, stop strings across pieces ------------------------------

def test_reasoning_split_on_the_think_token(tiny1_dir) -> None:
    from mtp_core.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny1_dir)
    think = tok.think_token_ids()
    ids = tok.encode("two plus two", add_special_tokens=False) + [think[1]] + \
        tok.encode("\n\nfour", add_special_tokens=False)
    whole = OutputText(tok, [], think, starts_in_reasoning=True)
    whole.feed(ids)
    whole.finish()
    assert whole.text == {"reasoning_content": "two plus two", "content": "\n\nfour"}
    one_by_one = OutputText(tok, [], think, starts_in_reasoning=True)
    got = {"reasoning_content": "", "content": ""}
    for t in ids:
        for k, v in one_by_one.feed([t]).items():
            got[k] += v
    for k, v in one_by_one.finish().items():
        got[k] += v
    assert got == whole.text
    plain = OutputText(tok, [], think, starts_in_reasoning=False)       # prompt not in <think>: ...
    plain.feed(tok.encode("no thoughts", add_special_tokens=False))
    plain.finish()
    assert plain.text == {"reasoning_content": "", "content": "no thoughts"}
    stop = OutputText(tok, ["plus t"], None)                             # a stop string across token pieces
    pieces = [stop.feed([t]).get("content", "") for t in ids] + [stop.finish().get("content", "")]
    assert "".join(pieces) == "two " and stop.stopped


# ---- mtp bench --base_url ---------------------------------------------------------------------

def test_bench_client_mode_matches_offline_bench(servers, tiny1_dir, tmp_path) -> None:
    from typer.testing import CliRunner

    from cli.app import app

    ds = tmp_path / "ds.jsonl"
    ds.write_text("".join(json.dumps({"task_id": i, "input_ids": [40 + i, 77, 300 + i], "output_tokens": 10}) + "\n"
                          for i in range(6)))
    common = ["bench", "--dataset", str(ds), "--concurrency", "3", "--warmup", "1"]
    runner = CliRunner()
    off = runner.invoke(app, common + ["--model_dir", str(tiny1_dir), "--num_threads", "1", "--report_json",
                                       str(tmp_path / "off.json"), "--request_json", str(tmp_path / "off_req.json")])
    assert off.exit_code == 0, off.output
    http = runner.invoke(app, common + ["--base_url", servers["mtp"], "--report_json", str(tmp_path / "http.json"),
                                        "--request_json", str(tmp_path / "http_req.json")])
    assert http.exit_code == 0, http.output
    assert "Total Output Throughput (tokens/sec)" in http.output and "DECODING STATISTICS (MTP-eagle)" not in off.output
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("off.json", "http.json"))

    def keys(d, prefix=""):
        return {prefix + k for k, v in d.items()} | {x for k, v in d.items() if isinstance(v, dict)
                                                      for x in keys(v, prefix + k + ".")}
    shared = {"request_info", "performance", "streaming_metrics", "decoding_stats", "dataset"}
    assert {k for k in keys({s: a[s] for s in shared}) if not k.startswith("request_info.base")} <= keys(
        {s: b[s] for s in shared})
    assert b["request_info"]["num_requests"] == 6 and b["request_info"]["total_output_tokens"] == 60
    assert b["performance"]["total_output_throughput_tps"] > 0 and b["performance"]["ttft_ms"] > 0
    ra, rb = (json.loads((tmp_path / f).read_text()) for f in ("off_req.json", "http_req.json"))
    assert [r["output"] for r in ra] == [r["output"] for r in rb]        # greedy: the same texts
    assert b["decoding_stats"]["num_draft_tokens"] > 0                    # the server's MTP counters came back
    bad = runner.invoke(app, ["bench", "--dataset", str(ds), "--base_url", servers["mtp"], "--max_batch_size", "4"])
    assert bad.exit_code == 2 and "--max_batch_size configures a local engine" in bad.output


# ---- the shipped model: 32 concurrent streaming clients with MTP, reasoning parser ---------------

@pytest.fixture(scope="module")
def shipped():
    """(url, offline LLM without MTP) for the shipped model served with MTP K=3 and the R1 reasoning parser."""
    from cli.common import DEFAULT_MODEL_DIR

    kw = dict(max_seq_len=512, max_batch_size=32, max_tokens_kv=8192, tokens_per_block=16)
    app = build_app(_llm(DEFAULT_MODEL_DIR, 3, **kw), "tiny-r1", reasoning_parser="deepseek-r1")
    with server_in_thread(app) as url:
        yield url, _llm(DEFAULT_MODEL_DIR, 0, **kw)


def test_32_concurrent_streaming_clients_on_the_shipped_model(shipped, caplog) -> None:
    from mtp_core.bench.dataset import encode_request, task_requests

    url, offline_llm = shipped
    caplog.set_level(logging.WARNING, logger="mtp")
    reqs = task_requests("all", 32, 32)
    prompts = [r.prompt for r in reqs]                 # chat-rendered, BOS included
    want = [o.text for o in offline_llm.generate([encode_request(offline_llm.tokenizer, r) for r in reqs],
                                                 SamplingParams(max_tokens=32))]

    async def one(client: openai.AsyncOpenAI, p: str) -> str:
        parts = []
        async for ev in await client.completions.create(model="tiny-r1", prompt=p, max_tokens=32, temperature=0,
                                                        stream=True):
            if ev.choices:
                parts.append(ev.choices[0].text)
        return "".join(parts)

    async def main():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return await asyncio.wait_for(asyncio.gather(*[one(client, p) for p in prompts]), 300)

    got = asyncio.run(main())
    assert got == want
    m = _wait_idle(url)
    assert m["mtp_kv_cache_free_blocks"] == m["mtp_kv_cache_total_blocks"]
    assert m["mtp_spec_decode_acceptance_length"] > 1.5           # MTP really drafted and was accepted
    assert m['mtp_spec_decode_acceptance_per_position{position="2"}'] > 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_reasoning_parser_on_the_shipped_model(shipped) -> None:
    url, offline_llm = shipped
    question = "What is 347 + 285?"
    out = offline_llm.generate([question], SamplingParams(max_tokens=400), apply_chat_template=True)[0]
    end = offline_llm.tokenizer.think_token_ids()[1]
    assert end in out.token_ids, "the shipped model should close its reasoning within 400 tokens"
    cut = out.token_ids.index(end)
    want_reasoning = offline_llm.tokenizer.decode(out.token_ids[:cut])
    want_content = offline_llm.tokenizer.decode(out.token_ids[cut + 1:])
    client = _client(url)
    msg = [{"role": "user", "content": question}]
    r = client.chat.completions.create(model="tiny-r1", messages=msg, max_tokens=400, temperature=0)
    assert r.choices[0].message.reasoning_content == want_reasoning
    assert r.choices[0].message.content == want_content and want_content.strip() and want_reasoning.strip()
    parts = {"reasoning_content": "", "content": ""}
    for ev in client.chat.completions.create(model="tiny-r1", messages=msg, max_tokens=400, temperature=0,
                                             stream=True):
        for k in parts:
            parts[k] += getattr(ev.choices[0].delta, k, None) or ""
    assert parts == {"reasoning_content": want_reasoning, "content": want_content}


# ---- the command: quickstart parity, signals, bad flags ---------------------------------------

def _start_cli(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    err = tmp_path / "server.err"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", "0", "--num_threads", "1", *args],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    deadline = time.monotonic() + 120
    while True:
        m = re.search(r"serving \S+ on (http://127\.0\.0\.1:\d+)", err.read_text())
        if m:
            return proc, m.group(1), err
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"mtp serve did not start: {err.read_text()}")
        time.sleep(0.1)


def test_cli_server_equals_quickstart_and_exits_0_on_sigterm(tiny1_dir, tmp_path) -> None:
    import ast

    from typer.testing import CliRunner

    from cli.app import app

    flags = ["--model_dir", str(tiny1_dir), "--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "2"]
    qs = CliRunner().invoke(app, ["quickstart", *flags, "--num_threads", "1", "--max_tokens", str(MAX_TOKENS),
                                  "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]])   # `mtp quickstart`, in-process
    assert qs.exit_code == 0, qs.output
    quick = [ast.literal_eval(line.split("Generated text: ", 1)[1]) for line in qs.stdout.splitlines()
             if "Generated text: " in line]
    assert len(quick) == 2
    proc, url, err = _start_cli(flags + ["--shutdown_timeout", "20"], tmp_path)
    try:
        client = _client(url)
        assert [client.completions.create(model=tiny1_dir.name, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
                .choices[0].text for p in PROMPTS[:2]] == quick
        # a streaming request in flight when SIGTERM arrives finishes; then the process exits 0
        events: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": tiny1_dir.name, "prompt": "1 2", "max_tokens": 100, "ignore_eos": True,
                    "temperature": 0, "stream": True}) as r:
                for line in r.iter_lines():
                    events.append(line)

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 60
        while not any(e.startswith("data: {") for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        t.join(30)
    finally:
        proc.kill()
    log = err.read_text()
    assert "Traceback" not in log and "SIGTERM received" in log, log
    assert events[-2:] == ["data: [DONE]", ""] or events[-1] == "data: [DONE]"
    assert any('"finish_reason": "length"' in e for e in events)          # it ran to its end


def test_ctrl_c_aborts_what_does_not_finish_in_time(tiny1_dir, caplog) -> None:
    """SIGINT to this process while `serve` runs in the main thread (as `mtp serve` does): serve returns
    normally after --shutdown_timeout, the unfinished stream is cut off and aborted, no traceback."""
    from mtp_core.serve.server import bind, serve

    llm = _llm(tiny1_dir, 2, max_seq_len=2048)
    app = build_app(llm, "tiny")
    sock = bind("127.0.0.1", 0)
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    ready = threading.Event()
    lines: list[str] = []

    def client() -> None:
        assert ready.wait(60)
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": "1 2", "max_tokens": 2000, "ignore_eos": True, "temperature": 0,
                    "stream": True}) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 3:
                        os.kill(os.getpid(), signal.SIGINT)        # Ctrl-C
        except httpx.HTTPError:
            pass                                                   # the connection closes under it: expected
        finally:
            if len(lines) < 3:                                     # never leave serve() running: fail instead
                os.kill(os.getpid(), signal.SIGINT)

    caplog.set_level(logging.INFO)
    before = signal.getsignal(signal.SIGINT)    # default_int_handler, or SIG_IGN when started in the background
    t = threading.Thread(target=client)
    t.start()
    serve(app, sock, shutdown_timeout=0.3, on_ready=ready.set)   # returns after the signal, no exception
    t.join(30)
    assert any(x.startswith("data: {") for x in lines)
    assert not any('"finish_reason": "length"' in x for x in lines)       # cut off, not finished
    assert "SIGINT received" in caplog.text and "Traceback" not in caplog.text
    assert not llm.engine.has_unfinished()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks      # its KV blocks came back
    assert signal.getsignal(signal.SIGINT) is before                            # handlers restored


def test_cli_serve_bad_flags_exit_2(tiny1_dir) -> None:
    import socket

    from typer.testing import CliRunner

    from cli.app import app

    runner = CliRunner()
    r = runner.invoke(app, ["serve", "--model_dir", str(tiny1_dir), "--reasoning_parser", "qwen9"])
    assert r.exit_code == 2 and "--reasoning_parser 'qwen9' is unknown; use deepseek-r1" in r.output
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = runner.invoke(app, ["serve", "--model_dir", str(tiny1_dir), "--port", str(port)])
    assert r.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in r.output
    r = runner.invoke(app, ["serve", "--model_dir", str(tiny1_dir), "--max_tokens", "5"])
    assert r.exit_code == 2 and "No such option: --max_tokens" in r.output
    bad_yaml = tiny1_dir.parent / "bad_serve.yml"
    bad_yaml.write_text("speculative_config:\n  num_nextn_predict_layer: 2\n")
    r = runner.invoke(app, ["serve", "--model_dir", str(tiny1_dir), "--config", str(bad_yaml)])   # quickstart's YAML
    assert r.exit_code == 2 and "did you mean num_nextn_predict_layers?" in r.output

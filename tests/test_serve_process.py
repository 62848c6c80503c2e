"""`mtp serve` with the engine in its own process, and the server's limits, auth, CORS, request ids, metrics
and shutdown. Loopback only (127.0.0.1, ephemeral ports); the ground truth is `LLM.generate` without MTP.

The `proc` fixture is the real layout: an EngineProcess (the model in a child process) behind the app,
served from a thread of this process, with an API key, one allowed origin and a 1 MiB body limit. The
signal tests start `python -m cli serve` as a subprocess.
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

from cli.serve import engine_threads
from conftest import llm_config
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams
from mtp_core.serve.app import ServeOptions, build_app
from mtp_core.serve.engine_client import EngineProcess
from mtp_core.serve.server import server_in_thread
from mtp_core.tokenizer import Tokenizer
from test_serve import BAD, MAX_SEQ_LEN, MAX_TOKENS, PROMPTS, _metrics, _start_cli, _wait_idle

KEY = "sekrit-key"
ORIGIN = "http://app.example"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def offline(tiny1_dir) -> dict[str, str]:
    llm = LLM(llm_config(tiny1_dir, nextn=0, max_seq_len=MAX_SEQ_LEN))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    chat = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), apply_chat_template=True)
    return {**{p: o.text for p, o in zip(PROMPTS, outs)}, **{"chat:" + p: o.text for p, o in zip(PROMPTS, chat)}}


@pytest.fixture(scope="module")
def proc(tiny1_dir):
    """(base URL, EngineProcess): MTP Eagle K=2 in a child process, API key, CORS for ORIGIN, 1 MiB bodies."""
    cfg = llm_config(tiny1_dir, nextn=2, max_seq_len=MAX_SEQ_LEN, num_threads=1)
    engine = EngineProcess(cfg, "warning")
    engine.wait_ready()
    app = build_app(engine, "tiny", tokenizer=Tokenizer.from_dir(tiny1_dir), model_dir=str(tiny1_dir),
                    options=ServeOptions(api_key=KEY, allowed_origins=[ORIGIN], max_request_bytes=1 << 20))
    with server_in_thread(app) as url:
        yield url, engine
    assert engine.proc.poll() == 0                 # the lifespan's shutdown stopped the engine process cleanly


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _post(url: str, body, path: str = "/v1/completions", headers: dict | None = None, **kw) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=data, headers={"Content-Type": "application/json", **AUTH, **(headers or {})},
                      timeout=60, **kw)


# ---- the engine process: same texts as offline greedy, metrics from both processes ------------------

def test_engine_process_equals_offline_greedy(proc, offline) -> None:
    url, engine = proc
    assert engine.proc.pid != os.getpid() and engine.alive
    client = _client(url)
    before = _metrics(url)
    for p in PROMPTS:
        r = client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == offline[p] and r.usage.completion_tokens == MAX_TOKENS
        streamed = "".join(ev.choices[0].text for ev in client.completions.create(
            model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if ev.choices)
        assert streamed == offline[p]
    for p in PROMPTS[:2]:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == offline["chat:" + p]
    m = _wait_idle(url)
    n = 2 * len(PROMPTS) + 2
    delta = lambda k: m[k] - before.get(k, 0)  # noqa: E731
    assert delta("mtp_time_to_first_token_seconds_count") == n
    assert delta("mtp_e2e_request_latency_seconds_count") == n
    assert delta("mtp_request_queue_time_seconds_count") == n
    assert delta("mtp_inter_token_latency_seconds_count") >= n          # >= one gap per request (12 tokens, K=2)
    assert delta('mtp_request_success_total{finished_reason="length"}') == n
    assert delta("mtp_generation_tokens_total") == n * MAX_TOKENS and delta("mtp_prompt_tokens_total") > 0
    assert m["mtp_spec_decode_num_draft_tokens_total"] > 0 and m["mtp_spec_decode_acceptance_length"] > 1.0
    assert delta('mtp_spec_decode_num_proposed_tokens_per_pos_total{position="1"}') > 0
    # histogram buckets are cumulative and end at the count
    buckets = [v for k, v in m.items() if k.startswith("mtp_time_to_first_token_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == m["mtp_time_to_first_token_seconds_count"]


def test_engine_process_carries_logprobs_penalties_and_choices(proc, servers_default) -> None:
    """Logprobs, prompt logprobs, a penalty, logit_bias and n > 1 cross the socket (MessagePack) unchanged: the
    child process with MTP gives what the in-thread server without MTP gives, bitwise."""
    url, _ = proc
    ref_url, _ = servers_default
    body = {"model": "tiny", "prompt": [PROMPTS[0], PROMPTS[1]], "max_tokens": 10, "temperature": 0, "logprobs": 2,
            "echo": True, "n": 2, "frequency_penalty": 0.8, "logit_bias": {"77": -100}, "ignore_eos": True}
    got = _post(url, body).json()
    ref = httpx.post(ref_url + "/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    assert got["choices"] == ref["choices"] and got["usage"] == ref["usage"]
    assert got["choices"][0]["logprobs"]["token_logprobs"][0] is None
    pytest.importorskip("xgrammar")
    guided = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0,
              "structured_outputs": {"regex": "[a-z]{3,6}-[0-9]{2}"}}
    got = _post(url, guided).json()
    assert got["choices"] == httpx.post(ref_url + "/v1/completions", json=guided, timeout=60).json()["choices"]
    assert re.fullmatch("[a-z]{3,6}-[0-9]{2}", got["choices"][0]["text"]), got


# ---- API key, CORS, X-Request-Id -----------------------------------------------------------------------

def test_api_key_is_required_on_v1_only(proc) -> None:
    url, _ = proc
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
        assert r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in _client(url).models.list().data] == ["tiny"]
    assert _post(url, body).status_code == 200
    for open_path in ("/health", "/metrics", "/server_info"):
        assert httpx.get(url + open_path, timeout=30).status_code == 200, open_path


def test_bench_sends_the_api_key(proc, tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from cli.app import app

    url, _ = proc
    ds = tmp_path / "ds.jsonl"
    ds.write_text("".join(json.dumps({"task_id": i, "input_ids": [40 + i, 77], "output_tokens": 4}) + "\n"
                          for i in range(3)))
    runner = CliRunner()
    common = ["bench", "--dataset", str(ds), "--base_url", url, "--concurrency", "2", "--warmup", "0"]
    r = runner.invoke(app, common)
    assert r.exit_code == 2 and "HTTP 401" in r.output and "--api_key" in r.output, r.output
    r = runner.invoke(app, common + ["--api_key", KEY])
    assert r.exit_code == 0, r.output
    assert "Total Output Throughput (tokens/sec)" in r.output
    r = runner.invoke(app, common, env={"MTP_API_KEY": KEY})
    assert r.exit_code == 0, r.output


def test_cors_preflight_and_exposed_request_id(proc) -> None:
    url, _ = proc
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type,x-request-id"}
    r = httpx.options(url + "/v1/chat/completions", headers=pre, timeout=30)        # no key: preflights carry none
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert {"authorization", "content-type", "x-request-id"} <= {
        h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert "POST" in r.headers["access-control-allow-methods"]
    bad = httpx.options(url + "/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"}, timeout=30)
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    r = _post(url, {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2}, headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    r = _post(url, {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 2}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers     # the browser blocks it


def test_request_id_is_echoed_generated_and_logged(proc, caplog) -> None:
    url, _ = proc
    caplog.set_level(logging.INFO, logger="mtp.serve")
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 3}
    r = _post(url, body, headers={"X-Request-Id": "trace-42/a"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42/a"
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      headers={**AUTH, "X-Request-Id": "trace-43"}, timeout=30) as s:
        assert s.headers["x-request-id"] == "trace-43"
        assert list(s.iter_lines())[-2:] == ["data: [DONE]", ""]
    gen = _post(url, body)
    assert re.fullmatch(r"[0-9a-f]{32}", gen.headers["x-request-id"])
    assert _post(url, {**body, "max_tokens": 0}, headers={"X-Request-Id": "e1"}).headers["x-request-id"] == "e1"
    assert httpx.get(url + "/v1/models", headers={"X-Request-Id": "e2"}, timeout=30).headers["x-request-id"] == "e2"
    bad = _post(url, body, headers={"X-Request-Id": "x" * 300})
    assert bad.status_code == 400 and "X-Request-Id must be" in bad.json()["error"]["message"]
    deadline = time.monotonic() + 10
    while not all(any(f"request {i} finished" in m for m in caplog.messages) for i in ("trace-42/a", "trace-43")):
        assert time.monotonic() < deadline, caplog.messages
        time.sleep(0.05)


# ---- limits ---------------------------------------------------------------------------------------------

def test_request_body_limit_is_a_413(proc) -> None:
    url, _ = proc
    big = json.dumps({"model": "tiny", "prompt": "x " * (1 << 20)}).encode()          # 2 MiB > the 1 MiB limit
    r = _post(url, big)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert "over the limit of 1048576 bytes (--max_request_bytes)" in err["message"] and "\n" not in err["message"]

    def chunks():                                                  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
    r = httpx.post(url + "/v1/completions", content=chunks(), headers={**AUTH, "Content-Type": "application/json"},
                   timeout=60)
    assert r.status_code == 413 and "over the limit" in r.json()["error"]["message"]
    ok = _client(url).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_context_check_comes_before_tokenizing_a_huge_prompt(servers_default) -> None:
    """A 10 MB prompt against max_seq_len 64: answered from its length alone, while /health keeps answering."""
    url, state = servers_default
    assert state.prompts.max_token_bytes is not None
    body = json.dumps({"model": "tiny", "prompt": "The capital of France is Paris. " * 330_000}).encode()
    assert len(body) > 10_000_000
    health: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as c:
            while not done.is_set():
                t = time.perf_counter()
                assert c.get(url + "/health").status_code == 200
                health.append(time.perf_counter() - t)
                time.sleep(0.005)

    th = threading.Thread(target=poll)
    th.start()
    try:
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"}, timeout=60)
        took = time.perf_counter() - t
    finally:
        done.set()
        th.join()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in r.json()["error"]["message"] and "shorten the prompt" in r.json()["error"]["message"]
    assert took < 5.0, took                  # tokenizing 10 MB takes ~10 s here: it was not tokenized
    assert health and max(health) < 1.0, max(health)


@pytest.fixture(scope="module")
def servers_default(tiny1_dir):
    """An in-thread server with the default limits (16 MiB bodies) and max_seq_len 64."""
    app = build_app(LLM(llm_config(tiny1_dir, nextn=0, max_seq_len=MAX_SEQ_LEN)), "tiny")
    with server_in_thread(app) as url:
        yield url, app.state.mtp


def test_byte_bound_is_a_lower_bound_on_tokens(tiny1_dir) -> None:
    import random

    from mtp_core.serve.prompts import max_token_bytes

    tok = Tokenizer.from_dir(tiny1_dir)
    bound = max_token_bytes(Path(tiny1_dir) / "tokenizer.json")
    assert bound is not None and 1 < bound < 64
    rng = random.Random(0)
    vocab = [tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)]
    for _ in range(200):            # texts made of whole tokens (the densest case), special ones included
        text = "".join(rng.choice(vocab) for _ in range(rng.randint(1, 60)))
        n = len(tok.encode(text, add_special_tokens=False))
        assert n >= -(-len(text.encode("utf-8")) // bound), (text, n)


HUGE_BAD = [
    ({"seed": 2 ** 64}, 400, "seed must be an integer in [-2^63, 2^64 - 1]"),
    ({"seed": -2 ** 63 - 1}, 400, "seed must be an integer"),
    ({"seed": 10 ** 30}, 400, "seed must be an integer"),
    ({"max_tokens": 2 ** 70}, 400, "lower max_tokens"),
    ({"prompt": [5, 2 ** 70]}, 400, "outside the vocabulary"),
    ({"n": 2 ** 70}, 400, "n must be in [1, 128]"),
    ({"stop": ["s%d" % i for i in range(65)]}, 400, "send at most 64"),
    ({"temperature": "@1e999"}, 400, "temperature must be a finite number"),      # parses to inf
    ({"model": "m" * 100_000}, 404, "does not exist"),
]


@pytest.mark.parametrize("extra,status,needle", HUGE_BAD, ids=[f"{i}-{b[2][:20]}" for i, b in enumerate(HUGE_BAD)])
def test_extreme_values_are_openai_errors(servers_default, extra, status, needle) -> None:
    url, _ = servers_default
    raw = re.sub(r'"@([^"]*)"', r"\1", json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2, **extra}))
    r = httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and "\n" not in err["message"] and len(err["message"]) < 400, err["message"]


@pytest.mark.parametrize("raw,needle", [
    (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', "Infinity is not a JSON number"),
    (b'{"model": "tiny", "prompt": "x", "seed": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
])
def test_non_json_numbers_and_nesting_are_400(servers_default, raw, needle) -> None:
    url, _ = servers_default
    r = httpx.post(url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_valid_extremes_are_served(servers_default) -> None:
    url, _ = servers_default
    for extra in ({"seed": 2 ** 64 - 1, "temperature": 1.0}, {"seed": -2 ** 63, "temperature": 0.5},
                  {"top_k": 2 ** 70, "temperature": 1.0}, {"temperature": 1e300}):
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3, **extra},
                       timeout=30)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["usage"]["completion_tokens"] >= 1


def test_bad_input_over_the_engine_process(proc) -> None:
    """The table of test_serve's bad bodies, now through the process layout (with the key)."""
    url, _ = proc
    for path, body, status, needle, param, code in BAD:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = _post(url, data, path=path)
        err = r.json()["error"]
        assert r.status_code == status and needle in err["message"], (body, r.text)
        assert (err["param"], err["code"]) == (param, code), (body, r.text)


# ---- shutdown and startup -----------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_requests_cut_at_shutdown_get_a_json_503(tiny1_dir, tmp_path) -> None:
    proc, url, err = _start_cli(["--model_dir", str(tiny1_dir), "--max_seq_len", "4096", "--shutdown_timeout", "0.3",
                                 "--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "2"], tmp_path)
    engine_pid = _children(proc.pid)
    # without --num_threads the engine leaves the API process a core (when the machine has few)
    assert httpx.get(url + "/server_info", timeout=30).json()["world_info"]["num_threads"] == engine_threads()
    body = {"model": tiny1_dir.name, "prompt": "1 2 3", "max_tokens": 4000, "ignore_eos": True, "temperature": 0}

    async def plain(c: httpx.AsyncClient) -> httpx.Response:
        return await c.post(url + "/v1/completions", json=body)

    async def stream(c: httpx.AsyncClient) -> list[str]:
        async with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            return [line async for line in r.aiter_lines() if line]

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            tasks = [asyncio.create_task(plain(c)) for _ in range(4)] + \
                [asyncio.create_task(stream(c)) for _ in range(4)]
            while _metrics(url)["mtp_num_requests_running"] < 8:
                await asyncio.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    try:
        res = asyncio.run(asyncio.wait_for(main(), 120))
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    for r in res[:4]:
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["message"] == "the server is shutting down; retry later"
    for lines in res[4:]:
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["type"] == "service_unavailable"
        assert len(lines) > 3                                     # it was streaming when it was cut
    log = err.read_text()
    assert "Traceback" not in log and "answered with 503" in log, log
    assert engine_pid and all(_gone(p) for p in engine_pid)


@pytest.mark.parametrize("torch_default,usable,want", [(2, 2, 1), (1, 1, 1), (4, 4, 3), (4, 8, 4), (8, 16, 8),
                                                        (16, 12, 11)])
def test_engine_threads_leave_the_api_process_a_core(torch_default, usable, want) -> None:
    assert engine_threads(torch_default, usable) == want


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_second_signal_forces_the_exit(tiny1_dir, tmp_path, sig) -> None:
    proc, url, err = _start_cli(["--model_dir", str(tiny1_dir), "--max_seq_len", "4096", "--shutdown_timeout", "60"],
                                tmp_path)
    engine_pid = _children(proc.pid)
    body = {"model": tiny1_dir.name, "prompt": "1 2", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    got: list[str] = []

    def client() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    got.append(line)
        except httpx.HTTPError:
            pass                                      # the process is gone under it: expected

    t = threading.Thread(target=client)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(sig)
        time.sleep(0.3)
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == 128 + sig
    finally:
        proc.kill()
        t.join(30)
    log = err.read_text()
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert f"second {signal.Signals(sig).name}: exiting now" in log
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in engine_pid):
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_while_loading_exits_with_one_line(tiny1_dir, tmp_path, sig) -> None:
    err = tmp_path / "server.err"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", "0", "--model_dir", str(tiny1_dir)],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(err, "w"))
    try:
        deadline = time.monotonic() + 60
        while "in the engine process" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.01)
        engine_pid = _children(proc.pid)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    lines = err.read_text().strip().splitlines()
    assert lines[-1] == f"stopped: {signal.Signals(sig).name} arrived while the model was loading", lines
    assert "Traceback" not in err.read_text() and "serving" not in err.read_text()
    assert engine_pid and all(_gone(p) for p in engine_pid)


def test_engine_process_that_dies_fails_its_requests_with_503(tiny1_dir) -> None:
    cfg = llm_config(tiny1_dir, nextn=0, max_seq_len=4096, num_threads=1)
    engine = EngineProcess(cfg, "warning")
    engine.wait_ready()
    app = build_app(engine, "tiny", tokenizer=Tokenizer.from_dir(tiny1_dir), model_dir=str(tiny1_dir))
    with server_in_thread(app) as url:
        got: list[str] = []

        def client() -> None:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": "1 2", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
                got.extend(r.iter_lines())
        t = threading.Thread(target=client)
        t.start()
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.proc.kill()
        t.join(30)
        assert got[-2:] == ["data: [DONE]", ""] and "the engine stopped" in got[-4], got[-4:]
        assert httpx.get(url + "/health", timeout=10).status_code == 503
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10)
        assert r.status_code == 503 and "the engine stopped" in r.json()["error"]["message"]


def test_prompt_over_the_kv_pool_is_a_400_before_streaming(tiny1_dir) -> None:
    app = build_app(LLM(llm_config(tiny1_dir, nextn=2, max_seq_len=512, max_tokens_kv=64)), "tiny")
    with server_in_thread(app) as url:
        for stream in (False, True):
            r = httpx.post(url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": list(range(10, 110)), "max_tokens": 4, "stream": stream})
            assert r.status_code == 400, r.text
            assert "KV slots but the whole KV cache pool holds" in r.json()["error"]["message"]
        ok = httpx.post(url + "/v1/completions", timeout=30, json={"model": "tiny", "prompt": [10, 11], "max_tokens": 4})
        assert ok.status_code == 200

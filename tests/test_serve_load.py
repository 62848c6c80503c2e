"""`mtp serve` under load, on the shipped model with MTP K=3, over loopback only (bounded in count and time).

`python -m cli serve` runs as in production (its own API process and engine process); the ground truth is
`LLM.generate` without MTP in this process. Each round sends STREAMS concurrent streaming requests (all
in the running batch: --max_batch_size STREAMS), of which about a fifth leave after a few chunks; once
every stream has its first chunk (the prompts are prefilled, only decode steps run), BIG_PROMPTS prompts of
1 MB arrive (the shipped model's context is 1,024 tokens: each is answered 400 from its length before it
is tokenized). Checked every round: every surviving stream's text equals offline greedy, the KV pool is full
again, the others' inter-token p99 while the big prompts arrive is at most twice their median, or 1.5 times
the p99 of the same streams in a round without big prompts just before (where the machine's own spread is
wider than twice the median); over the
rounds, neither process's resident memory grows. The latency criterion is the only one at the mercy of the
machine's other work (the engine's step time swings with it): a round whose criterion fails is tried
again, up to TRIES times, and no round may ever show a stall of a second (the issue saw 3.5 s).

STREAMS is 128, as the issue asks: on 2 shared cores a round takes a few seconds (the test ~20-40 s).
"""
from __future__ import annotations

import asyncio
import gc
import json
import random
import statistics
import time
from pathlib import Path
from typing import Optional

import httpx

from cli.common import DEFAULT_MODEL_DIR
from conftest import llm_config
from mtp_core.bench.dataset import encode_request, task_requests
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams
from test_serve import _metrics, _start_cli, _wait_idle
from test_serve_process import _children

# K drafts every step: what these tests time is what prompts do to the other streams, not the step-to-step
# variation of the cost policy's draft counts (its re-tries of other counts at a large batch are dearer steps)
FIXED = ("--spec_decode_draft_len_policy", "fixed")
STREAMS = 128
ROUNDS = 3
MAX_TOKENS = 48
BIG_PROMPTS = 3
BIG_BYTES = 1_000_000
LEAVE_SHARE = 0.2
RSS_GROWTH_MB = 40
TRIES = 5                # the latency criterion's tries per round (the 2 cores are shared: a try's p99 reaches
                         # 2-3x the median now and then, before issue 42's changes as after; 3 tries failed once)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def _stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, leave_after: int | None,
                  on_first=lambda: None) -> tuple[str, list[float], bool]:
    """(text, arrival time of each read that brought chunks, finished): one streaming completion that leaves
    after `leave_after` chunks. The client does as little as it can while streams run (it shares the 2 cores
    with the server): it keeps the raw bytes and parses them afterwards."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    raw, times, chunks = [], [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for data in r.aiter_raw():
            n = data.count(b"data: {")
            raw.append(data)
            if n:
                times.append(time.perf_counter())
                chunks += n
                if len(times) == 1:
                    on_first()
                if leave_after is not None and chunks >= leave_after:
                    break                              # leaves: the connection closes mid-stream
    text, finished = [], False
    for line in b"".join(raw).decode().split("\n"):
        if line.startswith("data: {"):
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            text.append(ev["choices"][0]["text"])
        finished |= line == "data: [DONE]"
    return "".join(text), times, finished


async def _big(client: httpx.AsyncClient, url: str, model: str, body: bytes) -> tuple[float, float, httpx.Response]:
    t0 = time.perf_counter()
    r = await client.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    return t0, time.perf_counter(), r


def _p(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _round(url: str, model: str, prompts: list[str], want: list[str], big_body: Optional[bytes],
           rng: random.Random, rnd: int, attempt: int) -> tuple[float, float]:
    """One round, with the big prompts (big_body) or without them (None: the baseline of the streams' own spread):
    every check but the latency one asserts; returns (the median of every decode-phase gap, the p99 of the gaps
    while the big prompts arrived, or of every decode-phase gap without them)."""
    leave = {i: rng.randint(1, 4) for i in rng.sample(range(STREAMS), int(LEAVE_SHARE * STREAMS))}
    before = _metrics(url)

    async def main():
        limits = httpx.Limits(max_connections=STREAMS + BIG_PROMPTS + 4)
        flowing = asyncio.Event()
        started = [0]

        def first() -> None:
            started[0] += 1
            if started[0] == STREAMS:
                flowing.set()
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            streams = [asyncio.create_task(_stream(client, url, model, p, leave.get(i), first))
                       for i, p in enumerate(prompts)]
            await flowing.wait()                 # every prompt is prefilled: only decode steps run
            t_flow = time.perf_counter()
            bigs = [await _big(client, url, model, big_body) for _ in range(BIG_PROMPTS)] \
                if big_body is not None else []                                                   # one by one
            return await asyncio.gather(*streams), bigs, t_flow

    gc.collect()
    gc.disable()          # this process is the client: its own collector must not pause the streams
    try:
        results, bigs, t_flow = asyncio.run(asyncio.wait_for(main(), 180))
    finally:
        gc.enable()
    # the big prompts: refused from their length, quickly
    for t0, t1, r in bigs:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    # every stream that stayed got exactly the offline greedy text
    stayed = [i for i in range(STREAMS) if i not in leave]
    for i in stayed:
        text, _, finished = results[i]
        assert finished and text == want[i], (i, text, want[i])
    for i in leave:
        assert not results[i][2] and 1 <= len(results[i][1]) <= leave[i]
    # the others' inter-token latency while the big prompts arrived: the gaps that end between the
    # first one's arrival and 0.25 s after the last one's answer (sampled by their end, so a typical
    # gap is as likely as a long one; a stall they caused ends there), against the median of all
    # decode-phase gaps (every stream had its first token)
    lo, hi = (min(b[0] for b in bigs), max(b[1] for b in bigs) + 0.25) if bigs else (t_flow, float("inf"))
    gaps, during = [], []
    for i in stayed:
        ts = results[i][1]
        for a, b in zip(ts, ts[1:]):
            if a >= t_flow:
                gaps.append(b - a)
            if lo <= b <= hi:
                during.append(b - a)
    med = statistics.median(gaps)
    print(f"round {rnd} try {attempt}{'' if bigs else ' (baseline, no big prompt)'}: {len(stayed)} streams, decode "
          f"inter-token median {1e3 * med:.1f} ms, p90 {1e3 * _p(gaps, 0.9):.1f}, p99 {1e3 * _p(gaps, 0.99):.1f}" +
          (f"; the {BIG_PROMPTS} 1 MB prompts took {1e3 * (hi - 0.25 - lo):.0f} ms; {len(during)} gaps then, p99 "
           f"{1e3 * _p(during, 0.99):.1f} ms, max {1e3 * max(during):.1f} ms" if bigs else ""))
    assert len(during) >= 100
    assert max(during) < 1.0, sorted(during)[-10:]          # never a stall of a second, whatever the load
    # the KV pool is whole again; the leavers were aborted
    m = _wait_idle(url)
    assert m["mtp_kv_cache_free_blocks"] == m["mtp_kv_cache_total_blocks"]
    aborted = m.get('mtp_request_success_total{finished_reason="abort"}', 0) - \
        before.get('mtp_request_success_total{finished_reason="abort"}', 0)
    finished = sum(m.get(k, 0) - before.get(k, 0) for k in m if k.startswith("mtp_request_success_total"))
    assert finished == STREAMS and aborted <= len(leave)      # a leaver may finish before its abort lands
    return med, _p(during, 0.99)


def test_128_streams_with_disconnects_and_1mb_prompts(tmp_path) -> None:
    reqs = task_requests("all", STREAMS, MAX_TOKENS)
    prompts = [r.prompt for r in reqs]                      # chat-rendered, BOS included
    offline = LLM(llm_config(DEFAULT_MODEL_DIR, nextn=0, dtype="auto", max_seq_len=1024, max_batch_size=32, max_tokens_kv=32768,
                             tokens_per_block=16))
    want = [o.text for o in offline.generate([encode_request(offline.tokenizer, r) for r in reqs],
                                             SamplingParams(max_tokens=MAX_TOKENS))]
    del offline
    proc, url, err = _start_cli(["--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "3", *FIXED,
                                 "--max_batch_size", str(STREAMS), "--max_seq_len", "1024"], tmp_path)
    model = "tiny-r1"
    rng = random.Random(30)
    words = " ".join(prompts).split()
    big_text = " ".join(rng.choice(words) for _ in range(BIG_BYTES // 5))[:BIG_BYTES]
    big_body = json.dumps({"model": model, "prompt": big_text, "max_tokens": 8}).encode()
    assert len(big_body) > BIG_BYTES
    rss: list[tuple[float, float]] = []
    try:
        engine_pid = _children(proc.pid)
        assert len(engine_pid) == 1
        for rnd in range(ROUNDS):
            for attempt in range(TRIES):
                # the same streams without big prompts first: on 2 shared cores their own gaps' p99 is 1.7-4.3x
                # the median (Zen 5, 2026-12-06), so twice the median alone failed without any big prompt
                _, base = _round(url, model, prompts, want, None, rng, rnd, attempt)
                med, p99 = _round(url, model, prompts, want, big_body, rng, rnd, attempt)
                ok = p99 <= max(2 * med, 1.5 * base)
                if ok:
                    break
            assert ok, f"round {rnd}: the inter-token p99 while the 1 MB prompts arrived was over twice the " \
                       f"median and 1.5 times the p99 without them in {TRIES} tries (printed above)"
            rss.append((_rss_mb(proc.pid), _rss_mb(engine_pid[0])))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print("resident MB (API, engine) per round:", [(round(a), round(b)) for a, b in rss])
    assert rss[-1][0] - rss[0][0] < RSS_GROWTH_MB and rss[-1][1] - rss[0][1] < RSS_GROWTH_MB, rss
    assert "Traceback" not in err.read_text()


def test_a_big_prompt_that_must_be_tokenized_does_not_stall_the_streams(tmp_path) -> None:
    """With a context long enough that the byte bound cannot refuse it, a 2 MB prompt is tokenized (in a
    worker thread, the GIL released): the streams running meanwhile keep their pace."""
    yml = tmp_path / "big.yml"
    yml.write_text("kv_cache_config:\n  max_tokens: 16384\n")
    proc, url, err = _start_cli(["--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "3", *FIXED, "--max_batch_size",
                                 "8", "--max_seq_len", "65536", "--config", str(yml)], tmp_path)
    reqs = task_requests("all", 8, 200)
    size = 2 * BIG_BYTES                     # ~0.3-1 s of tokenizing here: a stall that long could not hide
    big_text = " ".join(random.Random(1).choice(" ".join(r.prompt for r in reqs).split())
                        for _ in range(size // 5))[:size]
    big_body = json.dumps({"model": "tiny-r1", "prompt": big_text, "max_tokens": 8}).encode()
    try:
        flowing = asyncio.Event()
        started = [0]

        async def one(client: httpx.AsyncClient, p: str) -> list[float]:
            body = {"model": "tiny-r1", "prompt": p, "max_tokens": 600, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            times = []
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
                        if len(times) == 1:
                            started[0] += 1
                            if started[0] == len(reqs):
                                flowing.set()
            return times

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                streams = [asyncio.create_task(one(client, r.prompt)) for r in reqs]
                # every stream decoding (its first chunk came) before the big prompt is sent; a stream that ended
                # before the last one started fails here at once rather than leaving the wait to the timeout
                waiter = asyncio.create_task(flowing.wait())
                await asyncio.wait([waiter, *streams], return_when=asyncio.FIRST_COMPLETED)
                assert flowing.is_set(), f"a stream ended before all {len(reqs)} were decoding ({started[0]} were)"
                big = await _big(client, url, "tiny-r1", big_body)
                return await asyncio.gather(*streams), big

        gc.collect()
        gc.disable()
        try:
            streams, (t0, t1, r) = asyncio.run(asyncio.wait_for(main(), 180))
        finally:
            gc.enable()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert r.status_code == 400 and "the prompt has" in r.json()["error"]["message"], r.text
    assert "at least" not in r.json()["error"]["message"]            # it was tokenized: the exact count
    gaps = [b - a for ts in streams for a, b in zip(ts, ts[1:]) if b >= t0 and a <= t1]
    print(f"{size / 1e6:.0f} MB prompt tokenized in {1e3 * (t1 - t0):.0f} ms; {len(gaps)} gaps of the other streams meanwhile, "
          f"max {1e3 * max(gaps):.1f} ms")
    assert t1 - t0 > 0.1 and len(gaps) > 10, (t1 - t0, len(gaps))   # it took long enough to have stalled them
    # on the event loop it would stall every stream for about the whole tokenization; the goal: < 200 ms
    assert max(gaps) < min(0.2, 0.5 * (t1 - t0)), (t1 - t0, sorted(gaps)[-5:])


def test_chunked_prefill_keeps_streams_flowing_and_exact(tmp_path) -> None:
    """A ~900-token prompt arriving while 8 streams decode: with chunked prefill (serve's default) the longest
    gap of the streams is shorter than with one whole-prompt step, and every text equals offline greedy."""
    reqs = task_requests("all", 200, 16)
    offline = LLM(llm_config(DEFAULT_MODEL_DIR, nextn=0, dtype="auto", max_seq_len=1024, max_batch_size=16, max_tokens_kv=16384,
                             tokens_per_block=16))
    tok = offline.tokenizer
    head, tail = "<｜begin▁of▁sentence｜><｜User｜>", "<｜Assistant｜><think>\n"
    assert reqs[0].prompt.startswith(head) and reqs[0].prompt.endswith(tail)
    questions = [r.prompt[len(head):-len(tail)] for r in reqs]
    n = 1
    while len(tok.encode(head + " ".join(questions[:n + 1]) + tail, add_special_tokens=False)) < 900:
        n += 1
    long_prompt = head + " ".join(questions[:n]) + tail                  # many questions in one user turn
    n_long = len(tok.encode(long_prompt, add_special_tokens=False))
    assert 800 < n_long < 1000, n_long
    streams = [r.prompt for r in reqs[20:28]]
    want_long = offline.generate([tok.encode(long_prompt, add_special_tokens=False)],
                                 SamplingParams(max_tokens=16))[0].text
    want = [o.text for o in offline.generate([encode_request(tok, r) for r in reqs[20:28]],
                                             SamplingParams(max_tokens=160, ignore_eos=True))]
    del offline
    stall = {}
    for mode in ("--disable_chunked_prefill", "--enable_chunked_prefill"):
        proc, url, err = _start_cli(["--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "3", *FIXED,
                                     "--max_batch_size", "16", "--max_seq_len", "1024", mode], tmp_path)
        try:
            async def one(client: httpx.AsyncClient, p: str) -> tuple[str, list[float]]:
                body = {"model": "tiny-r1", "prompt": p, "max_tokens": 160, "temperature": 0, "stream": True,
                        "ignore_eos": True}
                parts, times = [], []
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            times.append(time.perf_counter())
                            parts.append(json.loads(line[6:])["choices"][0]["text"])
                return "".join(parts), times

            async def main():
                async with httpx.AsyncClient(timeout=120) as client:
                    tasks = [asyncio.create_task(one(client, p)) for p in streams]
                    while _metrics(url)["mtp_generation_tokens_total"] < 8 * 16:
                        await asyncio.sleep(0.01)
                    t0 = time.perf_counter()
                    r = await client.post(url + "/v1/completions", json={
                        "model": "tiny-r1", "prompt": long_prompt, "max_tokens": 16, "temperature": 0})
                    return await asyncio.gather(*tasks), (t0, time.perf_counter(), r)

            gc.collect()
            gc.disable()
            try:
                results, (t0, t1, r) = asyncio.run(asyncio.wait_for(main(), 180))
            finally:
                gc.enable()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want_long, (mode, r.text)
        assert [t for t, _ in results] == want, mode
        gaps = [b - a for _, ts in results for a, b in zip(ts, ts[1:]) if b >= t0 and a <= t1]
        assert gaps, mode
        stall[mode] = max(gaps)
    print("longest gap of another stream while a %d-token prompt is prefilled: whole %.0f ms, chunked %.0f ms"
          % (n_long, 1e3 * stall["--disable_chunked_prefill"], 1e3 * stall["--enable_chunked_prefill"]))
    assert stall["--enable_chunked_prefill"] < stall["--disable_chunked_prefill"], stall

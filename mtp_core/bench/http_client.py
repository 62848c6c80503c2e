"""`mtp bench --base_url URL`: the benchmark as a client of a running `mtp serve` (or any OpenAI server).

Every request is a streaming POST /v1/completions (greedy, `max_tokens` = the dataset's output_tokens,
`ignore_eos` as asked); at most `concurrency` are in flight (a closed loop, as offline). Times are taken
on the client: submission = just before the request is sent, first token = the first event carrying
text, every later event = a chunk (ITL), end = the final event. Token counts come from the response's
`usage`, the speculative statistics from its `spec_decode_stats` (an extension of `mtp serve`; other
servers give none). The report has the offline report's sections and fields; engine, machine and world
come from the server's GET /server_info. With an API key, every request carries `Authorization: Bearer KEY`.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Optional

from mtp_core.bench.metrics import RequestRecord, summarize_decoding, summarize_performance, summarize_streaming
from mtp_core.request.stats import SpecStats


class ServerError(RuntimeError):
    pass


def _stats(d: Optional[dict]) -> SpecStats:
    s = SpecStats()
    if d:
        s.num_steps = d.get("decoding_steps", 0)
        s.num_output_tokens = d.get("output_tokens", 0)
        s.num_draft_proposed = d.get("draft_tokens", 0)
        s.num_draft_accepted = d.get("accepted_draft_tokens", 0)
        s.proposed_per_position = list(d.get("proposed_per_position", []))
        s.accepted_per_position = list(d.get("accepted_per_position", []))
    return s


def _error_text(body: bytes) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except Exception:  # noqa: BLE001 - not an OpenAI error object
        return body.decode("utf-8", "replace")[:200]


async def _one(client: Any, url: str, model: str, index: int, task_id: Any, prompt: Any, max_tokens: int,
               ignore_eos: bool) -> tuple[RequestRecord, str]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    start = time.perf_counter()
    first: Optional[float] = None
    chunks: list[float] = []
    text: list[str] = []
    usage: dict = {}
    spec: Optional[dict] = None
    reason = None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise ServerError(f"request {task_id}: HTTP {r.status_code}: {_error_text(await r.aread())}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise ServerError(f"request {task_id}: {ev['error'].get('message')}")
            now = time.perf_counter()
            for ch in ev.get("choices", []):
                if ch.get("text"):
                    first = now if first is None else first
                    chunks.append(now)
                    text.append(ch["text"])
                reason = ch.get("finish_reason") or reason
            if ev.get("usage"):
                usage = ev["usage"]
                spec = ev.get("spec_decode_stats")
    end = time.perf_counter()
    rec = RequestRecord(index, task_id, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), start,
                        first if first is not None else end, end, _stats(spec), chunks, [], reason)
    return rec, "".join(text)


def _headers(api_key: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _run(base_url: str, model: str, requests: list[tuple[Any, Any, int]], concurrency: int,
               ignore_eos: bool, on_finish: Optional[Callable[[RequestRecord], None]],
               api_key: Optional[str] = None) -> list[tuple[RequestRecord, str]]:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    n = len(requests) if concurrency <= 0 else min(concurrency, len(requests))
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
    out: list[Optional[tuple[RequestRecord, str]]] = [None] * len(requests)
    nxt = iter(range(len(requests)))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits,
                                 headers=_headers(api_key)) as client:
        async def worker() -> None:
            for i in nxt:
                task_id, prompt, max_tokens = requests[i]
                out[i] = await _one(client, url, model, i, task_id, prompt, max_tokens, ignore_eos)
                if on_finish:
                    on_finish(out[i][0])
        await asyncio.gather(*(worker() for _ in range(n)))
    return [o for o in out if o is not None]


def get_json(base_url: str, path: str, api_key: Optional[str] = None) -> Any:
    import httpx

    try:
        r = httpx.get(base_url.rstrip("/") + path, timeout=10.0, headers=_headers(api_key))
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {base_url} ({e}); start it with `mtp serve` or fix "
                         "--base_url") from None
    if r.status_code == 401:
        raise ValueError(f"GET {path}: HTTP 401: {_error_text(r.content)} (pass the server's key with --api_key or "
                         "MTP_API_KEY)")
    if r.status_code != 200:
        raise ServerError(f"GET {path}: HTTP {r.status_code}: {_error_text(r.content)}")
    return r.json()


def served_model(base_url: str, api_key: Optional[str] = None) -> str:
    data = get_json(base_url, "/v1/models", api_key).get("data") or []
    if not data:
        raise ServerError(f"{base_url}/v1/models lists no model")
    return data[0]["id"]


def run_http_requests(base_url: str, requests: list[tuple[Any, Any, int]], concurrency: int, ignore_eos: bool = True,
                      model: Optional[str] = None, on_finish: Optional[Callable[[RequestRecord], None]] = None,
                      api_key: Optional[str] = None) -> list[tuple[RequestRecord, str]]:
    """requests: (task_id, prompt text or token ids, output tokens). -> (record, text) per request, in order."""
    model = model or served_model(base_url, api_key)
    return asyncio.run(_run(base_url, model, requests, concurrency, ignore_eos, on_finish, api_key))


def build_http_report(records: list[RequestRecord], info: dict, concurrency: int, dataset: dict,
                      extra_request_info: Optional[dict] = None) -> dict:
    """The offline report's sections; engine/machine/world from the server's /server_info."""
    request_info, performance = summarize_performance(records)
    request_info.update(extra_request_info or {})
    world = dict(info.get("world_info") or {})
    world["concurrency"] = concurrency if concurrency > 0 else None
    engine = {k: None for k in ("model", "model_path", "version", "dtype", "kv_cache_dtype", "quantization",
                                "num_mtp_modules")} | dict(info.get("engine") or {})
    machine = {k: None for k in ("cpu", "usable_cpus", "torch_num_threads", "gpu", "device", "torch")} \
        | dict(info.get("machine") or {})
    for k in ("tp_size", "ep_size", "max_batch_size", "max_num_tokens", "kv_cache_percentage"):
        world.setdefault(k, None)
    return {
        "engine": engine,
        "machine": machine,
        "world_info": world,
        "request_info": request_info,
        "performance": performance,
        "streaming_metrics": summarize_streaming(records, True),
        "decoding_stats": summarize_decoding(records, int(info.get("max_draft_len", 0)), info.get("mode", "unknown")),
        "dataset": dataset,
    }

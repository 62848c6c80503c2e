"""The FastAPI application: OpenAI-compatible endpoints over one EngineLoop.

GET /v1/models, POST /v1/completions, POST /v1/chat/completions (with `stream: true`: server-sent events
ending in `data: [DONE]`), GET /health, GET /metrics (Prometheus text), GET /server_info (what `mtp bench
--base_url` puts in its report). Every error is an OpenAI error object with a one-line message.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from mtp_core.sampling import SamplingParams
from mtp_core.serve.engine_loop import EngineLoop, Event, RequestHandle
from mtp_core.serve.metrics import render_metrics
from mtp_core.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from mtp_core.serve.text import OutputText

log = logging.getLogger("mtp.serve")

REASONING_PARSERS = ("deepseek-r1",)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions


@dataclass
class ServerState:
    llm: Any
    loop: EngineLoop
    model_name: str
    reasoning_parser: Optional[str]
    defaults: dict[str, Any]
    created: int
    accepting: bool = True
    info: Optional[dict] = None
    output_text: Callable[..., OutputText] = OutputText     # tests may wrap it to inject a per-request fault


def generation_defaults(model_dir: str) -> dict[str, Any]:
    """Sampling defaults from generation_config.json (as vLLM does): do_sample false -> greedy."""
    try:
        gen = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        gen = {}
    out: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0
    for k in ("temperature", "top_p", "top_k"):
        if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool) and gen.get("do_sample") is not False:
            out[k] = gen[k]
    return out


def build_app(llm: Any, model_name: str, reasoning_parser: Optional[str] = None,
              info: Optional[dict] = None) -> FastAPI:
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning_parser {reasoning_parser!r} is unknown; use {', '.join(REASONING_PARSERS)}")
    if reasoning_parser and llm.tokenizer.think_token_ids() is None:
        raise ValueError("--reasoning_parser deepseek-r1 needs <think> and </think> tokens, but the tokenizer has "
                         "neither; drop --reasoning_parser")
    state = ServerState(llm, EngineLoop(llm), model_name, reasoning_parser,
                        generation_defaults(llm.config.model_dir), int(time.time()), info=info)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop.start()
        try:
            yield
        finally:
            state.accepting = False
            await asyncio.to_thread(state.loop.stop)

    app = FastAPI(title="mtp", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.mtp = state
    app.add_middleware(_QuietCancel)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(404)
    async def _not_found(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(404, f"no route {request.method} {request.url.path}; see GET /v1/models, "
                                          "POST /v1/completions, POST /v1/chat/completions").body(), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(405, f"{request.method} is not allowed on {request.url.path}").body(),
                            status_code=405)

    @app.get("/health")
    async def health() -> Response:
        if not state.loop.alive or not state.accepting:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created, "owned_by": "mtp",
            "root": str(llm.config.model_dir), "max_model_len": llm.engine.max_seq_len}]})

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse(state.info or {})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(state.loop, state.model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(await request.body(), CompletionRequest)
        _check_common(state, req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"prompt holds {len(prompt)} prompts; send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        ids = _prompt_ids(state, prompt)
        params = _sampling(state, req, req.max_tokens, len(ids), COMPLETIONS_DEFAULT_MAX_TOKENS)
        return await _generate(state, request, req, ids, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(await request.body(), ChatCompletionRequest)
        _check_common(state, req)
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; send one of them", param="max_tokens")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise APIError(400, str(e).splitlines()[0], param="messages") from None
        ids = llm.tokenizer.encode(text, add_special_tokens=False)     # the template has the BOS already
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _sampling(state, req, max_tokens, len(ids), None)
        return await _generate(state, request, req, ids, params, chat=True)

    return app


# ---- request -> engine --------------------------------------------------------------------------

def _check_common(state: ServerState, req: Any) -> None:
    if not state.accepting or not state.loop.alive:
        raise APIError(503, "the server is shutting down; retry later")
    if req.model != state.model_name:
        raise APIError(404, f"the model {req.model!r} does not exist; this server serves {state.model_name!r} "
                            "(see GET /v1/models)", param="model", code="model_not_found")
    bad = req.unsupported()
    if bad:
        raise APIError(400, bad[1], param=bad[0])


def _prompt_ids(state: ServerState, prompt: Any) -> list[int]:
    tok = state.llm.tokenizer
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "prompt is an empty list; give text or at least one token id", param="prompt")
        vocab = state.llm.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}); send valid ids",
                           param="prompt")
        return list(prompt)
    if not prompt.strip():
        raise APIError(400, "prompt is empty; give non-empty text", param="prompt")
    bos = getattr(tok, "bos_token", None)
    # a prompt that is already rendered (it starts with the BOS text) gets no second BOS
    return tok.encode(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))


def _sampling(state: ServerState, req: Any, max_tokens: Optional[int], prompt_len: int,
              default_max: Optional[int]) -> SamplingParams:
    max_len = state.llm.engine.max_seq_len
    if prompt_len >= max_len:
        raise APIError(400, f"the prompt has {prompt_len} tokens but the model's context (max_seq_len) is {max_len}; "
                            "shorten the prompt", param="messages" if default_max is None else "prompt",
                       code="context_length_exceeded")
    room = max_len - prompt_len
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    elif max_tokens > room:
        raise APIError(400, f"max_tokens is {max_tokens} but the prompt ({prompt_len} tokens) leaves room for "
                            f"{room} in the model's context of {max_len}; lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    d = state.defaults
    pick = lambda v, k: d[k] if v is None else v  # noqa: E731
    params = SamplingParams(max_tokens=max_tokens, temperature=float(pick(req.temperature, "temperature")),
                            top_k=int(pick(req.top_k, "top_k")), top_p=float(pick(req.top_p, "top_p")),
                            seed=req.seed, ignore_eos=req.ignore_eos)
    try:
        params.validate()
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split()[0]) from None
    return params


async def _generate(state: ServerState, request: Request, req: Any, ids: list[int], params: SamplingParams,
                    chat: bool) -> Response:
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])     # matched on the text here
    think = state.llm.tokenizer.think_token_ids() if chat and state.reasoning_parser else None
    starts_in = False
    if think:
        last = max((i for i, t in enumerate(ids) if t in think), default=-1)
        starts_in = last >= 0 and ids[last] == think[0]
    text = state.output_text(state.llm.tokenizer, stops, think, starts_in)
    h = state.loop.submit(ids, params)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _Stream(_sse(state, h, text, rid, chat, include_usage, len(ids)), lambda: _release(state, h))
    try:
        return await _collect(state, request, h, text, rid, chat, len(ids))
    finally:
        _release(state, h)


def _release(state: ServerState, h: RequestHandle) -> None:
    """The response is over (sent, failed or its client left): make sure the engine drops the request."""
    if not h.closed:
        state.loop.abort(h)


def _fail(state: ServerState, h: RequestHandle, e: Exception) -> APIError:
    """A request whose output processing raised: it fails alone (500), the engine drops it."""
    log.error("request failed: %s: %s", type(e).__name__, e)
    log.debug("traceback", exc_info=True)
    state.loop.abort(h, "failed")
    return APIError(500, f"generation failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": "))


def _usage(prompt_len: int, n: int, stats: Any) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


def _spec_stats(stats: Any) -> Optional[dict]:
    """Extension: this request's speculative-decoding counters (what `mtp bench --base_url` reports)."""
    if stats is None:
        return None
    return {"decoding_steps": stats.num_steps, "output_tokens": stats.num_output_tokens,
            "draft_tokens": stats.num_draft_proposed, "accepted_draft_tokens": stats.num_draft_accepted,
            "proposed_per_position": list(stats.proposed_per_position),
            "accepted_per_position": list(stats.accepted_per_position)}


def _finish_reason(text: OutputText, ev: Event) -> str:
    return "stop" if text.stopped else ("length" if ev.finish_reason == "length" else "stop")


async def _collect(state: ServerState, request: Request, h: RequestHandle, text: OutputText, rid: str, chat: bool,
                   prompt_len: int) -> Response:
    async def watch() -> None:                 # the client leaving is an http.disconnect message
        while (await request.receive())["type"] != "http.disconnect":
            pass
        state.loop.abort(h)

    watcher = asyncio.create_task(watch())
    try:
        while True:
            ev = await h.events.get()
            if ev.kind == "error":
                raise APIError(ev.status, ev.message)
            try:
                text.feed(ev.token_ids)
                if text.stopped and not h.closed:
                    state.loop.abort(h, "stop string")
                if ev.kind != "done" and not text.stopped:
                    continue
                text.finish()
            except Exception as e:  # noqa: BLE001 - this request fails alone
                raise _fail(state, h, e) from None
            if ev.kind != "done":                              # stopped by a stop string: wait for the end
                ev = await _until_done(h)
            break
    finally:
        watcher.cancel()
    if h.abort_reason == "client disconnected":
        return Response(status_code=499)                       # nobody is there to read it
    reason = _finish_reason(text, ev)
    created = int(time.time())
    if chat:
        msg: dict[str, Any] = {"role": "assistant", "content": text.text["content"]}
        if state.reasoning_parser:
            msg["reasoning_content"] = text.text.get("reasoning_content") or None
            msg["content"] = text.text["content"] or (None if msg["reasoning_content"] else "")
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text.text["content"], "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                         "choices": [choice], "usage": _usage(prompt_len, text.num_tokens, ev.stats),
                         "spec_decode_stats": _spec_stats(ev.stats)})


async def _until_done(h: RequestHandle) -> Event:
    while True:
        ev = await h.events.get()
        if ev.kind != "tokens":
            return ev


def _sse(state: ServerState, h: RequestHandle, text: OutputText, rid: str, chat: bool, include_usage: bool,
         prompt_len: int) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    head = json.dumps({"id": rid, "object": obj, "created": created, "model": state.model_name})[:-1]

    def chunk(delta: Optional[dict[str, str]], reason: Optional[str], first: bool = False) -> str:
        # hand-assembled (the hot path: one per request per engine step); same JSON as json.dumps would give
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            d.update(delta or {})
            body = f'{{"index": 0, "delta": {json.dumps(d, ensure_ascii=False)}, "logprobs": null'
        else:
            body = f'{{"index": 0, "text": {json.dumps((delta or {}).get("content", ""), ensure_ascii=False)}, ' \
                   f'"logprobs": null'
        return f'data: {head}, "choices": [{body}, "finish_reason": {json.dumps(reason)}}}]}}\n\n'

    async def gen() -> AsyncIterator[str]:
        if chat:
            yield chunk(None, None, first=True)
        while True:
            ev = await h.events.get()
            if ev.kind == "error":
                yield _data(APIError(ev.status, ev.message).body())
                yield "data: [DONE]\n\n"
                return
            try:
                delta = text.feed(ev.token_ids)
                if text.stopped and not h.closed:
                    state.loop.abort(h, "stop string")
                if ev.kind == "done" or text.stopped:
                    for k, v in text.finish().items():
                        delta[k] = delta.get(k, "") + v
            except Exception as e:  # noqa: BLE001 - this request fails alone
                yield _data(_fail(state, h, e).body())
                yield "data: [DONE]\n\n"
                return
            if delta:
                yield chunk(delta, None)
            if ev.kind == "done" or text.stopped:
                if ev.kind != "done":
                    ev = await _until_done(h)
                yield chunk(None, _finish_reason(text, ev))
                if include_usage:
                    yield _data({"id": rid, "object": obj, "created": created, "model": state.model_name,
                                 "choices": [], "usage": _usage(prompt_len, text.num_tokens, ev.stats),
                                 "spec_decode_stats": _spec_stats(ev.stats)})
                yield "data: [DONE]\n\n"
                return

    return gen()


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _QuietCancel:
    """Outermost guard of every HTTP request. An unexpected exception becomes a 500 error object (one log
    line; the traceback only at debug level). A request cancelled by the server's shutdown (past
    --shutdown_timeout) ends quietly: its handler's cleanup has aborted its engine request already."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            log.warning("%s %s cancelled by the shutdown", scope.get("method"), scope.get("path"))
        except Exception as e:  # noqa: BLE001 - never a traceback in the server log for one request
            first = str(e).splitlines()[0] if str(e) else ""
            log.error("unexpected error on %s: %s: %s", scope.get("path"), type(e).__name__, first)
            log.debug("traceback", exc_info=True)
            if not started:
                await JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {first}".rstrip(": ")).body(),
                                   status_code=500)(scope, receive, send)


class _Stream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (done, error, client gone, cancelled)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

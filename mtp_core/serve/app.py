"""The FastAPI application: OpenAI-compatible endpoints over an engine client.

GET /v1/models, POST /v1/completions, POST /v1/chat/completions (with `stream: true`: server-sent events
ending in `data: [DONE]`), GET /health, GET /metrics (Prometheus text), GET /server_info (what `mtp bench
--base_url` puts in its report), POST /tokenize, POST /detokenize, GET /tokenizer_info (tokenize.py, vLLM's).
Every error is an OpenAI error object with a one-line message and a code, counted in /metrics.

A request's way through the modules of this package:

    middleware.py   error guard, CORS, X-Request-Id, API key, body limit (413)
    params.py       parse and check the body, tokenize (worker threads), SamplingParams: one Spec per choice;
                    tools.py: what the chat template does with tools, and how a request's tools are rendered
    generate.py     register the choices with the output thread (outputs.py), send them to the engine; the one
                    producer of per-choice updates, streamed or not
                    (tool calls in DeepSeek markup: tool_parser.py, as the text streams)
    render.py       the updates as SSE chunks, or folded into one JSON body (JSON parts: formats.py)
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from mtp_core.serve import render
from mtp_core.serve import tokenize as tokenize_api
from mtp_core.serve.engine_client import InProcessEngine
from mtp_core.serve.generate import start
from mtp_core.serve.metrics import render_metrics
from mtp_core.serve.middleware import add_middlewares
from mtp_core.serve.outputs import OutputProcessor
from mtp_core.serve.params import Spec, chat_specs, completion_specs, parse
from mtp_core.serve.prompts import PromptEncoder
from mtp_core.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, short_repr
from mtp_core.serve.state import REASONING_PARSERS, ServeOptions, ServerState, generation_defaults

__all__ = ["REASONING_PARSERS", "ServeOptions", "ServerState", "build_app", "generation_defaults"]


def build_app(engine: Any, model_name: str, reasoning_parser: Optional[str] = None, info: Optional[dict] = None,
              tokenizer: Any = None, model_dir: Optional[str] = None,
              options: Optional[ServeOptions] = None) -> FastAPI:
    """engine: an EngineProcess (its `ready` set), or an LLM, which is then run by an InProcessEngine."""
    if hasattr(engine, "generate"):                          # an LLM: serve it from a thread of this process
        tokenizer = tokenizer or engine.tokenizer
        model_dir = model_dir or engine.config.model_dir
        engine = InProcessEngine(engine, info)
    if tokenizer is None or model_dir is None:
        raise ValueError("build_app needs the tokenizer and the model directory with an EngineProcess")
    options = options or ServeOptions()
    options.validate()
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning_parser {reasoning_parser!r} is unknown; use {', '.join(REASONING_PARSERS)}")
    if reasoning_parser and tokenizer.think_token_ids() is None:
        raise ValueError("--reasoning_parser deepseek-r1 needs <think> and </think> tokens, but the tokenizer has "
                         "neither; drop --reasoning_parser")
    state = ServerState(engine, tokenizer, PromptEncoder(tokenizer, model_dir, engine.ready.max_seq_len),
                        OutputProcessor(engine), model_name, reasoning_parser, generation_defaults(model_dir),
                        int(time.time()), options, info=dict(info or engine.ready.server_info or {}))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        state.outputs.start()
        try:
            yield
        finally:
            state.cut()
            await asyncio.to_thread(state.engine.close)
            await asyncio.to_thread(state.outputs.join, 10.0)
            state.prompts.close()

    app = FastAPI(title="mtp", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.mtp = state
    _add_error_handlers(app, state)
    _add_info_routes(app, state, model_dir)
    _add_generation_routes(app, state)
    add_middlewares(app, options, state.errors)
    return app


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error answer is an OpenAI error object, counted in /metrics (unknown routes and methods too)."""
    def answer(e: APIError) -> JSONResponse:
        state.errors.add(e.status, e.code)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return answer(e)

    @app.exception_handler(404)
    async def _not_found(request: Request, e: Exception) -> JSONResponse:
        return answer(APIError(404, f"no route {request.method} {short_repr(request.url.path)}; see GET "
                                    "/v1/models, POST /v1/completions, POST /v1/chat/completions, POST /tokenize",
                               code="unknown_route"))

    @app.exception_handler(405)
    async def _bad_method(request: Request, e: Exception) -> JSONResponse:
        return answer(APIError(405, f"{request.method} is not allowed on {short_repr(request.url.path)}"))


def _add_info_routes(app: FastAPI, state: ServerState, model_dir: str) -> None:
    """/health, the model list, /server_info, /metrics and the tokenizer's endpoints."""
    @app.get("/health")
    async def health() -> Response:
        if not state.up:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "mtp",
                "root": str(model_dir), "max_model_len": state.max_seq_len}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != state.model_name:
            raise APIError(404, f"the model {short_repr(model_id)} does not exist; this server serves "
                                f"{state.model_name!r}", param="model", code="model_not_found")
        return JSONResponse(model_card())

    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse(state.info)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(state.outputs.metrics, state.outputs.engine_stats, state.model_name,
                                                state.errors), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse(await tokenize_api.tokenize(state, await request.body()))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(await tokenize_api.detokenize(state, await request.body()))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenize_api.tokenizer_info(state))


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    """POST /v1/completions and /v1/chat/completions: parsed and checked, then one generation each."""
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await parse(state, await request.body(), CompletionRequest)
        return await _respond(state, request, req, await completion_specs(state, req), False, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await parse(state, await request.body(), ChatCompletionRequest)
        return await _respond(state, request, req, await chat_specs(state, req), True, arrival)


async def _respond(state: ServerState, request: Request, req: Any, specs: list[Spec], chat: bool,
                   arrival: float) -> Response:
    """One generation, rendered as a stream or as one body; the engine drops its requests once the response
    is over, however it ends."""
    gen = start(state, req, specs, chat, request.state.request_id, arrival)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return render.StreamResponse(render.stream(state, gen, req, chat, include_usage), gen.release)
    try:
        return await render.fold(state, gen, req, chat, request.receive)
    finally:
        gen.release()

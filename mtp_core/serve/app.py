"""The FastAPI application: OpenAI-compatible endpoints over an engine client.

GET /v1/models, POST /v1/completions, POST /v1/chat/completions (with `stream: true`: server-sent events
ending in `data: [DONE]`), GET /health, GET /metrics (Prometheus text), GET /server_info (what `mtp bench
--base_url` puts in its report). Every error is an OpenAI error object with a one-line message.

Around the routes (outermost first): an error guard (an unexpected exception is a 500 object, never a
traceback), CORS (`allowed_origins`, browser preflights answered before the key check), `X-Request-Id`
(taken from the request or generated, echoed on every response, named in the log), the API key (Bearer
token on /v1/*), the request-body limit (413). A handler parses, validates and tokenizes (in worker threads,
see prompts.py), registers the request with the output thread (outputs.py) and sends it to the engine;
it then only formats and writes the text events that arrive.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from mtp_core.sampling import SamplingParams
from mtp_core.serve.engine_client import InProcessEngine
from mtp_core.serve.engine_core import SHUTDOWN_MESSAGE
from mtp_core.serve.messages import Add
from mtp_core.serve.metrics import render_metrics
from mtp_core.serve.outputs import OutputProcessor, RequestState, TextEvent
from mtp_core.serve.prompts import LARGE_TEXT, PromptEncoder
from mtp_core.serve.protocol import (MAX_CHOICES, SEED_MAX, APIError, ChatCompletionRequest, CompletionRequest,
                                     parse_body, short_repr, structured)
from mtp_core.speculative.stats import SpecStats
from mtp_core.serve.text import OutputText

log = logging.getLogger("mtp.serve")

REASONING_PARSERS = ("deepseek-r1",)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")


@dataclass
class ServeOptions:
    """The server's own settings (the engine's come with the engine)."""
    api_key: Optional[str] = None
    allowed_origins: Sequence[str] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def validate(self) -> None:
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api_key (or MTP_API_KEY) is empty; give a key or leave it unset")
        for o in self.allowed_origins:
            if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
                raise ValueError(f"--allowed_origins entry {o!r} is not an origin; use scheme://host[:port] "
                                 "(no path), or *")


@dataclass
class ServerState:
    engine: Any                                  # EngineProcess | InProcessEngine
    tokenizer: Any
    prompts: PromptEncoder
    outputs: OutputProcessor
    model_name: str
    reasoning_parser: Optional[str]
    defaults: dict[str, Any]
    created: int
    options: ServeOptions
    info: dict = field(default_factory=dict)
    accepting: bool = True
    output_text: Callable[..., OutputText] = OutputText     # tests may wrap it to inject a per-request fault

    @property
    def max_seq_len(self) -> int:
        return self.engine.ready.max_seq_len

    def cut(self) -> int:
        """Shutdown past --shutdown_timeout: every unfinished request gets its 503 now."""
        self.accepting = False
        return self.outputs.cut_all(503, SHUTDOWN_MESSAGE)


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

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(404)
    async def _not_found(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(404, f"no route {request.method} {short_repr(request.url.path)}; see GET "
                                          "/v1/models, POST /v1/completions, POST /v1/chat/completions").body(),
                            status_code=404)

    @app.exception_handler(405)
    async def _bad_method(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(APIError(405, f"{request.method} is not allowed on {short_repr(request.url.path)}").body(),
                            status_code=405)

    @app.get("/health")
    async def health() -> Response:
        if not _up(state):
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
        return PlainTextResponse(render_metrics(state.outputs.metrics, state.outputs.engine_stats, state.model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await _parse(state, await request.body(), CompletionRequest)
        _check_common(state, req)
        prompt = req.prompt
        # a string, a token-id list, or a list of either (one choice group per prompt, in order)
        prompts = [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else list(prompt)
        per_prompt = req.best_of or req.n
        if len(prompts) * per_prompt > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x {per_prompt} choices make {len(prompts) * per_prompt} "
                                f"sequences; send at most {MAX_CHOICES} per request", param="prompt")
        specs: list[_Spec] = []
        for k, p in enumerate(prompts):
            ids = await _prompt_ids(state, p)
            params = _sampling(state, req, req.max_tokens, len(ids), COMPLETIONS_DEFAULT_MAX_TOKENS,
                               logprobs=req.logprobs, zero_ok=req.echo)
            discard = req.max_tokens == 0
            if req.echo and req.logprobs is not None:
                params.prompt_logprobs = req.logprobs
            if per_prompt > req.n and params.logprobs is None:
                params.logprobs = 0                   # best_of ranks the candidates by their cumulative logprob
            echo = (p if isinstance(p, str) else state.tokenizer.decode(ids)) if req.echo else None
            for j in range(per_prompt):
                specs.append(_Spec(k * req.n + j, k, ids, _child(params, j), echo, discard))
        return await _generate(state, request, req, specs, chat=False, arrival=arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.perf_counter()
        req = await _parse(state, await request.body(), ChatCompletionRequest)
        _check_common(state, req)
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise APIError(400, "max_tokens and max_completion_tokens differ; send one of them", param="max_tokens")
        # developer messages are OpenAI's new name for system messages
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        size = sum(len(m["content"]) for m in messages)
        _check_min_tokens(state, size, "messages")
        try:
            ids = await state.prompts.encode_chat(messages, size)
        except ValueError as e:
            raise APIError(400, str(e).splitlines()[0], param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _sampling(state, req, max_tokens, len(ids), None,
                           logprobs=(req.top_logprobs or 0) if req.logprobs else None)
        mode, schema = req.tool_mode(f"the chat template of {state.model_name}")
        if mode is not None:               # a forced tool call: the grammar makes the output the call's JSON
            params.guided = ("json_schema", json.dumps(schema))
            try:
                params.validate()
            except ValueError as e:
                raise APIError(400, str(e), param="tool_choice") from None
        params.guided_after_think = params.guided is not None and state.reasoning_parser is not None
        tool = (mode, req.tool_choice["function"]["name"] if mode == "named" else None) if mode else None
        specs = [_Spec(j, 0, ids, _child(params, j), None, False, tool) for j in range(req.n)]
        return await _generate(state, request, req, specs, chat=True, arrival=arrival)

    # outermost last: guard -> CORS -> request id -> API key -> body limit -> routes
    app.add_middleware(_BodyLimit, limit=options.max_request_bytes)
    app.add_middleware(_ApiKey, key=options.api_key)
    app.add_middleware(_RequestId)
    if options.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"], max_age=600)
    app.add_middleware(_QuietCancel)
    return app


def _up(state: ServerState) -> bool:
    return state.accepting and state.engine.alive and not state.outputs.gone


# ---- request -> engine --------------------------------------------------------------------------

async def _parse(state: ServerState, raw: bytes, model: type) -> Any:
    if len(raw) > LARGE_TEXT:                 # a big body: parse it where a big prompt would be tokenized
        return await state.prompts.run(lambda: parse_body(raw, model), len(raw))
    return parse_body(raw, model)


def _check_common(state: ServerState, req: Any) -> None:
    if not _up(state):
        raise APIError(503, SHUTDOWN_MESSAGE if not state.accepting else "the engine stopped; retry later")
    if req.model != state.model_name:
        raise APIError(404, f"the model {short_repr(req.model)} does not exist; this server serves {state.model_name!r} "
                            "(see GET /v1/models)", param="model", code="model_not_found")
    bad = req.unsupported()
    if bad:
        raise APIError(400, bad[1], param=bad[0])


def _check_min_tokens(state: ServerState, num_chars: int, param: str) -> None:
    """The context check before tokenizing: the byte bound already puts the text over max_seq_len."""
    n = state.prompts.min_tokens(num_chars)
    if n >= state.max_seq_len:
        raise APIError(400, f"the prompt has at least {n} tokens ({num_chars} characters) but the model's context "
                            f"(max_seq_len) is {state.max_seq_len}; shorten the prompt", param=param,
                       code="context_length_exceeded")


async def _prompt_ids(state: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "prompt is an empty list; give text or at least one token id", param="prompt")
        _check_prompt_len(state, len(prompt), "prompt")             # before scanning a million ids
        vocab = state.engine.ready.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"prompt token id {short_repr(bad[0])} is outside the vocabulary [0, {vocab}); send "
                                "valid ids", param="prompt")
        return list(prompt)
    if not prompt.strip():
        raise APIError(400, "prompt is empty; give non-empty text", param="prompt")
    _check_min_tokens(state, len(prompt), "prompt")
    bos = getattr(state.tokenizer, "bos_token", None)
    # a prompt that is already rendered (it starts with the BOS text) gets no second BOS
    return await state.prompts.encode(prompt, add_special_tokens=not (bos and prompt.startswith(bos)))


def _check_prompt_len(state: ServerState, prompt_len: int, param: str) -> None:
    ready = state.engine.ready
    if prompt_len >= ready.max_seq_len:
        raise APIError(400, f"the prompt has {prompt_len} tokens but the model's context (max_seq_len) is "
                            f"{ready.max_seq_len}; shorten the prompt", param=param, code="context_length_exceeded")
    need = prompt_len + 1 + 2 * ready.num_draft_tokens
    if need > ready.pool_tokens:               # what Engine.add_request would refuse, answered before streaming
        raise APIError(400, f"the prompt needs {need} KV slots but the whole KV cache pool holds {ready.pool_tokens}; "
                            "shorten the prompt (or start the server with a larger kv_cache_config.max_tokens)",
                       param=param, code="context_length_exceeded")


def _sampling(state: ServerState, req: Any, max_tokens: Optional[int], prompt_len: int,
              default_max: Optional[int], logprobs: Optional[int] = None, zero_ok: bool = False) -> SamplingParams:
    """The request's SamplingParams. zero_ok: max_tokens 0 is allowed (completions with echo: the prompt's
    logprobs only; the engine then runs one token, which is not returned)."""
    max_len = state.max_seq_len
    _check_prompt_len(state, prompt_len, "messages" if default_max is None else "prompt")
    room = max_len - prompt_len
    if max_tokens is None:
        max_tokens = room if default_max is None else min(default_max, room)
    elif max_tokens == 0 and zero_ok:
        max_tokens = 1
    elif max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {short_repr(max_tokens)}", param="max_tokens")
    elif max_tokens > room:
        raise APIError(400, f"max_tokens is {short_repr(max_tokens)} but the prompt ({prompt_len} tokens) leaves room for "
                            f"{room} in the model's context of {max_len}; lower max_tokens",
                       param="max_tokens", code="context_length_exceeded")
    d = state.defaults
    pick = lambda v, k: d[k] if v is None else v  # noqa: E731
    top_k = int(pick(req.top_k, "top_k"))
    vocab = state.engine.ready.vocab_size
    if top_k > 0:
        top_k = min(top_k, vocab)     # the same distribution; fits the wire
    for name, ids in (("stop_token_ids", req.stop_token_ids or []),
                      ("logit_bias", [int(k) for k in (req.logit_bias or {})])):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"{name} token id {short_repr(bad[0])} is outside the vocabulary [0, {vocab})",
                           param=name)
    params = SamplingParams(max_tokens=max_tokens, temperature=float(pick(req.temperature, "temperature")),
                            top_k=top_k, top_p=float(pick(req.top_p, "top_p")), seed=req.seed,
                            ignore_eos=req.ignore_eos, stop_token_ids=list(req.stop_token_ids or []),
                            presence_penalty=float(req.presence_penalty or 0.0),
                            frequency_penalty=float(req.frequency_penalty or 0.0),
                            repetition_penalty=float(req.repetition_penalty if req.repetition_penalty is not None
                                                     else 1.0),
                            logit_bias={int(k): float(v) for k, v in (req.logit_bias or {}).items()},
                            min_tokens=min(req.min_tokens or 0, max_tokens), min_p=float(req.min_p or 0.0),
                            logprobs=logprobs,
                            guided=req.guided() if hasattr(req, "guided") else structured(req.structured_outputs))
    try:
        params.validate()
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split()[0]) from None
    return params


def _child(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j's parameters: its own seed, seed + j, as vLLM derives them (choice 0 keeps the request's)."""
    return replace(params, seed=None if params.seed is None else _wrap_seed(params.seed + j),
                   stop_token_ids=list(params.stop_token_ids), logit_bias=dict(params.logit_bias))


def _wrap_seed(seed: int) -> int:
    return seed if seed <= SEED_MAX else seed - 2 ** 64       # stays in what torch.Generator takes


@dataclass
class _Spec:
    """One engine request answering one choice (or one best_of candidate)."""
    index: int                      # the choice index (candidates of best_of: their prompt's first index + j)
    prompt_index: int
    ids: list[int]
    params: SamplingParams
    echo: Optional[str]             # completions with echo: the prompt's text, put before the choice's text
    discard: bool                   # max_tokens 0 (echo): no completion tokens
    tool: Optional[tuple[str, Optional[str]]] = None   # a forced tool call: ("named", name) | ("required", None)


@dataclass
class _Choice:
    """What the handler gathers for one choice."""
    spec: _Spec
    rs: RequestState
    text: dict[str, str] = field(default_factory=dict)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: Optional[list] = None
    done: Optional[TextEvent] = None
    offset: int = 0                 # completions logprobs: text_offset of the next token
    call_id: str = ""               # a forced tool call (named): its id, sent with its first streamed delta
    started: bool = False           # streaming: the choice's first chunk was sent


async def _generate(state: ServerState, request: Request, req: Any, specs: list[_Spec], chat: bool,
                    arrival: float) -> Response:
    """Every choice is a request in the engine's batch (the prefix cache shares their prompt); the streamed and
    the non-streamed response are built from the same events."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])     # matched on the text
    think = state.tokenizer.think_token_ids() if chat and state.reasoning_parser else None
    starts_in = False
    if think:
        ids = specs[0].ids
        last = max((i for i, t in enumerate(ids) if t in think), default=-1)
        starts_in = last >= 0 and ids[last] == think[0]
    if not _up(state):
        raise APIError(503, SHUTDOWN_MESSAGE)
    queue: asyncio.Queue = asyncio.Queue()
    choices: dict[int, _Choice] = {}
    for n, sp in enumerate(specs):
        text = state.output_text(state.tokenizer, stops, think, starts_in, req.include_stop_str_in_output)
        # best_of candidates are told apart by their position in specs until the best are chosen
        rs = state.outputs.register(text, len(sp.ids), request.state.request_id, arrival, n, queue, sp.discard)
        choices[n] = _Choice(sp, rs)
    firsts: dict[int, int] = {}              # prompt -> the rid of its first choice
    for c in choices.values():
        first = firsts.setdefault(c.spec.prompt_index, c.rs.rid)
        # the prompt's other choices wait for the first one's prefill and map its blocks from the prefix cache
        # (not with prompt logprobs: they compute every prompt position anyway)
        after = first if first != c.rs.rid and c.spec.params.prompt_logprobs is None else 0
        state.engine.send(Add(c.rs.rid, c.spec.ids, c.spec.params, after))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    prompt_tokens = sum(len(ids) for ids in {sp.prompt_index: sp.ids for sp in specs}.values())
    release = lambda: [_release(state, c.rs) for c in choices.values()]  # noqa: E731
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _Stream(_sse(state, req, queue, choices, rid, chat, include_usage, prompt_tokens), release)
    try:
        return await _collect(state, request, req, queue, choices, rid, chat, prompt_tokens)
    finally:
        release()


def _release(state: ServerState, rs: RequestState) -> None:
    """The response is over (sent, failed or its client left): make sure the engine drops the request."""
    if not rs.closed:
        state.outputs.abort(rs, "client disconnected")


def _usage(prompt_len: int, n: int) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


def _spec_stats(stats: Any) -> Optional[dict]:
    """Extension: this request's speculative-decoding counters (what `mtp bench --base_url` reports)."""
    if stats is None:
        return None
    return {"decoding_steps": stats.num_steps, "output_tokens": stats.num_output_tokens,
            "draft_tokens": stats.num_draft_proposed, "accepted_draft_tokens": stats.num_draft_accepted,
            "proposed_per_position": list(stats.proposed_per_position),
            "accepted_per_position": list(stats.accepted_per_position)}


def _sum_stats(stats: list[Any]) -> Any:
    """The spec_decode_stats of a response: the one request's, or the sum over its choices."""
    stats = [s for s in stats if s is not None]
    if len(stats) <= 1:
        return stats[0] if stats else None
    tot = SpecStats()
    for s in stats:
        tot.num_steps += s.num_steps
        tot.num_output_tokens += s.num_output_tokens
        tot.num_draft_proposed += s.num_draft_proposed
        tot.num_draft_accepted += s.num_draft_accepted
        for name in ("proposed_per_position", "accepted_per_position"):
            a, b = list(getattr(tot, name)), list(getattr(s, name))
            a += [0] * (len(b) - len(a))
            setattr(tot, name, [x + (b[i] if i < len(b) else 0) for i, x in enumerate(a)])
    return tot


def _finish_reason(ev: TextEvent) -> str:
    return "length" if ev.finish_reason == "length" else "stop"


def _absorb(c: _Choice, ev: TextEvent) -> None:
    for k, v in ev.delta.items():
        c.text[k] = c.text.get(k, "") + v
    if ev.logprobs:
        c.logprobs.extend(ev.logprobs)
    if ev.prompt_logprobs is not None:
        c.prompt_logprobs = ev.prompt_logprobs


def _chat_logprobs(entries: list) -> dict:
    """OpenAI's chat logprobs object: content, one entry per token (its text, bytes, top_logprobs)."""
    return {"content": [{"token": t, "logprob": lp, "bytes": raw,
                         "top_logprobs": [{"token": u, "logprob": v, "bytes": ub} for u, v, ub in top]}
                        for t, lp, top, _, raw in entries],
            "refusal": None}


def _completion_logprobs(entries: list, offset: int, top_n: int) -> tuple[dict, int]:
    """OpenAI's completions logprobs object for these tokens, text offsets from `offset`; (object, next offset).
    An entry None (the first prompt token of an echo) has no logprob. top_logprobs holds the top_n and the
    chosen token (so up to top_n + 1 entries, as OpenAI says)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        if e is None:
            continue
        t, lp, top = e[0], e[1], e[2]
        out["tokens"].append(t)
        out["token_logprobs"].append(lp)
        d: dict[str, float] = {}
        for u, v, _ in top[:top_n]:
            d.setdefault(u, v)          # two ids with the same text: the likelier one's value
        d.setdefault(t, lp)
        out["top_logprobs"].append(d)
        out["text_offset"].append(offset)
        offset += len(t)
    return out, offset


def _completion_chunk_logprobs(c: _Choice, entries: list, top_n: int, with_prompt: bool) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if with_prompt and c.prompt_logprobs:
        first = c.prompt_logprobs[0] is None
        if first:                                  # the first prompt token: its text, no logprob
            out["tokens"].append(_first_token_text(c))
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(c.offset)
            c.offset += len(out["tokens"][-1])
        part, c.offset = _completion_logprobs(c.prompt_logprobs[1:], c.offset, top_n)
        for k in out:
            out[k] += part[k]
    part, c.offset = _completion_logprobs(entries, c.offset, top_n)
    for k in out:
        out[k] += part[k]
    return out


def _first_token_text(c: _Choice) -> str:
    return c.rs.text.tok.decode([c.spec.ids[0]], skip_special_tokens=False)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _tool_calls(tool: tuple[str, Optional[str]], content: str) -> Optional[list[dict]]:
    """The tool_calls of a forced call's output (the grammar's JSON); None if it does not parse."""
    mode, name = tool
    try:
        data = json.loads(content)
    except ValueError:
        return None
    if mode == "named":
        return [{"id": _call_id(), "type": "function", "function": {"name": name, "arguments": content}}]
    return [{"id": _call_id(), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}}
            for c in data]


def _best(choices: dict[int, _Choice], req: Any) -> list[_Choice]:
    """The returned choices in OpenAI's order; best_of keeps each prompt's n candidates with the highest
    cumulative logprob (ties to the earlier candidate), as vLLM does."""
    out = sorted(choices.values(), key=lambda c: c.spec.index)
    best_of = getattr(req, "best_of", None) or req.n
    if best_of == req.n:
        return out
    kept: list[_Choice] = []
    groups: dict[int, list[_Choice]] = {}
    for c in out:
        groups.setdefault(c.spec.prompt_index, []).append(c)
    for k, group in sorted(groups.items()):
        ranked = sorted(group, key=lambda c: -sum(e[1] for e in c.logprobs))[:req.n]
        for j, c in enumerate(ranked):
            c.spec.index = k * req.n + j
            kept.append(c)
    return kept


async def _collect(state: ServerState, request: Request, req: Any, queue: asyncio.Queue,
                   choices: dict[int, _Choice], rid: str, chat: bool, prompt_tokens: int) -> Response:
    async def watch() -> None:                 # the client leaving is an http.disconnect message
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for c in choices.values():
            state.outputs.abort(c.rs, "client disconnected")

    watcher = asyncio.create_task(watch())
    left = len(choices)
    try:
        while left:
            ev = await queue.get()
            if ev.kind == "error":
                raise APIError(ev.status, ev.message)
            c = choices[ev.index]
            _absorb(c, ev)
            if ev.kind == "done":
                c.done = ev
                left -= 1
    finally:
        watcher.cancel()
    if any(c.rs.abort_reason == "client disconnected" for c in choices.values()):
        return Response(status_code=499)                       # nobody is there to read it
    completion_tokens = sum(c.done.num_tokens for c in choices.values())
    stats = _sum_stats([c.done.stats for c in choices.values()])
    out = []
    for c in _best(choices, req):
        reason = _finish_reason(c.done)
        content = c.text.get("content", "")
        if chat:
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if state.reasoning_parser:
                msg["reasoning_content"] = c.text.get("reasoning_content") or None
                msg["content"] = content or (None if msg["reasoning_content"] else "")
            calls = _tool_calls(c.spec.tool, content) if c.spec.tool and c.done.finish_reason != "length" else None
            if calls is not None:
                msg["content"], msg["tool_calls"] = None, calls
                reason = "tool_calls" if c.spec.tool[0] == "required" else "stop"     # OpenAI's reasons
            out.append({"index": c.spec.index, "message": msg,
                        "logprobs": _chat_logprobs(c.logprobs) if req.logprobs else None, "finish_reason": reason})
        else:
            lp = None
            if req.logprobs is not None:
                lp = _completion_chunk_logprobs(c, c.logprobs, req.logprobs, with_prompt=c.spec.echo is not None)
            out.append({"index": c.spec.index, "text": (c.spec.echo or "") + content, "logprobs": lp,
                        "finish_reason": reason})
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": int(time.time()), "model": state.model_name, "choices": out,
                         "usage": _usage(prompt_tokens, completion_tokens), "spec_decode_stats": _spec_stats(stats)})


def _sse(state: ServerState, req: Any, queue: asyncio.Queue, choices: dict[int, _Choice], rid: str, chat: bool,
         include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = json.dumps({"id": rid, "object": obj, "created": created, "model": state.model_name})[:-1]

    def chunk(c: _Choice, ev: Optional[TextEvent], reason: Optional[str], first: bool = False,
              delta: Optional[dict] = None) -> str:
        # hand-assembled (the hot path: one per request per engine step); same JSON as json.dumps would give
        if delta is None:
            delta = ev.delta if ev is not None else {}
        entries = (ev.logprobs or []) if ev is not None else []
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            d.update(delta)
            lp = json.dumps(_chat_logprobs(entries), ensure_ascii=False) if req.logprobs and entries else "null"
            body = f'{{"index": {c.spec.index}, "delta": {json.dumps(d, ensure_ascii=False)}, "logprobs": {lp}'
        else:
            text = delta.get("content", "")
            echo_now = c.spec.echo is not None and not c.started and ev is not None
            if echo_now:
                text = c.spec.echo + text
                c.started = True
            lp = "null"
            if req.logprobs is not None and (entries or echo_now):
                if echo_now and ev.prompt_logprobs is not None:
                    c.prompt_logprobs = ev.prompt_logprobs
                lp = json.dumps(_completion_chunk_logprobs(c, entries, req.logprobs, with_prompt=echo_now),
                                ensure_ascii=False)
            body = f'{{"index": {c.spec.index}, "text": {json.dumps(text, ensure_ascii=False)}, "logprobs": {lp}'
        return f'data: {head}, "choices": [{body}, "finish_reason": {json.dumps(reason)}}}]}}\n\n'

    async def gen() -> AsyncIterator[str]:
        if chat:
            for c in sorted(choices.values(), key=lambda c: c.spec.index):
                yield chunk(c, None, None, first=True)
        left, completion_tokens, stats = len(choices), 0, []
        while left:
            ev = await queue.get()
            if ev.kind == "error":
                yield _data(APIError(ev.status, ev.message).body())
                yield "data: [DONE]\n\n"
                return
            c = choices[ev.index]
            reason = _finish_reason(ev)
            if c.spec.tool:
                _absorb(c, ev)
                tool_delta = _tool_delta(c, ev)
                if tool_delta is not None:
                    yield chunk(c, ev, None, delta=tool_delta)
                    if ev.kind == "done" and c.spec.tool[0] == "required" and "tool_calls" in tool_delta:
                        reason = "tool_calls"
                elif ev.logprobs:
                    yield chunk(c, ev, None, delta={})
            elif ev.delta or ev.logprobs or (c.spec.echo is not None and not c.started):
                yield chunk(c, ev, None)
            if ev.kind == "done":
                yield chunk(c, None, reason)
                left -= 1
                completion_tokens += ev.num_tokens
                stats.append(ev.stats)
        if include_usage:
            yield _data({"id": rid, "object": obj, "created": created, "model": state.model_name,
                         "choices": [], "usage": _usage(prompt_tokens, completion_tokens),
                         "spec_decode_stats": _spec_stats(_sum_stats(stats))})
        yield "data: [DONE]\n\n"

    return gen()


def _tool_delta(c: _Choice, ev: TextEvent) -> Optional[dict]:
    """A forced tool call, streamed: a named call's arguments as they come (OpenAI's tool_calls deltas: the
    first with the id, type and name); `required` calls whole, once the output is complete."""
    mode, name = c.spec.tool
    piece = ev.delta.get("content", "")
    if mode == "named":
        if not piece:
            return None
        if not c.call_id:
            c.call_id = _call_id()
            return {"tool_calls": [{"index": 0, "id": c.call_id, "type": "function",
                                    "function": {"name": name, "arguments": piece}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
    if ev.kind != "done":
        return None
    calls = _tool_calls(c.spec.tool, c.text.get("content", "")) if ev.finish_reason != "length" else None
    if calls is None:                          # cut short by max_tokens: the text as it is
        return {"content": c.text.get("content", "")} if c.text.get("content") else None
    return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ---- middleware (plain ASGI) ------------------------------------------------------------------

async def _send_error(send: Any, e: APIError, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class _QuietCancel:
    """Outermost guard of every HTTP request. An unexpected exception becomes a 500 error object (one log
    line; the traceback only at debug level). A request cancelled by the server's shutdown ends quietly: its
    handler's cleanup has aborted its engine request already."""

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
            rid = scope.get("state", {}).get("request_id", "-")
            log.error("unexpected error on %s (request %s): %s: %s", scope.get("path"), rid, type(e).__name__, first)
            log.debug("traceback", exc_info=True)
            if not started:
                await _send_error(send, APIError(500, f"internal error: {type(e).__name__}: {first}".rstrip(": ")),
                                  [(b"x-request-id", rid.encode())])


class _RequestId:
    """X-Request-Id: the client's (1-256 visible ASCII characters) or a new one; echoed on every response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        rid = given.decode("latin-1") if given is not None else uuid.uuid4().hex
        if given is not None and not _REQUEST_ID.fullmatch(rid):
            new = uuid.uuid4().hex
            return await _send_error(send, APIError(400, "X-Request-Id must be 1-256 visible ASCII characters; send "
                                                         "another or leave it out"), [(b"x-request-id", new.encode())])
        scope.setdefault("state", {})["request_id"] = rid
        raw = rid.encode("latin-1")

        async def with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", raw)]
            await send(message)

        await self.app(scope, receive, with_id)


class _ApiKey:
    """With a key set: /v1/* needs `Authorization: Bearer <key>` (401 otherwise); the rest stays open."""

    def __init__(self, app: Any, key: Optional[str]) -> None:
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.key is None or scope.get("type") != "http" or not scope.get("path", "").startswith("/v1/"):
            return await self.app(scope, receive, send)
        auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            rid = scope.get("state", {}).get("request_id", "-")
            log.warning("request %s: %s %s refused: %s API key", rid, scope.get("method"), scope.get("path"),
                        "wrong" if auth else "no")
            return await _send_error(send, APIError(401, "invalid or missing API key; send the header "
                                                         "'Authorization: Bearer <key>'", code="invalid_api_key"),
                                     [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class _TooLarge(Exception):
    pass


class _BodyLimit:
    """Request bodies over `limit` bytes get a 413 error object. A declared Content-Length over it is
    refused before anything is buffered (the body is read and dropped, up to DRAIN_FACTOR x the limit, so
    that the client, still sending, sees the answer); a chunked body is counted as it arrives."""

    DRAIN_FACTOR = 8

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    def _error(self, size: Optional[int]) -> APIError:
        what = f"is {size} bytes" if size is not None else "is longer than that"
        return APIError(413, f"the request body {what}, over the limit of {self.limit} bytes (--max_request_bytes); "
                             "send a shorter prompt or raise the limit", code="request_too_large")

    async def _drain(self, receive: Any) -> None:
        seen = 0
        while seen <= self.DRAIN_FACTOR * self.limit:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            seen += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                return

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        size = int(declared) if declared is not None and declared.isdigit() else None
        if size is not None and size > self.limit:
            await self._drain(receive)
            return await _send_error(send, self._error(size))
        seen = 0
        started = False

        async def counted() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return msg

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await self._drain(receive)
                await _send_error(send, self._error(None))


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

"""A request body -> the engine requests that answer it: prompt ids, SamplingParams, one `Spec` per choice.

Every check that answers before generation lives here (503 while stopping, 404 for another model, 400 for a
value this server cannot honour, context_length_exceeded), so a handler either gets its specs or an
APIError. Tokenizing runs in worker threads (prompts.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from mtp_core.sampling import SamplingParams
from mtp_core.serve.engine_core import SHUTDOWN_MESSAGE
from mtp_core.serve.parse import parse_body
from mtp_core.serve.prompts import LARGE_TEXT
from mtp_core.serve.protocol import (MAX_CHOICES, NOT_IMPLEMENTED, SEED_MAX, APIError, ChatCompletionRequest,
                                     CompletionRequest, short_repr, structured)
from mtp_core.serve.state import ServerState
from mtp_core.serve.tools import ToolMode, plan_tools

COMPLETIONS_DEFAULT_MAX_TOKENS = 16          # OpenAI's default for /v1/completions


@dataclass
class Spec:
    """One engine request answering one choice (or one best_of candidate)."""
    index: int                      # the choice index (candidates of best_of: their prompt's first index + j)
    prompt_index: int
    ids: list[int]
    params: SamplingParams
    echo: Optional[str]             # completions with echo: the prompt's text, put before the choice's text
    discard: bool                   # max_tokens 0 (echo): no completion tokens
    tool: Optional[ToolMode] = None  # tools in play: how the output is read (tools.py)
    guided_param: Optional[str] = None  # the field a grammar came from (a grammar that cannot be compiled: its 400)


async def parse(state: ServerState, raw: bytes, model: type) -> Any:
    if len(raw) > LARGE_TEXT:                 # a big body: parse it where a big prompt would be tokenized
        return await state.prompts.run(lambda: parse_body(raw, model), len(raw))
    return parse_body(raw, model)


async def completion_specs(state: ServerState, req: CompletionRequest) -> list[Spec]:
    """A string, a token-id list, or a list of either: one choice group per prompt, in order; best_of
    candidates are specs too (the response keeps the best n)."""
    _check_common(state, req)
    prompt = req.prompt
    prompts = [prompt] if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else list(prompt)
    per_prompt = req.best_of or req.n
    if len(prompts) * per_prompt > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x {per_prompt} choices make {len(prompts) * per_prompt} "
                            f"sequences; send at most {MAX_CHOICES} per request", param="prompt")
    specs: list[Spec] = []
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
            specs.append(Spec(k * req.n + j, k, ids, _child(params, j), echo, discard,
                              guided_param="structured_outputs" if params.guided else None))
    return specs


async def chat_specs(state: ServerState, req: ChatCompletionRequest) -> list[Spec]:
    """The messages through the chat template, with the tools as tools.py plans them (a forced call: a grammar)."""
    _check_common(state, req)
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise APIError(400, "max_tokens and max_completion_tokens differ; send one of them", param="max_tokens")
    plan = plan_tools(req, state.prompts.template_tools, f"the chat template of {state.model_name}")
    size = sum(len(m["content"] or "") for m in plan.messages)
    _check_min_tokens(state, size, "messages")
    try:
        ids = await state.prompts.encode_chat(plan.messages, size, tools=plan.tools)
    except ValueError as e:             # the template refused the conversation (raise_exception)
        raise APIError(400, str(e).splitlines()[0], param="messages") from None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling(state, req, max_tokens, len(ids), None,
                       logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    guided_param = "response_format" if req.response_format is not None else "structured_outputs"
    if plan.guided is not None:        # a forced tool call: the grammar makes the output the call
        params.guided, guided_param = plan.guided, "tools"
        try:
            params.validate()
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from None
    params.guided_after_think = params.guided is not None and state.reasoning_parser is not None
    return [Spec(j, 0, ids, _child(params, j), None, False, plan.mode, guided_param if params.guided else None)
            for j in range(req.n)]


def _check_common(state: ServerState, req: Any) -> None:
    if not state.up:
        raise APIError(503, SHUTDOWN_MESSAGE if not state.accepting else "the engine stopped; retry later")
    if req.model != state.model_name:
        raise APIError(404, f"the model {short_repr(req.model)} does not exist; this server serves "
                            f"{state.model_name!r} (see GET /v1/models)", param="model", code="model_not_found")
    bad = req.unsupported()
    if bad:
        raise APIError(400, bad[1], param=bad[0],
                       code="unsupported_value" if bad[0] in NOT_IMPLEMENTED else "invalid_value")


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
        raise APIError(400, f"max_tokens is {short_repr(max_tokens)} but the prompt ({prompt_len} tokens) leaves "
                            f"room for {room} in the model's context of {max_len}; lower max_tokens",
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

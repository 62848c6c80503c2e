"""The one generation path of POST /v1/completions and /v1/chat/completions, streamed or not.

`start` registers every choice of a request with the output thread (one shared event queue) and sends it to
the engine; `Generation.updates` is the single producer: it turns the text events of the output thread
into per-choice `Update`s and ends with one `Usage`. The streamed response renders each update as SSE
chunks, the non-streamed one folds the same updates into its body (render.py); neither reads an event.

    engine ─▶ output thread ─▶ TextEvent(index, delta, logprobs, ...) ─▶ queue ─▶ updates(): Update ..., Usage
                                                                               ├─▶ render.stream: SSE chunks
                                                                               └─▶ render.fold: one JSON body

An error event (the engine failed the request, the shutdown cut it) raises its APIError from `updates`:
the streamed response sends it as an error event, the non-streamed one answers with it. Whatever way a
response ends, `release` aborts the choices still running in the engine.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Union

from mtp_core.chat_format import TOOL_MARKUP
from mtp_core.request.stats import SpecStats
from mtp_core.serve.engine_core import SHUTDOWN_MESSAGE
from mtp_core.serve.formats import call_id, forced_calls, spec_stats, sum_stats, usage
from mtp_core.serve.messages import Add
from mtp_core.serve.outputs import RequestState, TextEvent
from mtp_core.serve.params import Spec
from mtp_core.serve.protocol import APIError
from mtp_core.serve.state import ServerState
from mtp_core.serve.tool_parser import ParseDelta, ToolCallParser

DISCONNECTED = "client disconnected"


@dataclass
class Update:
    """What one engine event brings to one choice."""
    choice: int                             # the choice's position in Generation.specs
    text: dict[str, str]                    # new text per channel: content (and reasoning_content with a parser)
    logprobs: list                          # the entries of the tokens behind `text` (formats.py)
    prompt_logprobs: Optional[list] = None  # echo with logprobs: the prompt's entries (with the first tokens)
    echo: Optional[str] = None              # the choice's first update (echo): the prompt text, put before `text`
    # tool calls as OpenAI streams them: each call's first delta has its index, id, type and name, the next ones
    # pieces of its arguments (a forced JSON-list call of `required`: every call whole, on the last update)
    tool_calls_delta: Optional[list[dict]] = None
    finish_reason: Optional[str] = None     # the choice's last update: stop | length | tool_calls
    tool_calls: Optional[list[dict]] = None  # the last update: the calls made (None: none, or a forced call cut short)


@dataclass
class Usage:
    """The last item of `updates`: the request's token counts and speculative-decoding counters (every choice,
    best_of candidates included)."""
    prompt_tokens: int
    completion_tokens: int
    stats: Optional[SpecStats]

    def fields(self) -> dict:
        return {"usage": usage(self.prompt_tokens, self.completion_tokens), "spec_decode_stats": spec_stats(self.stats)}


@dataclass
class _Choice:
    """The producer's own state for one choice."""
    spec: Spec
    rs: RequestState
    started: bool = False                   # an update was produced
    content: str = ""                       # a forced JSON call: the output so far (the calls are parsed at its end)
    call_ids: list[str] = field(default_factory=list)   # the ids of the calls announced so far
    parser: Optional[ToolCallParser] = None  # tools whose output is DeepSeek markup (tool_parser.py)


def start(state: ServerState, req: Any, specs: list[Spec], chat: bool, request_id: str,
          arrival: float) -> Generation:
    """Every choice is a request in the engine's batch (the prefix cache shares their prompt)."""
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])     # matched on the text
    think = state.tokenizer.think_token_ids() if chat and state.reasoning_parser else None
    starts_in = False
    if think:
        ids = specs[0].ids
        last = max((i for i, t in enumerate(ids) if t in think), default=-1)
        starts_in = last >= 0 and ids[last] == think[0]
    if not state.up:
        raise APIError(503, SHUTDOWN_MESSAGE)
    queue: asyncio.Queue[TextEvent] = asyncio.Queue()
    choices: list[_Choice] = []
    for n, sp in enumerate(specs):
        # the parser reads the markup: shown even where the vocabulary has its markers as special tokens
        keep = state.tokenizer.special_ids(TOOL_MARKUP) if sp.tool and sp.tool.markup else []
        text = state.output_text(state.tokenizer, stops, think, starts_in, req.include_stop_str_in_output,
                                 **({"keep": keep} if keep else {}))
        # events name their choice by its position in specs (best_of candidates until the best are chosen)
        rs = state.outputs.register(text, len(sp.ids), request_id, arrival, n, queue, sp.discard)
        choices.append(_Choice(sp, rs, parser=ToolCallParser() if sp.tool and sp.tool.markup else None))
    firsts: dict[int, int] = {}              # prompt -> the rid of its first choice
    for c in choices:
        first = firsts.setdefault(c.spec.prompt_index, c.rs.rid)
        # the prompt's other choices wait for the first one's prefill and map its blocks from the prefix cache
        # (not with prompt logprobs: they compute every prompt position anyway)
        after = first if first != c.rs.rid and c.spec.params.prompt_logprobs is None else 0
        state.engine.send(Add(c.rs.rid, c.spec.ids, c.spec.params, after))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    return Generation(state, specs, choices, queue, rid)


class Generation:
    """One request's choices in flight: the producer of their updates, and the aborts when the response ends."""

    def __init__(self, state: ServerState, specs: list[Spec], choices: list[_Choice], queue: asyncio.Queue,
                 rid: str) -> None:
        self.state, self.specs, self.id = state, specs, rid
        self._choices, self._queue = choices, queue
        self.prompt_tokens = sum(len(ids) for ids in {sp.prompt_index: sp.ids for sp in specs}.values())

    async def updates(self) -> AsyncIterator[Union[Update, Usage]]:
        """Each event's update, in arrival order, until every choice is done; then the Usage."""
        left, completion_tokens, stats = len(self._choices), 0, []
        while left:
            ev = await self._queue.get()
            if ev.kind == "error":
                # a 400 from the engine is a grammar it cannot compile: name the field it came from
                param = self._choices[ev.index].spec.guided_param if ev.status == 400 else None
                raise APIError(ev.status, ev.message, param=param,
                               code="invalid_grammar" if param else None)
            yield self._update(self._choices[ev.index], ev)
            if ev.kind == "done":
                left -= 1
                completion_tokens += ev.num_tokens
                stats.append(ev.stats)
        yield Usage(self.prompt_tokens, completion_tokens, sum_stats(stats))

    def _update(self, c: _Choice, ev: TextEvent) -> Update:
        u = Update(ev.index, dict(ev.delta), ev.logprobs or [], ev.prompt_logprobs, None if c.started else c.spec.echo)
        c.started = True
        if c.parser is not None:
            self._markup(c, ev, u)
        elif c.spec.tool:
            self._forced_json(c, ev, u)
        if ev.kind == "done":
            u.finish_reason = "length" if ev.finish_reason == "length" else "stop"
            tool = c.spec.tool
            if u.finish_reason == "stop" and u.tool_calls and tool and tool.choice != "named":
                u.finish_reason = "tool_calls"                  # OpenAI's reasons (a named function's is stop)
        return u

    def _markup(self, c: _Choice, ev: TextEvent, u: Update) -> None:
        """Tool calls in DeepSeek markup: the content is what the parser leaves; calls stream as they are written."""
        piece = u.text.pop("content", "")
        d = c.parser.feed(piece) if piece else ParseDelta()
        if ev.kind == "done":
            end = c.parser.finish()
            d.content += end.content
            for cd in end.calls:
                d.add_args(cd.index, cd.arguments) if cd.name is None else d.calls.append(cd)
        if d.content:
            u.text["content"] = d.content
        entries: list[dict] = []
        for cd in d.calls:
            if cd.name is not None:
                c.call_ids.append(call_id())
                entries.append({"index": cd.index, "id": c.call_ids[cd.index], "type": "function",
                                "function": {"name": cd.name, "arguments": cd.arguments}})
            elif entries and entries[-1]["index"] == cd.index:
                entries[-1]["function"]["arguments"] += cd.arguments
            else:
                entries.append({"index": cd.index, "function": {"arguments": cd.arguments}})
        u.tool_calls_delta = entries or None
        if ev.kind == "done" and c.parser.calls:
            u.tool_calls = [{"id": c.call_ids[i], "type": "function",
                             "function": {"name": call.name, "arguments": call.arguments}}
                            for i, call in enumerate(c.parser.calls)]

    def _forced_json(self, c: _Choice, ev: TextEvent, u: Update) -> None:
        """A forced call on a template without DeepSeek markup: the output is the grammar's JSON (a named call's
        arguments, streamed as they come; `required`'s list, whole at the end). Cut by max_tokens: the text."""
        tool = c.spec.tool
        piece = u.text.pop("content", "")
        c.content += piece
        if tool.choice == "named" and piece:
            if not c.call_ids:
                c.call_ids.append(call_id())
                u.tool_calls_delta = [{"index": 0, "id": c.call_ids[0], "type": "function",
                                       "function": {"name": tool.name, "arguments": piece}}]
            else:
                u.tool_calls_delta = [{"index": 0, "function": {"arguments": piece}}]
        if ev.kind != "done":
            return
        if ev.finish_reason != "length":
            u.tool_calls = forced_calls(tool, c.content, c.call_ids[0] if c.call_ids else call_id())
        if tool.choice == "required":
            if u.tool_calls is not None:
                u.tool_calls_delta = [{"index": i, **call} for i, call in enumerate(u.tool_calls)]
            elif c.content:
                u.text["content"] = c.content      # cut short by max_tokens: the text as it is
        elif u.tool_calls is None and c.content:
            u.text["content"] = c.content

    async def watch(self, receive: Callable[[], Awaitable[dict]]) -> None:
        """Until the client leaves (an http.disconnect message), then every choice is aborted. The non-streamed
        response runs it while it waits; Starlette ends a stream whose client left, and its close runs `release`."""
        while (await receive())["type"] != "http.disconnect":
            pass
        for c in self._choices:
            self.state.outputs.abort(c.rs, DISCONNECTED)

    @property
    def disconnected(self) -> bool:
        return any(c.rs.abort_reason == DISCONNECTED for c in self._choices)

    def release(self) -> None:
        """The response is over (sent, failed or its client left): make sure the engine drops every choice."""
        for c in self._choices:
            if not c.rs.closed:
                self.state.outputs.abort(c.rs, DISCONNECTED)

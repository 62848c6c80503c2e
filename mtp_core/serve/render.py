"""The two renderers of a Generation's updates (generate.py): `stream` writes each update as SSE chunks,
`fold` folds them into one JSON body. Both take their text, logprobs, tool calls and finish reasons from
the updates alone, and their JSON parts from formats.py.

What only one of them does, and why:
- stream: a chat stream opens with one role chunk per choice; a choice's last update is followed by its own
  chunk with the finish reason; tool calls go in `tool_calls` deltas beside the text; the usage chunk only with
  stream_options.include_usage; an error becomes an `error` event, then [DONE].
- fold: best_of keeps each prompt's n likeliest candidates (best_of > 1 is never streamed); a message with tool
  calls has them in `tool_calls` and null content unless the model wrote text besides them; a client gone
  before the end gets a bare 499.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from fastapi.responses import JSONResponse, Response, StreamingResponse

from mtp_core.serve.formats import chat_logprobs, completion_logprobs
from mtp_core.serve.generate import Generation, Update, Usage
from mtp_core.serve.params import Spec
from mtp_core.serve.protocol import APIError
from mtp_core.serve.state import ServerState


def stream(state: ServerState, gen: Generation, req: Any, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """The events of a streamed response, each `data: <chunk JSON>`, the last `data: [DONE]`."""
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = json.dumps({"id": gen.id, "object": obj, "created": created, "model": state.model_name})[:-1]
    offsets = [0] * len(gen.specs)           # completions logprobs: the text_offset of each choice's next token

    def chunk(i: int, delta: dict, entries: list, reason: Optional[str] = None, first: bool = False,
              echo: Optional[str] = None, prompt: Optional[list] = None) -> str:
        # hand-assembled (the hot path: one per request per engine step); same JSON as json.dumps would give
        spec = gen.specs[i]
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            d.update(delta)
            lp = json.dumps(chat_logprobs(entries), ensure_ascii=False) if req.logprobs and entries else "null"
            body = f'{{"index": {spec.index}, "delta": {json.dumps(d, ensure_ascii=False)}, "logprobs": {lp}'
        else:
            text = (echo or "") + delta.get("content", "")
            lp = "null"
            if req.logprobs is not None and (entries or echo is not None):
                part, offsets[i] = completion_logprobs(entries, req.logprobs, offsets[i], prompt,
                                                       _first_text(state, spec) if prompt else "")
                lp = json.dumps(part, ensure_ascii=False)
            body = f'{{"index": {spec.index}, "text": {json.dumps(text, ensure_ascii=False)}, "logprobs": {lp}'
        return f'data: {head}, "choices": [{body}, "finish_reason": {json.dumps(reason)}}}]}}\n\n'

    def chunks(u: Update) -> list[str]:
        out = []
        if u.tool_calls_delta:
            out.append(chunk(u.choice, {**u.text, "tool_calls": u.tool_calls_delta}, u.logprobs))
        elif u.text or u.logprobs or u.echo is not None:
            # an echo's prompt logprobs go with its first chunk, the prompt's text
            prompt = u.prompt_logprobs if u.echo is not None else None
            out.append(chunk(u.choice, u.text, u.logprobs, echo=u.echo, prompt=prompt))
        if u.finish_reason is not None:
            out.append(chunk(u.choice, {}, [], u.finish_reason))
        return out

    async def events() -> AsyncIterator[str]:
        if chat:
            for i in sorted(range(len(gen.specs)), key=lambda i: gen.specs[i].index):
                yield chunk(i, {}, [], first=True)
        try:
            async for u in gen.updates():
                if isinstance(u, Usage):
                    if include_usage:
                        yield _data({"id": gen.id, "object": obj, "created": created, "model": state.model_name,
                                     "choices": [], **u.fields()})
                    continue
                for c in chunks(u):
                    yield c
        except APIError as e:
            state.errors.add(e.status, e.code)
            yield _data(e.body())
        yield "data: [DONE]\n\n"

    return events()


@dataclass
class _Folded:
    """One choice's updates, folded."""
    text: dict[str, str] = field(default_factory=dict)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: Optional[list] = None
    finish_reason: Optional[str] = None
    tool_calls: Optional[list[dict]] = None

    def add(self, u: Update) -> None:
        for k, v in u.text.items():
            self.text[k] = self.text.get(k, "") + v
        self.logprobs.extend(u.logprobs)
        if u.prompt_logprobs is not None:
            self.prompt_logprobs = u.prompt_logprobs
        if u.finish_reason is not None:
            self.finish_reason, self.tool_calls = u.finish_reason, u.tool_calls


async def fold(state: ServerState, gen: Generation, req: Any, chat: bool,
               receive: Callable[[], Awaitable[dict]]) -> Response:
    """The non-streamed response, once every choice is done; meanwhile `receive` is watched for the client
    leaving (then every choice is aborted and the answer is a 499 nobody reads)."""
    folded = [_Folded() for _ in gen.specs]
    watcher = asyncio.create_task(gen.watch(receive))
    try:
        async for u in gen.updates():
            if isinstance(u, Usage):
                totals = u
            else:
                folded[u.choice].add(u)
    finally:
        watcher.cancel()
    if gen.disconnected:
        return Response(status_code=499)                       # nobody is there to read it
    out = []
    for index, i in _best(gen.specs, folded, req):
        f, spec = folded[i], gen.specs[i]
        content = f.text.get("content", "")
        if chat:
            msg: dict[str, Any] = {"role": "assistant", "content": content}
            if state.reasoning_parser:
                msg["reasoning_content"] = f.text.get("reasoning_content") or None
                msg["content"] = content or (None if msg["reasoning_content"] else "")
            if f.tool_calls:
                msg["content"], msg["tool_calls"] = msg["content"] or None, f.tool_calls
            out.append({"index": index, "message": msg, "logprobs": chat_logprobs(f.logprobs) if req.logprobs else None,
                        "finish_reason": f.finish_reason})
        else:
            lp = None
            if req.logprobs is not None:
                prompt = f.prompt_logprobs if spec.echo is not None else None
                lp, _ = completion_logprobs(f.logprobs, req.logprobs, 0, prompt,
                                            _first_text(state, spec) if prompt else "")
            out.append({"index": index, "text": (spec.echo or "") + content, "logprobs": lp,
                        "finish_reason": f.finish_reason})
    return JSONResponse({"id": gen.id, "object": "chat.completion" if chat else "text_completion",
                         "created": int(time.time()), "model": state.model_name, "choices": out, **totals.fields()})


def _best(specs: list[Spec], folded: list[_Folded], req: Any) -> list[tuple[int, int]]:
    """(choice index, position in specs) of the returned choices in OpenAI's order; best_of keeps each prompt's
    n candidates with the highest cumulative logprob (ties to the earlier candidate), as vLLM does."""
    order = sorted(range(len(specs)), key=lambda i: specs[i].index)
    best_of = getattr(req, "best_of", None) or req.n
    if best_of == req.n:
        return [(specs[i].index, i) for i in order]
    groups: dict[int, list[int]] = {}
    for i in order:
        groups.setdefault(specs[i].prompt_index, []).append(i)
    kept: list[tuple[int, int]] = []
    for k, group in sorted(groups.items()):
        ranked = sorted(group, key=lambda i: -sum(e[1] for e in folded[i].logprobs))[:req.n]
        kept += [(k * req.n + j, i) for j, i in enumerate(ranked)]
    return kept


def _first_text(state: ServerState, spec: Spec) -> str:
    """An echo's first prompt token (it has no logprob): its own text, special tokens included."""
    return state.tokenizer.decode([spec.ids[0]], skip_special_tokens=False)


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class StreamResponse(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (done, error, client gone, cancelled)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

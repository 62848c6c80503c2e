"""The API process's output thread: engine outputs -> text events for the HTTP handlers.

One thread reads every message the engine sends (`EngineClient.recv`, blocking). For each request's
output it runs that request's `OutputText` (incremental detokenizer, stop strings, reasoning split),
records the request-level metrics (TTFT, inter-token, end-to-end, queue time), sends an `Abort` when a
stop string ended the text, and posts a `TextEvent` to the request's asyncio queue; all the events of one
engine message go to the event loop in one `call_soon_threadsafe`. So the event loop only formats and
writes what arrives, and detokenization never runs on it.

A request's life here: `register` (before its Add is sent) -> events -> a final event ("done" or
"error") -> unregistered. A request whose text processing raises fails alone (500, the engine aborts it).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from mtp_core.request.stats import SpecStats
from mtp_core.serve.engine_client import EngineGone
from mtp_core.serve.engine_core import STEP_BUCKETS_S
from mtp_core.serve.messages import Abort, EngineStats, Output, Outputs
from mtp_core.serve.metrics import RequestMetrics
from mtp_core.serve.text import OutputText

log = logging.getLogger("mtp.serve")


@dataclass
class TextEvent:
    kind: str                                    # "delta" | "done" | "error"
    delta: dict[str, str] = field(default_factory=dict)
    finish_reason: Optional[str] = None          # done: "stop" | "length" | "abort"
    stats: Optional[SpecStats] = None            # done: the request's speculative-decoding counters
    num_tokens: int = 0                          # done: completion tokens (up to a stop string)
    status: int = 200                            # error: the HTTP status ...
    message: str = ""                            # ... and the one-line message
    logprobs: Optional[list] = None              # per token fed: (text, logprob, top, id, bytes)
    prompt_logprobs: Optional[list] = None       # once: None, then the same per prompt token
    index: int = 0                               # the choice (set when the event is delivered)


class RequestState:
    """One request as the API process sees it (fields written by the output thread unless noted)."""

    def __init__(self, rid: int, text: OutputText, prompt_len: int, request_id: str, arrival: float,
                 loop: asyncio.AbstractEventLoop, index: int = 0, events: Optional[asyncio.Queue] = None,
                 discard: bool = False) -> None:
        self.rid, self.text, self.prompt_len, self.request_id = rid, text, prompt_len, request_id
        self.index = index                       # the choice this request answers
        self.discard = discard                   # echo with max_tokens 0: only the prompt logprobs count
        self.arrival = arrival                   # perf_counter when the HTTP request came in
        self.loop = loop
        # the choices of one HTTP request share one queue; events carry their choice's index
        self.events: asyncio.Queue[TextEvent] = events if events is not None else asyncio.Queue()
        self.first_t: Optional[float] = None
        self.last_t: Optional[float] = None
        self.abort_reason: Optional[str] = None  # set by either side: client gone, stop string, failed, shutdown
        self.closed = False                      # a final event was posted


class OutputProcessor:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.metrics = RequestMetrics()
        self.engine_stats = EngineStats(step_buckets=[0] * len(STEP_BUCKETS_S))     # until the engine's first
        self.requests: dict[int, RequestState] = {}
        self._lock = threading.Lock()
        self._pending: list[tuple[RequestState, TextEvent]] = []
        self._thread: Optional[threading.Thread] = None
        self._next_rid = 0
        self.gone = False                        # the engine stopped answering
        self._names: dict[int, str] = {}         # token id -> its text (logprobs)

    # ---- the event loop's side ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mtp-output", daemon=True)
            self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def register(self, text: OutputText, prompt_len: int, request_id: str, arrival: float, index: int = 0,
                 events: Optional[asyncio.Queue] = None, discard: bool = False) -> RequestState:
        with self._lock:
            self._next_rid += 1
            rs = RequestState(self._next_rid, text, prompt_len, request_id, arrival, asyncio.get_running_loop(),
                              index, events, discard)
            self.requests[rs.rid] = rs
        return rs

    def abort(self, rs: RequestState, reason: str) -> None:
        """The handler is done with a request that has not finished (client gone, shutdown)."""
        with self._lock:
            if rs.closed:
                return
            rs.abort_reason = rs.abort_reason or reason
        self.engine.send(Abort([rs.rid]))

    def cut_all(self, status: int, message: str) -> int:
        """Answers every unfinished request with an error now (shutdown) and aborts them in the engine."""
        with self._lock:
            cut = [rs for rs in self.requests.values() if not rs.closed]
            for rs in cut:
                rs.abort_reason = rs.abort_reason or "shutdown"
                self._close(rs, TextEvent("error", status=status, message=message))
                self.metrics.finished("abort")
            self._flush()
        if cut:
            self.engine.send(Abort([rs.rid for rs in cut]))
        return len(cut)

    # ---- the output thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                msg = self.engine.recv()
                if isinstance(msg, Outputs):
                    with self._lock:
                        self.engine_stats = msg.stats
                        for out in msg.outputs:
                            self._handle(out)
                        self._flush()
        except EngineGone:
            pass
        except Exception as e:  # noqa: BLE001 - never die silently: the requests must be answered
            log.error("the output thread stopped: %s: %s", type(e).__name__, e, exc_info=True)
        self.gone = True
        with self._lock:
            for rs in list(self.requests.values()):
                self._close(rs, TextEvent("error", status=503, message="the engine stopped; retry later"))
            self._flush()

    def _handle(self, out: Output) -> None:
        rs = self.requests.get(out.rid)
        if rs is None:
            return                                  # answered already (failed or cut)
        m = self.metrics
        now = time.perf_counter()
        if out.queue_s is not None:
            m.queue.observe(out.queue_s)
        if out.token_ids:
            if rs.first_t is None:
                m.ttft.observe(now - rs.arrival)
            else:
                m.itl.observe(now - rs.last_t)
            rs.first_t = rs.first_t or now
            rs.last_t = now
        if out.error_status:
            if out.error_status >= 500:
                m.requests_failed += 1
            self._close(rs, TextEvent("error", status=out.error_status, message=out.error))
            return
        delta: dict[str, str] = {}
        lps = plps = None
        if not (rs.text.stopped or rs.abort_reason == "failed" or rs.discard):
            fed = self._feed(rs, out)
            if fed is None:
                return                              # it failed (answered with an error)
            delta, lps = fed
        if out.prompt_logprobs is not None:
            plps = [None] + self._named(rs.text.tok, out.prompt_logprobs[1:])
        if out.finish_reason is None:
            if delta or lps or plps:
                self._pending.append((rs, TextEvent("delta", delta, logprobs=lps, prompt_logprobs=plps)))
            return
        self._finish(rs, out, now, delta, lps, plps)

    def _feed(self, rs: RequestState, out: Output) -> Optional[tuple[dict[str, str], Optional[list]]]:
        """The output's tokens into the request's text: (the text added, the logprobs of the tokens it took);
        None when that raised (the request then fails alone, answered here)."""
        text, lps = rs.text, None
        try:
            before = text.num_tokens
            delta = text.feed(out.token_ids)
            if out.logprobs is not None:     # the tokens the text took (up to a stop string)
                lps = self._named(text.tok, out.logprobs[:text.num_tokens - before])
            if text.stopped or out.finish_reason is not None:
                for k, v in text.finish().items():
                    delta[k] = delta.get(k, "") + v
        except Exception as e:  # noqa: BLE001 - this request fails alone
            log.error("request %s failed: %s: %s", rs.request_id, type(e).__name__, e)
            log.debug("traceback", exc_info=True)
            self.metrics.requests_failed += 1
            rs.abort_reason = "failed"
            if out.finish_reason is None:
                self.engine.send(Abort([rs.rid]))
            first = str(e).splitlines()[0] if str(e) else ""
            self._close(rs, TextEvent("error", status=500, message=f"generation failed: {type(e).__name__}: "
                                                                   f"{first}".rstrip(": ")))
            return None
        if text.stopped and out.finish_reason is None and rs.abort_reason is None:
            rs.abort_reason = "stop string"
            self.engine.send(Abort([rs.rid]))
        return delta, lps

    def _finish(self, rs: RequestState, out: Output, now: float, delta: dict[str, str], lps: Optional[list],
                plps: Optional[list]) -> None:
        """The request's last event, with its finish reason counted and its latency observed."""
        text, m = rs.text, self.metrics
        if text.stopped:
            reason = "stop"
        elif out.finish_reason == "abort":
            reason = "abort"                        # the client left, or the server cut it
        else:
            reason = out.finish_reason
        m.finished(reason)
        m.e2e.observe(now - rs.arrival)
        log.info("request %s finished (%s): %d prompt + %d completion tokens in %.3f s", rs.request_id, reason,
                 rs.prompt_len, text.num_tokens, now - rs.arrival)
        self._close(rs, TextEvent("done", delta, reason, out.stats, 0 if rs.discard else text.num_tokens,
                                  logprobs=lps, prompt_logprobs=plps))

    def _named(self, tok: Any, entries: list) -> list:
        """(id, logprob, top) -> (text, logprob, [(text, logprob, bytes)], id, bytes): each token's own text
        (special tokens included) and its bytes (a byte-level token's raw bytes, so a piece of a multi-byte
        character keeps them), computed once per id."""
        names = self._names

        def name(i: int) -> tuple[str, list[int]]:
            got = names.get(i)
            if got is None:
                got = names[i] = (tok.decode([i], skip_special_tokens=False), _token_bytes(tok, i))
            return got

        out = []
        for t, lp, top in entries:
            text, raw = name(t)
            out.append((text, lp, [(*name(i)[:1], v, name(i)[1]) for i, v in top], t, raw))
        return out

    # ---- both ------------------------------------------------------------------------------------
    def _close(self, rs: RequestState, ev: TextEvent) -> None:
        """Caller holds the lock: post the final event and forget the request."""
        if rs.closed:
            return
        rs.closed = True
        self.requests.pop(rs.rid, None)
        self._pending.append((rs, ev))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, TextEvent]]] = {}
        for rs, ev in pending:
            ev.index = rs.index
            by_loop.setdefault(rs.loop, []).append((rs.events, ev))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:     # that event loop is closed (shutdown): nobody is listening any more
                pass


@functools.cache
def _byte_of() -> dict[str, int]:
    """Byte-level BPE's alphabet -> the byte each character stands for: printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the characters from U+0100 on, in byte order."""
    same = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in same}
    shifted = [b for b in range(256) if b not in table.values()]
    table.update({chr(0x100 + n): b for n, b in enumerate(shifted)})
    return table


def _token_bytes(tok: Any, i: int) -> list[int]:
    """The bytes of token i: a byte-level vocabulary entry mapped back to its bytes; an added token (or any other
    tokenizer) gives its text's UTF-8."""
    backend = getattr(tok, "_tok", None)
    text = tok.decode([i], skip_special_tokens=False)
    if backend is None or type(getattr(backend, "decoder", None)).__name__ != "ByteLevel" \
            or i in backend.get_added_tokens_decoder():
        return list(text.encode("utf-8"))
    piece = backend.id_to_token(i)
    table = _byte_of()
    if piece is None or any(c not in table for c in piece):
        return list(text.encode("utf-8"))
    return [table[c] for c in piece]


def _deliver(items: list[tuple[asyncio.Queue, TextEvent]]) -> None:
    for q, ev in items:
        q.put_nowait(ev)

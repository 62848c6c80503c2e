"""The engine loop: one thread owns the model and the Engine; HTTP handlers talk to it through queues.

Handlers call `submit()` (from the asyncio event loop): the request goes into a thread-safe command queue
and the loop thread adds it to the engine between two steps, so it joins the in-flight batch. After every
step the loop posts each live request's new token ids (and, at the end, its finish reason and
statistics) to that request's asyncio queue: all of a step's events go over in one `call_soon_threadsafe`
per event loop (one wake-up per step, not one per request). `abort()` (a client that went
away, a stop string, shutdown) is a command too: the loop thread calls `Engine.abort` before its next
step, which frees the request's KV blocks. Nothing but the loop thread touches the Engine.

A step that raises finishes the requests in that step (the Engine aborts them and frees their blocks);
those requests get an error event, every other request carries on, and the loop keeps serving.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from mtp_core.engine.sequence import Sequence
from mtp_core.sampling import SamplingParams
from mtp_core.speculative.stats import SpecStats

log = logging.getLogger("mtp.serve")

STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Event:
    """What a request's asyncio queue receives: new tokens, then one final event (done or error)."""
    kind: str                                # "tokens" | "done" | "error"
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    status: int = 200                        # for "error": the HTTP status to report
    message: str = ""
    stats: Optional[SpecStats] = None


class RequestHandle:
    """One submitted request, as seen from both sides (the asyncio side reads only `events`)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
                 outbox: "Outbox") -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.loop = loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.seq: Optional[Sequence] = None      # set by the loop thread
        self.sent = 0                            # output tokens already posted
        self.closed = False                      # a final event was posted
        self.abort_reason: Optional[str] = None  # why the server side aborted it (client gone, stop string)
        self.outbox = outbox

    def post(self, ev: Event) -> None:
        """Loop thread only: queue `ev` for this request (sent on the next Outbox.flush)."""
        if self.closed:
            return
        if ev.kind != "tokens":
            self.closed = True
        self.outbox.pending.setdefault(self.loop, []).append((self.events, ev))


class Outbox:
    """Events posted by the loop thread, delivered in one call_soon_threadsafe per event loop."""

    def __init__(self) -> None:
        self.pending: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Event]]] = {}

    def flush(self) -> None:
        pending, self.pending = self.pending, {}
        for loop, items in pending.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:   # that event loop is closed (shutdown): nobody is listening any more
                pass


def _deliver(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for q, ev in items:
        q.put_nowait(ev)


@dataclass
class Counters:
    """Monotonic totals for /metrics (written by the loop thread only)."""
    requests_by_reason: dict[str, int] = field(default_factory=dict)
    requests_failed: int = 0
    requests_rejected: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    step_buckets: list[int] = field(default_factory=lambda: [0] * len(STEP_BUCKETS_S))
    step_failures: int = 0


class EngineLoop:
    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.commands: queue.Queue[tuple[str, RequestHandle]] = queue.Queue()
        self.outbox = Outbox()
        self.live: dict[int, RequestHandle] = {}          # id(handle) -> handle, loop thread only
        self.counters = Counters()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None        # set if the loop itself died
        self.num_running = 0
        self.num_waiting = 0

    # ---- the asyncio side --------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mtp-engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        h = RequestHandle(prompt_ids, params, asyncio.get_running_loop(), self.outbox)
        self.commands.put(("add", h))
        return h

    def abort(self, h: RequestHandle, reason: str = "client disconnected") -> None:
        if h.abort_reason is None:
            h.abort_reason = reason
        self.commands.put(("abort", h))

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts whatever is still running and joins the thread."""
        self._stop.set()
        self.commands.put(("wake", None))  # type: ignore[arg-type]
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the loop thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self._stop.is_set():
                    break
                if self.engine.has_unfinished():
                    self._step()
                self.outbox.flush()
        except BaseException as e:  # noqa: BLE001 - the loop must never die silently
            self.error = e
            log.error("engine loop stopped: %s: %s", type(e).__name__, e, exc_info=True)
        finally:
            for h in list(self.live.values()):
                if h.seq is not None and not h.seq.is_finished:
                    self.engine.abort(h.seq)
                h.post(Event("error", status=503, message="the server is shutting down; retry later"))
            self.live.clear()
            self._drain(block=False, refuse=True)
            self.outbox.flush()

    def _drain(self, block: bool, refuse: bool = False) -> None:
        try:
            cmd, h = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if h is not None:
                if refuse:
                    h.post(Event("error", status=503, message="the server is shutting down; retry later"))
                elif cmd == "add":
                    self._add(h)
                elif cmd == "abort":
                    self._abort(h)
            try:
                cmd, h = self.commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, h: RequestHandle) -> None:
        if h.abort_reason is not None:          # gone before it was admitted
            h.post(Event("done", finish_reason="abort"))
            self._count_finish("abort")
            return
        try:
            h.seq = self.engine.add_request(h.prompt_ids, h.params)
        except ValueError as e:
            self.counters.requests_rejected += 1
            h.post(Event("error", status=400, message=str(e).splitlines()[0]))
            return
        self.live[id(h)] = h
        self.counters.prompt_tokens += len(h.prompt_ids)
        self._refresh_gauges()

    def _abort(self, h: RequestHandle) -> None:
        if id(h) not in self.live:
            return                               # finished already (or not admitted yet: _add sees it)
        if not h.seq.is_finished:
            self.engine.abort(h.seq)
        self._publish(h)
        self._refresh_gauges()

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests of this step, keep serving
            self.counters.step_failures += 1
            msg = f"generation failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
            log.error("%s", msg)
            log.debug("traceback", exc_info=True)
            for h in list(self.live.values()):
                if h.seq.is_finished and h.seq.finish_reason == "abort" and h.abort_reason is None:
                    self.counters.requests_failed += 1
                    h.post(Event("error", status=500, message=msg))
                    del self.live[id(h)]
        dt = time.perf_counter() - t0
        c = self.counters
        c.steps += 1
        c.step_seconds += dt
        for i, b in enumerate(STEP_BUCKETS_S):
            if dt <= b:
                c.step_buckets[i] += 1
        for h in list(self.live.values()):
            self._publish(h)
        self._refresh_gauges()

    def _publish(self, h: RequestHandle) -> None:
        seq = h.seq
        new = seq.output_ids[h.sent:]
        if new:
            h.sent = len(seq.output_ids)
            self.counters.generation_tokens += len(new)
            h.post(Event("tokens", token_ids=list(new)))
        if seq.is_finished:
            reason = seq.finish_reason or "abort"
            h.post(Event("done", finish_reason=reason, stats=seq.stats))
            if reason == "abort" and h.abort_reason == "failed":
                self.counters.requests_failed += 1
            else:
                self._count_finish("stop" if reason == "abort" and h.abort_reason == "stop string" else reason)
            self.live.pop(id(h), None)

    def _count_finish(self, reason: str) -> None:
        r = self.counters.requests_by_reason
        r[reason] = r.get(reason, 0) + 1

    def _refresh_gauges(self) -> None:
        s = self.engine.scheduler
        self.num_running, self.num_waiting = len(s.running), len(s.waiting)

"""The engine side of `mtp serve`: one loop owns the Engine; commands come in, outputs go out.

`run_engine_loop` is the same whether it runs in the engine process (`engine_proc.py`, the default) or in
a thread of the API process (`InProcessEngine`, for tests and notebooks); only the two callables that move
messages differ. One iteration:

    commands = recv(block = nothing to run)     # Add / Abort / Shutdown, all that are there
    apply them                                  # add_request joins the next step; abort frees KV blocks
    engine.step()                               # if anything runs or waits
    send(Outputs)                               # every live request's new token ids, finals, gauges

Nothing here detokenizes, formats JSON or touches a socket's HTTP side: that is the API process's work,
so none of it takes the engine's time. A step that raises fails the requests in that step (the Engine
aborts them and frees their blocks: each gets a 500 error output) and the loop goes on.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from mtp_core.request.sequence import Sequence, Status
from mtp_core.serve.messages import (Abort, Add, Command, EngineStats, Output, Outputs, PREFIX_FIELDS, Ready,
                                     Shutdown)

log = logging.getLogger("mtp.serve")

STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SHUTDOWN_MESSAGE = "the server is shutting down; retry later"


class _Live:
    __slots__ = ("seq", "sent", "scheduled", "prompt_sent")

    def __init__(self, seq: Sequence) -> None:
        self.seq, self.sent, self.scheduled, self.prompt_sent = seq, 0, False, False


class EngineCore:
    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.live: dict[int, _Live] = {}                # rid -> request, in admission order
        self.deferred: dict[int, list[Add]] = {}        # rid -> the other choices waiting for its prefill
        self.outputs: list[Output] = []
        self.stats = EngineStats(step_buckets=[0] * len(STEP_BUCKETS_S))

    def ready(self, server_info: dict) -> Ready:
        eng = self.engine
        return Ready(max_seq_len=eng.stops.max_seq_len, pool_tokens=eng.pool_tokens,
                     vocab_size=self.llm.model.config.vocab_size, num_draft_tokens=eng.spec.draft_len,
                     server_info=server_info)

    # ---- commands ----------------------------------------------------------------------------
    def apply(self, cmd: Command) -> None:
        if isinstance(cmd, Add):
            first = self.live.get(cmd.after) if cmd.after else None
            if first is not None and self.engine.blocks.enable_reuse and not _prefilled(first.seq):
                self.deferred.setdefault(cmd.after, []).append(cmd)
                return
            try:
                seq = self.engine.add_request(cmd.prompt_ids, cmd.params)
            except ValueError as e:
                self.stats.requests_rejected += 1
                self.outputs.append(Output(cmd.rid, [], error_status=400, error=str(e).splitlines()[0]))
                return
            self.live[cmd.rid] = _Live(seq)
            self.stats.prompt_tokens += len(cmd.prompt_ids)
        elif isinstance(cmd, Abort):
            for rid in cmd.rids:
                r = self.live.get(rid)
                if r is None:
                    if self._drop_deferred(rid):
                        self.outputs.append(Output(rid, [], "abort"))
                    continue                             # finished already
                if not r.seq.is_finished:
                    self.engine.abort(r.seq)
                self._publish(rid, r)

    def _drop_deferred(self, rid: int) -> bool:
        for first, adds in list(self.deferred.items()):
            for a in adds:
                if a.rid == rid:
                    adds.remove(a)
                    if not adds:
                        del self.deferred[first]
                    return True
        return False

    def _release_deferred(self) -> None:
        """The choices whose first choice has prefilled its prompt (or is gone) join the batch now."""
        for first in list(self.deferred):
            r = self.live.get(first)
            if r is None or _prefilled(r.seq):
                for a in self.deferred.pop(first):
                    a.after = 0
                    self.apply(a)

    def abort_all(self, status: int = 503, message: str = SHUTDOWN_MESSAGE) -> None:
        for adds in self.deferred.values():
            self.outputs.extend(Output(a.rid, [], error_status=status, error=message) for a in adds)
        self.deferred.clear()
        for rid, r in list(self.live.items()):
            if not r.seq.is_finished:
                self.engine.abort(r.seq)
            self.outputs.append(Output(rid, r.seq.output_ids[r.sent:], error_status=status, error=message))
        self.live.clear()

    # ---- the step ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self.deferred)

    def step(self) -> None:
        t0 = time.perf_counter()
        try:
            self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests of this step, keep serving
            self.stats.step_failures += 1
            msg = f"generation failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
            log.error("%s", msg)
            log.debug("traceback", exc_info=True)
            for rid, r in list(self.live.items()):
                if r.seq.is_finished and r.seq.finish_reason == "abort":
                    self.outputs.append(Output(rid, r.seq.output_ids[r.sent:], error_status=500, error=msg))
                    del self.live[rid]
        dt = time.perf_counter() - t0
        s = self.stats
        s.steps += 1
        s.step_seconds += dt
        for i, b in enumerate(STEP_BUCKETS_S):
            if dt <= b:
                s.step_buckets[i] += 1
        for rid, r in list(self.live.items()):
            if not r.scheduled and (r.seq.status != Status.WAITING or r.seq.kv.num_prefilled):
                r.scheduled = True
                self._publish(rid, r, queue_s=max(t0 - r.seq.times.arrival_time, 0.0))
            elif r.seq.is_finished or len(r.seq.output_ids) > r.sent:
                self._publish(rid, r)
        if self.deferred:
            self._release_deferred()

    def _publish(self, rid: int, r: _Live, queue_s: Optional[float] = None) -> None:
        seq = r.seq
        new = seq.output_ids[r.sent:]
        lps = seq.returned.logprobs[r.sent:len(seq.output_ids)] if seq.params.logprobs is not None else None
        plp = None
        if seq.params.prompt_logprobs is not None and not r.prompt_sent and (new or seq.is_finished) \
                and len(seq.returned.prompt_logprobs) == len(seq.prompt_ids):
            plp, r.prompt_sent = seq.returned.prompt_logprobs, True
        r.sent = len(seq.output_ids)
        self.stats.generation_tokens += len(new)
        if seq.is_finished:
            self.outputs.append(Output(rid, new, seq.finish_reason or "abort", seq.stats, queue_s, logprobs=lps,
                                       prompt_logprobs=plp))
            del self.live[rid]
        elif new or queue_s is not None:
            self.outputs.append(Output(rid, new, queue_s=queue_s, logprobs=lps, prompt_logprobs=plp))

    # ---- what goes back --------------------------------------------------------------------------
    def take(self) -> Outputs:
        eng, s = self.engine, self.stats
        sch, blocks = eng.scheduler, eng.blocks
        s.num_running, s.num_waiting = len(sch.running), len(sch.waiting)
        s.kv_free_blocks = blocks.num_free_blocks
        s.kv_total_blocks = blocks.num_blocks - (1 if eng.paths.graphs is not None else 0)
        s.num_preemptions = sch.num_preemptions
        pc = getattr(blocks, "stats", None)
        if pc is not None:
            s.prefix_cache = [float(v) for v in (pc.prompt_tokens, pc.reused_tokens, pc.queried_blocks,
                                                 pc.hit_blocks, pc.token_hit_rate, pc.evicted_blocks)]
            assert len(s.prefix_cache) == len(PREFIX_FIELDS)
        s.spec = eng.stats
        out, self.outputs = self.outputs, []
        return Outputs(out, s)


def _prefilled(seq: Sequence) -> bool:
    return seq.is_finished or (seq.status != Status.WAITING and seq.kv.num_prefilled >= len(seq.prompt_ids))


def run_engine_loop(core: EngineCore, recv: Callable[[bool], list[Command]], send: Callable[[Outputs], None],
                    ) -> None:
    """Serves until a Shutdown command (or recv raising EOFError: the API side is gone). Whatever still runs
    then is aborted and answered with 503. recv(block) returns the commands waiting (block: wait for one)."""
    try:
        send(core.take())                        # the gauges before the first request
        while True:
            cmds = recv(not core.has_work())
            stop = False
            for c in cmds:
                if isinstance(c, Shutdown):
                    stop = True
                    break
                core.apply(c)
            if stop:
                break
            if core.has_work():
                core.step()
            if cmds or core.outputs or core.live:
                send(core.take())
    except EOFError:
        log.info("the API process is gone; the engine stops")
        return
    core.abort_all()
    send(core.take())

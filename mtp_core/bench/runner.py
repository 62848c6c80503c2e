"""Drives an Engine over benchmark requests with at most `concurrency` requests in flight.

New requests are submitted as others finish (a closed loop, like trtllm-bench's `--concurrency`);
concurrency <= 0 submits everything at once. Timestamps are taken when `Engine.step()` returns, i.e.
when a client of the engine would see the tokens: submission (the Sequence's arrival time), first
token, every later chunk, end.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mtp_core.bench.metrics import RequestRecord
from mtp_core.engine.engine import Engine
from mtp_core.request.sequence import Sequence
from mtp_core.sampling import SamplingParams


@dataclass
class _Live:
    index: int
    seq: Sequence
    seen: int = 0
    first: Optional[float] = None
    chunks: list[float] = field(default_factory=list)
    decoder: Any = None
    text: list[str] = field(default_factory=list)


def check_fits(engine: Engine, prompts: list[list[int]], output_tokens: list[int], ignore_eos: bool) -> None:
    """Every request must be able to emit its output_tokens within max_seq_len (else the run measures less)."""
    for i, (p, n) in enumerate(zip(prompts, output_tokens)):
        if ignore_eos and len(p) + n > engine.stops.max_seq_len:
            raise ValueError(f"request {i} has {len(p)} input + {n} output tokens but max_seq_len is "
                             f"{engine.stops.max_seq_len}; lower output_tokens or raise --max_seq_len")


def run_requests(engine: Engine, prompts: list[list[int]], output_tokens: list[int], concurrency: int,
                 ignore_eos: bool = True, task_ids: Optional[list[Any]] = None,
                 stream_decoder: Optional[Callable[[], Any]] = None,
                 on_finish: Optional[Callable[[RequestRecord], None]] = None) -> list[RequestRecord]:
    """Greedy generation of `output_tokens[i]` tokens (max_tokens; exact with ignore_eos) for each prompt.

    prompts: token ids per request. stream_decoder: a factory of incremental detokenizers (`feed(id)`,
    `flush()`); given, every step's new tokens are detokenized as a streaming client would.
    Returns one record per request, in request order."""
    if len(prompts) != len(output_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(output_tokens)} output lengths")
    check_fits(engine, prompts, output_tokens, ignore_eos)
    task_ids = task_ids if task_ids is not None else list(range(len(prompts)))
    pending = deque(range(len(prompts)))
    live: dict[int, _Live] = {}
    records: list[Optional[RequestRecord]] = [None] * len(prompts)
    try:
        while pending or live:
            while pending and (concurrency <= 0 or len(live) < concurrency):
                i = pending.popleft()
                params = SamplingParams(max_tokens=output_tokens[i], ignore_eos=ignore_eos)
                seq = engine.add_request(list(prompts[i]), params)
                live[seq.request_id] = _Live(i, seq, decoder=stream_decoder() if stream_decoder else None)
            progressed = engine.step()
            now = time.perf_counter()
            if not progressed:
                raise RuntimeError(f"the engine scheduled nothing with {len(live)} request(s) in flight")
            for seq in progressed:
                lv = live.get(seq.request_id)
                if lv is None:
                    continue
                new = seq.output_ids[lv.seen:]
                if new:
                    lv.first = now if lv.first is None else lv.first
                    lv.chunks.append(now)
                    if lv.decoder is not None:
                        lv.text += [lv.decoder.feed(t) for t in new]
                    lv.seen = len(seq.output_ids)
                if seq.is_finished:
                    if lv.decoder is not None:
                        lv.text.append(lv.decoder.flush())
                    rec = RequestRecord(lv.index, task_ids[lv.index], len(seq.prompt_ids), len(seq.output_ids),
                                        seq.times.arrival_time, lv.first if lv.first is not None else now, now,
                                        seq.stats, lv.chunks, list(seq.output_ids), seq.finish_reason)
                    records[lv.index] = rec
                    del live[seq.request_id]
                    if on_finish:
                        on_finish(rec)
    except BaseException:
        for lv in live.values():
            if not lv.seq.is_finished:
                engine.abort(lv.seq)
        raise
    return [r for r in records if r is not None]

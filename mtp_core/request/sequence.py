"""One request's state: its tokens, with its fields grouped by what reads them: KV state (`kv`), what decides its
next tokens (`decoding`), drafting state (`mtp`), statistics (`stats`), what it returns (`returned`), times."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from mtp_core.request.mtp_state import MTPState
from mtp_core.request.stats import SpecStats
from mtp_core.sampling import SamplingParams, token_logprobs

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class KVState:
    """Where a request's KV lives and how far it is valid (scheduler, engine commit, every step's attention)."""
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0          # positions 0..num_cached-1 hold valid KV in every layer (main and MTP)
    num_prefilled: int = 0       # how far the current prefill (prompt + recomputed output) has come
    prefill_target: int = 0      # tokens the current prefill covers
    block_digests: list[bytes] = field(default_factory=list)   # prefix cache: digest per full block of all_ids
    num_settled_blocks: int = 0  # prefix cache: leading table blocks already registered (or skipped)


@dataclass
class DecodeState:
    """What decides a request's next tokens beside its sampling params (verifier, native step, append)."""
    in_thinking: bool = False    # relaxed acceptance applies only while True
    matcher: Optional[object] = None   # params.guided: the grammar matcher, after every emitted non-thinking token
    penalty_rules: Optional[object] = None   # the native step's form of its logits processing (sampling.PenaltyRules)
    generator: Optional[torch.Generator] = None   # params.seed: this request's sampling generator


@dataclass
class Returned:
    """What a request returns beside its tokens. params.logprobs set: one (id, logprob, top) per output token;
    params.prompt_logprobs set: None for the first prompt token, then one per prompt token (filled by the
    prefill, which then skips the prefix cache)."""
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)


@dataclass
class Times:
    """time.perf_counter() stamps of a request (engine), for its TTFT and end-to-end latency."""
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None


@dataclass
class Stops:
    """What ends and bounds a request's output: its stop tokens, the <think> / </think> pair, its longest length
    (the engine's, read by the commit and by the native step for the rows that need their logits)."""
    eos_token_ids: set[int]
    think_ids: Optional[tuple[int, int]]
    max_seq_len: int


@dataclass(eq=False)      # identity: `seq in running` must not compare every field of every request
class Sequence:
    """A request: its tokens, its KV state (`kv`: scheduler, engine), what decides its next tokens (`decoding`),
    its drafting state (`mtp`), its statistics (`stats`, recorded by the engine's commit), what it returns beside
    its tokens (`returned`) and its timestamps (`times`)."""
    prompt_ids: list[int]
    params: SamplingParams
    request_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None          # "stop" | "length" | "abort"
    kv: KVState = field(default_factory=KVState)
    decoding: DecodeState = field(default_factory=DecodeState)
    mtp: MTPState = field(default_factory=MTPState)
    stats: SpecStats = field(default_factory=SpecStats)
    returned: Returned = field(default_factory=Returned)
    times: Times = field(default_factory=Times)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and its prefill has not scored every prompt token yet."""
        return self.params.prompt_logprobs is not None and len(self.returned.prompt_logprobs) < len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_prefilling(self) -> bool:
        return self.kv.num_prefilled < self.kv.prefill_target

    def start_prefill(self, start: int = 0) -> None:
        """(Re)start prefill over every known token; used on admission and after preemption. start > 0:
        positions before it are mapped from the prefix cache, the prefill computes the rest."""
        kv = self.kv
        kv.prefill_target = len(self.prompt_ids) + len(self.output_ids)
        kv.num_prefilled = start
        kv.num_cached = start
        self.mtp.restart(start)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def append(self, emitted: list[int], eos_token_ids: set[int], think_ids: Optional[tuple[int, int]],
               max_seq_len: int) -> int:
        """Appends tokens one by one, stopping at EOS / stop ids / max_tokens / max_seq_len (finish_reason
        set); returns how many it appended."""
        n, dec = 0, self.decoding
        for tok in emitted:
            p = self.params
            if (tok in eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self.finish_reason = "stop"
                break
            self.output_ids.append(tok)
            n += 1
            if dec.matcher is not None and not (p.guided_after_think and think_ids is not None
                                                and (dec.in_thinking or tok in think_ids)):
                dec.matcher.accept_token(tok)
            if think_ids is not None:
                if tok == think_ids[0]:
                    dec.in_thinking = True
                elif tok == think_ids[1]:
                    dec.in_thinking = False
            if len(self.output_ids) >= p.max_tokens or len(self.all_ids) >= max_seq_len:
                self.finish_reason = "length"
                break
        return n

    def score_prompt(self, start: int, logits: torch.Tensor) -> None:
        """A prefill chunk's logits [n, V] from position start: position p scores prompt token p + 1."""
        scored = self.returned.prompt_logprobs
        first = len(scored) - 1 - start          # the chunk's first position not scored yet
        end = min(logits.shape[0], len(self.prompt_ids) - 1 - start)
        if first < 0 or first >= end:
            return
        scored.extend(token_logprobs(logits[first:end], self.prompt_ids[start + first + 1: start + end + 1],
                                     self.params.prompt_logprobs))

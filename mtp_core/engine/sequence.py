"""One request's state inside the engine."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from mtp_core.sampling import SamplingParams
from mtp_core.speculative.stats import SpecStats

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)      # identity: `seq in running` must not compare every field of every request
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None          # "stop" | "length" | "abort"
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0          # positions 0..num_cached-1 hold valid KV in every layer (main and MTP)
    num_prefilled: int = 0       # how far the current prefill (prompt + recomputed output) has come
    drafts: list[int] = field(default_factory=list)   # drafts proposed for the next step
    in_thinking: bool = False    # relaxed acceptance applies only while True
    window_hidden: Optional[torch.Tensor] = None   # Vanilla: the last K valid positions' main hidden [<=K, H]
    stats: SpecStats = field(default_factory=SpecStats)
    # adaptive draft length (mtp_core/speculative/adaptive.py)
    mtp_valid: int = 0           # positions 0..mtp_valid-1 hold valid MTP-cache entries (<= num_cached)
    mtp_pending: Optional[list[torch.Tensor]] = None   # main hidden states, positions mtp_valid..num_cached-1
    accept_window: list[int] = field(default_factory=list)   # AL of the last decode steps that drafted
    pause_steps: int = 0         # decode steps left without drafting (acceptance window)
    num_pauses: int = 0
    spec_off: bool = False       # drafting off for good (the MTP lag outgrew MAX_MTP_LAG)
    # draft-length policy (mtp_core/speculative/policy.py)
    draft_len: int = 0           # drafts chosen for the next step when this request last drafted
    accept_est: Optional[list[float]] = None   # acceptance per draft position (None: the engine-wide one)
    expected: Optional[list[float]] = None     # expected tokens emitted with 0..K drafts, from accept_est
    accept_step: int = 0         # the policy's step count when accept_est last learnt something
    accept_n: int = 0            # observations accept_est has learnt from
    generator: Optional[torch.Generator] = None
    # params.logprobs set: one (id, logprob, top) per output token; params.prompt_logprobs set: None for the
    # first prompt token, then one per prompt token (filled by the prefill, which then skips the prefix cache)
    logprobs: list = field(default_factory=list)
    matcher: Optional[object] = None   # params.guided: the grammar matcher, after every emitted non-thinking token
    prompt_logprobs: list = field(default_factory=list)
    first_token_time: Optional[float] = None
    arrival_time: float = 0.0
    finish_time: Optional[float] = None
    block_digests: list[bytes] = field(default_factory=list)   # prefix cache: digest per full block of all_ids
    num_settled_blocks: int = 0  # prefix cache: leading table blocks already registered (or skipped)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and its prefill has not scored every prompt token yet."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    prefill_target: int = 0     # tokens the current prefill covers

    @property
    def is_prefilling(self) -> bool:
        return self.num_prefilled < self.prefill_target

    def start_prefill(self, start: int = 0) -> None:
        """(Re)start prefill over every known token; used on admission and after preemption. start > 0:
        positions before it are mapped from the prefix cache, the prefill computes the rest."""
        self.prefill_target = len(self.prompt_ids) + len(self.output_ids)
        self.num_prefilled = start
        self.num_cached = start
        self.drafts = []
        self.window_hidden = None
        self.mtp_valid = start          # a reused prefix brings its MTP-cache entries too
        self.mtp_pending = None

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

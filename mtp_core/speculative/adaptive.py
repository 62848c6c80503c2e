"""Adaptive draft length: the explicit rules that limit how many drafts a request proposes (0..K).

The default draft-length policy (speculative/policy.py, `draft_len_policy: cost`) chooses each step's count
from measured costs; these rules bound it (with `draft_len_policy: fixed`, a row drafts its limit). Three
rules, each lossless (a row verifies fewer drafts; greedy output never changes), combined by taking the
smallest limit:

1. Batch-size schedule (`draft_len_schedule`, TensorRT-LLM's name): {batch size: max drafts}. A batch of
   n requests in flight (running + waiting, at most max_batch_size) uses the entry with the largest key
   <= n; below the smallest key the limit is K. `{1: 4, 4: 2, 16: 0}`: 1-3 requests draft up to 4, 4-15
   up to 2, 16 and more decode without MTP.
2. Acceptance window (`acceptance_window` N, `acceptance_length_threshold` T): a request remembers the
   acceptance length (1 + accepted drafts) of its last N decode steps that verified at least one draft.
   When N such steps average below T, the request **pauses** drafting for the next N decode steps, then
   drafts again with an empty window (it is probed again, never switched off for good: a reasoning trace
   changes phase, e.g. from copying digits to computing them, and acceptance with it).
3. Confidence gate (`draft_confidence_threshold` c, in the drafter): the MTP head's probability of each
   greedy draft is known when it is proposed; the chain stops before the first draft whose running
   product of probabilities (an estimate of the chance that every draft so far is accepted) is below c.
   A step may then verify no draft at all. Eagle also skips the remaining chain forwards; Vanilla still
   runs every module over the request's window (each module's cache must stay complete) but verifies
   only the kept drafts.

A row whose limit is 0 (schedule or pause) skips the drafter entirely; speculative/backlog.py keeps what its
MTP caches will need when it drafts again.
"""
from __future__ import annotations

import bisect
from typing import Any, Optional

from mtp_core.config.schedule import parse_schedule
from mtp_core.request.mtp_state import MTPState
from mtp_core.request.stats import SpecStats


class DraftLimits:
    """The per-row draft limit of rules 1 and 2 (rule 3 lives in the drafters)."""

    def __init__(self, K: int, schedule: Optional[dict[int, int]] = None, window: int = 0,
                 al_threshold: float = 0.0, max_batch_size: int = 1 << 30) -> None:
        self.draft_len = K
        self.schedule = dict(sorted((schedule or {}).items()))
        self._keys = list(self.schedule)
        self.window, self.al_threshold = window, al_threshold
        self.max_batch_size = max_batch_size

    @classmethod
    def from_spec(cls, spec: Any, max_batch_size: int) -> "DraftLimits":
        return cls(spec.max_draft_len, parse_schedule(spec.draft_len_schedule), spec.acceptance_window,
                   spec.acceptance_length_threshold, max_batch_size)

    def batch_limit(self, batch_size: int) -> int:
        """Rule 1: the schedule's limit for this many requests in flight (K without a schedule)."""
        if not self._keys:
            return self.draft_len
        i = bisect.bisect_right(self._keys, batch_size) - 1
        return self.draft_len if i < 0 else min(self.draft_len, self.schedule[self._keys[i]])

    def in_flight(self, num_running: int, num_waiting: int) -> int:
        return min(num_running + num_waiting, self.max_batch_size)

    def row_limit(self, mtp: MTPState, batch_size: int) -> int:
        """min(rule 1, rule 2) for one request."""
        if mtp.is_off or mtp.pause_steps > 0:
            return 0
        return self.batch_limit(batch_size)

    def row_limits(self, mtps: list[Optional[MTPState]], batch_size: int) -> list[int]:
        """row_limit for each request of a batch (None: a row that drafts nothing, 0), rule 1 read once."""
        lim = self.batch_limit(batch_size)
        return [0 if m is None or m.is_off or m.pause_steps > 0 else lim for m in mtps]

    def observe(self, mtp: MTPState, proposed: int, accepted: int, stats: Optional[SpecStats] = None) -> None:
        """Rule 2 after a decode step of a request that verified `proposed` drafts and accepted `accepted`;
        a pause is counted in its statistics."""
        if not self.window:
            return
        if mtp.pause_steps > 0:
            mtp.pause_steps -= 1
            return
        if proposed == 0:
            return
        win = mtp.accept_window
        win.append(1 + accepted)
        if len(win) > self.window:
            win.pop(0)
        if len(win) == self.window and sum(win) / self.window < self.al_threshold:
            mtp.pause_steps = self.window
            win.clear()
            if stats is not None:
                stats.num_window_pauses += 1

"""The overlap scheduler: the next step's host work runs while this step's drafts are computed.

Default on a GPU (--disable_overlap_scheduler turns it off); on a CPU, where host work and compute share the
cores, it is off unless LLMConfig.overlap_scheduler_on_cpu. Once step N is committed, step N+1's schedule
and attention metadata (positions, slots, block tables: everything but the draft token ids) are prepared on
a worker thread while step N's MTP forwards run; the drafts are filled in afterwards. Continuing sequences
then keep their reserved tail blocks (the next step needs them again) instead of rewinding them; every
block still returns to the pool on finish, abort or preemption. The computation itself is unchanged, so
outputs are identical either way.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

from mtp_core.engine.model_runner import ModelRunner
from mtp_core.engine.scheduler import PreemptionNeeded, ScheduledRow, Scheduler
from mtp_core.model import AttentionMetadata

Prepared = tuple[list[ScheduledRow], Optional[AttentionMetadata]]


class OverlapScheduler:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler, self.runner = scheduler, runner
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mtp-overlap")
        self.prepared: Optional[Prepared] = None     # the next step, prepared ahead (None: schedule it then)

    def close(self) -> None:
        """Stops the worker thread (it is idle between steps; the engine calls this when it is closed)."""
        self.prepared = None
        self._executor.shutdown(wait=True)

    def take(self) -> Optional[Prepared]:
        prepared, self.prepared = self.prepared, None
        return prepared

    def while_drafting(self, propose: Callable[[], list[list[int]]]) -> list[list[int]]:
        """propose() (this step's MTP forwards) while the worker prepares the next step."""
        future = self._executor.submit(self._prepare_ahead)
        try:
            return propose()
        finally:
            self.prepared = future.result()

    def _prepare_ahead(self) -> Optional[Prepared]:
        """The worker's schedule: never preempts a sequence that is being drafted right now (the step is then
        scheduled normally once drafting is done)."""
        try:
            rows = self.scheduler.schedule(allow_preempt=False, placeholder=True)
        except PreemptionNeeded:
            return None
        return rows, (self.runner.prepare(rows) if rows else None)

    def fill_drafts(self) -> None:
        """The stored drafts (seq.mtp.drafts) into the prepared step's decode rows, in place of the placeholders
        the worker reserved slots for (as many as each row's limit allowed then)."""
        if not self.prepared:
            return
        prepared, ragged = self.prepared[0], False
        for row in prepared:
            if not row.is_prefill:
                d = row.seq.mtp.drafts[:len(row.token_ids) - 1]
                ragged |= len(d) != len(row.token_ids) - 1
                row.token_ids = [row.seq.all_ids[-1], *d]
        if ragged:     # fewer drafts than the placeholders: positions and slots change
            self.prepared = (prepared, self.runner.prepare(prepared))

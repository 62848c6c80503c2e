"""One decode step behind one interface: the routes a step can take and what every route returns.

A route answers "can you run these rows" (`accepts`) and "run them" (`step`), returning one `StepOutput`. The
engine holds its routes in order and takes the first that accepts the batch (Engine._forward):

- the static step (static_step.GraphRunner: a CUDA graph per batch size) or the native step (native_step.NativeStep:
  one mtp_core::mtp_step call), each wrapped as a `FusedRoute`: the target forward, the verification and the next
  drafts at once, the MTP state settled inside (speculative/backlog.py: settle);
- the native target (Engine's `NativeTargetRoute`): the target forward and the verification of a greedy batch in
  one native call (NativeStep.target) where the fused native step does not take it, then the drafter in the
  engine's propose stage;
- the general path (Engine's `GeneralRoute`): the target forward and verification (model_runner.py and the
  verifier), then the drafter in the engine's propose stage. It accepts every batch.

Which acceptance rules a fused step verifies is the rules' own answer (speculative/verifier.py: Acceptance.fused).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, Union

from mtp_core.engine.scheduler import ScheduledRow
from mtp_core.model import AttentionMetadata
from mtp_core.speculative.verifier import VerifyResult

if TYPE_CHECKING:
    from mtp_core.engine.model_runner import TargetOutput
    from mtp_core.engine.native_step import NativeStep
    from mtp_core.engine.static_step import GraphRunner


@dataclass
class StepOutput:
    """The target half of a step: what the forward and the verification produced."""
    rows: list[ScheduledRow]
    verified: VerifyResult                     # emitted tokens per row (accepted drafts, then the bonus)
    target: Optional["TargetOutput"]           # hidden states (and logits) per row; None after a fused step
    drafts: Optional[dict[int, list[int]]] = None   # a fused step's next drafts, by request id


class Route(Protocol):
    def accepts(self, rows: list[ScheduledRow]) -> bool:
        """Whether this route can run the batch."""

    def step(self, rows: list[ScheduledRow], meta: Optional[AttentionMetadata]) -> StepOutput:
        """Runs the batch it just accepted."""


class FusedRoute:
    """A fused step (GraphRunner or NativeStep) as a route: `step_for(rows)` picks the step that can run the batch,
    its `run(rows)` returns (the verification, the next drafts per row); `num_replays` counts the steps run."""

    def __init__(self, fused: Union["GraphRunner", "NativeStep"]) -> None:
        self.fused = fused
        self._chosen: Optional[tuple[list[ScheduledRow], object]] = None   # accepts' answer, for step

    def accepts(self, rows: list[ScheduledRow]) -> bool:
        step = self.fused.step_for(rows)
        self._chosen = (rows, step) if step is not None else None
        return step is not None

    def step(self, rows: list[ScheduledRow], meta: Optional[AttentionMetadata] = None) -> StepOutput:
        chosen, self._chosen = self._chosen, None
        step = chosen[1] if chosen is not None and chosen[0] is rows else self.fused.step_for(rows)
        verified, drafts = step.run(rows)
        self.fused.num_replays += 1
        return StepOutput(rows, verified, None, {r.seq.request_id: d for r, d in zip(rows, drafts)})

"""Acceptance statistics (TensorRT-LLM calls AL the "acceptance rate"; here AL = tokens / steps)."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields


@dataclass
class SpecStats:
    num_steps: int = 0                 # decoding steps, the prefill step that emits the first token included
    num_output_tokens: int = 0
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)   # [K]: steps whose draft i was accepted
    proposed_per_position: list[int] = field(default_factory=list)
    # adaptive draft length: histograms indexed by a number of drafts (0..K)
    drafts_per_step: list[int] = field(default_factory=list)    # decode steps that verified i drafts
    draft_limit_per_step: list[int] = field(default_factory=list)   # drafting steps whose chosen count was i
    num_window_pauses: int = 0         # acceptance-window pauses

    def record_step(self, num_emitted: int, num_proposed: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_output_tokens += num_emitted
        self.num_draft_proposed += num_proposed
        self.num_draft_accepted += num_accepted
        proposed, accepted = self.proposed_per_position, self.accepted_per_position
        for hist in (proposed, accepted):
            if len(hist) < num_proposed:
                hist += [0] * (num_proposed - len(hist))
        for i in range(num_proposed):
            proposed[i] += 1
            accepted[i] += i < num_accepted

    def record_decode(self, num_proposed: int) -> None:
        """One decode step of one request that verified num_proposed drafts (0..K)."""
        _bump(self.drafts_per_step, num_proposed)

    def record_limit(self, limit: int) -> None:
        """The draft count chosen for one request's next step (the policy's, within the explicit rules)."""
        _bump(self.draft_limit_per_step, limit)

    def merge(self, other: "SpecStats") -> None:
        """Adds other's counts to these (histograms element-wise, the shorter one padded with zeros)."""
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in _HISTOGRAMS:
            mine, theirs = getattr(self, name), getattr(other, name)
            if len(mine) < len(theirs):
                mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def acceptance_length(self) -> float:
        return self.num_output_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_draft_accepted / self.num_draft_proposed if self.num_draft_proposed else 0.0

    @property
    def waste(self) -> float:
        """Verified drafts per accepted draft (inf when none was accepted; 0 when none was proposed)."""
        if not self.num_draft_proposed:
            return 0.0
        return self.num_draft_proposed / self.num_draft_accepted if self.num_draft_accepted else float("inf")

    @property
    def mean_drafts_per_step(self) -> float:
        n = sum(self.drafts_per_step)
        return sum(i * c for i, c in enumerate(self.drafts_per_step)) / n if n else 0.0

    @property
    def num_drafting_steps(self) -> int:
        """Decode steps (of one request each) that verified at least one draft."""
        return self.proposed_per_position[0] if self.proposed_per_position else 0

    @property
    def drafting_acceptance_length(self) -> float:
        """AL of the steps that drafted: 1 + accepted drafts per such step (vLLM's mean acceptance length). Under
        the cost policy a step may verify no draft; this says what drafting achieves when it happens."""
        n = self.num_drafting_steps
        return 1.0 + self.num_draft_accepted / n if n else 0.0

    @property
    def drafting_share(self) -> float:
        """The share of decode steps that verified at least one draft."""
        n = sum(self.drafts_per_step)
        return self.num_drafting_steps / n if n else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    def summary_lines(self) -> list[str]:
        per_pos = ", ".join(f"{r:.3f}" for r in self.acceptance_per_position)
        return [
            f"decoding steps: {self.num_steps}, output tokens: {self.num_output_tokens}",
            f"drafts proposed: {self.num_draft_proposed}, accepted: {self.num_draft_accepted}, "
            f"draft acceptance rate: {self.draft_acceptance_rate:.3f}",
            f"acceptance length (AL): {self.acceptance_length:.3f}",
            f"AL of the steps that drafted: {self.drafting_acceptance_length:.3f}, in "
            f"{100 * self.drafting_share:.1f}% of the decode steps",
            f"acceptance per draft position: [{per_pos}]",
            "accepted / proposed per draft position: ["
            + ", ".join(f"{a}/{p}" for a, p in zip(self.accepted_per_position, self.proposed_per_position)) + "]",
            f"drafts per decode step (histogram, 0..K): {self.drafts_per_step}, mean "
            f"{self.mean_drafts_per_step:.3f}; drafts chosen per drafting step (0..K): {self.draft_limit_per_step}",
            ("waste (verified drafts per accepted draft): "
             + (f"{self.waste:.3f} ({self.waste - 1:.3f} rejected per accepted)" if self.num_draft_proposed else "-"))
            + (f"; acceptance-window pauses: {self.num_window_pauses}" if self.num_window_pauses else ""),
        ]


def _bump(hist: list[int], i: int) -> None:
    if len(hist) <= i:
        hist += [0] * (i + 1 - len(hist))
    hist[i] += 1


# merge() walks these (read once from the fields: a counter is an int, a histogram a list)
_COUNTS = tuple(f.name for f in fields(SpecStats) if f.default_factory is MISSING)
_HISTOGRAMS = tuple(f.name for f in fields(SpecStats) if f.default_factory is not MISSING)

"""One request's drafting state (`Sequence.mtp`), grouped by the component that writes it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch


@dataclass
class Unfinished:
    """A deferred prompt chunk's main hidden states before the target's last layer ran past its KV write there
    (ModelRunner, forward_split): the residual stream entering that layer, x [n, H], at positions [start,
    start + n). `ModelRunner.finish` runs the rest of the layer, the same numbers a whole forward gives; nothing
    runs it for a request that never drafts (speculative/backlog.py)."""
    x: torch.Tensor
    start: int

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, sl: slice) -> "Unfinished":
        """The first positions (sl = [:n]), as the engine cuts a row's states to its valid length."""
        assert isinstance(sl, slice) and sl.start is None and sl.step is None, \
            "Unfinished cuts only [:n]; its states are read once finished (backlog.finish_pending)"
        return Unfinished(self.x[sl], self.start)

    def clone(self) -> "Unfinished":
        return Unfinished(self.x.clone(), self.start)


@dataclass
class MTPState:
    # the drafts: the engine stores them for the next step, the Vanilla drafter (or the native step) its window
    drafts: list[int] = field(default_factory=list)   # proposed for the next step
    window_hidden: Optional[torch.Tensor] = None   # Vanilla: the last K valid positions' main hidden [<=K, H]
    # the backlog of a row that skips drafting (speculative/backlog.py; the static steps keep it up to date)
    num_valid: int = 0           # positions 0..num_valid-1 hold valid MTP-cache entries (<= seq.kv.num_cached)
    # main hidden states of positions num_valid..num_cached-1: [n, H] tensors, (a step's [B, H], row b) references,
    # or a deferred prompt chunk's Unfinished states (backlog.held_states reads them, once finished)
    pending: Optional[list[Union[torch.Tensor, tuple[torch.Tensor, int], Unfinished]]] = None
    is_off: bool = False         # drafting off for good (the lag outgrew backlog.MAX_MTP_LAG)
    # the acceptance window (adaptive.DraftLimits)
    accept_window: list[int] = field(default_factory=list)   # AL of the last decode steps that drafted
    pause_steps: int = 0         # decode steps left without drafting
    # the draft-length policy (policy.py)
    draft_len: int = 0           # drafts chosen for the next step when this request last drafted
    accept_est: Optional[list[float]] = None   # acceptance per draft position (None: the engine-wide one)
    expected: Optional[list[float]] = None     # expected tokens emitted with 0..K drafts, from accept_est
    accept_step: int = 0         # the policy's step count when accept_est last learnt something
    accept_n: int = 0            # observations accept_est has learnt from

    def restart(self, num_valid: int) -> None:
        """A (re)started prefill: no drafts, no window; a reused prefix brings its MTP-cache entries too."""
        self.drafts, self.window_hidden = [], None
        self.num_valid, self.pending = num_valid, None

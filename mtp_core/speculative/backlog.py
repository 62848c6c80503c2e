"""The drafter call, with the backlog of rows that skip drafting.

A decode row whose draft count is 0 (the policy, the batch-size schedule, a paused acceptance window)
skips the drafter entirely: its MTP caches lag behind its valid length, and the main model's hidden states
for the missing positions are kept (`MTPState.pending`: tensors, or references to a row of a step's states when
no row of that step drafted, `hold_rows`; `held_states` reads either). When it drafts again, the drafter's first MTP
forward covers every lagging position at once (one forward over n tokens, like a prefill chunk), so the
MTP caches are again equal to a recompute of the accepted prefix. A lag longer than MAX_MTP_LAG positions
drops the kept states and switches drafting off for that request for good (bounded memory). Every route
brings a row's MTP state up to date after its step with one function, `settle` (here after the drafter; the
static and native steps after their call).

Worked example (Eagle): a row valid up to position 9 with its MTP entries too (num_valid = 10) is given 0
drafts for two steps, each emitting one token: pending holds [h10], then [h10], [h11] (valid 12). The next
step emits x13 (new hidden [h12]) and the policy gives the row drafts again: forward 1 runs over positions
10..12 with tokens x11..x13 and hidden [h10, h11, h12], drafts follow from position 12, num_valid = 13.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from mtp_core.request.mtp_state import MTPState, Unfinished
from mtp_core.request.sequence import Sequence
from mtp_core.speculative.drafter import DraftInput, Drafter

# runs the target's last layer over a deferred prompt chunk's residual stream -> its hidden states [n, H]
# (ModelRunner.finish)
Finish = Callable[[Sequence, Unfinished], torch.Tensor]

MAX_MTP_LAG = 2048          # positions of main hidden states a row that skips drafting may keep

def held_states(mtp: MTPState) -> list[torch.Tensor]:
    """The row's kept main hidden states, oldest first, as [n, H] tensors (a row reference becomes its row); a
    deferred prompt's must have been finished (`finish_pending`: its own indexing refuses otherwise)."""
    return [h if isinstance(h, torch.Tensor) else h[0][h[1]:h[1] + 1] for h in mtp.pending or ()]


def held_len(mtp: MTPState) -> int:
    """Positions of main hidden states the row keeps."""
    return sum(1 if isinstance(h, tuple) else len(h) for h in mtp.pending) if mtp.pending else 0


def finish_pending(seq: Sequence, finish: Optional[Finish]) -> None:
    """A row about to run its MTP forward over its kept states (a catch-up: the drafter here, or inside the fused
    native step): the deferred prompt chunks among them get the target's last layer run over them (finish), in
    the step whose catch-up reads them, so the policy's catch-up cost includes it."""
    mtp = seq.mtp
    if mtp.pending and any(isinstance(h, Unfinished) for h in mtp.pending):
        mtp.pending = [finish(seq, h) if isinstance(h, Unfinished) else h for h in mtp.pending]


def finish_row(inp: DraftInput, finish: Optional[Finish]) -> None:
    """finish_pending, and the row's new states if they are a deferred prompt chunk's."""
    finish_pending(inp.seq, finish)
    if isinstance(inp.hidden, Unfinished):
        inp.hidden = finish(inp.seq, inp.hidden)


def hold_rows(mtps: list[MTPState], hidden: torch.Tensor, starts: list[int]) -> None:
    """A step in which no row drafted and row b fed one token (hidden [B, H]): each row that keeps states keeps a
    reference to its row of `hidden` (its new valid length starts[b] + 1), not a view: a view is a tensor object
    per row and step (~1 us each), a reference a tuple. Like `hold` without copy, the step's states stay alive
    while a row refers to them."""
    for b, mtp in enumerate(mtps):
        if not mtp.is_off:
            _keep(mtp, (hidden, b), starts[b] + 1)


def hold(mtp: MTPState, hidden: torch.Tensor, valid: int, copy: bool) -> None:
    """A row that skips drafting keeps its newly valid positions' main hidden states [n, H] (valid: its new
    valid length). copy: a view would keep the whole step's output (drafts, other rows) alive."""
    _keep(mtp, hidden.clone() if copy else hidden, valid)


def _keep(mtp: MTPState, states, valid: int) -> None:
    """Appends kept states (a tensor or a row reference) up to the new valid length; a lag past MAX_MTP_LAG
    drops them and switches drafting off."""
    if mtp.pending is None:
        mtp.pending = [states]
    else:
        mtp.pending.append(states)
    if valid - mtp.num_valid > MAX_MTP_LAG:
        mtp.is_off, mtp.pending = True, None


def settle(mtp: MTPState, valid: int, drafted: bool, hidden: Optional[torch.Tensor] = None, copy: bool = True,
           window: Optional[torch.Tensor] = None) -> None:
    """The one update of a row's MTP state after a step, on every route (`propose` on the general path, the static
    and native steps): a row whose MTP forwards ran has MTP caches up to its new valid length `valid` (Vanilla:
    and `window`, the main hidden states they re-read next time); a row that skipped them lags and holds its newly
    valid positions' main hidden states (`hidden` [n, H], see `hold`). A row with drafting off keeps nothing."""
    if mtp.is_off:
        return
    if not drafted:
        hold(mtp, hidden, valid, copy)
        return
    if window is not None:
        mtp.window_hidden = window
    mtp.num_valid, mtp.pending = valid, None


def propose(drafter: Drafter, inputs: list[DraftInput], views_ok: bool, defer_prompts: bool = False,
            shared_block: int = 0, finish: Optional[Finish] = None) -> list[list[int]]:
    """Each row's next drafts (inp.max_drafts of them, chosen by the policy). Rows whose count is 0 skip the
    drafter and hold their states; rows that lag catch up in their first MTP forward. views_ok: the step's
    output holds nothing else worth freeing. defer_prompts (the cost policy): prompt chunks given no drafts hold
    their states too (a request's MTP forward over its prompt waits until it first drafts, and never runs if it
    does not), up to MAX_MTP_LAG / 2 positions (a longer prompt runs it now, so that the request can still draft
    later). shared_block (prefix caching on and prompts seen to share prefixes: the pool's tokens per block, else
    0): a deferred prompt still runs its MTP forward up to its last full block (no drafts), since only blocks
    whose MTP entries are written can be shared with later requests; the rest of the prompt waits. finish: how a
    deferred prompt chunk's states are finished (`finish_row`) when its row runs the drafter."""
    drafts: list[list[int]] = [[] for _ in inputs]
    run: list[int] = []
    rest: dict[int, tuple[torch.Tensor, int]] = {}   # a deferred prompt's positions past its last full block
    for n, inp in enumerate(inputs):
        mtp = inp.seq.mtp
        if mtp.is_off:
            continue
        limit = inp.max_drafts if inp.needs_drafts and inp.max_drafts is not None else 0
        valid = inp.start + len(inp.next_tokens)
        upto = 0
        if limit == 0 and (valid > inp.seq.kv.prefill_target or (defer_prompts and valid <= MAX_MTP_LAG // 2)):
            prompt = valid <= inp.seq.kv.prefill_target
            upto = valid // shared_block * shared_block if prompt and shared_block else 0
            if upto <= max(mtp.num_valid, inp.start):
                settle(mtp, valid, False, inp.hidden, copy=True if prompt else not views_ok)
                continue   # a decode row that skips drafting, or a prompt chunk whose MTP forward is deferred
        finish_row(inp, finish)           # it runs the drafter: its deferred prompt's states are read
        if upto:                          # a deferred prompt's full blocks only
            rest[n] = (inp.hidden[upto - inp.start:], valid)
            inp.hidden, inp.next_tokens = inp.hidden[:upto - inp.start], inp.next_tokens[:upto - inp.start]
        if mtp.pending and mtp.num_valid < inp.start:
            # the MTP caches lag (drafting skipped in earlier steps): cover the missing positions too
            end = inp.start + len(inp.next_tokens)
            inp.hidden = torch.cat([*held_states(mtp), inp.hidden])
            inp.start, inp.next_tokens = mtp.num_valid, inp.seq.all_ids[mtp.num_valid + 1: end + 1]
        inp.max_drafts = limit
        run.append(n)
    if run:
        for n, d in zip(run, drafter.propose([inputs[n] for n in run])):
            inp, drafts[n] = inputs[n], d
            settle(inp.seq.mtp, inp.start + len(inp.next_tokens), True)
            if n in rest:              # the prompt's positions past its last full block wait
                hidden, valid = rest[n]
                if len(hidden):
                    settle(inp.seq.mtp, valid, False, hidden, copy=True)
    return drafts

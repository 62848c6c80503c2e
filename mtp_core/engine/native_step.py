"""The decode step as one native call on the CPU (mtp_core::mtp_step, csrc/cpu/mtp_step_cpu.cpp): MTP Eagle,
MTP Vanilla, or the plain greedy step of an engine without MTP.

The CPU twin of the static (CUDA-graph) step, with the same contract (static_step.py). Inside the one
call: the target forward over every row's [t, d_1..d_k], greedy strict verification, then for the rows that
draft the MTP forwards (Eagle's forward 1 and chain, or Vanilla's K modules over the row's window), each
forward the batch-invariant native forward; so the tokens are exactly the eager engine's, and Python does
O(1) work per step instead of a forward, a logits call and a metadata build per draft.

Rows may carry different numbers of drafts (adaptive draft length, the confidence gate inside the call).
A row the policy gives 0 drafts runs no MTP forward: its MTP caches lag and its hidden states wait in
seq.mtp.pending (speculative/backlog.py), as on the general path, so a step in which no row drafts costs
what decoding without MTP costs. A lagging row that drafts again catches up inside the call (its pending
states go in as its window). Out of scope (the step runs through the general path): prefill rows, sampled
rows, relaxed acceptance in the thinking phase, injected drafters and the overlap scheduler. `target()`
runs the target forward and the verification of a greedy batch in one call for the general path (rows
whose MTP state the call cannot bring up to date) and hands the hidden states to its drafter.
"""
from __future__ import annotations

import array
from typing import Optional

import torch

from mtp_core.engine.scheduler import ScheduledRow
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.model.native_decode import NativeDecoder
from mtp_core.speculative import backlog
from mtp_core.speculative.mtp_state import MTPState


def _i64(values: list[int]) -> torch.Tensor:
    """int64 tensor of a short list (over a buffer: a third of torch.tensor's ~3 us, five times a step)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)


def _i32(values: list[int]) -> torch.Tensor:
    return torch.frombuffer(array.array("i", values), dtype=torch.int32) if values else torch.empty(0, dtype=torch.int32)


class NativeStep:
    def __init__(self, model: DeepseekV3ForCausalLM, native: NativeDecoder, caches: list[torch.Tensor], K: int,
                 relaxed: Optional[tuple[int, float]], fixed_counts: bool, vanilla: bool = False,
                 confidence: float = 0.0) -> None:
        self.caches, self.K = caches, K
        self.native = native
        self.hidden_size = model.config.hidden_size
        self.mtp_layer = model.num_main_layers if K else -1  # the first MTP module; -1: no drafting (nextn = 0)
        self.vanilla = vanilla and K > 1                     # modules 0..K-1, each over the row's window
        self.relaxed_on = relaxed is not None and relaxed[0] > 1 and relaxed[1] > 0
        self.fixed_counts = fixed_counts                     # draft_len_policy fixed: K, as the static step
        self.confidence = confidence                         # the confidence gate's threshold (0: off)
        self.num_replays = 0                                 # steps run whole by run()

    def step_for(self, rows: list[ScheduledRow]) -> Optional["NativeStep"]:
        """self when every row is a greedy strict decode row and every row that drafts has the stored states its
        MTP forwards re-read (lagging positions; Vanilla's window), else None."""
        if not self.can_verify(rows):
            return None
        for r in rows:
            if self._limit(r) and self._window_len(r) > self._stored(r.seq.mtp):
                return None
        return self

    def can_verify(self, rows: list[ScheduledRow]) -> bool:
        """The target forward and strict verification of this batch fit one call (target()): greedy decode rows,
        none relaxed; whatever their MTP state (the drafter runs afterwards, as usual)."""
        return bool(rows) and all(not r.is_prefill and r.seq.params.greedy and len(r.token_ids) <= self.K + 1
                                  and not (self.relaxed_on and r.seq.in_thinking) for r in rows)

    def target(self, rows: list[ScheduledRow]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """The general step's runner.execute + verify in one call, for can_verify(rows): (emitted tokens per row,
        the target's hidden states per row [n_row, H]), which the engine commits and drafts from as usual."""
        out, hidden, _ = self._call(rows, [0] * len(rows), -1)
        tokens = [row[1:1 + row[0]] for row in out]
        return tokens, list(hidden.split([len(r.token_ids) for r in rows]))

    def run(self, rows: list[ScheduledRow]) -> tuple[list[list[int]], list[list[int]]]:
        # each row's next drafts, which the engine cuts to its choice once the step is committed (the choice
        # depends on what the step emits): under a fixed policy K for every row, as the static step does (so the
        # drafts are exactly the eager drafter's); under the cost policy the count it chose for the row last
        # (it changes counts rarely; a row it raises gets its new count one step late), so that a step whose
        # rows draft less does not compute the chain it would throw away
        limits = [self._limit(r) for r in rows]
        out, hidden, windows = self._call(rows, limits, self.mtp_layer)
        kmax = max(len(r.token_ids) for r in rows) - 1
        tokens = [row[1:1 + row[0]] for row in out]
        drafts = [row[2 + kmax: 2 + kmax + n] for row, n in zip(out, limits)]
        if self.confidence:          # the gate may stop a chain early: -1 past its last draft
            drafts = [d[:d.index(-1)] if -1 in d else d for d in drafts]
        self._settle(rows, limits, out, hidden, windows)
        return tokens, drafts

    # ---- the rows' MTP state ---------------------------------------------------------------
    def _limit(self, r: ScheduledRow) -> int:
        if not self.K or r.seq.mtp.is_off:
            return 0
        return self.K if self.fixed_counts else min(self.K, max(0, r.seq.mtp.draft_len))

    def _window_len(self, r: ScheduledRow) -> int:
        """Stored positions before r.start the row's MTP forwards re-read: the lagging ones, and for Vanilla at
        least min(K - 1, start) (module 1's window reaches that far back)."""
        lag = r.start - r.seq.mtp.num_valid
        return max(lag, min(self.K - 1, r.start)) if self.vanilla else lag

    def _stored(self, mtp: MTPState) -> int:
        """Positions before the row's valid length whose main hidden states the engine keeps (window, pending)."""
        n = sum(len(h) for h in mtp.pending) if mtp.pending else 0
        if self.vanilla and mtp.window_hidden is not None:
            n += len(mtp.window_hidden)
        return n

    def _windows(self, rows: list[ScheduledRow], limits: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored positions each drafting row's MTP forwards re-read, as the op takes them: their count, their
        tokens x_{q+1} and main hidden states (the last ones of the Vanilla window and the pending states), and
        each row's MTP valid length."""
        lens, ids, hid = [], [], []
        for r, n in zip(rows, limits):
            mtp = r.seq.mtp
            w = self._window_len(r) if n else 0
            lens.append(w)
            if not w:
                continue
            ids.extend(r.seq.all_ids[r.start - w + 1: r.start + 1])
            parts = ([mtp.window_hidden] if self.vanilla and mtp.window_hidden is not None else []) + \
                (mtp.pending or [])
            states = torch.cat(parts) if len(parts) > 1 else parts[0]
            hid.append(states[len(states) - w:])
        hidden = (torch.cat(hid) if len(hid) > 1 else hid[0]).float().contiguous() if hid else \
            torch.empty(0, self.hidden_size)
        return _i64(ids), hidden, _i32(lens), _i64([r.seq.mtp.num_valid for r in rows])

    def _settle(self, rows: list[ScheduledRow], limits: list[int], out: list[list[int]], hidden: torch.Tensor,
                windows: torch.Tensor) -> None:
        """After run(): rows that drafted have MTP caches up to their new valid length (Vanilla: and a new window);
        the others lag, keeping their new positions' hidden states (copies unless every row fed one token: a view
        would keep the whole step's states alive)."""
        if not self.K:
            return
        views_ok = hidden.shape[0] == len(rows)
        K, first = self.K, 0                 # first: the row's first position in hidden [T, H]
        for b, (r, row, n) in enumerate(zip(rows, out, limits)):
            mtp, valid = r.seq.mtp, r.start + row[0]
            first, at = first + len(r.token_ids), first
            if n:
                if self.vanilla:      # the main hidden states of its last min(K, window) valid positions
                    kept = min(K, valid - max(min(valid - K, mtp.num_valid), 0))
                    mtp.window_hidden = windows[b, K - kept:]
                mtp.num_valid, mtp.pending = valid, None
            elif not mtp.is_off:
                backlog.hold(mtp, hidden[at:at + row[0]], valid, copy=not views_ok)

    def _call(self, rows: list[ScheduledRow], limits: list[int], mtp_layer: int
              ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        ids = [t for r in rows for t in r.token_ids]
        qs = [0]
        for r in rows:
            qs.append(qs[-1] + len(r.token_ids))
        width = max(len(r.seq.block_table) for r in rows)
        tables = _i32([b for r in rows for b in r.seq.block_table + [-1] * (width - len(r.seq.block_table))]
                      ).view(len(rows), width)
        vanilla = self.vanilla and mtp_layer >= 0
        chain = [min(self.K - 1, n) if vanilla else max(n - 1, 0) for n in limits]
        ends = [r.start + len(r.token_ids) + c for r, c in zip(rows, chain)]
        nd = self.native
        if max(ends) > nd.rope_len:
            nd.grow_rope(max(ends) + 256)
        drafting = mtp_layer >= 0 and any(limits)
        window = self._windows(rows, limits) if drafting and (vanilla or any(
            r.seq.mtp.num_valid != r.start for r, n in zip(rows, limits) if n)) else (None, None, None, None)
        out, hidden, windows = nd.step_op(
            nd.handle, _i64(ids), _i32(qs), _i64([r.start for r in rows]), tables, _i32(limits),
            self.caches, nd.rope_cos, nd.rope_sin, mtp_layer, self.K if vanilla else 1, *window,
            self.confidence if drafting else 0.0)
        return out.tolist(), hidden, windows

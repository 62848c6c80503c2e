"""The decode step as one native call on the CPU (mtp_core::mtp_step, csrc/cpu/mtp_step_cpu.cpp): MTP Eagle,
or the plain greedy step of an engine without MTP.

The CPU twin of the static (CUDA-graph) step (graph_runner.py), with the same contract and the same engine
hook: `step_for(rows)` says whether this batch can take it, `run(rows)` returns (emitted tokens per row,
next drafts per row). Inside the one call: the target forward over every row's [t, d_1..d_k], greedy strict
verification, Eagle forward 1 over the accepted tokens and the chain of drafts, each forward the
batch-invariant native forward; so the tokens are exactly the eager engine's, and Python does O(1) work
per step instead of a forward, a logits call and a metadata build per draft.

Rows may carry different numbers of drafts (adaptive draft length). Out of scope (the step runs through the
general path): prefill rows, sampled rows, relaxed acceptance in the thinking phase, MTP Vanilla, rows whose
MTP caches lag, injected drafters and the overlap scheduler. Forward 1 runs for every row, also those that
want no drafts, so the native step never leaves an MTP cache behind. When only the drafting is out of scope
(MTP Vanilla, lagging rows), `target()` still runs the target forward and the verification in one call and
hands the hidden states to the general path's drafter.
"""
from __future__ import annotations

from typing import Optional

import torch

from mtp_core.engine.scheduler import ScheduledRow
from mtp_core.model import DeepseekV3ForCausalLM


class NativeStep:
    def __init__(self, model: DeepseekV3ForCausalLM, caches: list[torch.Tensor], K: int,
                 relaxed: Optional[tuple[int, float]], fixed_counts: bool, drafts_inside: bool) -> None:
        self.caches, self.K = caches, K
        self.native = model.native
        self.mtp_layer = model.num_main_layers if K else -1  # Eagle: module 0; -1: no drafting (nextn = 0)
        self.relaxed_on = relaxed is not None and relaxed[0] > 1 and relaxed[1] > 0
        self.fixed_counts = fixed_counts                     # draft_len_policy fixed: K, as the static step
        self.drafts_inside = drafts_inside                   # MTP Eagle without a confidence gate: run() drafts
        self.num_replays = 0                                 # steps run whole by run()
        self.num_targets = 0                                 # steps whose target + verification ran in target()

    def step_for(self, rows: list[ScheduledRow]) -> Optional["NativeStep"]:
        """self when every row is a greedy strict decode row whose MTP caches are up to date, else None."""
        if not self.drafts_inside or not self.can_verify(rows):
            return None
        if self.K and any(r.seq.spec_off or r.seq.mtp_valid != r.start for r in rows):
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
        out, hidden = self._call(rows, [0] * len(rows), -1)
        self.num_targets += 1
        tokens = [row[1:1 + row[0]] for row in out]
        return tokens, list(hidden.split([len(r.token_ids) for r in rows]))

    def run(self, rows: list[ScheduledRow]) -> tuple[list[list[int]], list[list[int]]]:
        # each row's next drafts, which the engine cuts to its choice once the step is committed (the choice
        # depends on what the step emits): under a fixed policy K for every row, as the static step does (so the
        # drafts are exactly the eager drafter's); under the cost policy the count it chose for the row last
        # (it changes counts rarely; a row it raises gets its new count one step late), so that a step whose
        # rows draft less does not compute the chain it would throw away
        limits = [self.K if self.fixed_counts else min(self.K, max(0, r.seq.draft_len)) for r in rows]
        out, _ = self._call(rows, limits, self.mtp_layer)
        kmax = max(len(r.token_ids) for r in rows) - 1
        tokens = [row[1:1 + row[0]] for row in out]
        drafts = [row[2 + kmax: 2 + kmax + n] for row, n in zip(out, limits)]
        return tokens, drafts

    def _call(self, rows: list[ScheduledRow], limits: list[int], mtp_layer: int) -> tuple[list[list[int]], torch.Tensor]:
        ids = [t for r in rows for t in r.token_ids]
        qs = [0]
        for r in rows:
            qs.append(qs[-1] + len(r.token_ids))
        width = max(len(r.seq.block_table) for r in rows)
        tables = torch.tensor([r.seq.block_table + [-1] * (width - len(r.seq.block_table)) for r in rows],
                              dtype=torch.int32)
        ends = [r.start + len(r.token_ids) + max(n - 1, 0) for r, n in zip(rows, limits)]
        nd = self.native
        if max(ends) > nd.rope_len:
            nd.grow_rope(max(ends) + 256)
        out, hidden = torch.ops.mtp_core.mtp_step(
            nd.handle, torch.tensor(ids, dtype=torch.long), torch.tensor(qs, dtype=torch.int32),
            torch.tensor([r.start for r in rows], dtype=torch.long), tables, torch.tensor(limits, dtype=torch.int32),
            self.caches, nd.rope_cos, nd.rope_sin, mtp_layer)
        return out.tolist(), hidden

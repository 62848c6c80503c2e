"""The decode step as one native call on the CPU (mtp_core::mtp_step, csrc/cpu/mtp_step_cpu.cpp): MTP Eagle,
MTP Vanilla, or the plain greedy step of an engine without MTP.

The CPU twin of the static (CUDA-graph) step, with the same contract (static_step.py). Inside the one
call: the target forward over every row's [t, d_1..d_k], greedy strict verification, then for the rows that
draft the MTP forwards (Eagle's forward 1 and chain, or Vanilla's K modules over the row's window), each
forward the batch-invariant native forward; so the tokens are exactly the eager engine's, and Python does
O(1) work per step instead of a forward, a logits call and a metadata build per draft.

Rows that need their logits stay on the call (`_logits_args`): before it, each such row's logits processing
(penalties, logit_bias, min_tokens: sampling.PenaltyRules) and grammar masks (structured.guided_masks) are
prepared along its drafts, position by position, as the general path applies them once those drafts are
accepted; the call verifies on the processed, masked logits, and returns the log-probabilities of the emitted
tokens of the rows that want them (computed there by the same kernels as sampling.token_logprobs). So such a
request's tokens and float32 logprobs are bitwise the general path's, and plain decoding's (test_native_step.py).

Rows may carry different numbers of drafts (adaptive draft length, the confidence gate inside the call).
A row the policy gives 0 drafts runs no MTP forward: its MTP caches lag and its hidden states wait in
seq.mtp.pending (speculative/backlog.py), as on the general path, so a step in which no row drafts costs
what decoding without MTP costs. A lagging row that drafts again catches up inside the call (its pending
states go in as its window). Out of scope (the step runs through the general path): prefill rows (prompt
logprobs included), sampled rows, relaxed acceptance in the thinking phase, injected drafters and the overlap
scheduler. `target()` runs the target forward and the verification of a greedy batch in one call for the
general path (rows whose MTP state the call cannot bring up to date) and hands the hidden states to its
drafter.
"""
from __future__ import annotations

import array
from typing import NamedTuple, Optional

import numpy as np
import torch

from mtp_core.engine.scheduler import ScheduledRow
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.native.native_decode import NativeDecoder, padded_tables
from mtp_core.request.mtp_state import MTPState
from mtp_core.request.sequence import Stops
from mtp_core.sampling import PenaltyRules
from mtp_core.speculative import backlog
from mtp_core.speculative.verifier import Acceptance, VerifyResult
from mtp_core.structured import guided_masks


def _i64(values: list[int]) -> torch.Tensor:
    """int64 tensor of a short list (over a buffer: a third of torch.tensor's ~3 us, five times a step)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.long) if values else torch.empty(0, dtype=torch.long)


def _i32(values: list[int]) -> torch.Tensor:
    return torch.frombuffer(array.array("i", values), dtype=torch.int32) if values else torch.empty(0, dtype=torch.int32)


class EngineParts(NamedTuple):
    """What a native step takes from its engine (NativeStep.bind): the stop tokens and <think> / </think> that rows
    needing their logits need, and how a deferred prompt's Unfinished states are finished before a catch-up in the
    call reads them (ModelRunner.finish; None: nothing defers)."""
    stops: Stops
    finish: Optional[backlog.Finish]


class NativeStep:
    def __init__(self, model: DeepseekV3ForCausalLM, native: NativeDecoder, caches: list[torch.Tensor], K: int,
                 acceptance: Acceptance, fixed_counts: bool, vanilla: bool = False,
                 confidence: float = 0.0) -> None:
        self.caches, self.draft_len = caches, K
        self.native = native
        self.mtp_layer = model.num_main_layers if K else -1  # the first MTP module; -1: no drafting (nextn = 0)
        self.main_caches = caches[:model.num_main_layers]    # what a step in which no row drafts passes
        self.vanilla = vanilla and K > 1                     # modules 0..K-1, each over the row's window
        self.acceptance = acceptance                         # which rows the call verifies (strict, guided)
        self.fixed_counts = fixed_counts                     # draft_len_policy fixed: K, as the static step
        self.confidence = confidence                         # the confidence gate's threshold (0: off)
        self.num_replays = 0                                 # steps run whole by run()
        self.engine = EngineParts(Stops(set(), None, 0), None)   # what the engine lends it (bind)
        self._limits: Optional[tuple[list[ScheduledRow], list[int]]] = None   # step_for's, for run()

    def bind(self, stops: Stops, finish: Optional[backlog.Finish] = None) -> None:
        self.engine = EngineParts(stops, finish)

    def step_for(self, rows: list[ScheduledRow]) -> Optional["NativeStep"]:
        """self when every row is a greedy strict decode row and every row that drafts has the stored states its
        MTP forwards re-read (lagging positions; Vanilla's window), else None."""
        if not self.can_verify(rows):
            return None
        limits = self._limits_of(rows)
        if any(limits):
            for r, n in zip(rows, limits):
                if n and self._window_len(r) > self._stored(r.seq.mtp):
                    return None
        self._limits = (rows, limits)
        return self

    def can_verify(self, rows: list[ScheduledRow]) -> bool:
        """The target forward and verification of this batch fit one call (target()): decode rows whose acceptance
        rule the call verifies (strict and greedy guided rows, with their logits processing and logprobs; not
        sampled or relaxed ones); whatever their MTP state (the drafter runs afterwards, as usual)."""
        return bool(rows) and all(not r.is_prefill and len(r.token_ids) <= self.draft_len + 1 for r in rows) \
            and self.acceptance.fused("native", [r.seq for r in rows])

    def target(self, rows: list[ScheduledRow]) -> tuple[VerifyResult, list[torch.Tensor]]:
        """The general step's runner.execute + verify in one call, for can_verify(rows): (emitted tokens per row and
        the logprobs asked for, the target's hidden states per row [n_row, H]), which the engine commits and drafts
        from as usual."""
        out, hidden, _, logprobs = self._call(rows, [0] * len(rows), -1)
        tokens = [row[1:1 + row[0]] for row in out]
        return VerifyResult(tokens, logprobs), list(hidden.split([len(r.token_ids) for r in rows]))

    def run(self, rows: list[ScheduledRow]) -> tuple[VerifyResult, list[list[int]]]:
        # each row's next drafts, which the engine cuts to its choice once the step is committed (the choice
        # depends on what the step emits): under a fixed policy K for every row, as the static step does (so the
        # drafts are exactly the eager drafter's); under the cost policy the count it chose for the row last
        # (it changes counts rarely; a row it raises gets its new count one step late), so that a step whose
        # rows draft less does not compute the chain it would throw away
        cached, self._limits = self._limits, None
        limits = cached[1] if cached is not None and cached[0] is rows else self._limits_of(rows)
        out, hidden, windows, logprobs = self._call(rows, limits, self.mtp_layer)
        kmax = max(len(r.token_ids) for r in rows) - 1
        tokens = [row[1:1 + row[0]] for row in out]
        drafts = [row[2 + kmax: 2 + kmax + n] for row, n in zip(out, limits)]
        if self.confidence:          # the gate may stop a chain early: -1 past its last draft
            drafts = [d[:d.index(-1)] if -1 in d else d for d in drafts]
        self._settle(rows, limits, out, hidden, windows)
        return VerifyResult(tokens, logprobs), drafts

    # ---- the rows' MTP state ---------------------------------------------------------------
    def _limits_of(self, rows: list[ScheduledRow]) -> list[int]:
        """Each row's drafts for its next step: 0 with drafting off, K under a fixed count, else the policy's count
        (seq.mtp.draft_len, within 0..K)."""
        K = self.draft_len
        if not K:
            return [0] * len(rows)
        if self.fixed_counts:
            return [0 if r.seq.mtp.is_off else K for r in rows]
        return [0 if r.seq.mtp.is_off else min(K, max(0, r.seq.mtp.draft_len)) for r in rows]

    def _window_len(self, r: ScheduledRow) -> int:
        """Stored positions before r.start the row's MTP forwards re-read: the lagging ones, and for Vanilla at
        least min(K - 1, start) (module 1's window reaches that far back)."""
        lag = r.start - r.seq.mtp.num_valid
        return max(lag, min(self.draft_len - 1, r.start)) if self.vanilla else lag

    def _stored(self, mtp: MTPState) -> int:
        """Positions before the row's valid length whose main hidden states the engine keeps (window, pending)."""
        n = backlog.held_len(mtp)
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
            backlog.finish_pending(r.seq, self.engine.finish)
            parts = ([mtp.window_hidden] if self.vanilla and mtp.window_hidden is not None else []) + \
                backlog.held_states(mtp)
            states = torch.cat(parts) if len(parts) > 1 else parts[0]
            hid.append(states[len(states) - w:])
        hidden = (torch.cat(hid) if len(hid) > 1 else hid[0]).float().contiguous() if hid else \
            torch.empty(0, self.native.weights.dims["hidden"])
        return _i64(ids), hidden, _i32(lens), _i64([r.seq.mtp.num_valid for r in rows])

    def _settle(self, rows: list[ScheduledRow], limits: list[int], out: list[list[int]], hidden: torch.Tensor,
                windows: torch.Tensor) -> None:
        """After run(): rows that drafted have MTP caches up to their new valid length (Vanilla: and a new window);
        the others lag, keeping their new positions' hidden states (copies unless every row fed one token: a view
        would keep the whole step's states alive)."""
        if not self.draft_len:
            return
        views_ok = hidden.shape[0] == len(rows)
        if views_ok and not any(limits):     # no row drafted, each fed one token: each refers to its row of hidden
            backlog.hold_rows([r.seq.mtp for r in rows], hidden, [r.start for r in rows])
            return
        K, first = self.draft_len, 0                 # first: the row's first position in hidden [T, H]
        for b, (r, row, n) in enumerate(zip(rows, out, limits)):
            mtp, valid = r.seq.mtp, r.start + row[0]
            first, at = first + len(r.token_ids), first
            if n:
                window = None
                if self.vanilla:      # the main hidden states of its last min(K, window) valid positions
                    kept = min(K, valid - max(min(valid - K, mtp.num_valid), 0))
                    window = windows[b, K - kept:]
                backlog.settle(mtp, valid, True, window=window)
            else:
                backlog.settle(mtp, valid, False, hidden[at:at + row[0]], copy=not views_ok)

    # ---- rows that need their logits --------------------------------------------------------
    def _logits_args(self, rows: list[ScheduledRow]) -> Optional[dict]:
        """mtp_step's inputs for the rows that need their logits (pack_logits_args), None when no row does: each
        row's logprobs, logits processing (PenaltyRules.at over its output and drafts) and grammar masks
        (guided_masks), where it asks for them."""
        need = [r.seq.params.needs_logits for r in rows]
        if not any(need):
            return None
        specs = []
        for r, asks in zip(rows, need):
            seq, n = r.seq, len(r.token_ids)
            if not asks:
                specs.append(RowLogits(n))
                continue
            p, dec = seq.params, seq.decoding
            rules = masks = None
            if p.processes_logits:
                if dec.penalty_rules is None:
                    stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.engine.stops.eos_token_ids))
                    dec.penalty_rules = PenaltyRules(p, seq.prompt_ids, stop_ids, self.native.vocab)
                rules = dec.penalty_rules.at(seq.output_ids, r.token_ids[1:])
            if dec.matcher is not None:
                think_ids = self.engine.stops.think_ids
                after_think = p.guided_after_think and think_ids is not None
                masks = guided_masks(dec.matcher.backend, dec.matcher, r.token_ids[1:],
                                     after_think and dec.in_thinking, think_ids if after_think else None)
            specs.append(RowLogits(n, -1 if p.logprobs is None else p.logprobs, rules, masks))
        return pack_logits_args(specs)

    def _call(self, rows: list[ScheduledRow], limits: list[int], mtp_layer: int
              ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor, Optional[list]]:
        ids = [t for r in rows for t in r.token_ids]
        qs = [0]
        for r in rows:
            qs.append(qs[-1] + len(r.token_ids))
        tables = padded_tables([r.seq.kv.block_table for r in rows])
        vanilla = self.vanilla and mtp_layer >= 0
        chain = [min(self.draft_len - 1, n) if vanilla else max(n - 1, 0) for n in limits]
        ends = [r.start + len(r.token_ids) + c for r, c in zip(rows, chain)]
        nd = self.native
        if max(ends) > nd.rope_len:
            nd.grow_rope(max(ends) + 256)
        drafting = mtp_layer >= 0 and any(limits)
        window = self._windows(rows, limits) if drafting and (vanilla or any(
            r.seq.mtp.num_valid != r.start for r, n in zip(rows, limits) if n)) else (None, None, None, None)
        # a step in which no row drafts is the call of an engine without MTP: no MTP layer, the main caches only
        caches = self.caches if drafting else self.main_caches
        logits = self._logits_args(rows)
        out, hidden, windows, lp_vals, lp_ids = nd.step_op(
            nd.handle, _i64(ids), _i32(qs), _i64([r.start for r in rows]), tables, _i32(limits),
            caches, nd.rope_cos, nd.rope_sin, mtp_layer if drafting else -1, self.draft_len if vanilla and drafting
            else 1, *window, self.confidence if drafting else 0.0, **(logits or {}))
        out = out.tolist()
        top = logits.get("top_logprobs") if logits else None
        return out, hidden, windows, None if top is None else \
            unpack_logprobs(out, [r.seq.params.logprobs if r.seq.params.logprobs is not None else -1 for r in rows],
                            lp_vals, lp_ids)


class RowLogits(NamedTuple):
    """What one row of a native step needs for its logits: its positions (1 + its drafts), its number of top
    logprobs (-1: none), its logits processing's rule entries (PenaltyRules.at) and its grammar's masks
    (guided_masks), None where it has none."""
    n: int
    top: int = -1
    rules: Optional[tuple[np.ndarray, np.ndarray, int]] = None
    masks: Optional[tuple[torch.Tensor, list[bool], int]] = None


def pack_logits_args(rows: list[RowLogits]) -> dict:
    """The rows' needs as mtp_step's (and verify_greedy's) keyword arguments: rule_start / rule_ids / rule_vals
    (every position's rule entries, in batch order), accept_cap / mask_of / masks (each position's mask, the most
    drafts each row may accept) and top_logprobs; a group is left out when no row needs it."""
    args: dict = {}
    rules = [r for r in rows if r.rules is not None]
    if rules:
        start, at = [0], 0
        for r in rows:
            u = r.rules[2] if r.rules is not None else 0
            for _ in range(r.n):
                at += u
                start.append(at)
        args["rule_start"] = _i32(start)
        args["rule_ids"] = torch.from_numpy(rules[0].rules[0] if len(rules) == 1 else
                                            np.concatenate([r.rules[0] for r in rules]))
        args["rule_vals"] = torch.from_numpy(rules[0].rules[1] if len(rules) == 1 else
                                             np.concatenate([r.rules[1] for r in rules]))
    guided = [r.masks[0] for r in rows if r.masks is not None]
    if guided:
        mask_of: list[int] = []
        cap, first = [], 0
        for r in rows:
            if r.masks is None:
                mask_of += [-1] * r.n
                cap.append(r.n - 1)
                continue
            m, has, c = r.masks
            for h in has:
                mask_of.append(first if h else -1)
                first += 1
            mask_of += [-1] * (r.n - len(has))
            cap.append(c)
        args["accept_cap"] = _i32(cap)
        args["mask_of"] = _i32(mask_of)
        args["masks"] = guided[0] if len(guided) == 1 else torch.cat(guided)
    if any(r.top >= 0 for r in rows):
        args["top_logprobs"] = _i32([r.top for r in rows])
    return args


def unpack_logprobs(out: list[list[int]], top: list[int], vals: torch.Tensor, ids: torch.Tensor) -> list:
    """mtp_step's logprobs -> per row None, or (id, logprob, top [(id, logprob)]) per emitted token, as
    sampling.token_logprobs gives them."""
    v, i = vals.tolist(), ids.tolist()
    result: list = []
    at = 0
    for row, n in zip(out, top):
        if n < 0:
            result.append(None)
            continue
        m = row[0]
        result.append([(t, vr[0], list(zip(ir[:n], vr[1:n + 1])))
                       for t, vr, ir in zip(row[1:1 + m], v[at:at + m], i[at:at + m])])
        at += m
    return result

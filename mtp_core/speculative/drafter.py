"""MTP drafters: Eagle (one module reused K times) and Vanilla (K distinct modules).

Both keep, in every MTP module's cache, one entry per valid position q built from
(token x_{q+1}, main hidden h_q) — "tokens shifted by one" — so after each step every MTP cache equals a
fresh recompute of the accepted prefix. Draft chains write K-1 more speculative slots past the valid
length (the overshoot); the next step's truncate to the valid length rewinds them.

Worked example (Eagle, K=3, valid length before the step V_prev=10): the target verified
[t, d1, d2, d3] at positions 10..13 and accepted n=2 tokens, so V=12 and the emitted tokens are
x11=d1, x12=bonus.
  forward 1: module at positions 10, 11 with tokens [x11, x12] and hidden [h10, h11] -> at 11: D1, g1
  forward 2: position 12, token D1, hidden g1 -> D2, g2
  forward 3: position 13, token D2, hidden g2 -> D3        (positions 12, 13 are the overshoot)
Vanilla runs module k on the request's window (the last K valid positions, plus any newly valid ones
before it) and appends the chain (D1, g1) .. (D_{k-1}, g_{k-1}) at positions V .. V+k-2.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch

from mtp_core.model import AttentionMetadata, DeepseekV3ForCausalLM
from mtp_core.model.forward_path import ForwardPath, RowOutputs, draft_tokens
from mtp_core.native.native_decode import NativeDecoder
from mtp_core.request.sequence import Sequence

log = logging.getLogger("mtp.engine")


@dataclass
class DraftInput:
    """One row after verification. Positions [start, start + len(next_tokens)) became valid this step."""
    seq: Sequence
    start: int
    next_tokens: list[int]        # x_{q+1} for each newly valid position q
    hidden: torch.Tensor          # [n, hidden] main hidden states at those positions
    needs_drafts: bool            # False for non-final prefill chunks and finished requests
    max_drafts: Optional[int] = None   # adaptive limit for this row (None = the drafter's K)


class Drafter(Protocol):
    num_draft_tokens: int

    def propose(self, rows: list[DraftInput]) -> list[list[int]]:
        """Writes every row's MTP caches for its new positions; returns K drafts per row
        (an empty list for rows that need none)."""


class _MTPRunner:
    def __init__(self, path: ForwardPath, caches: list[torch.Tensor], tokens_per_block: int) -> None:
        self.path, self.caches, self.tokens_per_block = path, caches, tokens_per_block
        # the native decoder drafts a whole Eagle chain in one call (forward 1, then each draft's LM head and
        # forward), where Python would build metadata and call an op per forward and per LM head
        self.native = path if isinstance(path, NativeDecoder) else None

    def eagle_drafts(self, rows: list["DraftInput"], limits: list[int]) -> list[list[int]]:
        """Every row's forward 1 over its new positions and its `limits[r]` (>= 1) drafts, in one native call."""
        return self.native.eagle_drafts([r.next_tokens for r in rows], torch.cat([r.hidden for r in rows]),
                                        [r.start for r in rows], [r.seq.kv.block_table for r in rows], limits,
                                        self.caches)

    def run(self, module: int, positions: list[list[int]], tokens: list[list[int]], hidden: torch.Tensor,
            tables: list[list[int]], outputs: RowOutputs = "all") -> Optional[torch.Tensor]:
        """hidden [T, H] aligned with the flattened tokens -> module output [T, H] (outputs "last": [rows, H] at
        each row's last position; "none": None, the module's cache written only)."""
        meta = AttentionMetadata.build(positions, tables, self.tokens_per_block, device=hidden.device)
        ids = torch.tensor([t for row in tokens for t in row], dtype=torch.long, device=hidden.device)
        return self.path.mtp_forward(module, ids, hidden, meta, self.caches, outputs)

    def draft(self, out_last: torch.Tensor, with_prob: bool) -> tuple[list[int], Optional[list[float]]]:
        """[R, H] -> (greedy draft token per row (drafts are always greedy), with_prob: the MTP head's
        probability of it). Scored over the path's draft vocabulary where it has one (its probabilities then
        normalised over those ids)."""
        logits = self.path.draft_logits(out_last)
        if not with_prob:
            return draft_tokens(self.path, logits.argmax(-1)).tolist(), None
        p, d = torch.softmax(logits.float(), dim=-1).max(-1)
        return draft_tokens(self.path, d).tolist(), p.tolist()


def _rows(last: torch.Tensor, active: list[int]) -> torch.Tensor:
    """last [rows, H] (each row's last position) -> [len(active), H]: the active rows' (no copy when every row
    is active, a slice when one is)."""
    if len(active) == len(last):
        return last
    if len(active) == 1:
        return last[active[0]:active[0] + 1]
    return last[active]


def _limit(r: DraftInput, K: int) -> int:
    return K if r.max_drafts is None else max(0, min(r.max_drafts, K))


class _MTPDrafter:
    def __init__(self, model: DeepseekV3ForCausalLM, path: ForwardPath, caches: list[torch.Tensor],
                 tokens_per_block: int, num_draft_tokens: int, confidence_threshold: float = 0.0) -> None:
        self.runner = _MTPRunner(path, caches, tokens_per_block)
        self.num_draft_tokens = num_draft_tokens
        self.confidence_threshold = confidence_threshold


class EagleDrafter(_MTPDrafter):

    def propose(self, rows: list[DraftInput]) -> list[list[int]]:
        """Up to K drafts per row: fewer where the row's max_drafts says so, or where the running product of
        the drafts' probabilities falls below confidence_threshold (the chain stops before that draft);
        rows that stop leave the remaining chain forwards."""
        drafts: list[list[int]] = [[] for _ in rows]
        if not rows:
            return drafts
        K, thr = self.num_draft_tokens, self.confidence_threshold
        if self.runner.native is not None and not thr and all(r.needs_drafts and _limit(r, K) > 0 for r in rows):
            return self.runner.eagle_drafts(rows, [_limit(r, K) for r in rows])     # the same drafts, one call
        positions = [list(range(r.start, r.start + len(r.next_tokens))) for r in rows]
        active = [i for i, r in enumerate(rows) if r.needs_drafts and _limit(r, K) > 0]
        out = self.runner.run(0, positions, [r.next_tokens for r in rows], torch.cat([r.hidden for r in rows]),
                              [r.seq.kv.block_table for r in rows], "last" if active else "none")
        if not active:
            return drafts
        limits = {i: _limit(rows[i], K) for i in active}
        conf = {i: 1.0 for i in active}
        g = _rows(out, active)                                            # [R, H]
        for j in range(1, K + 1):
            d, p = self.runner.draft(g, thr > 0)
            keep: list[int] = []
            for n, (i, tok) in enumerate(zip(active, d)):
                if p is not None:
                    conf[i] *= p[n]
                    if conf[i] < thr:
                        continue                                          # the chain of row i stops here
                drafts[i].append(tok)
                if j < limits[i]:
                    keep.append(n)
            if not keep:
                break
            if len(keep) < len(active):
                sel = torch.tensor(keep, device=g.device)
                g, d, active = g[sel], [d[n] for n in keep], [active[n] for n in keep]
            pos = [[positions[i][-1] + j] for i in active]
            g = self.runner.run(0, pos, [[t] for t in d], g, [rows[i].seq.kv.block_table for i in active])
        return drafts


class VanillaDrafter(_MTPDrafter):
    def __init__(self, model: DeepseekV3ForCausalLM, path: ForwardPath, caches: list[torch.Tensor],
                 tokens_per_block: int, num_draft_tokens: int, confidence_threshold: float = 0.0) -> None:
        if num_draft_tokens > model.num_mtp_modules:
            raise ValueError(f"MTP Vanilla needs one module per draft token: max_draft_len={num_draft_tokens} but "
                             f"the checkpoint has {model.num_mtp_modules} MTP module(s); lower "
                             f"--spec_decode_max_draft_len or use --mtp_mode eagle")
        super().__init__(model, path, caches, tokens_per_block, num_draft_tokens, confidence_threshold)

    def _window_inputs(self, r: DraftInput) -> tuple[int, list[int], torch.Tensor]:
        """Positions [s, V) covering the request's window and the newly valid positions."""
        K = self.num_draft_tokens
        V = r.start + len(r.next_tokens)
        s = max(min(V - K, r.start), 0)
        old = r.start - s                                   # positions taken from the stored window
        ids = r.seq.all_ids
        tokens = ids[s + 1: r.start + 1] + r.next_tokens if old else list(r.next_tokens)
        hidden = r.hidden if not old else torch.cat([r.seq.mtp.window_hidden[-old:], r.hidden])
        return s, tokens, hidden

    def propose(self, rows: list[DraftInput]) -> list[list[int]]:
        """Module k drafts d_{k+1}. Every module runs over every row's window (each module's cache must hold
        every valid position); a row that stopped (its max_drafts, or the confidence gate as in Eagle) just
        takes no more drafts."""
        drafts: list[list[int]] = [[] for _ in rows]
        if not rows:
            return drafts
        K, thr = self.num_draft_tokens, self.confidence_threshold
        drafting = {i: _limit(r, K) for i, r in enumerate(rows) if r.needs_drafts and _limit(r, K) > 0}
        conf = {i: 1.0 for i in drafting}
        base = [self._window_inputs(r) for r in rows]
        chain_tok: list[list[int]] = [[] for _ in rows]
        chain_hid: list[list[torch.Tensor]] = [[] for _ in rows]
        for k in range(self.num_draft_tokens):
            positions, tokens, hiddens = [], [], []
            for i, (s, toks, hid) in enumerate(base):
                n = len(toks) + len(chain_tok[i])
                positions.append(list(range(s, s + n)))
                tokens.append(toks + chain_tok[i])
                hiddens.append(torch.cat([hid, *[h[None] for h in chain_hid[i]]]) if chain_hid[i] else hid)
            active = [i for i in drafting if len(drafts[i]) == k and k < drafting[i]]
            out = self.runner.run(k, positions, tokens, torch.cat(hiddens), [r.seq.kv.block_table for r in rows],
                                  "last" if active else "none")
            if not active:
                continue
            g = _rows(out, active)
            d, p = self.runner.draft(g, thr > 0)
            for n, (i, tok, h) in enumerate(zip(active, d, g)):
                if p is not None:
                    conf[i] *= p[n]
                    if conf[i] < thr:
                        continue
                drafts[i].append(tok)
                chain_tok[i].append(tok)
                chain_hid[i].append(h)
        for r, (s, toks, hid) in zip(rows, base):
            r.seq.mtp.window_hidden = hid[-self.num_draft_tokens:].clone()
        return drafts


def make_drafter(model: DeepseekV3ForCausalLM, path: ForwardPath, caches: list[torch.Tensor],
                 tokens_per_block: int, spec: Any) -> Optional[Drafter]:
    """The drafter a SpeculativeConfig asks for (None without one)."""
    if not spec:
        return None
    n = model.num_mtp_modules
    if n == 0:
        raise ValueError("--spec_decode_algo MTP needs MTP modules, but the checkpoint has "
                         "num_nextn_predict_layers = 0")
    mode = spec.resolved_mode(n)
    cls = VanillaDrafter if mode == "vanilla" else EagleDrafter
    log.info("MTP %s drafting, max_draft_len=%d, %d module(s) in the checkpoint", mode, spec.max_draft_len, n)
    return cls(model, path, caches, tokens_per_block, spec.max_draft_len,
               confidence_threshold=spec.draft_confidence_threshold)

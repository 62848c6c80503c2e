"""The engine's general path: the target model over one scheduled batch (hidden states and logits per row), then
the verification of every row (`verify_rows`: rows grouped by their number of drafts, logits processing, guided
rows, logprobs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from mtp_core.engine.scheduler import ScheduledRow
from mtp_core.model import AttentionMetadata
from mtp_core.model.forward_path import ForwardPath
from mtp_core.request.mtp_state import Unfinished
from mtp_core.request.sequence import Sequence
from mtp_core.sampling import process_logits, token_logprobs
from mtp_core.speculative.verifier import Acceptance, VerifyResult, verify


@dataclass
class TargetOutput:
    # per row [n_row, H]: main hidden after the final norm ([1, H], the row's last, where the runner keeps no hidden
    # states: ModelRunner.keep_hidden; a prompt chunk's Unfinished states where it defers them: split_prompts)
    hidden: list[Union[torch.Tensor, Unfinished]]
    logits: list[torch.Tensor | None] # per row: [K+1, V] decode, [1, V] final prefill chunk, None otherwise
    # per row: [n_row, V] over a prefill chunk whose request wants prompt logprobs (a call of its own, so the
    # other rows' logits do not change), None otherwise; None: no such row
    prompt_logits: list[torch.Tensor | None] | None = None


class ModelRunner:
    def __init__(self, path: ForwardPath, caches: list[torch.Tensor], tokens_per_block: int, device: str,
                 keep_hidden: bool = True) -> None:
        self.path, self.caches, self.tokens_per_block, self.device = path, caches, tokens_per_block, device
        # whether anything reads the hidden states of every position (a drafter: the MTP forward reads each
        # prompt position's); if not, a batch whose rows need only their last position's (one-token decode
        # rows, prompt chunks without prompt logprobs) asks the forward for those alone, and the native path
        # runs its last layer past the KV write at those positions only, as llama.cpp skips the rows of its
        # last layer that no output reads
        self.keep_hidden = keep_hidden
        # an MTP engine whose policy defers prompts' MTP forwards (speculative/backlog.py): whether a batch of prompt
        # chunks may leave their hidden states Unfinished now (the forward split before its last layer, that
        # layer run past the KV write at each row's last position only); the rest runs (finish) only for a
        # request that drafts. None: never (no drafter, a fixed count, a one-layer model).
        self.split_prompts: Optional[Callable[[], bool]] = None
        self.split_max_len = 0          # a prompt longer than this runs its MTP forward at once (backlog.propose)

    def prepare(self, rows: list[ScheduledRow]) -> AttentionMetadata:
        """Host-side inputs of a step: positions, slots, padded index maps (no token ids needed)."""
        positions = [list(range(r.start, r.start + len(r.token_ids))) for r in rows]
        return AttentionMetadata.build(positions, [r.seq.kv.block_table for r in rows], self.tokens_per_block,
                                       use_absorbed=not any(r.is_prefill for r in rows), device=self.device)

    @torch.inference_mode()
    def execute(self, rows: list[ScheduledRow], meta: AttentionMetadata | None = None) -> TargetOutput:
        meta = meta if meta is not None else self.prepare(rows)
        ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.long, device=self.device)
        if self._splits(rows):
            x, last_hidden = self.path.forward_split(ids, meta, self.caches)
            ends = list(last_hidden.split(1))
            # a one-token decode row's last output is its only one
            per_row = [Unfinished(h, r.start) if r.is_prefill else e
                       for r, h, e in zip(rows, x.split([len(r.token_ids) for r in rows]), ends)]
        else:
            last = not self.keep_hidden and all(len(r.token_ids) == 1 if not r.is_prefill else
                                                not r.seq.wants_prompt_logprobs for r in rows)
            hidden = self.path.forward(ids, meta, self.caches, "last" if last else "all")   # [T or B, H]
            per_row = ends = list(hidden.split(1 if last else [len(r.token_ids) for r in rows]))
        # one lm_head call for every position whose logits are needed
        wanted = [h if not r.is_prefill else h[-1:] for r, h in zip(rows, ends)
                  if not r.is_prefill or r.is_final_chunk]
        logits_iter = iter(self.path.logits(torch.cat(wanted)).split([len(w) for w in wanted])) \
            if wanted else iter(())
        logits = [next(logits_iter) if (not r.is_prefill or r.is_final_chunk) else None for r in rows]
        prompt_logits = None
        if any(r.is_prefill and r.seq.wants_prompt_logprobs for r in rows):
            prompt_logits = [self.path.logits(h) if r.is_prefill and r.seq.wants_prompt_logprobs else None
                             for r, h in zip(rows, per_row)]
        return TargetOutput(per_row, logits, prompt_logits)

    def _splits(self, rows: list[ScheduledRow]) -> bool:
        """Whether this batch's prompt chunks' hidden states may stay Unfinished: none wants prompt logprobs or runs
        past the length whose MTP forward runs at once, the other rows are one-token decode rows (their one
        output is their last), and the engine allows it now (split_prompts)."""
        return self.split_prompts is not None and any(r.is_prefill for r in rows) and \
            all(not r.seq.wants_prompt_logprobs and r.start + len(r.token_ids) <= self.split_max_len
                if r.is_prefill else len(r.token_ids) == 1 for r in rows) and self.split_prompts()

    @torch.inference_mode()
    def finish(self, seq: Sequence, u: Unfinished) -> torch.Tensor:
        """A deferred prompt chunk's hidden states [n, H]: the target's last layer over its residual stream at its
        positions (it re-writes that layer's KV entries there with the same values)."""
        meta = AttentionMetadata.build([list(range(u.start, u.start + len(u)))], [seq.kv.block_table],
                                       self.tokens_per_block, use_absorbed=False, device=self.device)
        return self.path.forward_last_layer(u.x, meta, self.caches)


def verify_rows(rows: list[ScheduledRow], out: TargetOutput, eos_token_ids: set[int], acceptance: Acceptance
                ) -> VerifyResult:
    """Emitted tokens per row (and logprobs where asked) from the target's logits, each row by its acceptance
    rule (acceptance.rule_for)."""
    tokens: list[list[int]] = [[] for _ in rows]
    logprobs: Optional[list] = None
    # rows may carry different numbers of drafts (adaptive draft length): one verify call per count
    counts = sorted({len(r.token_ids) for r in rows if not r.is_prefill})
    for group in (
        *([i for i, r in enumerate(rows) if not r.is_prefill and len(r.token_ids) == n] for n in counts),
        [i for i, r in enumerate(rows) if r.is_final_chunk],
    ):
        if not group:
            continue
        logits = torch.stack([out.logits[i] for i in group])           # [B, K+1 or 1, V]
        drafts = torch.tensor([rows[i].token_ids[1:] if not rows[i].is_prefill else [] for i in group],
                              dtype=torch.long, device=logits.device).view(len(group), -1)  # [B, K or 0]
        seqs = [rows[i].seq for i in group]
        if any(s.params.processes_logits for s in seqs):
            # penalties, bias, min_tokens: position j of a row sees the counts after drafts 1..j, so every
            # acceptance below compares a draft with exactly what plain decoding would choose there
            logits = logits.float().clone() if logits.dtype != torch.float32 else logits.clone()
            for b, (i, s) in enumerate(zip(group, seqs)):
                if s.params.processes_logits:
                    stop_ids = list(s.params.stop_token_ids) + ([] if s.params.ignore_eos
                                                               else sorted(eos_token_ids))
                    logits[b] = process_logits(logits[b], s.params, s.prompt_ids, s.output_ids,
                                               rows[i].token_ids[1:] if not rows[i].is_prefill else [], stop_ids)
        res = verify(logits, drafts, [acceptance.rule_for(s) for s in seqs], seqs)
        for i, t in zip(group, res.tokens):
            tokens[i] = t
            lp = rows[i].seq.params.logprobs
            if lp is not None:          # the raw target logits at each emitted position
                if logprobs is None:
                    logprobs = [None] * len(rows)
                logprobs[i] = token_logprobs(out.logits[i], t, lp)
    return VerifyResult(tokens, logprobs)

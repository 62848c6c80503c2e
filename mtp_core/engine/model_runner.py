"""Runs the target model over one scheduled batch and returns hidden states and logits per row."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp_core.engine.scheduler import ScheduledRow
from mtp_core.model import AttentionMetadata
from mtp_core.model.forward_path import ForwardPath


@dataclass
class TargetOutput:
    hidden: list[torch.Tensor]        # per row [n_row, H]: main hidden after the final norm
    logits: list[torch.Tensor | None] # per row: [K+1, V] decode, [1, V] final prefill chunk, None otherwise
    # per row: [n_row, V] over a prefill chunk whose request wants prompt logprobs (a call of its own, so the
    # other rows' logits do not change), None otherwise; None: no such row
    prompt_logits: list[torch.Tensor | None] | None = None


class ModelRunner:
    def __init__(self, path: ForwardPath, caches: list[torch.Tensor], tokens_per_block: int, device: str) -> None:
        self.path, self.caches, self.tokens_per_block, self.device = path, caches, tokens_per_block, device

    def prepare(self, rows: list[ScheduledRow]) -> AttentionMetadata:
        """Host-side inputs of a step: positions, slots, padded index maps (no token ids needed)."""
        positions = [list(range(r.start, r.start + len(r.token_ids))) for r in rows]
        return AttentionMetadata.build(positions, [r.seq.block_table for r in rows], self.tokens_per_block,
                                       use_absorbed=not any(r.is_prefill for r in rows), device=self.device)

    @torch.inference_mode()
    def execute(self, rows: list[ScheduledRow], meta: AttentionMetadata | None = None) -> TargetOutput:
        meta = meta if meta is not None else self.prepare(rows)
        ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.long, device=self.device)
        hidden = self.path.forward(ids, meta, self.caches)                          # [T, H]
        per_row = list(hidden.split([len(r.token_ids) for r in rows]))
        # one lm_head call for every position whose logits are needed
        wanted = [h if not r.is_prefill else h[-1:] for r, h in zip(rows, per_row)
                  if not r.is_prefill or r.is_final_chunk]
        logits_iter = iter(self.path.logits(torch.cat(wanted)).split([len(w) for w in wanted])) \
            if wanted else iter(())
        logits = [next(logits_iter) if (not r.is_prefill or r.is_final_chunk) else None for r in rows]
        prompt_logits = None
        if any(r.is_prefill and r.seq.wants_prompt_logprobs for r in rows):
            prompt_logits = [self.path.logits(h) if r.is_prefill and r.seq.wants_prompt_logprobs else None
                             for r, h in zip(rows, per_row)]
        return TargetOutput(per_row, logits, prompt_logits)

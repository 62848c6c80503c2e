"""The general path's verification of a batch: rows grouped by their number of drafts, logits processing
(penalties, bias, min_tokens), guided rows, logprobs. The verification itself is speculative/verifier.py's."""
from __future__ import annotations

from typing import Optional

import torch

from mtp_core.engine.model_runner import TargetOutput
from mtp_core.engine.scheduler import ScheduledRow
from mtp_core.sampling import SamplingParams, process_logits, token_logprobs
from mtp_core.speculative.verifier import VerifyResult, verify
from mtp_core.structured import GrammarBackend, verify_guided_row

_STRICT = SamplingParams()


def verify_rows(rows: list[ScheduledRow], out: TargetOutput, eos_token_ids: set[int],
                relaxed: Optional[tuple[int, float]], think_ids: Optional[tuple[int, int]],
                grammars: Optional[GrammarBackend]) -> VerifyResult:
    """Emitted tokens per row (and logprobs where asked) from the target's logits; `relaxed` applies to
    thinking rows."""
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
        # (a guided row is verified below; here it is a cheap strict row that draws nothing from its generator)
        res = verify(logits, drafts, [s.params if s.matcher is None else _STRICT for s in seqs],
                     [relaxed if s.in_thinking and s.matcher is None else None for s in seqs],
                     [s.generator if s.matcher is None else None for s in seqs])
        for b, (i, s) in enumerate(zip(group, seqs)):
            if s.matcher is not None:      # the grammar's mask at every position, drafts accepted in order
                after_think = s.params.guided_after_think and think_ids is not None
                res.tokens[b] = verify_guided_row(grammars, s.matcher, logits[b], drafts[b].tolist(), s.params,
                                                  s.generator, after_think and s.in_thinking,
                                                  think_ids if after_think else None)
        for i, t in zip(group, res.tokens):
            tokens[i] = t
            lp = rows[i].seq.params.logprobs
            if lp is not None:          # the raw target logits at each emitted position
                if logprobs is None:
                    logprobs = [None] * len(rows)
                logprobs[i] = token_logprobs(out.logits[i], t, lp)
    return VerifyResult(tokens, logprobs)

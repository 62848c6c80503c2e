"""Verification of draft tokens: pure functions of (logits, drafts, per-request params).

Vocabulary: the target model scores the step input [t, d_1..d_K], giving logits for K+1 positions.
target_i is the target's choice at position i (i = 0..K). Draft d_{i+1} is *accepted* if it agrees with
position i; with m accepted drafts the step emits d_1..d_m and then the *bonus* token from position m,
so it emits n = m + 1 tokens (1..K+1).

Worked example (strict, from the write-up): drafts A B C D E, targets A B C H x x
-> A, B, C accepted, D rejected; emitted A B C H (n = 4).

`verify_rows` is the engine's entry for a whole batch (its general path): rows grouped by their number of
drafts, logits processing (penalties, bias, min_tokens), guided rows, logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mtp_core.engine.model_runner import TargetOutput
from mtp_core.engine.scheduler import ScheduledRow
from mtp_core.sampling import SamplingParams, process_logits, sample_tokens, token_logprobs
from mtp_core.structured import GrammarBackend, verify_guided_row

_STRICT = SamplingParams()


@dataclass
class VerifyResult:
    tokens: list[list[int]]     # per row: the n emitted tokens (accepted drafts, then the bonus)
    logprobs: Optional[list] = None   # per row: None, or (id, logprob, top) per emitted token (raw logits)

    @property
    def num_accepted_drafts(self) -> list[int]:
        return [len(t) - 1 for t in self.tokens]


def verify_strict(logits: torch.Tensor, drafts: torch.Tensor) -> VerifyResult:
    """logits [B, K+1, V], drafts [B, K]. Greedy: accept while d_{i+1} == argmax(logits_i)."""
    rows = logits.argmax(-1).tolist()                            # [B][K+1]: one tensor op, then host lists
    out: list[list[int]] = []
    for target, d in zip(rows, drafts.tolist()):
        m = 0
        while m < len(d) and d[m] == target[m]:
            m += 1
        out.append(target[: m + 1])
    return VerifyResult(out)


def relaxed_counted(logits: torch.Tensor, topk: int, delta: float) -> torch.Tensor:
    """logits [..., V] -> bool [..., V]: the candidates relaxed acceptance counts at each position.

    p = softmax of the raw logits (float32). The candidates are the first `topk` tokens ordered by
    probability, ties broken by the lower token id (so the set never depends on how a top-k kernel orders
    equal values). The top-1 (argmax of the logits, the strict target: the lowest id among equal maxima)
    always counts; a lower candidate counts only if p > 0 and p >= p_top1 - delta. So a token whose
    probability underflows to 0 never counts, even when delta >= p_top1 makes the threshold negative.
    topk <= 1 or delta <= 0 is strict acceptance by definition (only the top-1 counts), ties included.

    Worked example (V = 5, top-3, delta 0.95): logits [5, 4, -100, -100, -100] -> p = [.731, .269, 0, 0, 0]
    (e^-105 underflows in float32); candidates 0, 1, 2 (2 is the lowest id of the three zeros); threshold
    .731 - .95 < 0; counted = {0, 1}: token 2 is a candidate but has p = 0.
    No host sync (the static CUDA-graph step calls it too)."""
    top1 = logits.argmax(-1, keepdim=True)
    counted = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(-1, top1, True)
    if topk <= 1 or delta <= 0:
        return counted
    p = torch.softmax(logits.float(), dim=-1)
    k = min(topk, p.shape[-1])
    kth = p.topk(k, dim=-1).values[..., -1:]                       # the k-th largest probability
    above, tied = p > kth, p == kth
    room = k - above.sum(-1, keepdim=True)                        # candidate slots left for the tied ones
    in_topk = above | (tied & (tied.cumsum(-1) <= room))          # ... which go to the lowest ids
    p_top1 = p.gather(-1, top1)
    return counted | (in_topk & (p > 0) & (p >= p_top1 - delta))


def verify_relaxed_row(logits: torch.Tensor, drafts: torch.Tensor, topk: int, delta: float) -> list[int]:
    """One row: logits [K+1, V], drafts [K]. Accepts a draft that is a counted candidate
    (`relaxed_counted`) of its position; stops at the first miss; emits the accepted drafts themselves and
    then the top-1 of the next position."""
    K = drafts.shape[0]
    ok = relaxed_counted(logits[:K], topk, delta).gather(-1, drafts.view(K, 1)).view(K).tolist()   # [K]
    m = 0
    while m < K and ok[m]:
        m += 1
    return drafts[:m].tolist() + [int(logits[m].argmax())]


def verify_sampled_row(logits: torch.Tensor, drafts: torch.Tensor, params: SamplingParams,
                       generator: Optional[torch.Generator]) -> list[int]:
    """One row with temperature > 0: sample every position from the target distribution and accept
    drafts while they equal the sample. With a one-hot (greedy) proposal this is exactly rejection
    sampling, so emitted tokens follow the target distribution."""
    samples = sample_tokens(logits, params, generator).tolist()   # [K+1]
    out: list[int] = []
    for i, d in enumerate(drafts.tolist()):
        if samples[i] != d:
            break
        out.append(d)
    out.append(samples[len(out)])
    return out


def verify(logits: torch.Tensor, drafts: torch.Tensor, params: Sequence[SamplingParams],
           relaxed: Sequence[Optional[tuple[int, float]]], generators: Sequence[Optional[torch.Generator]]
           ) -> VerifyResult:
    """Dispatch per row: sampled if temperature > 0, relaxed if `relaxed[b]` = (topk, delta) is set for
    a greedy row (thinking phase), strict otherwise. logits [B, K+1, V], drafts [B, K]."""
    result = verify_strict(logits, drafts)
    for b, p in enumerate(params):
        if not p.greedy:
            result.tokens[b] = verify_sampled_row(logits[b], drafts[b], p, generators[b])
        elif relaxed[b] is not None and drafts.shape[1] > 0:
            topk, delta = relaxed[b]
            if topk > 1 and delta > 0:
                result.tokens[b] = verify_relaxed_row(logits[b], drafts[b], topk, delta)
    return result


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

"""Verification of draft tokens: pure functions of (logits, drafts, per-request params).

Vocabulary: the target model scores the step input [t, d_1..d_K], giving logits for K+1 positions.
target_i is the target's choice at position i (i = 0..K). Draft d_{i+1} is *accepted* if it agrees with
position i; with m accepted drafts the step emits d_1..d_m and then the *bonus* token from position m,
so it emits n = m + 1 tokens (1..K+1).

Worked example (strict, from the write-up): drafts A B C D E, targets A B C H x x
-> A, B, C accepted, D rejected; emitted A B C H (n = 4).

The engine's general path verifies a whole batch with these (engine/model_runner.py: verify_rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mtp_core.sampling import SamplingParams, sample_tokens


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

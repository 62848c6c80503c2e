"""Verification of draft tokens: pure functions of (logits, drafts, per-request params).

Vocabulary: the target model scores the step input [t, d_1..d_K], giving logits for K+1 positions.
target_i is the target's choice at position i (i = 0..K). Draft d_{i+1} is *accepted* if it agrees with
position i; with m accepted drafts the step emits d_1..d_m and then the *bonus* token from position m,
so it emits n = m + 1 tokens (1..K+1).

Worked example (strict, from the write-up): drafts A B C D E, targets A B C H x x
-> A, B, C accepted, D rejected; emitted A B C H (n = 4).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from mtp_core.sampling import SamplingParams, sample_tokens


@dataclass
class VerifyResult:
    tokens: list[list[int]]     # per row: the n emitted tokens (accepted drafts, then the bonus)

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


def relaxed_candidates(logits: torch.Tensor, topk: int, delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [..., K+1, V] -> (candidate ids [..., K+1, topk], counted [..., K+1, topk] bool).

    Softmax of the raw logits; among the top `topk`, the top-1 always counts and a lower candidate
    counts while its probability is >= p_top1 - delta."""
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.topk(min(topk, probs.shape[-1]), dim=-1)
    counted = top.values >= (top.values[..., :1] - delta)
    counted[..., 0] = True
    return top.indices, counted


def verify_relaxed_row(logits: torch.Tensor, drafts: torch.Tensor, topk: int, delta: float) -> list[int]:
    """One row: logits [K+1, V], drafts [K]. Accepts a draft that equals any counted candidate; stops
    at the first miss; emits the accepted drafts themselves and then the top-1 of the next position."""
    ids, counted = relaxed_candidates(logits, topk, delta)
    out: list[int] = []
    for i, d in enumerate(drafts.tolist()):
        if not bool(((ids[i] == d) & counted[i]).any()):
            break
        out.append(d)
    out.append(int(logits[len(out)].argmax()))
    return out


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

"""Verification of draft tokens: acceptance rules, pure functions of (logits, drafts, per-request params).

Vocabulary: the target model scores the step input [t, d_1..d_K], giving logits for K+1 positions.
target_i is the target's choice at position i (i = 0..K). Draft d_{i+1} is *accepted* if it agrees with
position i; with m accepted drafts the step emits d_1..d_m and then the *bonus* token from position m,
so it emits n = m + 1 tokens (1..K+1).

Worked example (strict, from the write-up): drafts A B C D E, targets A B C H x x
-> A, B, C accepted, D rejected; emitted A B C H (n = 4).

The rules. Every row is verified by one acceptance rule, chosen per row by the engine's `Acceptance`
(`rule_for`): `guided` (a grammar: structured.Guided), `sampled` (temperature > 0), `relaxed` (greedy, in the
thinking phase, when relaxed acceptance is on) or `strict` (greedy). A rule owns
- its row-wise verify, `verify_row(logits [K+1, V], drafts [K], seq)` (the general path, `verify`);
- the flat form the fused static step uses where it has one, `match(logits, target, drafts)` -> bool [B, K]
  with no host sync (`verify_static`);
- `fused`: the fused steps that verify it inside their call: "static" (engine/static_step.py, the CUDA graph)
  and "native" (engine/native_step.py: mtp_step, whose C++ twin of strict verification, csrc/cpu/
  mtp_step_cpu.cpp, is held to the same hand-checked tables in tests/test_verifier.py).
Strict acceptance is defined once, `accept_while_equal`: strict, sampled and guided rows differ only in how the
target's choice at a position is made (the argmax, a sample, the masked choice). A new rule is a class here (or
beside its state, as structured.Guided) and a line in `Acceptance.rule_for`; see docs/architecture.md.

The engine's general path verifies a whole batch with these (engine/model_runner.py: verify_rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Protocol, Sequence

import torch

from mtp_core.sampling import SamplingParams, sample_tokens


@dataclass
class VerifyResult:
    tokens: list[list[int]]     # per row: the n emitted tokens (accepted drafts, then the bonus)
    logprobs: Optional[list] = None   # per row: None, or (id, logprob, top) per emitted token (raw logits)

    @property
    def num_accepted_drafts(self) -> list[int]:
        return [len(t) - 1 for t in self.tokens]


class AcceptanceRule(Protocol):
    """What every acceptance rule answers (the module docstring)."""
    name: str
    fused: tuple[str, ...]          # the fused steps that verify it inside their call: "static", "native"

    def verify_row(self, logits: torch.Tensor, drafts: torch.Tensor, seq: Any) -> list[int]:
        """One row: logits [K+1, V], drafts [K] -> the emitted tokens (accepted drafts, then the bonus)."""


# ---- strict -------------------------------------------------------------------------------------

def accept_while_equal(choices: Iterable[int], drafts: Sequence[int]) -> list[int]:
    """Strict acceptance, its one definition: draft d_{i+1} is accepted while it equals choice_i, the target's
    choice at position i; emits the accepted drafts, then the choice at the first position whose draft differs
    (or after the last draft). `choices` may be lazy: choice i is asked for only once d_1..d_i are accepted (a
    grammar's mask after them, the next sample of the row's generator)."""
    out: list[int] = []
    for i, c in enumerate(choices):
        out.append(c)
        if i >= len(drafts) or drafts[i] != c:
            break
    return out


def verify_strict(logits: torch.Tensor, drafts: torch.Tensor) -> VerifyResult:
    """logits [B, K+1, V], drafts [B, K]. Greedy: accept while d_{i+1} == argmax(logits_i)."""
    rows = logits.argmax(-1).tolist()                            # [B][K+1]: one tensor op, then host lists
    return VerifyResult([accept_while_equal(target, d) for target, d in zip(rows, drafts.tolist())])


class Strict:
    """Greedy: accept while d_{i+1} == argmax(logits_i)."""
    name = "strict"
    fused = ("static", "native")

    def match(self, logits: torch.Tensor, target: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The flat form: target [B, K+1] (the argmax), drafts [B, K] -> whether each draft counts [B, K]."""
        return drafts == target[:, :-1]

    def verify_row(self, logits: torch.Tensor, drafts: torch.Tensor, seq: Any = None) -> list[int]:
        return accept_while_equal(logits.argmax(-1).tolist(), drafts.tolist())


STRICT = Strict()


# ---- relaxed (thinking phase) -------------------------------------------------------------------

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


@dataclass(frozen=True)
class Relaxed:
    """Relaxed acceptance (thinking rows only, SPEC §4.2): a draft counts when it is one of the top `topk`
    candidates of its position within `delta` of the top-1 (`relaxed_counted`). Made by `Relaxed.of`, which
    decides once whether it is really on."""
    topk: int
    delta: float
    name = "relaxed"
    fused = ("static",)          # the native step leaves relaxed rows to the general path

    @classmethod
    def of(cls, spec: Any) -> Optional["Relaxed"]:
        """The rule a speculative config asks for, or None: off, or topk <= 1 or delta <= 0, which is strict by
        definition (only the top-1 counts)."""
        if spec is None or not spec.use_relaxed_acceptance_for_thinking:
            return None
        return cls(spec.relaxed_topk, spec.relaxed_delta) if spec.relaxed_topk > 1 and spec.relaxed_delta > 0 \
            else None

    def match(self, logits: torch.Tensor, target: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """The flat form: logits [B, K+1, V], drafts [B, K] -> whether each draft is counted [B, K]."""
        counted = relaxed_counted(logits[:, :-1], self.topk, self.delta)             # [B, K, V]
        return counted.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)

    def verify_row(self, logits: torch.Tensor, drafts: torch.Tensor, seq: Any = None) -> list[int]:
        return verify_relaxed_row(logits, drafts, self.topk, self.delta)


# ---- sampled (temperature > 0) ------------------------------------------------------------------

def verify_sampled_row(logits: torch.Tensor, drafts: torch.Tensor, params: SamplingParams,
                       generator: Optional[torch.Generator]) -> list[int]:
    """One row with temperature > 0: sample every position from the target distribution and accept
    drafts while they equal the sample. With a one-hot (greedy) proposal this is exactly rejection
    sampling, so emitted tokens follow the target distribution."""
    return accept_while_equal(sample_tokens(logits, params, generator).tolist(), drafts.tolist())   # [K+1]


class Sampled:
    """Temperature > 0: strict acceptance against a sample of each position (`verify_sampled_row`)."""
    name = "sampled"
    fused: tuple[str, ...] = ()    # the sample needs the request's generator in Python

    def verify_row(self, logits: torch.Tensor, drafts: torch.Tensor, seq: Any) -> list[int]:
        return verify_sampled_row(logits, drafts, seq.params, seq.decoding.generator)


SAMPLED = Sampled()


# ---- a batch ------------------------------------------------------------------------------------

class Acceptance:
    """The engine's acceptance rules and which one verifies each row (`rule_for`): a guided row its grammar's
    (greedy or sampled), a sampled row `sampled`, a greedy row in the thinking phase `relaxed` where it is on,
    any other `strict`. guided: the grammar rules for greedy and sampled rows (structured.Guided.pair)."""

    def __init__(self, relaxed: Optional[Relaxed] = None,
                 guided: Optional[tuple[AcceptanceRule, AcceptanceRule]] = None) -> None:
        self.relaxed, self.guided = relaxed, guided

    @classmethod
    def of(cls, spec: Any, guided: Optional[tuple[AcceptanceRule, AcceptanceRule]] = None) -> "Acceptance":
        """The rules a speculative config turns on (spec None: no drafting; a row is still verified by its rule)."""
        return cls(Relaxed.of(spec), guided)

    def rule_for(self, seq: Any) -> AcceptanceRule:
        dec = seq.decoding
        if dec.matcher is not None:
            return self.guided[0 if seq.params.greedy else 1]
        if not seq.params.greedy:
            return SAMPLED
        if self.relaxed is not None and dec.in_thinking:
            return self.relaxed
        return STRICT

    def fused(self, step: str, seqs: Iterable[Any]) -> bool:
        """Whether the fused step ("static", "native") verifies every one of these rows inside its call."""
        return all(step in self.rule_for(s).fused for s in seqs)


def verify(logits: torch.Tensor, drafts: torch.Tensor, rules: Sequence[AcceptanceRule], seqs: Sequence[Any]
           ) -> VerifyResult:
    """Each row by its rule (Acceptance.rule_for; seqs: what a rule reads of the row: params, and decoding's
    generator, matcher, in_thinking). logits [B, K+1, V], drafts [B, K]. The strict rows in one argmax."""
    result = verify_strict(logits, drafts)
    for b, (rule, seq) in enumerate(zip(rules, seqs)):
        if rule is not STRICT:
            result.tokens[b] = rule.verify_row(logits[b], drafts[b], seq)
    return result


def verify_static(logits: torch.Tensor, drafts: torch.Tensor, thinking: torch.Tensor,
                  relaxed: Optional[Relaxed], offsets: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The static step's verification, with no host sync: the rules' flat forms (strict, and relaxed for
    thinking rows). logits [B, K+1, V], drafts [B, K], thinking [B] bool -> (m accepted drafts [B], emitted
    [B, K+1]: d_1..d_m, the target's token at m, then the target's choices past m, which are never emitted,
    only fed to forward 1's throwaway entries)."""
    target = logits.argmax(-1)                                                  # [B, K+1]
    match = STRICT.match(logits, target, drafts)                                # [B, K]
    if relaxed is not None:
        match = torch.where(thinking.unsqueeze(-1), relaxed.match(logits, target, drafts), match)
    m = match.int().cumprod(dim=-1).sum(-1)                                     # [B]
    if offsets is None:
        offsets = torch.arange(logits.shape[1], device=logits.device)
    drafts_padded = torch.cat([drafts, target[:, -1:]], dim=1)                 # [B, K+1]
    return m, torch.where(offsets[None, :] < m[:, None], drafts_padded, target)

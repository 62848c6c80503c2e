"""Verification tables (strict, relaxed, sampled) and SpecStats arithmetic, all computed by hand.

Letters name token ids: A=0 B=1 C=2 D=3 E=4 F=5 G=6 H=7 in a vocabulary of 10. `one_hot(targets)`
gives logits whose argmax at position i is targets[i]; `from_probs(rows)` gives logits whose softmax is
exactly the listed probabilities (logits = log p), so relaxed thresholds can be checked on paper.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mtp_core.sampling import SamplingParams
from mtp_core.request.sequence import DecodeState
from mtp_core.request.stats import SpecStats
from mtp_core.speculative.verifier import (
    STRICT, Acceptance, Relaxed, accept_while_equal, relaxed_counted, verify, verify_relaxed_row, verify_sampled_row,
    verify_static, verify_strict,
)
from mtp_core.structured import Guided

torch.set_num_threads(1)


def relaxed_spec(topk: int, delta: float) -> SimpleNamespace:
    """The speculative config fields relaxed acceptance reads."""
    return SimpleNamespace(use_relaxed_acceptance_for_thinking=True, relaxed_topk=topk, relaxed_delta=delta)


A, B, C, D, E, F, G, H = range(8)
V = 10


def one_hot(targets: list[int]) -> torch.Tensor:
    """[K+1] targets -> logits [K+1, V]: 5.0 at the target, -5.0 elsewhere."""
    x = torch.full((len(targets), V), -5.0)
    x[torch.arange(len(targets)), torch.tensor(targets)] = 5.0
    return x


def from_probs(rows: list[dict[int, float]]) -> torch.Tensor:
    """Each row lists some token probabilities; the rest of the mass is spread evenly over the others."""
    out = torch.empty(len(rows), V, dtype=torch.float64)
    for i, row in enumerate(rows):
        rest = (1.0 - sum(row.values())) / (V - len(row))
        for t in range(V):
            out[i, t] = math.log(row.get(t, rest))
    return out.float()


def drafts_of(*tokens: int) -> torch.Tensor:
    return torch.tensor([list(tokens)], dtype=torch.long)      # [1, K]


# ---- strict ----------------------------------------------------------------------------------

STRICT_TABLE = [
    # drafts d_1..d_K        targets t_0..t_K            emitted             case
    ([A, B, C, D, E], [A, B, C, H, F, G], [A, B, C, H]),         # the write-up's example
    ([A, B, C, D, E], [A, B, C, D, E, F], [A, B, C, D, E, F]),   # all accepted: K+1 tokens
    ([A, B, C, D, E], [H, B, C, D, E, F], [H]),                  # first rejected: the bonus only
    ([B], [B, G], [B, G]),                                       # K=1 accepted
    ([B], [C, G], [C]),                                          # K=1 rejected
    ([A, A, A], [A, A, B, A], [A, A, B]),                        # repeated tokens
]


@pytest.mark.parametrize("drafts,targets,emitted", STRICT_TABLE)
def test_strict_table(drafts, targets, emitted):
    res = verify_strict(one_hot(targets)[None], drafts_of(*drafts))
    assert res.tokens == [emitted]
    assert res.num_accepted_drafts == [len(emitted) - 1]


def test_strict_batch_rows_are_independent():
    logits = torch.stack([one_hot([A, B, C, H, F, G]), one_hot([A, B, C, D, E, F]), one_hot([H, B, C, D, E, F])])
    drafts = torch.tensor([[A, B, C, D, E]] * 3)
    res = verify_strict(logits, drafts)
    assert res.tokens == [[A, B, C, H], [A, B, C, D, E, F], [H]]
    assert res.num_accepted_drafts == [3, 5, 0]


def test_strict_without_drafts_emits_the_first_target():
    logits = torch.stack([one_hot([G]), one_hot([C])])            # prefill: K = 0
    res = verify_strict(logits, torch.zeros(2, 0, dtype=torch.long))
    assert res.tokens == [[G], [C]]


@pytest.mark.parametrize("drafts,targets,emitted", STRICT_TABLE)
def test_strict_table_every_form(drafts, targets, emitted):
    """The strict rule's three forms on the same table: accept_while_equal (eager and lazy choices), the rule's row
    verify, and its flat form through verify_static."""
    assert accept_while_equal(targets, drafts) == emitted
    asked: list[int] = []

    def lazy():
        for t in targets:
            asked.append(t)
            yield t
    assert accept_while_equal(lazy(), drafts) == emitted and asked == emitted    # nothing past the first miss
    assert STRICT.verify_row(one_hot(targets), torch.tensor(drafts)) == emitted
    m, out = verify_static(one_hot(targets)[None], drafts_of(*drafts), torch.tensor([False]), None)
    assert out[0, : int(m) + 1].tolist() == emitted


def test_acceptance_picks_one_rule_per_row_and_the_fused_steps_that_verify_it():
    """Acceptance.rule_for: a grammar first (greedy or sampled), then sampled, then relaxed for a greedy thinking row
    where it is on, else strict; each rule names the fused steps that verify it inside their call."""
    acc = Acceptance(Relaxed(3, 0.2), Guided.pair(None))

    def row(temperature: float = 0.0, thinking: bool = False, guided: bool = False) -> SimpleNamespace:
        return SimpleNamespace(params=SamplingParams(temperature=temperature),
                               decoding=DecodeState(in_thinking=thinking, matcher=object() if guided else None))
    table = [
        (row(), "strict", ("static", "native")),
        (row(thinking=True), "relaxed", ("static",)),
        (row(temperature=0.8), "sampled", ()),
        (row(temperature=0.8, thinking=True), "sampled", ()),
        (row(guided=True), "guided", ("native",)),
        (row(guided=True, thinking=True), "guided", ("native",)),
        (row(temperature=0.8, guided=True), "guided", ()),
    ]
    for seq, name, fused in table:
        rule = acc.rule_for(seq)
        assert (rule.name, tuple(rule.fused)) == (name, fused)
    assert acc.fused("static", [row(), row(thinking=True)]) and not acc.fused("native", [row(), row(thinking=True)])
    assert Acceptance.of(None, Guided.pair(None)).rule_for(row(thinking=True)) is STRICT      # relaxed off


# ---- relaxed ---------------------------------------------------------------------------------

# The write-up's relaxed example shape (nextn=4, top-3), with delta = 0.2 and drafts B C D E:
#   pos 0: A .40  B .35  C .15   threshold .40-.2=.20 -> counted {A, B}        d1=B accepted (not top-1)
#   pos 1: C .60                 threshold .40        -> counted {C}           d2=C accepted (top-1)
#   pos 2: F .30  G .28  D .25   threshold .10        -> counted {F, G, D}     d3=D accepted (3rd of top-3)
#   pos 3: H .50  E .20  A .10   threshold .30        -> counted {H}           d4=E rejected (below top1-delta)
#   emitted: B C D (the drafts themselves) then top-1 of pos 3 = H.   Strict on the same logits: [A].
RELAXED_PROBS = [
    {A: 0.40, B: 0.35, C: 0.15},
    {C: 0.60, A: 0.10, B: 0.09},
    {F: 0.30, G: 0.28, D: 0.25},
    {H: 0.50, E: 0.20, A: 0.10},
    {A: 0.70},
]


def counted_set(logits: torch.Tensor, topk: int, delta: float) -> list[list[int]]:
    """Per position, the ids relaxed acceptance counts (sorted)."""
    return [sorted(torch.nonzero(row).flatten().tolist()) for row in relaxed_counted(logits, topk, delta)]


def test_relaxed_candidates_table():
    assert counted_set(from_probs(RELAXED_PROBS[:4]), topk=3, delta=0.2) == [[A, B], [C], [D, F, G], [H]]


def exact_probs(*p: float) -> list[float]:
    """A full probability vector over V tokens (the listed ones, zeros after)."""
    return list(p) + [0.0] * (V - len(p))


def logits_of(probs: list[float]) -> torch.Tensor:
    """log p per token (log 0 = -inf): softmax gives back exactly these probabilities, zeros as zeros."""
    return torch.tensor(probs, dtype=torch.float64).log().float()


# Hand-checkable relaxed tables. Candidates = the first topk tokens by probability, ties to the lower id;
# the top-1 always counts; another candidate counts iff p > 0 and p >= p_top1 - delta; delta 0 or topk 1 =
# strict (top-1 only).
RELAXED_TABLE = [
    # (probs, topk, delta, counted ids)                                             top-1, why
    (exact_probs(.4, .35, .15, .1), 3, 0.2, [A, B]),          # top-1 A; threshold .2: C .15 below
    (exact_probs(.4, .2, .2, .2), 2, 0.5, [A, B]),            # top-1 A; B C D tie at .2: only B (lowest id) fits top-2
    (exact_probs(.4, .2, .2, .2), 3, 0.5, [A, B, C]),         # top-3: B and C of the tied three
    (exact_probs(.3, .3, .2, .2), 2, 0.1, [A, B]),            # A and B tie for top-1: A is top-1 (lower id), B counts
    (exact_probs(.3, .3, .2, .2), 1, 0.9, [A]),               # topk 1 = strict: the tied B does not count
    (exact_probs(.3, .3, .2, .2), 4, 0.0, [A]),               # delta 0 = strict, even for the tie
    (exact_probs(.5, .3, .2), 5, 0.9, [A, B, C]),             # threshold -.4 < 0: every p > 0 of the top-5, zeros never
    ([0.0] * 3 + [1.0] + [0.0] * (V - 4), V, 1.0, [D]),      # one token has all the mass: the zeros never count
    (exact_probs(.1, .1, .1, .1, .1, .1, .1, .1, .1, .1), 3, 0.05, [A, B, C]),  # all tied: the three lowest ids
]


@pytest.mark.parametrize("probs,topk,delta,counted", RELAXED_TABLE)
def test_relaxed_counted_table(probs, topk, delta, counted):
    assert counted_set(logits_of(probs)[None], topk, delta) == [counted]


def test_relaxed_never_accepts_a_zero_probability_draft_the_peers_case():
    """The peer's case: logits [5, 4, -100, -100, -100] at every position, drafts [4, 4], top-3, delta 0.95.
    # probs = [.731, .269, 0, 0, 0] (e^-105 underflows in float32); top-1 id = 0; counted = {0, 1}
    Token 4 has p = 0: rejected at position 0, so the row emits only the top-1, [0] (was [4, 4, 0])."""
    logits = torch.tensor([[5.0, 4.0, -100.0, -100.0, -100.0]] * 3)          # [K+1 = 3, V = 5]
    drafts = torch.tensor([4, 4])
    p = torch.softmax(logits[0], -1)
    assert p[2:].tolist() == [0.0, 0.0, 0.0] and p[0] - 0.95 < 0           # the premise: zeros, negative threshold
    assert counted_set(logits, 3, 0.95) == [[0, 1]] * 3
    assert verify_relaxed_row(logits, drafts, topk=3, delta=0.95) == [0]
    assert verify(logits[None], drafts[None], [Relaxed(3, 0.95)], [None]).tokens == [[0]]
    m, emitted = verify_static(logits[None], drafts[None], torch.tensor([True]), Relaxed(3, 0.95))
    assert m.tolist() == [0] and emitted[0, :1].tolist() == [0]
    # token 1 (p = .269 >= .731 - .95) is a counted candidate: drafts [1, 1] are both accepted
    assert verify_relaxed_row(logits, torch.tensor([1, 1]), topk=3, delta=0.95) == [1, 1, 0]


# Drafts through each implementation of relaxed acceptance (eager row, dispatcher, static step):
#   pos 0: probs .4 .2 .2 .2 (A B C D), top-2, delta .5 -> counted {A, B}
#   pos 1: probs .3 .3 .2 .2 (A B C D)                 -> counted {A, B} (tie for top-1: A is the top-1)
#   pos 2: probs 1 at H                                -> counted {H}; emitted bonus = H when reached
RELAXED_ROWS = [exact_probs(.4, .2, .2, .2), exact_probs(.3, .3, .2, .2), [0.0] * 7 + [1.0] + [0.0] * (V - 8)]
RELAXED_DRAFT_TABLE = [
    # drafts   emitted       case
    ([B, B], [B, B, H]),     # both lower candidates accepted, then the top-1 of pos 2
    ([C, A], [A]),           # C ties with B at pos 0 but is outside the top-2 by id: rejected, bonus = top-1 A
    ([A, C], [A, A]),        # pos 1 rejects C (outside the top-2), bonus = A (argmax takes the lower tied id)
    ([E, A], [A]),           # p(E) = 0: never counted
]


@pytest.mark.parametrize("drafts,emitted", RELAXED_DRAFT_TABLE)
@pytest.mark.parametrize("impl", ["row", "dispatch", "static"])
def test_relaxed_draft_table_every_implementation(impl, drafts, emitted):
    logits = torch.stack([logits_of(p) for p in RELAXED_ROWS])                  # [K+1 = 3, V]
    d = torch.tensor(drafts)
    if impl == "row":
        got = verify_relaxed_row(logits, d, topk=2, delta=0.5)
    elif impl == "dispatch":
        got = verify(logits[None], d[None], [Relaxed(2, 0.5)], [None]).tokens[0]
    else:
        m, out = verify_static(logits[None], d[None], torch.tensor([True]), Relaxed(2, 0.5))
        got = out[0, : int(m) + 1].tolist()
    assert got == emitted


def test_static_verification_equals_the_eager_verifier_on_random_rows():
    """verify_static (thinking and plain rows mixed) against verify_relaxed_row / verify_strict, with ties
    and zero probabilities made common by rounding logits to a coarse grid with many -inf entries."""
    g = torch.Generator().manual_seed(5)
    for trial in range(60):
        B, K = 3, 1 + trial % 4
        logits = (torch.randn(B, K + 1, V, generator=g) * 2).round()
        logits[torch.rand(B, K + 1, V, generator=g) < 0.4] = float("-inf")
        logits[..., 0] = logits[..., 0].clamp(min=0.0)                             # some finite logit per row
        drafts = torch.randint(0, V, (B, K), generator=g)
        take = torch.rand(B, K, generator=g) < 0.6                                  # many drafts = the target
        drafts = torch.where(take, logits[:, :K].argmax(-1), drafts)
        thinking = torch.tensor([True, False, True])
        topk, delta = 1 + trial % 5, [0.0, 0.3, 0.9][trial % 3]
        m, out = verify_static(logits, drafts, thinking, Relaxed(topk, delta))
        for b in range(B):
            want = (verify_relaxed_row(logits[b], drafts[b], topk, delta) if thinking[b]
                    else verify_strict(logits[b][None], drafts[b][None]).tokens[0])
            assert out[b, : int(m[b]) + 1].tolist() == want


def test_relaxed_writeup_example():
    logits, drafts = from_probs(RELAXED_PROBS), torch.tensor([B, C, D, E])
    assert verify_relaxed_row(logits, drafts, topk=3, delta=0.2) == [B, C, D, H]
    assert verify_strict(logits[None], drafts[None]).tokens == [[A]]
    # through the dispatcher, relaxed applies only to the row that asks for it
    res = verify(torch.stack([logits, logits]), torch.stack([drafts, drafts]),
                 [Relaxed(3, 0.2), STRICT], [None, None])
    assert res.tokens == [[B, C, D, H], [A]]


def test_relaxed_topk_caps_the_candidates():
    # B is 4th by probability but within delta of the top-1: counted with top-4, not with top-3
    logits = from_probs([{A: 0.22, C: 0.21, D: 0.20, B: 0.19}, {G: 0.9}])
    assert verify_relaxed_row(logits, torch.tensor([B]), topk=3, delta=0.5) == [A]
    assert verify_relaxed_row(logits, torch.tensor([B]), topk=4, delta=0.5) == [B, G]


def test_relaxed_stops_at_first_miss():
    # d1 = E is outside every candidate set; d2 = C would be top-1 at pos 1 but must not be looked at
    logits = from_probs([{A: 0.40, B: 0.35, C: 0.15}, {C: 0.90}, {D: 0.90}])
    assert verify_relaxed_row(logits, torch.tensor([E, C]), topk=3, delta=0.3) == [A]
    assert verify_relaxed_row(logits, torch.tensor([B, C]), topk=3, delta=0.3) == [B, C, D]


def test_relaxed_with_top1_or_zero_delta_equals_strict():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        K = 1 + trial % 5
        logits = torch.randn(K + 1, V, generator=g) * 2                     # [K+1, V]
        target = logits.argmax(-1)
        drafts = target[:K].clone()
        cut = int(torch.randint(0, K + 1, (1,), generator=g))              # first wrong draft (K = none)
        if cut < K:
            drafts[cut] = (drafts[cut] + 1 + int(torch.randint(0, V - 1, (1,), generator=g))) % V
        strict = verify_strict(logits[None], drafts[None]).tokens[0]
        assert strict == target[: min(cut, K) + 1].tolist()
        assert verify_relaxed_row(logits, drafts, topk=1, delta=0.9) == strict
        assert verify_relaxed_row(logits, drafts, topk=V, delta=0.0) == strict
        for topk, delta in ((1, 0.9), (V, 0.0)):
            # strict by definition: the engine never makes the rule, and the rule itself would agree
            assert Relaxed.of(relaxed_spec(topk, delta)) is None
            assert verify(logits[None], drafts[None], [Relaxed(topk, delta)], [None]).tokens[0] == strict


# ---- sampled (temperature > 0) ---------------------------------------------------------------

CHI2_CRIT_P001 = {2: 13.82, 3: 16.27, 6: 22.46}     # chi-square critical values at p = 0.001


def chi_square(counts: dict, expected: dict, n: int) -> float:
    assert set(counts) <= set(expected), f"impossible outcomes {set(counts) - set(expected)}"
    return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in expected.items())


def test_sampled_verification_preserves_the_target_distribution():
    """Draft d1 = B (one-hot proposal). Joint law of the emitted tokens must be: first token x ~ p0; if
    x == B the step continues and the second token y ~ p1; otherwise the step ends after x."""
    p0, p1 = [0.5, 0.25, 0.125, 0.125], [0.1, 0.2, 0.3, 0.4]
    logits = torch.log(torch.tensor([p0, p1]))                                  # [2, 4]
    expected = {(0,): 0.5, (2,): 0.125, (3,): 0.125}
    expected.update({(B, y): p0[B] * p1[y] for y in range(4)})
    gen, params, n = torch.Generator().manual_seed(1234), SamplingParams(temperature=1.0), 2500
    counts: dict[tuple, int] = {}
    for _ in range(n):
        out = tuple(verify_sampled_row(logits, torch.tensor([B]), params, gen))
        counts[out] = counts.get(out, 0) + 1
    assert chi_square(counts, expected, n) < CHI2_CRIT_P001[6]
    # total variation as a plain-language bound too
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in expected.items())
    assert tv < 0.05


@pytest.mark.parametrize("draft", [A, D])
def test_sampled_first_token_ignores_the_draft_and_honours_temperature_top_k(draft):
    """T = 0.5 squares the probabilities; top_k = 3 removes D. p0 = [.5 .3 .15 .05] ->
    [.25 .09 .0225] / .3625. Whatever the draft (likely A or impossible D), the first token follows it."""
    p0 = [0.5, 0.3, 0.15, 0.05]
    logits = torch.log(torch.tensor([p0, [0.25] * 4]))
    z = 0.25 + 0.09 + 0.0225
    expected = {A: 0.25 / z, B: 0.09 / z, C: 0.0225 / z}
    params = SamplingParams(temperature=0.5, top_k=3)
    gen, n = torch.Generator().manual_seed(7 + draft), 1500
    counts: dict[int, int] = {}
    for _ in range(n):
        out = verify_sampled_row(logits, torch.tensor([draft]), params, gen)
        assert len(out) == (2 if out[0] == draft else 1)
        counts[out[0]] = counts.get(out[0], 0) + 1
    assert chi_square(counts, expected, n) < CHI2_CRIT_P001[2]


def test_sampled_rows_are_reproducible_with_a_seeded_generator():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    drafts = logits.argmax(-1)[:3]
    params = SamplingParams(temperature=1.3)
    a = [verify_sampled_row(logits, drafts, params, torch.Generator().manual_seed(s)) for s in range(20)]
    b = [verify_sampled_row(logits, drafts, params, torch.Generator().manual_seed(s)) for s in range(20)]
    assert a == b
    assert len({tuple(x) for x in a}) > 1


def test_dispatch_samples_rows_with_temperature_and_ignores_relaxed_for_them():
    # row 0 greedy + relaxed, row 1 sampled with T so small that it is effectively greedy
    logits, drafts = from_probs(RELAXED_PROBS), torch.tensor([B, C, D, E])
    seqs = [SimpleNamespace(params=p, decoding=DecodeState(in_thinking=True, generator=g)) for p, g in
            ((SamplingParams(), None), (SamplingParams(temperature=1e-4), torch.Generator().manual_seed(0)))]
    rules = [Acceptance(Relaxed.of(relaxed_spec(3, 0.2))).rule_for(s) for s in seqs]
    res = verify(torch.stack([logits, logits]), torch.stack([drafts, drafts]), rules, seqs)
    assert res.tokens == [[B, C, D, H], [A]]


# ---- statistics ------------------------------------------------------------------------------

def test_spec_stats_arithmetic():
    s = SpecStats()
    # (emitted, proposed, accepted): prefill, all 3 accepted, 1 accepted, none, 2 accepted but cut to 3
    for rec in [(1, 0, 0), (4, 3, 3), (2, 3, 1), (1, 3, 0), (3, 3, 2)]:
        s.record_step(*rec)
    assert (s.num_steps, s.num_output_tokens, s.num_draft_proposed, s.num_draft_accepted) == (5, 11, 12, 6)
    assert s.acceptance_length == pytest.approx(11 / 5)
    assert s.draft_acceptance_rate == pytest.approx(0.5)
    assert s.proposed_per_position == [4, 4, 4]
    assert s.accepted_per_position == [3, 2, 1]
    assert s.acceptance_per_position == pytest.approx([0.75, 0.5, 0.25])
    lines = "\n".join(s.summary_lines())
    assert "acceptance length (AL): 2.200" in lines
    assert "draft acceptance rate: 0.500" in lines
    assert "[0.750, 0.500, 0.250]" in lines

    t = SpecStats()
    for rec in [(2, 1, 1), (1, 1, 0)]:
        t.record_step(*rec)
    s.merge(t)
    assert (s.num_steps, s.num_output_tokens, s.num_draft_proposed, s.num_draft_accepted) == (7, 14, 14, 7)
    assert s.proposed_per_position == [6, 4, 4]
    assert s.accepted_per_position == [4, 2, 1]


def test_spec_stats_empty():
    s = SpecStats()
    assert s.acceptance_length == 0.0 and s.draft_acceptance_rate == 0.0 and s.acceptance_per_position == []


# ---- relaxed acceptance at its threshold, exactly ------------------------------------------------

def test_a_candidate_exactly_on_the_threshold_counts_in_every_implementation():
    """p >= p_top1 - delta, with the candidate exactly on it: delta = p_A - p_B computed in float32 from the
    softmax itself is exact (p_B is within a factor 2 of p_A, Sterbenz), and so is p_A - delta = p_B. B counts
    (and is accepted as a draft); a hair more of delta's complement, it does not. A `>` in place of `>=` fails
    here: no other table puts a candidate on the threshold."""
    logits = torch.tensor([[0.5, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0]] * 2)   # [K+1 = 2, V]
    p = torch.softmax(logits[0], -1)
    delta = float(p[0] - p[1])
    assert float(p[0] - torch.tensor(delta, dtype=torch.float32)) == float(p[1])          # the premise: exact
    assert counted_set(logits[:1], 2, delta) == [[A, B]]
    below = float(p[0] - torch.nextafter(p[1], torch.tensor(1.0)))   # the threshold one float32 step above p_B
    assert counted_set(logits[:1], 2, below) == [[A]]
    d = torch.tensor([B])
    assert verify_relaxed_row(logits, d, topk=2, delta=delta) == [B, A]
    assert verify(logits[None], d[None], [Relaxed(2, delta)], [None]).tokens == [[B, A]]
    m, out = verify_static(logits[None], d[None], torch.tensor([True]), Relaxed(2, delta))
    assert int(m) == 1 and out[0, :2].tolist() == [B, A]
    assert verify_relaxed_row(logits, d, topk=2, delta=below) == [A]


# ---- the native step's verification (csrc/cpu/mtp_step_cpu.cpp), fed the same tables -------------

native = pytest.mark.skipif(not __import__("mtp_core.kernels", fromlist=["x"]).native_ops().cpu,
                            reason="native CPU ops not built")


def native_verify(rows: list[tuple[list[int], torch.Tensor]]) -> list[list[int]]:
    """rows: (fed tokens [t, d_1..d_k], the target's logits at those positions [k+1, V]), in one call."""
    ids = torch.tensor([t for toks, _ in rows for t in toks], dtype=torch.long)
    logits = torch.cat([lg for _, lg in rows]).float().contiguous()
    qs = [0]
    for toks, _ in rows:
        qs.append(qs[-1] + len(toks))
    out = torch.ops.mtp_core.verify_greedy(logits, ids, torch.tensor(qs, dtype=torch.int32)).tolist()
    return [r[1:1 + r[0]] for r in out]


@native
@pytest.mark.parametrize("drafts,targets,emitted", STRICT_TABLE)
def test_native_strict_table(drafts, targets, emitted):
    assert native_verify([([H] + drafts, one_hot(targets))]) == [emitted]


@native
def test_native_strict_table_as_one_batch_and_rows_that_end_on_the_next_rows_token():
    """Every table row in one call, each between rows whose first fed token equals its bonus: row 0 accepts
    every draft (A B C, bonus D) and row 1 starts with D, so a loop that compared one position past a row's end
    would accept D and emit a fifth token."""
    rows = [([H, A, B, C], one_hot([A, B, C, D])), ([D, E], one_hot([E, F])), ([F], one_hot([G]))]
    want = [[A, B, C, D], [E, F], [G]]
    for drafts, targets, emitted in STRICT_TABLE:
        rows.append(([H] + drafts, one_hot(targets)))
        want.append(emitted)
        rows.append(([emitted[-1], targets[-1]], one_hot([targets[-1], B])))   # starts with the bonus
        want.append([targets[-1], B])
    assert native_verify(rows) == want


@native
def test_native_verification_equals_the_eager_verifier_on_random_rows():
    """Random logits with planted ties (argmax: the lowest id) and drafts that match a random prefix."""
    g = torch.Generator().manual_seed(3)
    rows, want = [], []
    for _ in range(200):
        k = int(torch.randint(0, 5, (1,), generator=g))
        lg = torch.randint(-3, 3, (k + 1, V), generator=g).float()     # small integers: ties are common
        target = lg.argmax(-1).tolist()
        cut = int(torch.randint(0, k + 1, (1,), generator=g))
        drafts = target[:cut] + [int(x) for x in torch.randint(0, V, (k - cut,), generator=g)]
        rows.append(([int(torch.randint(0, V, (1,), generator=g))] + drafts, lg))
        want.append(verify_strict(lg[None], torch.tensor([drafts], dtype=torch.long).view(1, k)).tokens[0])
    assert native_verify(rows) == want


@native
@pytest.mark.parametrize("vocab", [1, 2, 7, 8, 9, 15, 16, 17, 33, 1024, 1031])
def test_native_choice_is_torch_argmax_at_every_vocabulary_width(vocab):
    """The verification's choice (argmax_row: 8 chains, then the first index of the maximum) against torch.argmax,
    with the maximum planted at each chain and in the tail, tied with an earlier and a later copy, on -inf
    fillers, and -0.0 beside 0.0: one row per case, each fed no draft, so its one emitted token is the choice."""
    g = torch.Generator().manual_seed(vocab)
    cases = []
    for at in sorted({0, vocab // 2, vocab - 1, *range(min(vocab, 18))}):
        x = torch.randint(-5, 5, (vocab,), generator=g).float()
        x[at] = 9.0
        cases.append(x)
        y = x.clone()
        y[torch.randint(0, vocab, (1,), generator=g)] = 9.0          # a tie before or after
        cases.append(y)
        z = torch.full((vocab,), float("-inf"))
        z[at] = -1.0
        cases.append(z)
        w = torch.full((vocab,), -1.0)
        w[at], w[vocab - 1 - at] = -0.0, 0.0                           # equal: the first one wins
        cases.append(w)
    cases.append(torch.full((vocab,), float("-inf")))
    got = native_verify([([0], c[None].contiguous()) for c in cases])
    assert got == [[int(c.argmax())] for c in cases]


# ---- the native step's logits processing (LogitsRules in csrc/cpu/mtp_step_cpu.cpp), held to process_logits -------

def native_rules(logits: torch.Tensor, fed: list[list[int]], rows: list) -> tuple[list[list[int]], torch.Tensor]:
    """Rows fed [t, d_1..d_k] with their RowLogits (native_step.py) -> (verify_greedy's emitted tokens per row, the
    processed logits apply_logits_rules gives for every position)."""
    from mtp_core.engine.native_step import pack_logits_args

    args = pack_logits_args(rows)
    args.pop("top_logprobs", None)
    qs = torch.tensor([0] + [sum(len(f) for f in fed[:i + 1]) for i in range(len(fed))], dtype=torch.int32)
    ids = torch.tensor([t for f in fed for t in f], dtype=torch.long)
    out = torch.ops.mtp_core.verify_greedy(logits, ids, qs, **args).tolist()
    start = args.get("rule_start", torch.zeros(ids.numel() + 1, dtype=torch.int32))
    processed = torch.ops.mtp_core.apply_logits_rules(
        logits, start, args.get("rule_ids", torch.empty(0, dtype=torch.long)),
        args.get("rule_vals", torch.empty(0, 4)), args.get("mask_of"), args.get("masks"))
    return [r[1:1 + r[0]] for r in out], processed


@native
def test_native_rules_reject_a_draft_as_process_logits():
    """test_logits_processing's table, inside the native verification: row [t=2, d1=2, d2=2], raw logits
    [0, 3, 5, 0] at every position, frequency 1.5 over output [2]. The rule entries name token 2 at each position
    with freq 1.5, 3.0, 4.5 (its count after d_1..d_i): processed [0, 3, 3.5, 0] -> 2 = d1 accepted; [0, 3, 2, 0]
    -> 1 != d2: the row emits 2, 1, as process_logits + verify do. Without the rules it emits 2, 2, 2."""
    from mtp_core.engine.native_step import RowLogits
    from mtp_core.sampling import PenaltyRules, process_logits

    raw = torch.tensor([[0.0, 3.0, 5.0, 0.0]] * 3)
    p = SamplingParams(frequency_penalty=1.5)
    rules = PenaltyRules(p, [0], [], 4).at([2], [2, 2])
    assert rules[0].tolist() == [2, 2, 2] and rules[2] == 1
    assert rules[1].tolist() == [[0.0, 1.0, 1.5, 0.0], [0.0, 1.0, 3.0, 0.0], [0.0, 1.0, 4.5, 0.0]]
    emitted, processed = native_rules(raw, [[2, 2, 2]], [RowLogits(3, rules=rules)])
    assert emitted == [[2, 1]]
    assert processed.tolist() == process_logits(raw, p, [0], [2], [2, 2], []).tolist() == \
        [[0.0, 3.0, 3.5, 0.0], [0.0, 3.0, 2.0, 0.0], [0.0, 3.0, 0.5, 0.0]]
    assert native_verify([([2, 2, 2], raw)]) == [[2, 2, 2]]


@native
def test_native_masks_and_accept_cap_table():
    """Masks and the cap, by hand (V = 10; a mask row as xgrammar's int32 words). Row 0 [H, A, B], logits that
    prefer H everywhere: position 0 allows {A, C}: A = d1 accepted; position 1 allows {B} only: B = d2 accepted;
    position 2 allows nothing: every logit is -inf and the choice is token 0 = A (torch's argmax of a row of -inf):
    emitted A, B, A. Row 1 [H, D, E] with cap 1 (as if the grammar rejected E after D): D = d1 accepted, and the cap
    ends the row there: the bonus is position 1's choice E, though E = d2; without the cap D, E, E. Row 2 [H, A, B]:
    no mask, no cap, strict."""
    from mtp_core.engine.native_step import RowLogits

    def mask(*allowed):
        return sum(1 << t for t in allowed)

    masks = torch.tensor([[mask(A, C)], [mask(B)], [0]], dtype=torch.int32)
    row0 = one_hot([H, H, H])
    row0[0, C], row0[0, A] = 1.0, 2.0
    row0[1, B] = -4.0
    row1 = one_hot([D, E, E])
    row2 = one_hot([A, B, C])
    logits = torch.cat([row0, row1, row2])
    rows = [RowLogits(3, masks=(masks, [True, True, True], 2)), RowLogits(3, masks=(masks[:0], [], 1)),
            RowLogits(3)]
    emitted, processed = native_rules(logits, [[H, A, B], [H, D, E], [H, A, B]], rows)
    assert emitted == [[A, B, A], [D, E], [A, B, C]]
    inf = float("-inf")
    assert processed[0].tolist() == [2.0, inf, 1.0] + [inf] * 7
    assert processed[1].tolist() == [inf, -4.0] + [inf] * 8
    assert processed[2].tolist() == [inf] * V and torch.equal(processed[3:], logits[3:])
    # the same rows without the cap: row 1 accepts E too
    rows[1] = RowLogits(3)
    assert native_rules(logits, [[H, A, B], [H, D, E], [H, A, B]], rows)[0][1] == [D, E, E]


@native
@pytest.mark.parametrize("seed", range(3))
def test_native_rules_equal_process_logits_on_random_requests(seed):
    """Random requests (repetition, frequency, presence, logit_bias, min_tokens and stop ids in every mix), each over
    a few steps of a growing output, with drafts that follow the processed argmax for a while: the rule entries
    applied natively give process_logits' values bitwise (torch.equal: the sign of a zero aside) at every position,
    and the native verification emits what process_logits + verify emit. Logits mix small integers (ties: the lowest
    id) and fractions that round differently under x / r and x * (1 / r)."""
    import random

    from mtp_core.engine.native_step import RowLogits
    from mtp_core.sampling import PenaltyRules, process_logits

    g = random.Random(seed)
    Vr = 12
    values = [-3.0, -1.5, -0.7, 0.0, 0.1, 0.3, 0.7, 1.3, 2.0, 3.1, 1e-3]
    checked = accepted = 0
    for _ in range(60):
        p = SamplingParams(max_tokens=64, repetition_penalty=g.choice([1.0, 0.7, 1.1, 1.3, 1.8]),
                           frequency_penalty=g.choice([0.0, 0.3, -0.5, 1.5]),
                           presence_penalty=g.choice([0.0, 0.25, -1.0, 2.0]),
                           logit_bias={t: g.choice([-100.0, -1.5, 0.3, 5.0, 100.0]) for t in g.sample(range(Vr), 2)}
                           if g.random() < 0.5 else {}, min_tokens=g.choice([0, 0, 3, 7]))
        if not p.processes_logits:
            p.frequency_penalty = 0.3
        prompt = [g.randrange(Vr) for _ in range(g.randint(1, 8))]
        stops = g.sample(range(Vr), g.randint(0, 2))
        rules = PenaltyRules(p, prompt, stops, Vr)
        output: list[int] = []
        for _ in range(4):
            logits = torch.tensor([[g.choice(values) if g.random() < 0.7 else g.gauss(0, 2) for _ in range(Vr)]
                                   for _ in range(5)])
            k = g.randint(0, 4)
            drafts: list[int] = []
            for i in range(k):         # the processed argmax so far, sometimes replaced
                best = int(process_logits(logits[i:i + 1], p, prompt, output, [], stops).argmax()) if not drafts \
                    else int(process_logits(logits[:i + 1], p, prompt, output, drafts, stops)[i].argmax())
                drafts.append(best if g.random() < 0.8 else g.randrange(Vr))
            lg = logits[:k + 1].contiguous()
            want = process_logits(lg, p, prompt, output, drafts, stops)
            emitted, processed = native_rules(lg, [[g.randrange(Vr)] + drafts],
                                              [RowLogits(k + 1, rules=rules.at(output, drafts))])
            assert torch.equal(processed, want), (p, prompt, output, drafts)
            ref = verify(want[None], torch.tensor([drafts], dtype=torch.long).view(1, k), [STRICT], [None])
            assert emitted == ref.tokens
            checked += 1
            accepted += len(emitted[0]) - 1
            output += emitted[0]
    assert checked == 240 and accepted > 60

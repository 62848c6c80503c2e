"""How many drafts each request verifies in its next step (0..K): the draft-length policy.

The engine asks the policy's `choose` once per step, after committing the step's tokens and before
drafting the next ones; the answer is each row's draft count for the next step, and the drafter proposes
that many. Two policies (`speculative_config.draft_len_policy`; `make_policy` builds either):

- **fixed** (`FixedPolicy`): every row gets its explicit limit (K, or less under `draft_len_schedule` / a
  paused acceptance window): the behaviour before this policy.
- **cost** (`CostPolicy`, the default): the count with the most expected output tokens per second, from what
  the engine measures (costs.StepTimer, costs.StepCosts) and the acceptance it sees (acceptance.EngineAcceptance
  and each request's own estimate); the choosing itself is here.

  Costs (speculative/costs.py): u(B, k) = per-row seconds of a step of B decode rows that all verify k
  drafts, per batch-size bucket, a target part and a drafter part. A step is measured only if it is
  decode-only, uniform (every row at the same count) and the third or later of a run of that count (the
  first steps after a change pay for the previous ones: measured on the shipped model, a k = 0 step after
  k = 3 steps costs ~25% more at batch 16). The engine's first 3 decode steps run cold and are not
  measured. On a CPU the clock is the engine thread's CPU time (time.thread_time: other processes on a
  shared machine and idle time between requests stay out of it), elsewhere wall time.

  Acceptance (speculative/acceptance.py): E_r(k), the expected tokens row r emits with k drafts, from
  per-request estimates of each draft position's acceptance, learnt from its verified steps.

  Choice. For k = 0..max(cap_r): rate(k) = sum_r E_r(min(k, cap_r)) / sum_r u(B, min(k, cap_r)), where
  cap_r is the row's explicit limit (`adaptive.DraftLimits`: schedule, paused window; the confidence gate
  then stops chains inside the drafter), so explicit settings bound this policy. A drafting count must
  beat k = 0 by 5% (measurement noise, and the k = 0 steps among drafting ones cost more than in a run
  of k = 0), the previous count is kept unless another is 2% better, ties go to the smaller count. The
  count is re-derived every 4th step at 0, then every 8th and 16th while it comes out 0 in the same batch
  (nothing is learnt at 0), every step at a count below the largest
  (the positions it does not verify are not observed), and at the largest once chosen twice in a row every
  8th step or at once after a row's drafts are all rejected (a decision is ~40 us of Python at batch 1, a
  tenth of the shipped model's drafting step). Once
  per 32 decisions of a bucket another count may be re-tried for 3 steps (the last one measured), when
  the budget it accrued since it was last chosen (1% of throughput, shared by the alternatives) covers
  its expected loss; a re-try makes lagging rows catch up only when every row lags, by RETRY_MAX_LAG
  positions at most in all (else no drafting count could ever be measured again).

  Catch-up. A row at 0 skips the drafter and its MTP caches lag (see backlog.py; a prompt's last chunk too,
  whose MTP forward over the prompt waits: `_lag`); the first step that
  drafts for it again runs the MTP forward over every lagging position, c seconds each (measured: the
  drafter's time in such steps beyond its usual time at that count, the median of recent values; before
  that, a k = 0 step's per-row time x MTP modules run / main layers). So the choice compares drafting
  with the lagging rows (their catch-up amortised over their remaining steps, at most 128) and without
  them (they stay at 0, the others draft), and takes the better. Where drafting loses for every row
  (batch 16 on this CPU), the lag only grows: such a batch decodes as without MTP.

Lossless: a count only decides how many drafts the target verifies, never what greedy decoding emits; it is
chosen from earlier steps' information only (costs, accepted counts), before the step whose target sample
it affects, so sampled rows keep the target distribution. All bookkeeping is plain Python on floats and
short lists, O(B x K) per decision; no tensor op.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Sequence

from mtp_core.config import DRAFT_LEN_POLICIES
from mtp_core.request.mtp_state import MTPState
from mtp_core.request.stats import SpecStats
from mtp_core.speculative.acceptance import EngineAcceptance, request_expected
from mtp_core.speculative.adaptive import DraftLimits
from mtp_core.speculative.backlog import MAX_MTP_LAG
from mtp_core.speculative.costs import SETTLE, TRUSTED, CostPrior, Measure, StepCosts, StepTimer, bucket

if TYPE_CHECKING:
    from mtp_core.speculative.drafter import DraftInput


EXPLORE_BUDGET = 0.01      # expected throughput spent on re-trying counts that are not the best
MIN_EXPLORE_GAP = 32       # decisions of one batch-size bucket between two re-tries, at least
RETRY_MAX_LAG = 64         # lagging positions a re-try may catch up (the rows' MTP forwards over them), at most
ALL_ROWS = float("inf")    # Decision.resume: every lagging row catches up and drafts ...
NO_ROW = 0.0               # ... none does (they stay at 0 drafts)
HORIZON = 128              # steps over which a catch-up is amortised, at most (the rest of the request)
DRAFT_MARGIN = 0.05        # drafting must promise this much more than no drafting (measurement noise, and the
                           # k = 0 steps between drafting ones measured dearer than in a run of k = 0 only)
STICK = 0.02               # keep the previous count unless another promises this much more (a change costs)
REDECIDE = 4               # steps a decision for 0 drafts stands while the batch stays the same, doubled for each
REDECIDE_ZERO_MAX = 16     # re-derivation that came out 0 again, up to this (a decision is 50-60 us of Python at
                           # batch 1-4, where the shipped model's k = 0 step is 0.2-0.4 ms)
REDECIDE_DRAFTING = 8      # steps the largest count, chosen twice in a row, stands (until a row's drafts are all
                           # rejected: observe)
ZERO_TIMING = 8            # in a run of decisions for 0 drafts, one step of every ZERO_TIMING is timed (and the one
                           # before it, whose end it starts from): a k = 0 step's clock reads and bookkeeping cost
                           # ~3% of the shipped model's step at batch 1, and nothing is learnt at 0 but that cost


class Decision(NamedTuple):
    draft_len: int             # the count
    resume: float              # rows whose MTP caches lag by at most this many positions catch up and draft (the
                               # others stay at 0): ALL_ROWS, NO_ROW, or the bound of the rows lagging least
    settled: bool              # whether the count may stand for REDECIDE steps (not a re-try)


class Retry(NamedTuple):
    """A re-try of another count in progress: it lasts SETTLE + 1 steps (the last one measured)."""
    bucket: int
    draft_len: int
    steps_left: int
    resume: float


@dataclass(slots=True)
class Standing:
    """A decision that stands while the batch (its size, largest limit, rows) stays the same (mutable: a standing
    step counts down in place, a namedtuple's _replace costs ~0.6 us a step)."""
    batch: tuple[int, int, int]
    draft_len: int
    resume: float
    steps_left: int


@dataclass
class BucketLog:
    """Per batch-size bucket: decisions made, when each count was last chosen, when the last re-try was."""
    decisions: int = 0
    last_chosen: list[int] = field(default_factory=list)
    last_retry: int = 0
    probed_zero: bool = False      # whether its first re-try of 0 drafts (owed once drafting is measured) ran


@dataclass
class _Batch:
    """The rows of one decision: expected-token lists, grouped."""
    size: int
    full: list[list[float]] = field(default_factory=list)                    # E of rows allowed the largest count
    other: list[tuple[list[float], int]] = field(default_factory=list)       # (E, cap) of rows limited below it
    lagging: list[tuple[list[float], int, int]] = field(default_factory=list)   # (E, lag, tokens left): MTP lags


class FixedPolicy:
    """draft_len_policy fixed: every row drafts its explicit limit (rules: schedule, acceptance window). Also
    the engine's one policy object's interface: `choose` once per step, `observe` per verified row,
    `record_step` once per step with its timestamps (from `clock`); `row_limit` and `in_flight` serve the
    scheduler."""
    policy = "fixed"
    times_next_step = False    # whether the engine reads `clock` for the next step (record_step: None when not)

    def __init__(self, draft_len: int, rules: Optional[DraftLimits] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.draft_len = draft_len
        self.rules = rules if rules is not None else DraftLimits(draft_len)
        self.clock = clock                             # the engine stamps its steps with it (record_step)

    def defers_prompts(self) -> bool:
        """Whether prompt chunks skip their MTP forward (backlog.propose): never under a fixed count."""
        return False

    def in_flight(self, num_running: int, num_waiting: int) -> int:
        return self.rules.in_flight(num_running, num_waiting)

    def row_limit(self, mtp: MTPState, batch_size: int) -> int:
        """Drafts this row may verify now: the explicit rules, and no more than chosen when it drafted."""
        return min(self.rules.row_limit(mtp, batch_size), mtp.draft_len) if mtp.draft_len > 0 else 0

    def caps(self, rows: Sequence["DraftInput"], in_flight: int) -> list[int]:
        """Each row's explicit limit (0 for rows that draft nothing: non-final prefill chunks, drafting off)."""
        return self.rules.row_limits([r.seq.mtp if r.needs_drafts else None for r in rows], in_flight)

    def choose(self, rows: Sequence["DraftInput"], in_flight: int) -> list[int]:
        """Each row's draft count for the next step; also sets seq.mtp.draft_len."""
        return _apply(rows, self.caps(rows, in_flight))

    def observe(self, mtp: MTPState, proposed: int, accepted: int, stats: Optional[SpecStats] = None) -> None:
        """A decode step of a request verified `proposed` drafts and accepted `accepted`: the acceptance window
        (explicit rule; a pause is counted in stats)."""
        self.rules.observe(mtp, proposed, accepted, stats)

    def record_step(self, rows: Sequence, t0: Optional[float], t1: Optional[float], t2: Optional[float]) -> None:
        """Nothing is measured under a fixed count."""

    def fuse_drafting(self) -> None:
        """The engine's steps draft inside the target's call (the native CPU step): nothing to do at a fixed count."""

    def summary(self) -> dict:
        return {"policy": self.policy, "max_draft_len": self.draft_len, "step_costs": None,
                "catchup_us_per_position": None, "engine_acceptance_estimate": None, "num_explorations": 0}


class CostPolicy(FixedPolicy):
    """draft_len_policy cost (the module docstring): the count with the most expected tokens per second."""
    policy = "cost"

    def __init__(self, draft_len: int, rules: Optional[DraftLimits] = None, prior: CostPrior = CostPrior(),
                 clock: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(draft_len, rules, clock)
        self.timer = StepTimer(draft_len, prior)       # which steps are measured; its .costs the cost table
        self.acceptance = EngineAcceptance(draft_len)  # the engine-wide estimate new requests start from
        self.buckets: dict[int, BucketLog] = {}
        self.num_explorations = 0
        self.num_steps = 0                             # choose() calls
        self._last_k: Optional[int] = None             # the previous decision's count ...
        self._run_k = 0                                # ... and how many decisions in a row chose it
        self._retry: Optional[Retry] = None
        self._standing: Optional[Standing] = None
        self._zero_stand = REDECIDE                    # steps the next standing decision for 0 stands
        self.times_next_step = True

    def fuse_drafting(self) -> None:
        """The target part of a step then holds its drafting: predicted per draft as such (CostPrior.fused)."""
        self.costs.prior = self.costs.prior._replace(fused=True)

    @property
    def costs(self) -> StepCosts:
        return self.timer.costs

    @property
    def accept(self) -> list[float]:
        """The engine-wide acceptance per draft position."""
        return self.acceptance.rates

    def defers_prompts(self) -> bool:
        """Whether prompt chunks given no drafts skip their MTP forward (backlog.propose): always under this
        policy. A prompt counts as a lagging row in the decision (`_lag`): its MTP forward is a catch-up that
        drafting for it pays (amortised over its tokens), so a request whose drafts would not pay never runs
        it, and one whose drafts pay runs it in the step that first drafts for it."""
        return True

    # ---- once per step -------------------------------------------------------------------
    def choose(self, rows: Sequence["DraftInput"], in_flight: int) -> list[int]:
        """Each row's draft count for the next step (0 for rows that draft nothing); also sets
        seq.mtp.draft_len. While the batch stays the same a count of 0 is re-derived from the estimates every
        REDECIDE steps, the largest count once chosen twice in a row every REDECIDE_DRAFTING steps (at once
        after a row's drafts are all rejected); else each step. A standing 0 in a batch of as many rows skips
        the rows' explicit limits too: they only bound counts from above."""
        self.timer.pending = None
        self.num_steps += 1
        prev, self._last_k = self._last_k, None
        st = self._standing
        if st is not None and prev == 0 and st.steps_left > 0 and st.batch[2] == len(rows) and self._retry is None:
            st.steps_left -= 1
            log = self.buckets[bucket(st.batch[0])]
            log.decisions += 1
            return self._zero(rows, st.batch[0], log, prev)
        caps = self.caps(rows, in_flight)
        kmax = max(caps, default=0)
        if kmax == 0:
            self._run_k, self._standing, self.times_next_step = 0, None, True
            return _apply(rows, caps)
        B = sum(r.needs_drafts for r in rows)
        b = bucket(B)
        log = self.buckets.get(b)
        if log is None:
            log = self.buckets[b] = BucketLog(last_chosen=[0] * (self.draft_len + 1))   # no re-try owed yet
        log.decisions += 1
        k, resume = self._count(rows, caps, kmax, B, b, log, prev)
        if k == 0:                  # every row at 0: no lag to weigh, every row at the count
            return self._zero(rows, B, log, prev)
        log.last_chosen[k] = log.decisions
        self._last_k = k
        self._run_k = self._run_k + 1 if k == prev else 1
        self.times_next_step = True
        limits, catchup, uniform, decode_only = [], 0, True, True
        for r, c in zip(rows, caps):
            mtp = r.seq.mtp
            if r.start + len(r.next_tokens) <= r.seq.kv.prefill_target:
                decode_only = False                          # a prefill chunk: this step's drafting is not timed
            j = k if k < c else c
            lag = _lag(r) if j else 0                        # (a row at 0 drafts nothing: no lag to weigh)
            if lag:
                if lag <= resume:
                    catchup += lag                           # its MTP caches catch up in this drafting step
                else:
                    j = 0                                    # it stays at 0 (and lags on)
            if r.needs_drafts and j != k:
                uniform = False
            mtp.draft_len = j
            limits.append(j)
        # measured: decode rows only, every row at k (the costs are per row of such steps), in a run of k
        self.timer.pending = Measure(B, k, catchup, decode_only and uniform and self._run_k > SETTLE)
        return limits

    def _zero(self, rows: Sequence["DraftInput"], B: int, log: BucketLog, prev: Optional[int]) -> list[int]:
        """A decision for 0 drafts, every row at it: its bookkeeping, and whether the next step is timed."""
        log.last_chosen[0] = log.decisions
        run = self._run_k = self._run_k + 1 if prev == 0 else 1
        self._last_k = 0
        self.times_next_step = run <= SETTLE + 1 or run % ZERO_TIMING in (0, ZERO_TIMING - 1)
        measured = self.times_next_step and run > SETTLE and all(
            r.start + len(r.next_tokens) > r.seq.kv.prefill_target for r in rows)      # decode rows only
        self.timer.pending = Measure(B, 0, 0, measured)
        for r in rows:
            r.seq.mtp.draft_len = 0
        return [0] * len(rows)

    def _count(self, rows: Sequence["DraftInput"], caps: list[int], kmax: int, B: int, b: int, log: BucketLog,
               prev: Optional[int]) -> tuple[int, float]:
        """(count, resume): a standing decision while the batch stays the same, else a new one."""
        key = (B, kmax, len(rows))
        st = self._standing
        if st is not None and st.batch == key and st.steps_left > 0 and self._retry is None and prev is not None:
            st.steps_left -= 1
            return st.draft_len, st.resume
        k, resume, settled = self._decide(rows, caps, kmax, B, b, log.decisions, log.last_chosen, prev)
        # a count of 0 stands a few steps (nothing is learnt meanwhile, and the k = 0 steps are the ones whose
        # overhead matters most); the largest count stands a few more once it is chosen a second time in a row
        # (a decision costs ~40 us of Python at batch 1, a tenth of a drafting step of the shipped model), unless
        # a row's drafts are all rejected (observe): a head that stops proposing well is re-judged at once. A
        # smaller count is re-derived each step: the positions it does not verify are not observed, and their
        # stale estimates would keep it there longer

        stands = settled and self._retry is None and (not k or k == prev == kmax)
        # 0 again, re-derived in the same batch: it stands twice as long (nothing but the batch changes at 0)
        self._zero_stand = min(2 * self._zero_stand, REDECIDE_ZERO_MAX) if stands and not k and prev == 0 and \
            st is not None and st.batch == key else REDECIDE
        self._standing = Standing(key, k, resume, (REDECIDE_DRAFTING if k else self._zero_stand) - 1) \
            if stands else None
        return k, resume

    def _decide(self, rows: Sequence["DraftInput"], caps: list[int], kmax: int, B: int, b: int, n: int,
                last: list[int], prev: Optional[int]) -> Decision:
        """A new decision (count, resume, settled), from the costs and the rows' expected tokens."""
        costs = self.costs.per_row(B)
        retry, self._retry = self._retry, None
        if costs is None:                     # nothing measured yet: a prior (relative) cost per count, so that
            costs = ([1.0] * (self.draft_len + 1), [self.costs.prior.per_draft * k for k in range(self.draft_len + 1)])
            # the acceptance decides from the first step: a head that proposes well drafts at once, one that
            # does not stops
        if retry is not None and retry.bucket == b and retry.draft_len <= kmax:
            if retry.steps_left > 1:          # a re-try lasts SETTLE + 1 steps: only the last is measured
                self._retry = retry._replace(steps_left=retry.steps_left - 1)
            return Decision(retry.draft_len, retry.resume, False)
        # expected tokens E(0..K) per row, grouped so that the sums stay cheap
        now = self.num_steps
        glob = self.acceptance.expected(now)
        batch = _Batch(B)
        for r, cap in zip(rows, caps):
            if not r.needs_drafts:
                continue
            seq = r.seq
            e = request_expected(seq.mtp, self.acceptance.rates, glob, now)
            lag = _lag(r) if cap else 0
            if lag:
                batch.lagging.append((e, lag, seq.params.max_tokens - len(seq.output_ids)))
            elif cap == kmax:
                batch.full.append(e)
            else:
                batch.other.append((e, cap))
        return Decision(*self._best(batch, costs, kmax, n, last, prev), True)

    def _rates(self, batch: "_Batch", costs: tuple[list[float], list[float]], kmax: int
               ) -> tuple[list[float], list[float], list[float]]:
        """(per-row step seconds u(0..kmax), expected tokens per second with the lagging rows catching up,
        without them): the step's cost is the sum of its rows' u at the count each verifies."""
        tgt, drf = costs
        u = [t + d for t, d in zip(tgt, drf)][:kmax + 1]
        R = range(kmax + 1)
        nf = len(batch.full)
        tokens = [sum(col) for col in zip(*batch.full)][:kmax + 1] if nf else [0.0] * (kmax + 1)
        cost = [nf * x for x in u]
        for e, cap in batch.other:
            for k in R:
                j = k if k < cap else cap
                tokens[k] += e[j]
                cost[k] += u[j]
        # rows whose MTP caches lag: with them (catching up, amortised) or without them (they stay at 0)
        c = self.costs.catchup_position_s(u[0])
        lag_tokens, lag_cost, amortised = [0.0] * (kmax + 1), [0.0] * (kmax + 1), 0.0
        for e, lag, left in batch.lagging:
            amortised += c * lag / min(HORIZON, max(1.0, left / e[kmax]))
            for k in R:
                lag_tokens[k] += e[k]
                lag_cost[k] += u[k]
        nl = len(batch.lagging)
        rate_with = [(tokens[k] + lag_tokens[k]) / max(cost[k] + lag_cost[k] + (amortised if k else 0.0), 1e-12)
                     for k in R]
        rate_without = [(tokens[k] + nl) / max(cost[k] + nl * u[0], 1e-12) for k in R]
        return u, rate_with, rate_without

    def _best(self, batch: "_Batch", costs: tuple[list[float], list[float]], kmax: int, n: int,
              last: list[int], prev: Optional[int]) -> tuple[int, float]:
        """(count, which lagging rows resume drafting: Decision.resume): the most expected tokens per second
        with all of them catching up or none, or a count to re-try."""
        u, rate_with, rate_without = self._rates(batch, costs, kmax)
        R, nl = range(kmax + 1), len(batch.lagging)
        # the decision compares rates with drafting discounted by DRAFT_MARGIN and the previous count favoured
        bias = [1.0] + [1.0 / (1.0 + DRAFT_MARGIN)] * kmax

        def score(rate: list[float], k: int) -> float:
            return rate[k] * bias[k] * (1.0 + STICK if k == prev else 1.0)
        best, resume = max(R, key=lambda k: (score(rate_with, k), -k)), ALL_ROWS
        kw = max(R, key=lambda k: (score(rate_without, k), -k))
        if score(rate_without, kw) > score(rate_with, best):
            best, resume = kw, NO_ROW
        top = rate_with[best] if resume else rate_without[best]
        # re-try another count when the budget accumulated since it was last chosen covers its cost (SETTLE + 1
        # steps at it, only the last measured). A re-try makes lagging rows catch up only when every row lags
        # (else the rows that do not lag carry it): then the rows lagging least, by RETRY_MAX_LAG positions at
        # most in all (_retry_bound). A batch at 0 drafts whose every row lags (batch 1 with each new prompt
        # deferred; a larger batch once new requests come in, each lagging by its prompt) could never measure a
        # drafting count again otherwise: the simulated engine of test_policy.py stayed at 0 for whole runs (7
        # seeds of 10), the shipped model at batch 4 for the rest of a run in one run of three. The bound is on
        # the sum, so that a re-try never pays a batch's worth of catch-ups (with a bound per row, batch 16
        # re-tried drafting more often: 0.78 / 0.85x of nextn=0 in two rounds against 0.93 / 0.98x); a re-try
        # in which only some lagging rows catch up pays their catch-up for its information only: it is charged
        # to the budget, in k = 0 steps of the batch
        lags = [lag for _, lag, _ in batch.lagging]
        bound, positions = _retry_bound(lags) if nl == batch.size else (NO_ROW if nl else ALL_ROWS, 0)
        every = positions == sum(lags)                # every lagging row resumes (or none lags)
        rate, charge = rate_with if every else rate_without, 0.0
        if positions and not every:                   # the rows lagging least draft, the others stay at 0
            part = [e for e, lag, _ in batch.lagging if lag <= bound]
            rest = nl - len(part)
            rate = [(sum(e[k] for e in part) + rest) / max(len(part) * u[k] + rest * u[0], 1e-12) for k in R]
            charge = self.costs.catchup_position_s(u[0]) * positions / max(batch.size * u[0], 1e-12)
        share, due, pick = EXPLORE_BUDGET / kmax, 0.0, best
        b = bucket(batch.size)
        log = self.buckets[b]
        if best and not log.probed_zero and self._zero_unmeasured(b, best):
            pick = 0       # owed at once: whether drafting pays at all at this batch size (below)
        for k in R:
            if pick != best or k == best or n - log.last_retry < MIN_EXPLORE_GAP or \
                    (k and nl == batch.size and not positions):
                continue
            slack = (n - last[k]) * share - (SETTLE + 1) * (1.0 - rate[k] / top) - (charge if k else 0.0)
            if slack > due:
                due, pick = slack, k
        if pick != best:
            log.probed_zero = log.probed_zero or pick == 0
            self.num_explorations += 1
            log.last_retry = n
            resume = bound
            self._retry = Retry(b, pick, SETTLE, resume)
        return pick, resume

    def _zero_unmeasured(self, b: int, best: int) -> bool:
        """Whether this bucket's drafting count `best` is measured (TRUSTED samples of its target part) and
        its k = 0 is not. Then 0 drafts is re-tried once, at once: its cost was predicted from the drafting
        steps along a memory-bound shape (costs.TARGET_SLOPE), which a compute-bound step breaks (the shipped
        model at batch 16: a step verifying 3 drafts per row costs ~4.3x one without, not 1.75x), and the
        budget rule would wait hundreds of decisions before it tried 0 (a whole benchmark run)."""
        cells = self.costs.target.get(b)
        return (cells is not None and cells[0] is None and cells[best] is not None
                and len(cells[best].samples) >= TRUSTED)

    # ---- after verification, per row -----------------------------------------------------
    def observe(self, mtp: MTPState, proposed: int, accepted: int, stats: Optional[SpecStats] = None) -> None:
        """The acceptance window, and the acceptance estimates (the request's and the engine-wide one)."""
        self.rules.observe(mtp, proposed, accepted, stats)
        if proposed > 0:
            self.acceptance.observe(mtp, proposed, accepted, self.num_steps)
            if not accepted and self._standing is not None:
                self._standing = None

    # ---- timing, once per step -----------------------------------------------------------
    def record_step(self, rows: Sequence, t0: Optional[float], t1: Optional[float], t2: Optional[float]) -> None:
        """rows: the step's scheduled rows; t0 its start, t1 after commit (target part done), t2 its end
        (drafting for the next step done), all read from `clock`; None in a step not timed (times_next_step)."""
        self.timer.record_step(rows, t0, t1, t2)

    def summary(self) -> dict:
        """For reports: the policy, its cost table (ms per row), acceptance estimate, explorations."""
        c = self.costs.catchup_s
        return {"policy": self.policy, "max_draft_len": self.draft_len, "step_costs": self.costs.snapshot(),
                "catchup_us_per_position": None if c is None else round(1e6 * c, 3),
                "engine_acceptance_estimate": [round(a, 4) for a in self.acceptance.rates],
                "num_explorations": self.num_explorations}


def _lag(r: "DraftInput") -> int:
    """Positions a row's first drafting step must run the MTP forward over beyond its own: a decode row whose
    MTP caches lag (it drafted 0 in earlier steps), or a prompt's last chunk whose MTP forward over the prompt
    waits until the request drafts (backlog.propose; a prompt longer than MAX_MTP_LAG / 2 runs it at once)."""
    mtp = r.seq.mtp
    if mtp.pending:
        return r.start - mtp.num_valid
    valid = r.start + len(r.next_tokens)
    if valid <= r.seq.kv.prefill_target and valid <= MAX_MTP_LAG // 2:
        return valid - mtp.num_valid
    return 0


def _retry_bound(lags: list[int]) -> tuple[float, int]:
    """(Decision.resume, positions caught up) of a re-try in a batch whose every row lags: the rows lagging least,
    RETRY_MAX_LAG positions at most in all; (NO_ROW, 0) when even the least exceeds it."""
    bound, total = NO_ROW, 0
    for lag in sorted(lags):
        if total + lag > RETRY_MAX_LAG:
            break
        bound, total = lag, total + lag
    return bound, sum(lag for lag in lags if lag <= bound)


def _apply(rows: Sequence["DraftInput"], limits: list[int]) -> list[int]:
    for r, k in zip(rows, limits):
        r.seq.mtp.draft_len = k
    return limits


def make_policy(draft_len: int, rules: Optional[DraftLimits] = None, policy: str = "cost",
                prior: CostPrior = CostPrior(), clock: Callable[[], float] = time.perf_counter) -> FixedPolicy:
    """The engine's draft-length policy: CostPolicy for `cost` (with drafts to choose among), else FixedPolicy."""
    if policy not in DRAFT_LEN_POLICIES:
        raise ValueError(f"speculative_config.draft_len_policy must be one of {', '.join(DRAFT_LEN_POLICIES)}, "
                         f"got {policy!r}")
    if policy == "cost" and draft_len:
        return CostPolicy(draft_len, rules, prior, clock)
    return FixedPolicy(draft_len, rules, clock)


DraftLenPolicy = make_policy       # the name the engine and the tests know

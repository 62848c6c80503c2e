"""How many drafts each request verifies in its next step (0..K): the draft-length policy.

The engine asks `DraftLenPolicy.choose` once per step, after committing the step's tokens and before
drafting the next ones; the answer is each row's draft count for the next step, and the drafter proposes
that many. Two policies (`speculative_config.draft_len_policy`):

- **fixed**: every row gets its explicit limit (K, or less under `draft_len_schedule` / a paused
  acceptance window): the behaviour before this policy.
- **cost** (the default): the count with the most expected output tokens per second, from what the engine
  measures while it runs.

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
  cap_r is the row's explicit limit (`adaptive.DraftPolicy`: schedule, paused window; the confidence gate
  then stops chains inside the drafter), so explicit settings bound this policy. A drafting count must
  beat k = 0 by 5% (measurement noise, and the k = 0 steps among drafting ones cost more than in a run
  of k = 0), the previous count is kept unless another is 2% better, ties go to the smaller count. The
  count is re-derived every step while drafting and every 4th step at 0 (nothing is learnt at 0). Once
  per 32 decisions of a bucket another count may be re-tried for 3 steps (the last one measured), when
  the budget it accrued since it was last chosen (1% of throughput, shared by the alternatives) covers
  its expected loss; a re-try never makes lagging rows catch up.

  Catch-up. A row at 0 skips the drafter and its MTP caches lag (see backlog.py); the first step that
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
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from mtp_core.config import DRAFT_LEN_POLICIES
from mtp_core.speculative.acceptance import (GLOBAL_RELAX, PRIOR_ACCEPT, STALE, expected_tokens, learn, relaxed,
                                             request_expected)
from mtp_core.speculative.adaptive import DraftPolicy
from mtp_core.speculative.costs import StepCosts, bucket
from mtp_core.speculative.mtp_state import MTPState
from mtp_core.speculative.stats import SpecStats

if TYPE_CHECKING:
    from mtp_core.engine.scheduler import ScheduledRow
    from mtp_core.speculative.drafter import DraftInput


WARMUP_STEPS = 3           # the engine's first decode steps run cold (caches, allocator): not measured
SETTLE = 2                 # steps of a count after a change that are not measured (the change's cost)
EXPLORE_BUDGET = 0.01      # expected throughput spent on re-trying counts that are not the best
MIN_EXPLORE_GAP = 32       # decisions of one batch-size bucket between two re-tries, at least
HORIZON = 128              # steps over which a catch-up is amortised, at most (the rest of the request)
DRAFT_MARGIN = 0.05        # drafting must promise this much more than no drafting (measurement noise, and the
                           # k = 0 steps between drafting ones measured dearer than in a run of k = 0 only)
STICK = 0.02               # keep the previous count unless another promises this much more (a change costs)
REDECIDE = 4               # steps a decision for 0 drafts stands while the batch stays the same
PRIOR_DRAFT_COST = 0.4     # before any step is measured: a step verifying k drafts costs 1 + 0.4 k steps without
                           # (a multi-token verify plus the MTP forwards; measured 1.4-1.6 at k = 1 on every model
                           # here, lower per draft at k = 3)


@dataclass
class _Batch:
    """The rows of one decision: expected-token lists, grouped."""
    size: int
    full: list[list[float]] = field(default_factory=list)                    # E of rows allowed the largest count
    other: list[tuple[list[float], int]] = field(default_factory=list)       # (E, cap) of rows limited below it
    lagging: list[tuple[list[float], int, int]] = field(default_factory=list)   # (E, lag, tokens left): MTP lags


class DraftLenPolicy:
    """The engine's one policy object: `choose` once per step, `observe` per verified row, `record_step`
    once per step with its timestamps. `row_limit` and `in_flight` serve the scheduler."""

    def __init__(self, K: int, rules: Optional[DraftPolicy] = None, policy: str = "cost",
                 mtp_cost_ratio: float = 0.25, clock: Callable[[], float] = time.perf_counter) -> None:
        if policy not in DRAFT_LEN_POLICIES:
            raise ValueError(f"speculative_config.draft_len_policy must be one of {', '.join(DRAFT_LEN_POLICIES)}, got {policy!r}")
        self.K = K
        self.rules = rules if rules is not None else DraftPolicy(K)
        self.policy = policy if K else "fixed"
        self.mtp_cost_ratio = mtp_cost_ratio
        self.clock = clock                             # the engine stamps its steps with it (record_step)
        self.costs = StepCosts(K)
        self.accept = [PRIOR_ACCEPT] * K               # engine-wide acceptance per draft position ...
        self._glob_expected: Optional[list[float]] = None   # ... and its E(0..K), None when stale
        self.num_decisions: dict[int, int] = {}        # per bucket
        self.last_chosen: dict[int, list[int]] = {}    # per bucket: decision index when each k was last chosen
        self.num_explorations = 0
        self.last_retry: dict[int, int] = {}           # per bucket: decision index of the last re-try
        self.num_steps = 0                             # choose() calls
        self._glob_seen = 0                            # the step count when self.accept last learnt something
        self._last_obs = 0                             # the step count of the last verified draft
        self._probe_fails = 0                          # probes in a row (drafting after a stretch at 0) that
                                                       # found the first draft rejected
        self._num_observed = 0                         # observations self.accept has learnt from
        self._pending: Optional[tuple[int, int, int, bool]] = None   # (rows, k, catch-up positions, clean)
        self._last_k: Optional[int] = None             # the previous decision's count ...
        self._run_k = 0                                # ... and how many decisions in a row chose it
        self._hold: Optional[tuple[int, int, int, bool]] = None   # (bucket, k, steps left, resume): a re-try
        self._reuse: Optional[tuple[tuple[int, int, int], int, bool, int]] = None   # (batch, k, resume, steps left)
        self._prev_end: Optional[float] = None         # end of the previous step, if it was a decode step
        self._prev_verified: Optional[int] = None      # drafts the previous step verified, if decode-only ...
        self._run_verified = 0                         # ... and how many steps in a row verified as many
        self._warmup = WARMUP_STEPS

    def defers_prompts(self) -> bool:
        """Whether prompt chunks skip their MTP forward (backlog.propose): the cost policy's decision of this
        step drafts nothing, so a new request's MTP forward over its prompt waits until it first drafts."""
        return self.policy == "cost" and self._last_k == 0

    # ---- the scheduler's view ------------------------------------------------------------
    def in_flight(self, num_running: int, num_waiting: int) -> int:
        return self.rules.in_flight(num_running, num_waiting)

    def row_limit(self, mtp: MTPState, batch_size: int) -> int:
        """Drafts this row may verify now: the explicit rules, and no more than chosen when it drafted."""
        return min(self.rules.row_limit(mtp, batch_size), mtp.draft_len)

    # ---- once per step -------------------------------------------------------------------
    def choose(self, rows: Sequence["DraftInput"], in_flight: int) -> list[int]:
        """Each row's draft count for the next step (0 for rows that draft nothing: non-final prefill
        chunks, drafting off or paused). Also sets seq.mtp.draft_len. The count is re-derived from the
        estimates every REDECIDE steps, and at once when the batch changes (size, limits, a re-try)."""
        self._pending = None
        self.num_steps += 1
        prev, self._last_k = self._last_k, None
        caps = [self.rules.row_limit(r.seq.mtp, in_flight) if r.needs_drafts else 0 for r in rows]   # explicit rules
        kmax = max(caps, default=0)
        if self.policy == "fixed" or kmax == 0:
            self._run_k, self._reuse = 0, None
            return self._apply(rows, caps)
        B = sum(1 for r in rows if r.needs_drafts)
        b = bucket(B)
        n = self.num_decisions[b] = self.num_decisions.get(b, 0) + 1
        last = self.last_chosen.setdefault(b, [0] * (self.K + 1))   # a new bucket owes no re-try yet
        key = (B, kmax, len(rows))
        if self._reuse is not None and self._reuse[0] == key and self._reuse[3] > 0 and self._hold is None \
                and prev is not None:
            _, k, resume, left = self._reuse
            self._reuse = (key, k, resume, left - 1)
        else:
            k, resume, settled = self._decide(rows, caps, kmax, B, b, n, last, prev)
            # a count of 0 stands a few steps (nothing is learnt meanwhile, and the k = 0 steps are the ones
            # whose overhead matters most); a drafting count is re-derived each step from what it shows
            self._reuse = (key, k, resume, REDECIDE - 1) if settled and not k and self._hold is None else None
        last[k] = n
        self._last_k = k
        self._run_k = self._run_k + 1 if k == prev else 1
        limits, catchup, uniform, decode_only = [], 0, True, True
        for r, c in zip(rows, caps):
            mtp = r.seq.mtp
            if r.start + len(r.next_tokens) <= r.seq.prefill_target:
                decode_only = False                          # a prefill chunk: this step's drafting is not timed
            j = k if k < c else c
            if j and mtp.pending:
                if resume:
                    catchup += r.start - mtp.num_valid       # its MTP caches catch up in this drafting step
                else:
                    j = 0                                    # it stays at 0 (and lags on)
            if r.needs_drafts and j != k:
                uniform = False
            mtp.draft_len = j
            limits.append(j)
        # measured: decode rows only, every row at k (the costs are per row of such steps), in a run of k
        self._pending = (B, k, catchup, decode_only and uniform and self._run_k > SETTLE)
        return limits

    def _decide(self, rows: Sequence["DraftInput"], caps: list[int], kmax: int, B: int, b: int, n: int,
                last: list[int], prev: Optional[int]) -> tuple[int, bool, bool]:
        """(count, whether lagging rows resume drafting, whether the count may stand for REDECIDE steps)."""
        costs = self.costs.per_row(B)
        hold, self._hold = self._hold, None
        if costs is None:                     # nothing measured yet: a prior (relative) cost per count, so that
            costs = ([1.0] * (self.K + 1), [PRIOR_DRAFT_COST * k for k in range(self.K + 1)])   # the acceptance
            # decides from the first step: a head that proposes well drafts at once, one that does not stops
        if hold is not None and hold[0] == b and hold[1] <= kmax:
            if hold[2] > 1:                   # a re-try lasts SETTLE + 1 steps: only the last is measured
                self._hold = (b, hold[1], hold[2] - 1, hold[3])
            return hold[1], hold[3], False
        # expected tokens E(0..K) per row, grouped so that the sums stay cheap
        now = self.num_steps
        if now - self._glob_seen > 1:           # nothing observed lately: the engine-wide estimate goes stale,
            # back toward the prior, half as fast after each probe that found nothing accepted (a head that
            # predicts nothing is re-tried after ~30, ~60, ~120 ... steps; one that was stopped by bad luck
            # resumes after ~30)
            rate = GLOBAL_RELAX / (1 << min(self._probe_fails, 16))
            self.accept = relaxed(self.accept, [PRIOR_ACCEPT] * self.K, now - self._glob_seen, rate)
            self._glob_seen, self._glob_expected = now, None
        glob = self._glob_expected or expected_tokens(self.accept, self.K)
        self._glob_expected = glob
        batch = _Batch(B)
        for r, cap in zip(rows, caps):
            if not r.needs_drafts:
                continue
            seq = r.seq
            e = request_expected(seq.mtp, self.accept, glob, now)
            if cap and seq.mtp.pending:
                batch.lagging.append((e, r.start - seq.mtp.num_valid, seq.params.max_tokens - len(seq.output_ids)))
            elif cap == kmax:
                batch.full.append(e)
            else:
                batch.other.append((e, cap))
        return (*self._best(batch, costs, kmax, n, last, prev), True)

    def _best(self, batch: "_Batch", costs: tuple[list[float], list[float]], kmax: int, n: int,
              last: list[int], prev: Optional[int]) -> tuple[int, bool]:
        """(count, whether lagging rows resume drafting): the most expected tokens per second, or a count to
        re-try. The step's cost is the sum of its rows' per-row costs u(k) = target + drafter part of a
        uniform step of this bucket, so rows limited below the count cost what they verify."""
        tgt, drf = costs
        u = [t + d for t, d in zip(tgt, drf)][:kmax + 1]                 # per-row step seconds at each count
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
        c = self.costs.catchup_s if self.costs.catchup_s is not None else u[0] * self.mtp_cost_ratio
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
        # the decision compares rates with drafting discounted by DRAFT_MARGIN and the previous count favoured
        bias = [1.0] + [1.0 / (1.0 + DRAFT_MARGIN)] * kmax
        def score(rate: list[float], k: int) -> float:
            return rate[k] * bias[k] * (1.0 + STICK if k == prev else 1.0)
        best, resume = max(R, key=lambda k: (score(rate_with, k), -k)), True
        kw = max(R, key=lambda k: (score(rate_without, k), -k))
        if score(rate_without, kw) > score(rate_with, best):
            best, resume = kw, False
        top = rate_with[best] if resume else rate_without[best]
        # re-try another count when the budget accumulated since it was last chosen covers its cost
        # (SETTLE + 1 steps at it, only the last measured); a re-try never makes lagging rows catch up
        rate = rate_without if nl else rate_with
        share, due, pick = EXPLORE_BUDGET / kmax, 0.0, best
        b = bucket(batch.size)
        for k in R:
            if k == best or n - self.last_retry.get(b, 0) < MIN_EXPLORE_GAP or (k and nl == batch.size):
                continue
            slack = (n - last[k]) * share - (SETTLE + 1) * (1.0 - rate[k] / top)
            if slack > due:
                due, pick = slack, k
        if pick != best:
            self.num_explorations += 1
            self.last_retry[b] = n
            resume = not nl
            self._hold = (b, pick, SETTLE, resume)
        return pick, resume

    @staticmethod
    def _apply(rows: Sequence["DraftInput"], limits: list[int]) -> list[int]:
        for r, k in zip(rows, limits):
            r.seq.mtp.draft_len = k
        return limits

    # ---- after verification, per row -----------------------------------------------------
    def observe(self, mtp: MTPState, proposed: int, accepted: int, stats: Optional[SpecStats] = None) -> None:
        """A decode step of a request verified `proposed` drafts and accepted `accepted`: the acceptance window
        (explicit rule; a pause is counted in stats) and the acceptance estimates (acceptance.learn)."""
        self.rules.observe(mtp, proposed, accepted, stats)
        if self.policy == "fixed" or proposed <= 0:
            return
        now = self.num_steps
        if now - self._last_obs > REDECIDE:   # a probe after a stretch without drafts: did the head do better?
            self._probe_fails = self._probe_fails + 1 if accepted == 0 else 0
        elif accepted:
            self._probe_fails = 0
        self._last_obs = now
        self._num_observed = 1 if now - self._glob_seen > STALE else self._num_observed + 1
        learn(mtp, self.accept, self._num_observed, now, proposed, accepted)
        self._glob_seen, self._glob_expected = now, None

    # ---- timing, once per step -----------------------------------------------------------
    def record_step(self, rows: Sequence["ScheduledRow"], t0: float, t1: float, t2: float) -> None:
        """rows: the step's scheduled rows; t0 its start, t1 after commit (target part done), t2 its end
        (drafting for the next step done), all read from `clock`. Only decode-only steps are measured."""
        if self.policy == "fixed":
            return
        decode = bool(rows) and not any(r.is_prefill for r in rows)
        verified = max(len(r.token_ids) for r in rows) - 1 if decode else None
        if decode and min(len(r.token_ids) for r in rows) - 1 != verified:
            decode, verified = False, None        # rows verified different counts: not a uniform step
        p, self._pending = self._pending, None
        self._run_verified = self._run_verified + 1 if decode and verified == self._prev_verified else 1
        self._prev_verified = verified
        prev_end, self._prev_end = self._prev_end, t2 if decode else None
        if decode and self._warmup > 0:
            self._warmup -= 1
            return
        # a step is measured only in a run of the same count: the first steps after a change pay for the
        # earlier ones (the tokens they emitted, the caches their working set evicted; measured: a k = 0 step
        # after k = 3 ones costs ~25% more at batch 16, ~10% one step later) and would blur both counts
        if decode and self._run_verified > SETTLE:
            self.costs.add_target(len(rows), verified, t1 - (prev_end if prev_end is not None else t0))
        if p is not None:
            B, k, catchup, clean = p
            if catchup:
                cell = self.costs.draft.get(bucket(B), [None] * (self.K + 1))[k]
                if cell is not None:          # the drafter's usual time at k is known: the rest is the catch-up
                    self.costs.add_catchup((t2 - t1 - B * cell.value) / catchup)
            elif clean:
                self.costs.add_draft(B, k, t2 - t1)

    def summary(self) -> dict:
        """For reports: the policy, its cost table (ms per row), acceptance estimate, explorations."""
        return {"policy": self.policy, "max_draft_len": self.K,
                "step_costs": self.costs.snapshot() if self.policy == "cost" else None,
                "catchup_us_per_position": None if self.costs.catchup_s is None else round(1e6 * self.costs.catchup_s, 3),
                "engine_acceptance_estimate": [round(a, 4) for a in self.accept] if self.policy == "cost" else None,
                "num_explorations": self.num_explorations}

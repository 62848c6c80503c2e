"""How many drafts each request verifies in its next step (0..K): the draft-length policy.

The engine asks `DraftLenPolicy.choose` once per step, after committing the step's tokens and before
drafting the next ones; the answer is each row's draft count for the next step, and the drafter proposes
that many. Two policies (`speculative_config.draft_len_policy`):

- **fixed**: every row gets its explicit limit (K, or less under `draft_len_schedule` / a paused
  acceptance window): the behaviour before this policy.
- **cost** (the default): the count with the most expected output tokens per second, from what the engine
  measures while it runs.

  Costs. u(B, k) = per-row seconds of a step of B decode rows that all verify k drafts, per batch-size
  bucket (1, 2, 3, 4, 5-8, 9-16, ...), as two tables: the target part (from the previous step's end:
  the caller's work between steps, schedule, target forward over k+1 tokens per row, verification,
  commit), keyed by the drafts verified, and the drafter part (this choice, the MTP forwards, storing the
  drafts), keyed by the drafts chosen; k = 0 skips the drafter. A step is measured only if it is
  decode-only, uniform (every row at the same count) and the third or later of a run of that count (the
  first steps after a change pay for the previous ones: measured on the shipped model, a k = 0 step after
  k = 3 steps costs ~25% more at batch 16). The engine's first 3 decode steps run cold and are not
  measured. On a CPU the clock is the engine thread's CPU time (time.thread_time: other processes on a
  shared machine and idle time between requests stay out of it), elsewhere wall time. Each cell keeps its
  last 9 samples and takes their mean without those above 1.5x their median (delays by other work come in
  bursts). A cell with fewer than 3 samples is replaced by what the bucket's other cells predict (least-squares line in k) when that
  is lower, and an unmeasured count gets the prediction (from one measured count, optimistically: flat
  above it, proportional below it); a bucket with no measurement borrows the nearest bucket's. With
  nothing measured at all the first steps draft nothing, and the optimistic predictions get the other
  counts tried next: 2-4 short runs per bucket, then the choice follows the measurements.

  Acceptance. a_j = the chance that draft j is accepted when drafts 1..j-1 were, per request: an
  exponentially weighted mean of its own steps (weight 0.1; the first observations weigh 1/(n+4), the
  prior counting as 4, and so do the first ones after 16 steps without any), starting from the
  engine-wide mean (weight 0.05, prior 0.8 counting as 8). A
  position a request does not observe moves 10% per step back to the engine-wide value (what it showed
  goes stale: a reasoning trace changes phase), and the engine-wide value moves 0.5% per step back to
  the prior while no request verifies a draft, so a long stretch at 0 is re-tried, rarely.
  E_r(k) = 1 + sum_{i<=k} prod_{j<=i} a_j is the expected tokens row r emits with k drafts.

  Choice. For k = 0..max(cap_r): rate(k) = sum_r E_r(min(k, cap_r)) / sum_r u(B, min(k, cap_r)), where
  cap_r is the row's explicit limit (`adaptive.DraftPolicy`: schedule, paused window; the confidence gate
  then stops chains inside the drafter), so explicit settings bound this policy. A drafting count must
  beat k = 0 by 5% (measurement noise, and the k = 0 steps among drafting ones cost more than in a run
  of k = 0), the previous count is kept unless another is 2% better, ties go to the smaller count. The
  count is re-derived every step while drafting and every 4th step at 0 (nothing is learnt at 0). Once
  per 32 decisions of a bucket another count may be re-tried for 3 steps (the last one measured), when
  the budget it accrued since it was last chosen (1% of throughput, shared by the alternatives) covers
  its expected loss; a re-try never makes lagging rows catch up.

  Catch-up. A row at 0 skips the drafter and its MTP caches lag (see adaptive.py); the first step that
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

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from mtp_core.speculative.adaptive import DraftPolicy

if TYPE_CHECKING:
    from mtp_core.engine.scheduler import ScheduledRow
    from mtp_core.speculative.drafter import DraftInput

POLICIES = ("cost", "fixed")

RING = 9                   # samples per cost cell
TRUSTED = 3                # samples from which a cell's own value is its estimate (before: see _estimate)
WARMUP_STEPS = 3           # the engine's first decode steps run cold (caches, allocator): not measured
SETTLE = 2                 # steps of a count after a change that are not measured (the change's cost)
ACCEPT_WEIGHT = 0.1        # weight of a request's newest observation in its acceptance estimate
GLOBAL_WEIGHT = 0.05       # the same for the engine-wide estimate new requests start from
PRIOR_ACCEPT = 0.8         # the engine-wide estimate before any observation (optimistic: draft first)
PRIOR_WEIGHT = 4           # observations a request's prior (the engine-wide estimate) counts as; the
                           # engine-wide estimate's prior counts twice that
RELAX = 0.1                # per step a draft position is not observed, a request's estimate there moves this
                           # far back to the engine-wide one (what it showed goes stale: a trace changes phase)
GLOBAL_RELAX = 0.005       # per step in which no request verified a draft, the engine-wide estimate moves this
                           # far back to PRIOR_ACCEPT (so that a long run at 0 drafts is re-tried, rarely)
STALE = 16                 # steps without an observation after which an estimate learns as if new again
EXPLORE_BUDGET = 0.01      # expected throughput spent on re-trying counts that are not the best
MIN_EXPLORE_GAP = 32       # decisions of one batch-size bucket between two re-tries, at least
HORIZON = 128              # steps over which a catch-up is amortised, at most (the rest of the request)
DRAFT_MARGIN = 0.05        # drafting must promise this much more than no drafting (measurement noise, and the
                           # k = 0 steps between drafting ones measured dearer than in a run of k = 0 only)
STICK = 0.02               # keep the previous count unless another promises this much more (a change costs)
REDECIDE = 4               # steps a decision for 0 drafts stands while the batch stays the same


def bucket(batch_size: int) -> int:
    """1, 2, 3, 4 exactly; then the next power of two (5-8 -> 8, 9-16 -> 16, ...)."""
    return batch_size if batch_size <= 4 else 1 << (batch_size - 1).bit_length()


class _Cell:
    """The last RING samples of one cost cell. Its value is their mean without the samples above 1.5x their
    median (a step on a shared machine is now and then delayed, in bursts, by other work), or the smallest
    of fewer than 3 samples. The mean, not a low quantile: a drafting step's own cost varies (the MTP
    forward covers the tokens each row accepted), and tokens per second follow its mean."""
    __slots__ = ("samples", "next", "value")

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.next = 0
        self.value = 0.0

    def add(self, x: float) -> None:
        if len(self.samples) < RING:
            self.samples.append(x)
        else:
            self.samples[self.next] = x
            self.next = (self.next + 1) % RING
        s = sorted(self.samples)
        if len(s) < 3:
            self.value = s[0]
            return
        cut = 1.5 * s[len(s) // 2]
        kept = [x for x in s if x <= cut]
        self.value = sum(kept) / len(kept)


def _predict(points: list[tuple[int, float, int]], k: int, first: int) -> Optional[float]:
    """The value at count k from measured (count, value, samples) points of one table: the least-squares
    line weighted by min(samples, TRUSTED), slope >= 0; from a single point an optimistic guess (flat above
    it, proportional below it: to k + 1 tokens for the target part, to k chain forwards for the drafter,
    whose counts start at first = 1); None without points."""
    if not points:
        return None
    if len({j for j, _, _ in points}) == 1:
        k1, v1, _ = points[0]
        return v1 * min(1.0, (k - first + 1) / (k1 - first + 1))
    w = [min(n, TRUSTED) for _, _, n in points]
    sw = sum(w)
    mk = sum(wi * j for wi, (j, _, _) in zip(w, points)) / sw
    mv = sum(wi * v for wi, (_, v, _) in zip(w, points)) / sw
    var = sum(wi * (j - mk) ** 2 for wi, (j, _, _) in zip(w, points))
    slope = max(sum(wi * (j - mk) * (v - mv) for wi, (j, v, _) in zip(w, points)) / var, 0.0)
    return max(mv + slope * (k - mk), 0.0)


def _estimate(cells: list[Optional[_Cell]], drafter: bool) -> list[float]:
    """Per-row seconds for k = 0..K. A cell with TRUSTED samples gives its value. A cell with fewer gives
    the smaller of its value and what the other cells predict for it (`_predict`): one slow sample
    must not keep a count from being tried again. An unmeasured count gets the prediction from the
    measured cells so estimated (0 when there are none). The drafter's k = 0 (it does not run) is apart: 0 until measured."""
    K = len(cells) - 1
    out = [0.0] * (K + 1)
    first = 1 if drafter else 0
    if drafter and cells[0] is not None:
        out[0] = cells[0].value
    points = [(k, c.value, len(c.samples)) for k, c in enumerate(cells) if c is not None and k >= first]
    if not points:
        return out
    if len(points) == K + 1 - first and all(n >= TRUSTED for _, _, n in points):
        out[first:] = [v for _, v, _ in points]         # every count measured: no prediction needed
        return out
    settled = []                                        # measured cells, as estimated
    for k, v, n in points:
        if n < TRUSTED:
            guess = _predict([p for p in points if p[0] != k], k, first)
            v = v if guess is None else min(v, guess)
        settled.append((k, v, n))
        out[k] = v
    measured = {k for k, _, _ in points}
    for k in range(first, K + 1):
        if k not in measured:
            out[k] = _predict(settled, k, first) or 0.0
    return out


class StepCosts:
    """t(B, k) per batch-size bucket: target-part and drafter-part cells of per-row seconds, and the
    catch-up cost per lagging position."""

    def __init__(self, K: int) -> None:
        self.K = K
        self.target: dict[int, list[Optional[_Cell]]] = {}
        self.draft: dict[int, list[Optional[_Cell]]] = {}
        self._catchup = _Cell()                      # seconds per lagging position caught up
        self._cache: dict[int, tuple[list[float], list[float]]] = {}   # per bucket, until its next sample

    def _add(self, table: dict[int, list[Optional[_Cell]]], batch_size: int, k: int, seconds: float) -> None:
        b = bucket(batch_size)
        cells = table.setdefault(b, [None] * (self.K + 1))
        if cells[k] is None:
            cells[k] = _Cell()
        cells[k].add(seconds / batch_size)
        for x in [x for x in self._cache if x == b or x not in self.target]:   # b, and buckets that borrow
            del self._cache[x]

    def add_target(self, batch_size: int, k: int, seconds: float) -> None:
        self._add(self.target, batch_size, k, seconds)

    def add_draft(self, batch_size: int, k: int, seconds: float) -> None:
        self._add(self.draft, batch_size, k, seconds)

    def add_catchup(self, seconds_per_position: float) -> None:
        self._catchup.add(max(seconds_per_position, 0.0))

    @property
    def catchup_s(self) -> Optional[float]:
        """Seconds per lagging position: the median of the last RING measurements (each the difference of two
        noisy times, so errors go both ways; a catch-up also follows a change of count, whose own extra cost
        the measurement cannot separate)."""
        s = sorted(self._catchup.samples)
        return s[len(s) // 2] if s else None

    def per_row(self, batch_size: int) -> Optional[tuple[list[float], list[float]]]:
        """(target part, drafter part) per row for k = 0..K at this batch size; None when nothing is measured.
        A bucket without target measurements borrows the nearest measured bucket's."""
        b = bucket(batch_size)
        hit = self._cache.get(b)
        if hit is not None:
            return hit
        src = b
        if src not in self.target:
            if not self.target:
                return None
            src = min(self.target, key=lambda x: (abs(math.log2(x / b)), x))
        out = self._cache[b] = (_estimate(self.target[src], drafter=False),
                                _estimate(self.draft.get(src, [None] * (self.K + 1)), drafter=True))
        return out

    def snapshot(self) -> dict:
        """Per bucket: estimated step ms per row (target + drafter) for k = 0..K and samples per cell."""
        out: dict[str, Any] = {}
        for b in sorted(self.target):
            t, d = self.per_row(b)                   # type: ignore[misc]
            out[str(b)] = {"step_ms_per_row": [round(1e3 * (x + y), 4) for x, y in zip(t, d)],
                           "target_samples": [len(c.samples) if c else 0 for c in self.target[b]],
                           "draft_samples": [len(c.samples) if c else 0
                                             for c in self.draft.get(b, [None] * (self.K + 1))]}
        return out


class _Batch:
    """The rows of one decision: expected-token lists, grouped."""
    __slots__ = ("size", "full", "other", "lagging")

    def __init__(self) -> None:
        self.size = 0
        self.full: list[list[float]] = []                        # E of rows allowed the largest count, no lag
        self.other: list[tuple[list[float], int]] = []           # (E, cap) of rows limited below it
        self.lagging: list[tuple[list[float], int, int]] = []   # (E, lag, tokens left) of rows whose MTP lags


class DraftLenPolicy:
    """The engine's one policy object: `choose` once per step, `observe` per verified row, `record_step`
    once per step with its timestamps. `row_limit` and `in_flight` serve the scheduler."""

    def __init__(self, K: int, rules: Optional[DraftPolicy] = None, policy: str = "cost",
                 mtp_cost_ratio: float = 0.25, clock: Callable[[], float] = time.perf_counter) -> None:
        if policy not in POLICIES:
            raise ValueError(f"speculative_config.draft_len_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
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

    @classmethod
    def from_spec(cls, spec: Any, max_batch_size: int, mtp_cost_ratio: float = 0.25,
                  policy: Optional[str] = None, clock: Callable[[], float] = time.perf_counter) -> "DraftLenPolicy":
        if spec is None:
            return cls(0, DraftPolicy(0), "fixed")
        return cls(spec.max_draft_len, DraftPolicy.from_spec(spec, max_batch_size),
                   policy or spec.draft_len_policy, mtp_cost_ratio, clock)

    # ---- the scheduler's view ------------------------------------------------------------
    def in_flight(self, num_running: int, num_waiting: int) -> int:
        return self.rules.in_flight(num_running, num_waiting)

    def row_limit(self, seq: Any, batch_size: int) -> int:
        """Drafts this row may verify now: the explicit rules, and no more than chosen when it drafted."""
        return min(self.rules.row_limit(seq, batch_size), seq.draft_len)

    # ---- once per step -------------------------------------------------------------------
    def choose(self, rows: Sequence["DraftInput"], in_flight: int) -> list[int]:
        """Each row's draft count for the next step (0 for rows that draft nothing: non-final prefill
        chunks, drafting off or paused). Also sets seq.draft_len. The count is re-derived from the
        estimates every REDECIDE steps, and at once when the batch changes (size, limits, a re-try)."""
        self._pending = None
        self.num_steps += 1
        prev, self._last_k = self._last_k, None
        cap_all = self.rules.batch_limit(in_flight)          # the explicit rules' limit (DraftPolicy.row_limit)
        caps = [cap_all if r.needs_drafts and not r.seq.spec_off and r.seq.pause_steps <= 0 else 0 for r in rows]
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
            seq = r.seq
            if r.start + len(r.next_tokens) <= seq.prefill_target:
                decode_only = False                          # a prefill chunk: this step's drafting is not timed
            j = k if k < c else c
            if j and seq.mtp_pending:
                if resume:
                    catchup += r.start - seq.mtp_valid       # its MTP caches catch up in this drafting step
                else:
                    j = 0                                    # it stays at 0 (and lags on)
            if r.needs_drafts and j != k:
                uniform = False
            seq.draft_len = j
            limits.append(j)
        # measured: decode rows only, every row at k (the costs are per row of such steps), in a run of k
        self._pending = (B, k, catchup, decode_only and uniform and self._run_k > SETTLE)
        return limits

    def _decide(self, rows: Sequence["DraftInput"], caps: list[int], kmax: int, B: int, b: int, n: int,
                last: list[int], prev: Optional[int]) -> tuple[int, bool, bool]:
        """(count, whether lagging rows resume drafting, whether the count may stand for REDECIDE steps)."""
        costs = self.costs.per_row(B)
        hold, self._hold = self._hold, None
        if costs is None:                     # nothing measured yet: no drafts (never slower), then the
            return 0, True, True              # optimistic estimates of the other counts make them tried
        if hold is not None and hold[0] == b and hold[1] <= kmax:
            if hold[2] > 1:                   # a re-try lasts SETTLE + 1 steps: only the last is measured
                self._hold = (b, hold[1], hold[2] - 1, hold[3])
            return hold[1], hold[3], False
        # expected tokens E(0..K) per row, grouped so that the sums stay cheap
        now = self.num_steps
        if now - self._glob_seen > 1:           # nothing observed lately: the engine-wide estimate goes stale
            d = (1.0 - GLOBAL_RELAX) ** (now - self._glob_seen)
            self.accept = [PRIOR_ACCEPT + (a - PRIOR_ACCEPT) * d for a in self.accept]
            self._glob_seen, self._glob_expected = now, None
        glob = self._glob_expected or self._expected(self.accept, self.K)
        self._glob_expected = glob
        batch = _Batch()
        batch.size = B
        for r, cap in zip(rows, caps):
            if not r.needs_drafts:
                continue
            seq = r.seq
            e = seq.expected or glob
            if seq.expected is not None and now - seq.accept_step > 1:     # no draft verified lately
                d = (1.0 - RELAX) ** (now - seq.accept_step)
                e = self._expected([g + (a - g) * d for a, g in zip(seq.accept_est, self.accept)], self.K)
            if cap and seq.mtp_pending:
                batch.lagging.append((e, r.start - seq.mtp_valid, seq.params.max_tokens - len(seq.output_ids)))
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
    def _expected(accept: list[float], k: int) -> list[float]:
        """[E(0), .., E(k)]: expected tokens emitted with j drafts, E(j) = 1 + sum_{i<=j} prod_{l<=i} a_l."""
        out, p = [1.0], 1.0
        for j in range(k):
            p *= accept[j]
            out.append(out[-1] + p)
        return out

    @staticmethod
    def _apply(rows: Sequence["DraftInput"], limits: list[int]) -> list[int]:
        for r, k in zip(rows, limits):
            r.seq.draft_len = k
        return limits

    # ---- after verification, per row -----------------------------------------------------
    def observe(self, seq: Any, proposed: int, accepted: int, stats: Any = None) -> None:
        """A decode step of `seq` verified `proposed` drafts and accepted `accepted`: the acceptance window
        (explicit rule) and the acceptance estimates (positions 1..accepted+1 were observed)."""
        self.rules.observe(seq, proposed, accepted, stats)
        if self.policy == "fixed" or proposed <= 0:
            return
        a = seq.accept_est
        if a is None:
            a = seq.accept_est = list(self.accept)
            seq.accept_n = 0
        g = self.accept
        # the n-th observation weighs 1/(n + PRIOR_WEIGHT) (the prior counts as that many) until that is
        # below the fixed weight; after STALE steps without an observation the count starts again (what was
        # learnt before is a prior now: the request, or the workload, may have changed)
        now = self.num_steps
        seq.accept_n = 1 if now - seq.accept_step > STALE else seq.accept_n + 1
        self._num_observed = 1 if now - self._glob_seen > STALE else self._num_observed + 1
        w = max(ACCEPT_WEIGHT, 1.0 / (seq.accept_n + PRIOR_WEIGHT))
        wg = max(GLOBAL_WEIGHT, 1.0 / (self._num_observed + 2 * PRIOR_WEIGHT))
        seen = min(accepted + 1, proposed)
        for j in range(seen):
            x = 1.0 if j < accepted else 0.0
            a[j] += w * (x - a[j])
            g[j] += wg * (x - g[j])
        for j in range(seen, self.K):
            a[j] += RELAX * (g[j] - a[j])
        seq.expected = self._expected(a, self.K)
        seq.accept_step = self._glob_seen = self.num_steps
        self._glob_expected = None

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

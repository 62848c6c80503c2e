"""The measured step costs the draft-length policy chooses from (speculative/policy.py).

u(B, k) = per-row seconds of a step of B decode rows that all verify k drafts, per batch-size bucket (1, 2,
3, 4, 5-8, 9-16, ...), as two tables: the target part (from the previous step's end: the caller's work
between steps, schedule, target forward over k+1 tokens per row, verification, commit), keyed by the drafts
verified, and the drafter part (this choice, the MTP forwards, storing the drafts), keyed by the drafts
chosen; k = 0 skips the drafter. Which steps are measured is the policy's (`DraftLenPolicy.record_step`).

Each cell keeps its last 9 samples and takes their mean without those above 1.5x their median (delays by other
work come in bursts). A cell with fewer than 3 samples is replaced by what the bucket's other cells predict
(least-squares line in k) when that is lower, and an unmeasured count gets the prediction (from one measured
count, a line of the expected shape through it); a bucket with no measurement borrows the nearest bucket's. With
nothing measured at all the policy takes a prior cost per count (CostPrior.per_draft, from the bytes a draft
reads), so the acceptance decides the first steps. A catch-up (speculative/backlog.py) is measured apart, per
lagging position.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any, NamedTuple, Optional, Sequence

RING = 9                   # samples per cost cell
TRUSTED = 3                # samples from which a cell's own value is its estimate (before: see _estimate)


def bucket(batch_size: int) -> int:
    """1, 2, 3, 4 exactly; then the next power of two (5-8 -> 8, 9-16 -> 16, ...)."""
    return batch_size if batch_size <= 4 else 1 << (batch_size - 1).bit_length()


class _Cell:
    """The last RING samples of one cost cell. Its value is their mean without the samples above 1.5x their
    median (a step on a shared machine is now and then delayed, in bursts, by other work), or the smallest
    of fewer than 3 samples. The mean, not a low quantile: a drafting step's own cost varies (the MTP
    forward covers the tokens each row accepted), and tokens per second follow its mean."""
    __slots__ = ("samples", "_value")

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=RING)
        self._value: Optional[float] = 0.0

    def add(self, x: float) -> None:
        self.samples.append(x)
        self._value = None            # computed when read: most steps add a sample, few decisions read it

    @property
    def value(self) -> float:
        if self._value is None:
            s = sorted(self.samples)
            if len(s) < 3:
                self._value = s[0]
            else:
                cut = 1.5 * s[len(s) // 2]
                kept = [x for x in s if x <= cut]
                self._value = sum(kept) / len(kept)
        return self._value


TARGET_SLOPE = 0.25        # from one measured count: the target part grows by this share of its k = 0 cost per draft
                           # verified (a memory-bound step: 0.06-0.2 measured; a compute-bound tiny model: 0.4)


class CostPrior(NamedTuple):
    """What the policy assumes until it measures, from the model (Engine._make_policy)."""
    catchup_ratio: float = 0.25   # a catch-up position's cost per k = 0 row: the MTP modules it runs / main layers
    draft_share: float = 0.15     # one draft's forward (an MTP module, the LM head it reads) / a k = 0 step's, in
                                  # bytes read per token (decode reads every weight it touches once per token)
    fused: bool = False           # the drafting runs inside the target's call (the native CPU step): the target
                                  # cells hold it, the drafter's hold only the choice

    @property
    def per_draft(self) -> float:
        """A step verifying (and drafting) k drafts costs 1 + per_draft k steps without, before any is measured."""
        return TARGET_SLOPE + self.draft_share

    @property
    def target_slope(self) -> float:
        return self.per_draft if self.fused else TARGET_SLOPE


def _predict(points: list[tuple[int, float, int]], k: int, first: int, slope: float = TARGET_SLOPE
             ) -> Optional[float]:
    """The value at count k from measured (count, value, samples) points of one table: the least-squares
    line weighted by min(samples, TRUSTED), slope >= 0; from a single point a line of the expected shape
    through it: the target part 1 + slope k (TARGET_SLOPE, plus the drafting where the target's call
    drafts: CostPrior.target_slope), the drafter part (counts from first = 1) proportional to
    its chain forwards. (Flat above a single point, as before, made an unmeasured large count look as cheap as
    a measured small one: it was tried whatever the acceptance.) None without points."""
    if not points:
        return None
    if len({j for j, _, _ in points}) == 1:
        k1, v1, _ = points[0]
        if first == 0:
            return v1 * (1.0 + slope * k) / (1.0 + slope * k1)
        return v1 * k / k1
    w = [min(n, TRUSTED) for _, _, n in points]
    sw = sum(w)
    mk = sum(wi * j for wi, (j, _, _) in zip(w, points)) / sw
    mv = sum(wi * v for wi, (_, v, _) in zip(w, points)) / sw
    var = sum(wi * (j - mk) ** 2 for wi, (j, _, _) in zip(w, points))
    slope = max(sum(wi * (j - mk) * (v - mv) for wi, (j, v, _) in zip(w, points)) / var, 0.0)
    return max(mv + slope * (k - mk), 0.0)


def _estimate(cells: list[Optional[_Cell]], drafter: bool, slope: float = TARGET_SLOPE) -> list[float]:
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
            guess = _predict([p for p in points if p[0] != k], k, first, slope)
            v = v if guess is None else min(v, guess)
        settled.append((k, v, n))
        out[k] = v
    measured = {k for k, _, _ in points}
    for k in range(first, K + 1):
        if k not in measured:
            out[k] = _predict(settled, k, first, slope) or 0.0
    return out


class StepCosts:
    """t(B, k) per batch-size bucket: target-part and drafter-part cells of per-row seconds, and the
    catch-up cost per lagging position."""

    def __init__(self, K: int, prior: CostPrior = CostPrior()) -> None:
        self.draft_len = K
        self.prior = prior                           # what it assumes until it measures (catch-up: catchup_ratio)
        self.target: dict[int, list[Optional[_Cell]]] = {}
        self.draft: dict[int, list[Optional[_Cell]]] = {}
        self._catchup = _Cell()                      # seconds per lagging position caught up
        self._prefill = _Cell()                      # seconds per prompt token of a prefill-only step
        self._cache: dict[int, tuple[list[float], list[float]]] = {}   # per bucket, until its next sample

    def _add(self, table: dict[int, list[Optional[_Cell]]], batch_size: int, k: int, seconds: float) -> None:
        b = bucket(batch_size)
        cells = table.setdefault(b, [None] * (self.draft_len + 1))
        if cells[k] is None:
            cells[k] = _Cell()
        cells[k].add(seconds / batch_size)
        if self._cache:                   # b, and buckets that borrow, are estimated again when next read
            for x in [x for x in self._cache if x == b or x not in self.target]:
                del self._cache[x]

    def add_target(self, batch_size: int, k: int, seconds: float) -> None:
        self._add(self.target, batch_size, k, seconds)

    def add_draft(self, batch_size: int, k: int, seconds: float) -> None:
        self._add(self.draft, batch_size, k, seconds)

    def add_catchup(self, seconds_per_position: float) -> None:
        self._catchup.add(max(seconds_per_position, 0.0))

    def add_prefill(self, seconds_per_token: float) -> None:
        self._prefill.add(seconds_per_token)

    @property
    def catchup_s(self) -> Optional[float]:
        """Seconds per lagging position: the median of the last RING measurements (each the difference of two
        noisy times, so errors go both ways; a catch-up also follows a change of count, whose own extra cost
        the measurement cannot separate)."""
        s = sorted(self._catchup.samples)
        return s[len(s) // 2] if s else None

    def catchup_position_s(self, k0_row_s: float) -> float:
        """Seconds per lagging position caught up: measured; else a prompt token's seconds in a prefill-only step
        x catchup_ratio (a catch-up is a prefill of the MTP modules: catchup_ratio = the modules it runs / the
        main layers); else a k = 0 row's seconds x catchup_ratio (a decode row reads every weight for one token:
        far dearer per position than a batched forward, so this last prior holds drafting back the longest)."""
        c = self.catchup_s
        if c is not None:
            return c
        if self._prefill.samples:
            return self._prefill.value * self.prior.catchup_ratio
        return k0_row_s * self.prior.catchup_ratio

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
        target = _estimate(self.target[src], drafter=False, slope=self.prior.target_slope)
        cells = self.draft.get(src) or [None] * (self.draft_len + 1)
        draft = _estimate(cells, drafter=True)
        if not self.prior.fused and not any(cells[1:]):     # no drafting step measured: the prior's share per draft
            draft = [draft[0] + self.prior.draft_share * target[0] * k for k in range(self.draft_len + 1)]
        out = self._cache[b] = (target, draft)
        return out

    def snapshot(self) -> dict:
        """Per bucket: estimated step ms per row (target + drafter) for k = 0..K and samples per cell."""
        out: dict[str, Any] = {}
        for b in sorted(self.target):
            t, d = self.per_row(b)                   # type: ignore[misc]
            out[str(b)] = {"step_ms_per_row": [round(1e3 * (x + y), 4) for x, y in zip(t, d)],
                           "target_samples": [len(c.samples) if c else 0 for c in self.target[b]],
                           "draft_samples": [len(c.samples) if c else 0
                                             for c in self.draft.get(b, [None] * (self.draft_len + 1))]}
        return out


WARMUP_STEPS = 3           # the engine's first decode steps run cold (caches, allocator): not measured
SETTLE = 2                 # steps of a count after a change that are not measured (the change's cost)


class Measure(NamedTuple):
    """What a decision leaves for the step's timing: its rows, count, catch-up positions, whether it is clean
    (decode rows only, every row at the count, in a settled run of it)."""
    rows: int
    draft_len: int
    catchup: int
    clean: bool


class StepTimer:
    """Which steps are measured, and into which cells of `costs`. A step is measured only if it is decode-only,
    uniform (every row verified the same count) and the (SETTLE + 1)-th or later of a run of that count: the
    first steps after a change pay for the earlier ones (the tokens they emitted, the caches their working set
    evicted; measured: a k = 0 step after k = 3 ones costs ~25% more at batch 16, ~10% one step later). The
    drafter part is measured for clean decisions; a decision whose lagging rows catch up measures the catch-up
    per position instead (the drafter's usual time at that count subtracted)."""

    def __init__(self, draft_len: int, prior: CostPrior = CostPrior()) -> None:
        self.costs = StepCosts(draft_len, prior)
        self.pending: Optional[Measure] = None      # this step's decision, for its drafter part
        self._prev_end: Optional[float] = None      # end of the previous step, if it was a decode step
        self._prev_verified: Optional[int] = None   # drafts the previous step verified, if decode-only ...
        self._run_verified = 0                      # ... and how many steps in a row verified as many
        self.warmup = WARMUP_STEPS

    def record_step(self, rows: Sequence[Any], t0: Optional[float], t1: Optional[float], t2: Optional[float]
                    ) -> None:
        """rows: the step's scheduled rows; t0 its start, t1 after commit (target part done), t2 its end
        (drafting for the next step done); all None in a step not timed, which counts in the runs but measures
        nothing."""
        num_prefill, lens = 0, set()              # one pass over the rows
        for r in rows:
            num_prefill += r.is_prefill
            lens.add(len(r.token_ids))
        decode = bool(rows) and not num_prefill
        if t2 is None:                            # not timed: the runs go on, nothing is measured
            t0 = t1 = None
        if rows and num_prefill == len(rows) and self.warmup < WARMUP_STEPS and t1 is not None:
            # a prompt's forward per token (after the first decode step: the first prefill runs cold), the prior
            # for what a catch-up costs per position until one is measured
            self.costs.add_prefill((t1 - t0) / sum(len(r.token_ids) for r in rows))
        verified = None
        if decode:
            if len(lens) == 1:
                verified = lens.pop() - 1
            else:
                decode = False                    # rows verified different counts: not a uniform step
        p, self.pending = self.pending, None
        self._run_verified = self._run_verified + 1 if decode and verified == self._prev_verified else 1
        self._prev_verified = verified
        prev_end, self._prev_end = self._prev_end, t2 if decode else None
        if decode and self.warmup > 0:
            self.warmup -= 1
            return
        if t1 is None:
            return
        if decode and self._run_verified > SETTLE:
            self.costs.add_target(len(rows), verified, t1 - (prev_end if prev_end is not None else t0))
        if p is None:
            return
        if p.catchup:
            cell = self.costs.draft.get(bucket(p.rows), [None] * (self.costs.draft_len + 1))[p.draft_len]
            if cell is not None:          # the drafter's usual time at this count is known: the rest is the catch-up
                self.costs.add_catchup((t2 - t1 - p.rows * cell.value) / p.catchup)
        elif p.clean:
            self.costs.add_draft(p.rows, p.draft_len, t2 - t1)

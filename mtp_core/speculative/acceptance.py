"""The acceptance estimates the draft-length policy chooses from (speculative/policy.py).

a_j = the chance that draft j is accepted when drafts 1..j-1 were, per request: an exponentially weighted
mean of its own steps (weight 0.1; the first observations weigh 1/(n+1), the prior counting as one
observation, and so do the first ones after 16 steps without any), starting from the engine-wide mean
(weight 0.05, prior 0.8 counting as 1 too). The prior is weak on purpose: an MTP head that predicts nothing
(random or broken weights, a quantized head that lost it) shows it in the first draft it proposes, and
every drafting step it costs is a step slower than decoding without MTP. A rejected draft j also caps the
positions after it that went unobserved (their estimate moves toward j's by the same weight): a chain
that fails at its first draft is no evidence that deeper drafts would do better. A position a request does not observe moves 10% per step back to the engine-wide value
(what it showed goes stale: a reasoning trace changes phase), and an engine-wide value below the prior moves 2% per
step back up to it while no request verifies a draft, so a long stretch at 0 is re-tried, rarely; one above the
prior stays (it is what the head showed last).
E_r(k) = 1 + sum_{i<=k} prod_{j<=i} a_j is the expected tokens row r emits with k drafts.

Worked example (K = 3, a request's first observation, weight 1/(1+1) = 0.5, engine-wide 0.8 everywhere):
a step verifies 3 drafts and accepts 1, so position 1 is seen accepted, position 2 rejected, position 3 not
at all: a = (0.8 + 0.5 * 0.2, 0.8 - 0.5 * 0.8, 0.8 + 0.5 * (0.4 - 0.8)) = (0.9, 0.4, 0.6),
E = (1, 1.9, 2.26, 2.476).
"""
from __future__ import annotations

from typing import Optional

from mtp_core.request.mtp_state import MTPState

ACCEPT_WEIGHT = 0.1        # weight of a request's newest observation in its acceptance estimate
GLOBAL_WEIGHT = 0.05       # the same for the engine-wide estimate new requests start from
PRIOR_ACCEPT = 0.8         # the engine-wide estimate before any observation (optimistic: draft first)
PRIOR_WEIGHT = 1           # observations a request's prior (the engine-wide estimate) counts as; the
                           # engine-wide estimate's prior counts as much (a new request starts from it)
RELAX = 0.1                # per step a draft position is not observed, a request's estimate there moves this
                           # far back to the engine-wide one (what it showed goes stale: a trace changes phase)
GLOBAL_RELAX = 0.02        # per step in which no request verified a draft, the engine-wide estimate moves this
                           # far back up to PRIOR_ACCEPT where below it (so that a run at 0 drafts is re-tried;
                           # halved after each re-try that found nothing accepted)
STALE = 16                 # steps without an observation after which an estimate learns as if new again


def expected_tokens(accept: list[float], k: int) -> list[float]:
    """[E(0), .., E(k)]: expected tokens emitted with j drafts, E(j) = 1 + sum_{i<=j} prod_{l<=i} a_l."""
    out, p = [1.0], 1.0
    for j in range(k):
        p *= accept[j]
        out.append(out[-1] + p)
    return out


def decayed_toward(accept: list[float], toward: list[float], steps: int, rate: float) -> list[float]:
    """accept moved back toward `toward` by `rate` per step, over `steps` steps."""
    d = (1.0 - rate) ** steps
    return [t + (a - t) * d for a, t in zip(accept, toward)]


def learn(mtp: MTPState, engine: list[float], num_engine_observed: int, now: int, proposed: int,
          accepted: int) -> None:
    """A decode step verified `proposed` > 0 drafts and accepted `accepted`: positions 1..accepted+1 were
    observed. Updates the request's estimate (mtp) and the engine-wide one (engine, in place, its
    num_engine_observed-th observation); now: the policy's step count."""
    K = len(engine)
    if mtp.accept_est is None:
        mtp.accept_est, mtp.accept_n = list(engine), 0
    a = mtp.accept_est
    # the n-th observation weighs 1/(n + PRIOR_WEIGHT) (the prior counts as that many) until that is below
    # the fixed weight; after STALE steps without an observation the count starts again (what was learnt
    # before is a prior now: the request, or the workload, may have changed)
    mtp.accept_n = 1 if now - mtp.accept_step > STALE else mtp.accept_n + 1
    w = max(ACCEPT_WEIGHT, 1.0 / (mtp.accept_n + PRIOR_WEIGHT))
    wg = max(GLOBAL_WEIGHT, 1.0 / (num_engine_observed + PRIOR_WEIGHT))
    seen = min(accepted + 1, proposed)
    for j in range(seen):
        x = 1.0 if j < accepted else 0.0
        a[j] += w * (x - a[j])
        engine[j] += wg * (x - engine[j])
    if accepted < proposed:   # draft accepted + 1 was rejected: the deeper, unobserved positions are capped by it
        j = accepted
        for l in range(seen, proposed):
            a[l] += w * (min(a[l], a[j]) - a[l])
            engine[l] += wg * (min(engine[l], engine[j]) - engine[l])
    for j in range(seen, K):
        a[j] += RELAX * (engine[j] - a[j])
    mtp.expected = expected_tokens(a, K)
    mtp.accept_step = now


def request_expected(mtp: MTPState, engine: list[float], engine_expected: list[float], now: int) -> list[float]:
    """E(0..K) for one request: its own, moved back toward the engine-wide estimate when it verified no draft
    lately, or the engine-wide one (engine_expected) before its first observation."""
    if mtp.expected is None:
        return engine_expected
    if now - mtp.accept_step > 1:
        return expected_tokens(decayed_toward(mtp.accept_est, engine, now - mtp.accept_step, RELAX), len(engine))
    return mtp.expected


REDECIDE_GAP = 4           # a verified draft this many policy steps after the last one is a probe (the policy
                           # drafted nothing in between): its outcome sets the re-try backoff


class EngineAcceptance:
    """The engine-wide acceptance estimate every new request starts from, carried across requests: `rates` per draft
    position, learnt from every verified draft (with each request's own, `learn`), raised back toward the prior
    while nothing is verified (where below it), half as fast after each probe whose first draft was rejected (a
    head that predicts nothing is re-tried after ~30, ~60, ~120 ... steps; one stopped by bad luck resumes after
    ~30)."""

    def __init__(self, draft_len: int) -> None:
        self.draft_len = draft_len
        self.rates = [PRIOR_ACCEPT] * draft_len
        self._expected: Optional[list[float]] = None   # E(0..draft_len) of `rates`, None when stale
        self._seen = 0                 # the policy step when `rates` last learnt something (or was decayed)
        self._last_obs = 0             # the policy step of the last verified draft
        self._probe_fails = 0          # probes in a row that found the first draft rejected
        self._num_observed = 0         # observations `rates` has learnt from (since it last went stale)

    def observe(self, mtp: MTPState, proposed: int, accepted: int, now: int) -> None:
        """A row verified proposed > 0 drafts and accepted `accepted` at policy step `now`."""
        if now - self._last_obs > REDECIDE_GAP:   # a probe after a stretch without drafts: did it do better?
            self._probe_fails = self._probe_fails + 1 if accepted == 0 else 0
        elif accepted:
            self._probe_fails = 0
        self._last_obs = now
        self._num_observed = 1 if now - self._seen > STALE else self._num_observed + 1
        learn(mtp, self.rates, self._num_observed, now, proposed, accepted)
        self._seen, self._expected = now, None

    def expected(self, now: int) -> list[float]:
        """E(0..draft_len) of the engine-wide estimate at policy step `now` (decayed first if it went stale)."""
        if now - self._seen > 1:
            rate = GLOBAL_RELAX / (1 << min(self._probe_fails, 16))
            # only an estimate below the prior moves back to it (so that a head that stopped proposing well is
            # re-tried); one above it is what the head showed last, and moving it down while nothing is verified
            # would leave a good head at 0 drafts for good wherever drafting pays only near what it showed
            self.rates = decayed_toward(self.rates, [max(a, PRIOR_ACCEPT) for a in self.rates], now - self._seen, rate)
            self._seen, self._expected = now, None
        if self._expected is None:
            self._expected = expected_tokens(self.rates, self.draft_len)
        return self._expected

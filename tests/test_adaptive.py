"""Adaptive draft length (mtp_core/speculative/adaptive.py): confidence-gated drafting, the batch-size
schedule and the per-request acceptance window. Everything must stay lossless: greedy output equals
greedy output without MTP (`conftest.reference`) token for token, with rows of one batch carrying
different numbers of drafts, through preemption, the overlap scheduler and the static step.

The tiny checkpoints' MTP heads are nearly uniform (their top probability is ~0.003), so confidence
gating would stop every chain at once. `confident()` copies a model and scales each MTP module's
`shared_head.norm` weight: its logits get sharper (top probabilities then spread over 0.2..1.0) while its
argmax, and the hidden state fed on (normalised again by `hnorm`), stay the same.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import PROMPTS, THINK_IDS, OracleDrafter, greedy, llm_config, make_engine, reference, run_to_end
from mtp_core.config import CudaGraphConfig, SpeculativeConfig
from mtp_core.sampling import SamplingParams
from mtp_core.speculative import backlog
from mtp_core.config.schedule import parse_schedule
from mtp_core.speculative.adaptive import DraftLimits
from mtp_core.request.mtp_state import MTPState
from mtp_core.request.stats import SpecStats

torch.set_num_threads(1)

MAX_TOKENS = 20
_CONFIDENT: dict[int, object] = {}


def confident(model, scale: float = 30.0):
    if id(model) not in _CONFIDENT:
        m = copy.deepcopy(model)
        with torch.no_grad():
            for k in range(m.num_mtp_modules):
                m.mtp_module(k).shared_head.norm.weight.mul_(scale)
        _CONFIDENT[id(model)] = m
    return _CONFIDENT[id(model)]


def record_rows(eng) -> list[list[int]]:
    """Per step: the number of drafts of every decode row (what the target verified)."""
    log: list[list[int]] = []
    execute = eng._target          # the target step, native (one call) or the runner's

    def recording(rows, meta=None, *rest):
        log.append([len(r.token_ids) - 1 for r in rows if not r.is_prefill])
        return execute(rows, meta, *rest)
    eng._target = recording
    if eng.paths.native_step is not None:      # the whole step in one native call bypasses _target
        run = eng.paths.native_step.run

        def recording_run(rows):
            log.append([len(r.token_ids) - 1 for r in rows])
            return run(rows)
        eng.paths.native_step.run = recording_run
    return log


OPTIONS = {
    "gate": dict(draft_confidence_threshold=0.3),
    "schedule": dict(draft_len_schedule={1: 9, 3: 1, 6: 0}),          # 9 = K (capped below)
    "window": dict(acceptance_window=2, acceptance_length_threshold=2.0),
    "all": dict(draft_confidence_threshold=0.2, draft_len_schedule={1: 9, 4: 2, 7: 0}, acceptance_window=3,
                acceptance_length_threshold=1.8),
}


def spec_for(name: str, K: int) -> dict:
    spec = dict(OPTIONS[name])
    if "draft_len_schedule" in spec:
        spec["draft_len_schedule"] = {b: min(k, K) for b, k in spec["draft_len_schedule"].items()}
    return spec


# ---- lossless greedy -------------------------------------------------------------------------

@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("ckpt,mode,K", [("tiny1", "eagle", 3), ("tiny3", "eagle", 5), ("tiny3", "vanilla", 3)])
def test_adaptive_greedy_is_token_exact_batch_8(models, ckpt, mode, K, option):
    """Batch 8, requests of 12..20 tokens (the batch shrinks as they finish, so the schedule's limit
    moves); overlap scheduler on for Eagle (placeholder drafts replaced by fewer real ones)."""
    model = confident(models[ckpt])
    params = [greedy(MAX_TOKENS - 2 * (i % 5)) for i in range(len(PROMPTS))]
    eng = make_engine(model, nextn=K, mode=mode, max_batch_size=8, spec=spec_for(option, K),
                      disable_overlap_scheduler=mode == "vanilla")
    steps = record_rows(eng)
    seqs = run_to_end(eng, PROMPTS, params)
    for p, s, sp in zip(PROMPTS, seqs, params):
        assert s.output_ids == reference(models[ckpt], p, sp.max_tokens), f"prompt of length {len(p)}"
    st = eng.stats
    assert sum(st.drafts_per_step) == sum(len(s) for s in steps)
    counts = {n for s in steps for n in s}
    assert len(counts) >= 2, f"every decode row verified {counts} drafts: nothing adaptive happened"
    assert 0 < st.num_draft_accepted <= st.num_draft_proposed < K * sum(st.drafts_per_step)
    if option in ("gate", "all"):
        assert any(len(set(s)) > 1 for s in steps), "no ragged step (rows with different draft counts)"
    if option in ("schedule", "all"):
        assert st.draft_limit_per_step[0] > 0 and st.draft_limit_per_step[-1] > 0    # 0 and K both chosen
    if option == "window":
        assert st.num_window_pauses > 0
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("ckpt,mode,K,option", [("tiny1", "eagle", 3, "gate"), ("tiny3", "vanilla", 3, "all"),
                                                ("tiny3", "eagle", 4, "window")])
def test_adaptive_greedy_is_token_exact_batch_1(models, ckpt, mode, K, option):
    model = confident(models[ckpt])
    eng = make_engine(model, nextn=K, mode=mode, max_batch_size=1, spec=spec_for(option, K))
    prompts = PROMPTS[2:5]
    seqs = run_to_end(eng, prompts, greedy(MAX_TOKENS))
    assert [s.output_ids for s in seqs] == [reference(models[ckpt], p, MAX_TOKENS) for p in prompts]
    assert len([c for c in eng.stats.drafts_per_step if c]) >= 2


@pytest.mark.parametrize("ckpt,mode,K", [("tiny1", "eagle", 3), ("tiny3", "vanilla", 2)])
def test_ragged_batches_with_preemption(models, ckpt, mode, K):
    """A 64-slot KV pool: requests are preempted and recomputed while rows carry 0..K drafts."""
    model = confident(models[ckpt])
    spec = dict(draft_confidence_threshold=0.3, draft_len_schedule={1: K, 6: 1})
    params = [greedy(16 - i % 4) for i in range(len(PROMPTS))]
    eng = make_engine(model, nextn=K, mode=mode, max_tokens_kv=64, tokens_per_block=4, max_batch_size=8,
                      spec=spec, enable_chunked_prefill=True, max_num_tokens=16)
    steps = record_rows(eng)
    seqs = run_to_end(eng, PROMPTS, params)
    assert eng.scheduler.num_preemptions > 0
    assert any(len(set(s)) > 1 for s in steps)
    assert [s.output_ids for s in seqs] == [reference(models[ckpt], p, sp.max_tokens) for p, sp in zip(PROMPTS, params)]
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


# ---- the MTP caches of a request that skipped drafting catch up exactly ----------------------

@pytest.mark.parametrize("ckpt,mode", [("tiny1", "eagle"), ("tiny3", "vanilla")])
def test_paused_requests_catch_up_their_mtp_caches(models, ckpt, mode):
    """Acceptance window 2 at threshold 2.5 with a drafter that is right for one draft in three: requests
    pause, lag, resume; after a drafting step every cache equals a dense recompute of the prefix."""
    from test_mtp_decoding import ControlledDrafter, _check_caches, cycling

    model, K = models[ckpt], 3
    spec = dict(acceptance_window=2, acceptance_length_threshold=2.5)
    eng = make_engine(model, nextn=K, mode=mode, tokens_per_block=4, spec=spec)
    oracle = OracleDrafter(K, model.config.vocab_size, cycling([1, 0, 3, 0, 0]))
    eng.spec.drafter = ControlledDrafter(eng.spec.drafter, oracle)
    prompts = [PROMPTS[2], PROMPTS[4]]
    seqs = [eng.add_request(p, greedy(60)) for p in prompts]
    for p, s in zip(prompts, seqs):
        oracle.futures[s.request_id] = p + reference(model, p, 80)
    lagged = resumed = False
    for _ in range(40):
        eng.step()
        lagged |= any(s.mtp.num_valid < s.kv.num_cached for s in seqs)
        if lagged and all(s.mtp.num_valid == s.kv.num_cached and s.mtp.pause_steps == 0 for s in seqs) and \
                eng.stats.num_window_pauses >= 2:
            resumed = True
            break
    assert lagged and resumed
    for p, s in zip(prompts, seqs):
        assert s.output_ids == reference(model, p, 80)[: len(s.output_ids)]
    _check_caches(model, eng, seqs, mode, K)


def test_mtp_lag_beyond_the_cap_switches_drafting_off(models, monkeypatch):
    monkeypatch.setattr(backlog, "MAX_MTP_LAG", 3)
    model = models["tiny1"]
    eng = make_engine(model, nextn=2, mode="eagle", max_batch_size=4, spec=dict(draft_len_schedule={1: 2, 3: 0}))
    prompts = PROMPTS[1:4]
    seqs = run_to_end(eng, prompts, [greedy(6), greedy(14), greedy(16)])
    assert [s.output_ids for s in seqs] == [reference(model, p, n) for p, n in zip(prompts, (6, 14, 16))]
    assert all(s.mtp.is_off for s in seqs[1:]) and seqs[1].mtp.pending is None


def test_settle_is_the_one_update_of_the_mtp_state_after_a_step():
    """backlog.settle, which every route calls: a row that skipped its MTP forwards lags and holds its new hidden
    states (copied); one whose forwards ran is up to date (Vanilla: with its new window); drafting off keeps
    nothing."""
    mtp, h = MTPState(num_valid=10), torch.ones(2, 4)
    backlog.settle(mtp, 12, False, h, copy=True)
    assert mtp.num_valid == 10 and len(mtp.pending) == 1 and mtp.pending[0] is not h
    assert torch.equal(mtp.pending[0], h)
    window = torch.zeros(3, 4)
    backlog.settle(mtp, 13, True, window=window)
    assert (mtp.num_valid, mtp.pending) == (13, None) and mtp.window_hidden is window
    off = MTPState(num_valid=4, is_off=True)
    backlog.settle(off, 9, True)
    backlog.settle(off, 9, False, h)
    assert (off.num_valid, off.pending) == (4, None)


def test_rows_that_skip_drafting_refer_to_their_row_of_the_step(monkeypatch):
    """backlog.hold_rows (a step in which no row drafted, one token per row): each row keeps a reference to its row
    of the step's states, read back by held_states / held_len in order with states held as tensors; rows with
    drafting off keep nothing; a lag past MAX_MTP_LAG switches drafting off."""
    monkeypatch.setattr(backlog, "MAX_MTP_LAG", 4)
    a, b, off = MTPState(num_valid=5), MTPState(num_valid=1), MTPState(num_valid=3, is_off=True)
    backlog.hold(a, torch.full((2, 4), 7.0), 7, copy=True)          # positions 5, 6 as a tensor
    step1, step2 = torch.arange(12.0).view(3, 4), torch.arange(12.0, 24.0).view(3, 4)
    backlog.hold_rows([a, b, off], step1, [7, 4, 9])                # each fed position start -> valid start + 1
    assert backlog.held_len(a) == 3 and backlog.held_len(b) == 1 and off.pending is None
    states = backlog.held_states(a)
    assert [tuple(t.shape) for t in states] == [(2, 4), (1, 4)]
    assert torch.equal(states[0], torch.full((2, 4), 7.0)) and torch.equal(states[1], step1[0:1])
    assert torch.equal(backlog.held_states(b)[0], step1[1:2])
    backlog.hold_rows([a, b], step2, [8, 5])                        # b: valid 6, 5 past num_valid 1: off
    assert torch.equal(torch.cat(backlog.held_states(a)), torch.cat([torch.full((2, 4), 7.0), step1[:1], step2[:1]]))
    assert b.is_off and b.pending is None and backlog.held_len(b) == 0


# ---- policy rules ----------------------------------------------------------------------------

class _Seq:
    def __init__(self) -> None:
        self.accept_window: list[int] = []
        self.pause_steps = 0
        self.is_off = False


def test_schedule_lookup():
    pol = DraftLimits(4, {1: 4, 4: 2, 16: 0}, max_batch_size=32)
    assert [pol.batch_limit(n) for n in (1, 2, 3, 4, 15, 16, 40)] == [4, 4, 4, 2, 2, 0, 0]
    assert DraftLimits(3, {2: 1}).batch_limit(1) == 3          # below the smallest key: K
    assert DraftLimits(3, {1: 5}).batch_limit(1) == 3          # never above K
    assert DraftLimits(3).batch_limit(100) == 3
    assert pol.in_flight(10, 30) == 32
    assert parse_schedule("1:4, 4:2,16:0") == {1: 4, 4: 2, 16: 0}


def test_acceptance_window_pauses_then_probes_again():
    """Window 3, threshold 2.0: the mean AL of the last 3 drafting steps below 2 pauses the request for
    3 decode steps; then it drafts again with an empty window (never off for good)."""
    pol, seq, st = DraftLimits(3, window=3, al_threshold=2.0), _Seq(), SpecStats()
    limits = []
    for proposed, accepted in [(3, 3), (3, 0), (0, 0), (3, 1), (3, 0), (1, 0), (1, 0), (1, 0),
                               (3, 0), (3, 2), (3, 3), (2, 0)]:
        limits.append(pol.row_limit(seq, 1))
        pol.observe(seq, proposed if limits[-1] else 0, accepted if limits[-1] else 0, st)
    # ALs 4, 1, (no draft: not counted), 2 -> mean 7/3 >= 2; then 1 -> (1, 2, 1) mean 4/3 < 2: pause 3 steps
    assert limits == [3, 3, 3, 3, 3, 0, 0, 0, 3, 3, 3, 3]
    assert st.num_window_pauses == 1
    assert seq.accept_window == [3, 4, 1]          # restarted empty after the pause: ALs 1, 3, 4, 1 -> last 3


def test_window_pauses_through_the_engine_with_an_always_wrong_drafter(models):
    model, K = models["tiny1"], 2
    oracle = OracleDrafter(K, model.config.vocab_size, lambda seq: 0)
    eng = make_engine(model, nextn=K, mode="eagle", drafter=oracle,
                      spec=dict(acceptance_window=2, acceptance_length_threshold=1.5))
    prompt = PROMPTS[3]
    seq = eng.add_request(prompt, greedy(13))
    oracle.futures[seq.request_id] = prompt + reference(model, prompt, 20)
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == reference(model, prompt, 13)
    # 12 decode steps: draft, draft, pause, pause, draft, draft, pause, pause, ...
    assert seq.stats.drafts_per_step == [6, 0, 6] and seq.stats.num_window_pauses == 3


# ---- static (CUDA-graph) step ----------------------------------------------------------------

def test_static_step_falls_back_for_limited_rows_and_is_off_with_gating(models):
    model = models["tiny1"]
    graphs = CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True)
    params = [greedy(MAX_TOKENS - 4 * (i % 3)) for i in range(4)]
    eng = make_engine(model, nextn=3, mode="eagle", max_batch_size=4, cuda_graph_config=graphs,
                      spec=dict(draft_len_schedule={1: 3, 3: 1}))
    steps = record_rows(eng)
    seqs = run_to_end(eng, PROMPTS[:4], params)
    assert [s.output_ids for s in seqs] == [reference(model, p, sp.max_tokens) for p, sp in zip(PROMPTS, params)]
    assert eng.paths.graphs is not None and 0 < eng.paths.graphs.num_replays < eng.num_steps
    assert any(s and max(s) == 1 for s in steps)              # the limited steps ran eagerly
    gated = make_engine(model, nextn=3, mode="eagle", cuda_graph_config=graphs,
                        spec=dict(draft_confidence_threshold=0.2))
    assert gated.paths.graphs is None


# ---- relaxed acceptance in thinking ----------------------------------------------------------

def test_relaxed_thinking_rows_with_adaptive_drafting(models):
    """Relaxed acceptance applies only inside <think>; a plain row in the same batch stays exact while the
    thinking row accepts relaxed drafts, with gating and a schedule on."""
    model = confident(models["tiny1"])
    spec = dict(use_relaxed_acceptance_for_thinking=True, relaxed_topk=model.config.vocab_size, relaxed_delta=1.0,
                draft_confidence_threshold=0.2, draft_len_schedule={1: 3, 2: 2})
    thinking, plain = [120, 220, THINK_IDS[0]], [100, 200, 300]
    eng = make_engine(model, nextn=3, mode="eagle", spec=spec)
    a, b = run_to_end(eng, [thinking, plain], greedy(16))
    assert b.output_ids == reference(models["tiny1"], plain, 16)
    assert a.decoding.in_thinking and a.stats.num_draft_accepted == a.stats.num_draft_proposed > 0   # all accepted


def test_schedule_cuts_a_custom_drafter_in_thinking(models):
    """A drafter that ignores max_drafts: the scheduler still verifies at most the schedule's limit."""
    from test_mtp_decoding import X, FixedDrafter
    model = models["tiny1"]
    spec = dict(use_relaxed_acceptance_for_thinking=True, relaxed_topk=model.config.vocab_size, relaxed_delta=1.0,
                draft_len_schedule={1: 2})
    eng = make_engine(model, drafter=FixedDrafter([X, X, X]), nextn=3, mode="eagle", spec=spec)
    seq = run_to_end(eng, [[120, 220, THINK_IDS[0]]], greedy(10))[0]
    out = seq.output_ids
    assert out[1::3] == [X] * 3 and out[2::3] == [X] * 3       # two X per step, then the target's token
    assert seq.stats.drafts_per_step == [0, 0, 3]


# ---- sampled verification keeps the target distribution with gating on -------------------------

def _chi2_crit(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_outputs_follow_the_target_distribution_with_gating(models):
    """600 seeded requests, temperature 1, top-k 3, 3 tokens each: the joint law of (t1, t2, t3) with gated
    MTP K=3 equals the law without MTP (two-sample chi-square at p = 0.001)."""
    model, n = confident(models["tiny1"]), 600
    prompt = PROMPTS[2]

    def run(nextn: int, seed0: int) -> tuple[dict, object]:
        eng = make_engine(model, nextn=nextn, mode="eagle", max_batch_size=n, max_tokens_kv=n * 24,
                          spec=dict(draft_confidence_threshold=0.3) if nextn else None)
        params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=seed0 + i, ignore_eos=True)
                  for i in range(n)]
        counts: dict[tuple, int] = {}
        for s in run_to_end(eng, [prompt] * n, params):
            counts[tuple(s.output_ids)] = counts.get(tuple(s.output_ids), 0) + 1
        return counts, eng.stats

    base, _ = run(0, 0)
    mtp, st = run(3, 100_000)
    assert st.num_draft_accepted > 0 and len([c for c in st.drafts_per_step if c]) >= 2
    cells = sorted(set(base) | set(mtp))
    # merge cells expected below 5 into one
    small = [c for c in cells if base.get(c, 0) + mtp.get(c, 0) < 10]
    big = [c for c in cells if c not in small]
    pairs = [(base.get(c, 0), mtp.get(c, 0)) for c in big]
    if small:
        pairs.append((sum(base.get(c, 0) for c in small), sum(mtp.get(c, 0) for c in small)))
    stat = sum((a - b) ** 2 / (a + b) for a, b in pairs if a + b)
    assert len(pairs) >= 5
    assert stat < _chi2_crit(len(pairs) - 1), (stat, pairs)


# ---- bad values ------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,match", [
    (dict(draft_confidence_threshold=1.0), r"draft_confidence_threshold must be in \[0, 1\)"),
    (dict(draft_confidence_threshold=-0.1), r"draft_confidence_threshold must be in \[0, 1\)"),
    (dict(draft_len_schedule={0: 1}), "batch size 0 must be an integer >= 1"),
    (dict(draft_len_schedule={1: -1}), "must be an integer >= 0 drafts"),
    (dict(draft_len_schedule={1: 1.5}), "must be an integer >= 0 drafts"),
    (dict(draft_len_schedule={1: 4}), "4 drafts at batch size 1 exceed max_draft_len 3"),
    (dict(draft_len_schedule={}), "non-empty mapping"),
    (dict(acceptance_window=-1), "acceptance_window must be an integer >= 0"),
    (dict(acceptance_window=4), "acceptance_length_threshold is 0"),
    (dict(acceptance_length_threshold=1.5), "needs acceptance_window >= 1"),
])
def test_bad_adaptive_values(fields, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(num_nextn_predict_layers=3, **fields).validate()


def test_bad_adaptive_yaml_and_flags(tmp_path, tiny1_dir):
    from typer.testing import CliRunner

    from cli.app import app
    from mtp_core.yaml_config import ConfigError, apply_yaml_options

    cfg = llm_config(nextn=3)
    for opts, match in [({"draft_len_schedule": {1: -2}}, "speculative_config.draft_len_schedule"),
                        ({"draft_len_schedule": [1, 2]}, "expected a mapping"),
                        ({"draft_confidence_threshold": 1}, r"must be in \[0, 1\)"),
                        ({"acceptance_window": 2.5}, "expected an integer")]:
        with pytest.raises(ConfigError, match=match):
            apply_yaml_options(cfg, {"speculative_config": {"max_draft_len": 3, **opts}}, {}, lambda s: None)
    ok = apply_yaml_options(cfg, {"speculative_config": {"max_draft_len": 4, "draft_len_schedule": {1: 4, 8: 0},
                                                         "draft_confidence_threshold": 0.25}}, {}, lambda s: None)
    assert ok.speculative_config.draft_len_schedule == {1: 4, 8: 0}
    assert ok.speculative_config.draft_confidence_threshold == 0.25
    for flags, match in [(["--spec_decode_draft_confidence", "1.5"], "--spec_decode_draft_confidence must be in"),
                         (["--spec_decode_draft_len_schedule", "1:x"], "--spec_decode_draft_len_schedule"),
                         (["--spec_decode_max_draft_len", "3", "--mtp_mode", "vanilla"], "one module per draft")]:
        r = CliRunner().invoke(app, ["quickstart", "--model_dir", str(tiny1_dir), "--prompt", "hi", "--max_tokens", "2",
                                     "--num_threads", "1", "--spec_decode_algo", "MTP", *flags])
        assert r.exit_code == 2 and r.stdout == "", r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], r.stderr


def test_adaptive_statistics_arithmetic():
    s, t = SpecStats(), SpecStats()
    for proposed, accepted in [(0, 0), (3, 3), (1, 0), (2, 1)]:
        s.record_step(1 + accepted, proposed, accepted)
        s.record_decode(proposed)
    for limit in (3, 3, 1, 0):
        s.record_limit(limit)
    assert s.drafts_per_step == [1, 1, 1, 1] and s.mean_drafts_per_step == pytest.approx(1.5)
    assert s.draft_limit_per_step == [1, 1, 0, 2]
    assert s.proposed_per_position == [3, 2, 1] and s.accepted_per_position == [2, 1, 1]
    assert s.waste == pytest.approx(6 / 4)
    t.record_decode(5)
    t.num_window_pauses = 2
    s.merge(t)
    assert s.drafts_per_step == [1, 1, 1, 1, 0, 1] and s.num_window_pauses == 2
    lines = "\n".join(s.summary_lines())
    assert "accepted / proposed per draft position: [2/3, 1/2, 1/1]" in lines
    assert "drafts per decode step (histogram, 0..K): [1, 1, 1, 1, 0, 1]" in lines
    assert "waste (verified drafts per accepted draft): 1.500 (0.500 rejected per accepted)" in lines
    assert "acceptance-window pauses: 2" in lines

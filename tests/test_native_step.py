"""The decode step as one native call on the CPU (mtp_core::mtp_step, engine/native_step.py): the CPU twin of
the static CUDA-graph step, held to the same contract by the same checks (tests/test_cuda_graphs.py): token
for token the general path's output, and every step's next drafts equal to the eager Eagle drafter's."""
from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, THINK_IDS, greedy, make_engine, reference, run_to_end
from mtp_core import kernels
from mtp_core.sampling import SamplingParams
from mtp_core.speculative.costs import CostPrior
from test_cuda_graphs import drafts_per_step

pytestmark = pytest.mark.skipif(not kernels.native_ops().cpu, reason=kernels.native_ops().summary)
torch.set_num_threads(1)
MAX_TOKENS = 24


def engines(model, **kw):
    """(general path, native step) engines with the same settings; the overlap scheduler off (it needs the
    general path)."""
    kw.setdefault("overlap_scheduler_on_cpu", False)
    return make_engine(model, native_step=False, **kw), make_engine(model, native_step=True, **kw)


@pytest.mark.parametrize("ckpt,K,mode", [("tiny1", 0, "eagle"), ("tiny1", 1, "eagle"), ("tiny1", 3, "eagle"),
                                         ("tiny3", 2, "eagle"), ("tiny3", 4, "eagle"), ("tiny3", 2, "vanilla"),
                                         ("tiny3", 3, "vanilla")])
def test_native_step_is_token_exact_and_drafts_as_eager(models, ckpt, K, mode) -> None:
    """Batches of 1..4 rows, requests finishing at different times: the output equals greedy without MTP, and
    every step's drafts and statistics equal the general path's (Eagle's and Vanilla's drafters)."""
    model = models[ckpt]
    prompts = PROMPTS[:7]
    params = [greedy(MAX_TOKENS - 3 * (i % 3)) for i in range(len(prompts))]
    drafts, stats = [], []
    for eng in engines(model, nextn=K, mode=mode, max_batch_size=4):
        drafts.append(drafts_per_step(eng))
        seqs = run_to_end(eng, prompts, params)
        for p, s, sp in zip(prompts, seqs, params):
            assert s.output_ids == reference(model, p, sp.max_tokens)
        stats.append((eng.stats.num_draft_proposed, eng.stats.num_draft_accepted, eng.num_steps))
    assert eng.paths.native_step is not None and eng.paths.native_step.num_replays > 0
    assert drafts[1] == drafts[0] and stats[1] == stats[0]
    if K:
        assert 0 < eng.stats.num_draft_accepted < eng.stats.num_draft_proposed
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


@pytest.mark.parametrize("ckpt,K,schedule", [("tiny1", 1, None), ("tiny1", 3, None), ("tiny3", 4, None),
                                              ("tiny3", 3, {1: 3, 2: 1, 4: 2})])
def test_the_native_eagle_draft_equals_the_drafters_chain(models, ckpt, K, schedule) -> None:
    """mtp_core::eagle_draft (forward 1 and the whole chain in one call: the Eagle drafter on the native decoder)
    against the drafter's own chain of one op call per forward and per LM head, on the general path (so every
    step drafts through the drafter: prompts, rows that accepted 0..K drafts, ragged batches and, with a
    batch-size schedule, rows given fewer drafts): the same drafts in every step, bitwise the same MTP cache,
    the output of greedy decoding without MTP."""
    model = models[ckpt]
    prompts = PROMPTS[:7]
    params = [greedy(MAX_TOKENS - 3 * (i % 3)) for i in range(len(prompts))]
    runs, calls = [], []
    spec = None if schedule is None else dict(draft_len_schedule=schedule)
    for native in (False, True):
        eng = make_engine(model, nextn=K, mode="eagle", max_batch_size=4, native_step=False,
                          overlap_scheduler_on_cpu=False, spec=spec)
        runner = eng.spec.drafter.runner
        assert runner.native is not None
        if native:
            real = runner.eagle_drafts
            runner.eagle_drafts = lambda rows, limits, _real=real: calls.append(len(rows)) or _real(rows, limits)
        else:
            runner.native = None                    # the chain of per-forward calls
        log = drafts_per_step(eng)
        seqs = run_to_end(eng, prompts, params)
        assert [s.output_ids for s in seqs] == [reference(model, p, sp.max_tokens) for p, sp in zip(prompts, params)]
        runs.append((log, eng.caches[model.num_main_layers].clone()))
    assert runs[1][0] == runs[0][0]
    assert torch.equal(runs[1][1], runs[0][1])
    assert len(calls) > len(prompts) and max(calls) > 1     # prompts and decode steps, batches of several rows


def test_the_native_eagle_draft_refuses_bad_rows(models) -> None:
    """One-line errors, nothing written past the table: a row that reaches past its block table, a token outside
    the vocabulary, a row that wants no draft, a module that is not an MTP layer."""
    eng = make_engine(models["tiny1"], nextn=2, mode="eagle", native_step=False, overlap_scheduler_on_cpu=False)
    nd = eng.spec.drafter.runner.native
    H, page = nd.weights.dims["hidden"], eng.blocks.tokens_per_block
    op = torch.ops.mtp_core.eagle_draft

    def call(ids, start, drafts, table=(0,), layer=nd.num_main):
        return op(nd.handle, torch.tensor(ids), torch.zeros(len(ids), H), torch.tensor([0, len(ids)], dtype=torch.int32),
                  torch.tensor([start]), torch.tensor([list(table)], dtype=torch.int32),
                  torch.tensor([drafts], dtype=torch.int32), eng.caches, nd.rope_cos, nd.rope_sin, layer)
    assert call([3, 4], 0, 2).shape == (1, 2)                      # the premise: a good row drafts
    with pytest.raises(RuntimeError, match="reaches position"):
        call([3, 4], page - 2, 2)                                   # its chain's last draft is one block on
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        call([3, nd.vocab], 0, 1)
    with pytest.raises(RuntimeError, match="wants 0 drafts"):
        call([3], 0, 0)
    with pytest.raises(RuntimeError, match="must be an MTP module"):
        call([3], 0, 1, layer=0)


@pytest.mark.parametrize("spec", [dict(draft_len_schedule={1: 3, 2: 1, 4: 0}),
                                  dict(acceptance_window=2, acceptance_length_threshold=3.5)])
def test_native_step_with_per_row_draft_limits(models, spec) -> None:
    """Rows with fewer drafts than K (a batch-size schedule, a paused window): ragged rows in one call, and
    rows whose MTP caches lag take the general path until they catch up; output and drafts as eager."""
    model = models["tiny3"]
    prompts = PROMPTS[:6]
    outs, drafts = [], []
    for eng in engines(model, nextn=3, mode="eagle", max_batch_size=4, spec=spec):
        drafts.append(drafts_per_step(eng))
        outs.append([s.output_ids for s in run_to_end(eng, prompts, greedy(MAX_TOKENS))])
    assert outs[0] == outs[1] == [reference(model, p, MAX_TOKENS) for p in prompts]
    assert drafts[0] == drafts[1] and eng.paths.native_step.num_replays > 0


def test_relaxed_thinking_and_sampled_take_the_general_path(models) -> None:
    model = models["tiny1"]
    spec = dict(use_relaxed_acceptance_for_thinking=True, relaxed_topk=5, relaxed_delta=0.3)
    prompts = [[100, THINK_IDS[0], 200], [40, THINK_IDS[0], 41, 42]]
    outs = []
    for eng in engines(model, nextn=3, mode="eagle", max_batch_size=2, spec=spec):
        outs.append([s.output_ids for s in run_to_end(eng, prompts, greedy(MAX_TOKENS))])
    assert outs[0] == outs[1] and eng.paths.native_step.num_replays == 0        # every row is thinking: relaxed
    _, eng = engines(model, nextn=2, mode="eagle", max_batch_size=2)
    run_to_end(eng, PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0.8, seed=3))
    assert eng.paths.native_step.num_replays == 0


@pytest.mark.parametrize("mode,K", [("eagle", 3), ("vanilla", 3)])
def test_native_step_with_the_confidence_gate_drafts_as_eager(models, mode, K) -> None:
    """The confidence gate inside the call: each chain stops where the eager drafter's stops (the same drafts
    every step, ragged across rows), and the output is plain greedy."""
    from test_adaptive import confident

    model = confident(models["tiny3"])
    prompts = PROMPTS[:6]
    drafts, stats = [], []
    for eng in engines(model, nextn=K, mode=mode, max_batch_size=4, spec=dict(draft_confidence_threshold=0.3)):
        drafts.append(drafts_per_step(eng))
        seqs = run_to_end(eng, prompts, greedy(MAX_TOKENS))
        assert [s.output_ids for s in seqs] == [reference(model, p, MAX_TOKENS) for p in prompts]
        stats.append((eng.stats.num_draft_proposed, eng.stats.num_draft_accepted))
    assert eng.paths.native_step.num_replays > 0 and drafts[0] == drafts[1] and stats[0] == stats[1]
    lengths = {len(d) for step in drafts[1] for d in step}
    assert len(lengths) > 1 and 0 < stats[1][0] < K * sum(len(step) for step in drafts[1]), \
        f"the gate never stopped a chain (draft lengths {lengths})"


def test_native_step_refuses_bad_tables(models) -> None:
    model = models["tiny1"]
    _, eng = engines(model, nextn=2, mode="eagle", max_batch_size=1)
    nd = model.native
    args = dict(ids=torch.tensor([5, 6, 7]), qs=torch.tensor([0, 3], dtype=torch.int32), start=torch.tensor([40]),
                nd_=torch.tensor([2], dtype=torch.int32))
    table = torch.tensor([[0, -1, -1, -1, -1, -1, -1]], dtype=torch.int32)    # position 40 needs block 5
    with pytest.raises(RuntimeError, match="not a cache block|beyond"):
        torch.ops.mtp_core.mtp_step(nd.handle, args["ids"], args["qs"], args["start"], table, args["nd_"],
                                    eng.caches, nd.rope_cos, nd.rope_sin, model.num_main_layers)
    with pytest.raises(RuntimeError, match="mtp_layer"):
        torch.ops.mtp_core.mtp_step(nd.handle, args["ids"], args["qs"], args["start"], table, args["nd_"],
                                    eng.caches, nd.rope_cos, nd.rope_sin, 0)


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_native_step_under_the_cost_policy_is_lossless(models, mode) -> None:
    """The default draft-length policy (measured costs) with the native step: each row's next drafts are the
    count the policy chose last, cut to its new choice; greedy output stays exactly plain greedy."""
    model = models["tiny3"]
    prompts = PROMPTS[:6]
    _, eng = engines(model, nextn=3, mode=mode, max_batch_size=4, spec=dict(draft_len_policy="cost"))
    assert not eng.paths.native_step.fixed_counts
    seqs = run_to_end(eng, prompts, greedy(MAX_TOKENS))
    assert [s.output_ids for s in seqs] == [reference(model, p, MAX_TOKENS) for p in prompts]
    assert eng.paths.native_step.num_replays > 0


def test_native_vanilla_step_refuses_short_windows(models) -> None:
    """MTP Vanilla's module 1 re-reads up to K - 1 stored positions, a lagging row its lagging ones: a window
    shorter than that is refused before anything is written."""
    model = models["tiny3"]
    _, eng = engines(model, nextn=3, mode="vanilla", max_batch_size=1)
    nd = model.native
    H = model.config.hidden_size
    table = torch.arange(8, dtype=torch.int32)[None]

    def call(w, valid=10, num_drafts=3, ids=(5, 6, 7, 8)):
        return torch.ops.mtp_core.mtp_step(
            nd.handle, torch.tensor(ids), torch.tensor([0, len(ids)], dtype=torch.int32), torch.tensor([10]),
            table, torch.tensor([num_drafts], dtype=torch.int32), eng.caches, nd.rope_cos, nd.rope_sin,
            model.num_main_layers, 3, torch.full((w,), 3, dtype=torch.long), torch.zeros(w, H),
            torch.tensor([w], dtype=torch.int32), torch.tensor([valid]))
    with pytest.raises(RuntimeError, match="window of 1 positions"):
        call(1)
    with pytest.raises(RuntimeError, match="window of 2 positions"):
        call(2, valid=7)                                  # positions 7..9 lag: 3 stored ones needed
    out, hidden, window, _, _ = call(2)
    assert out.shape == (1, 1 + 4 + 3) and hidden.shape == (4, H) and window.shape == (1, 3, H)
    out, _, window, _, _ = call(0, num_drafts=0)                # no drafts: no MTP forward, no window needed
    assert (out[0, 5:] == -1).all() and window.numel() == 0
    with pytest.raises(RuntimeError, match="wants 4 drafts from 3"):
        call(2, num_drafts=4, ids=(5,))


def test_native_step_lets_rows_without_drafts_lag_and_catches_them_up(models) -> None:
    """Rows given 0 drafts run no MTP forward inside the call (their caches lag, their hidden states wait in
    seq.mtp.pending) and catch up inside a later call: the output stays plain greedy, for both drafting modes."""
    from test_mtp_decoding import _check_caches

    model = models["tiny3"]
    prompts = PROMPTS[:4]
    for mode in ("eagle", "vanilla"):
        _, eng = engines(model, nextn=3, mode=mode, max_batch_size=4, spec=dict(draft_len_policy="cost"))
        pattern = {}

        def choose(rows, in_flight, eng=eng):     # per row and step: 0, 0, K, 0, 2, K, ... (ragged, lagging)
            out = []
            for r in rows:
                n = pattern[r.seq.request_id] = pattern.get(r.seq.request_id, -1) + 1
                k = [0, 0, 3, 0, 2, 3, 1][(n + r.seq.request_id) % 7] if r.needs_drafts else 0
                r.seq.mtp.draft_len = k
                out.append(k)
            return out
        eng.spec.policy.choose = choose
        lagged = []
        run = eng.paths.native_step.run

        def recording(rows, run=run):
            limits = eng.paths.native_step._limits_of(rows)
            lagged.append(sum(1 for r, n in zip(rows, limits) if r.seq.mtp.num_valid < r.start and n))
            return run(rows)
        eng.paths.native_step.run = recording
        seqs = [eng.add_request(p, greedy(MAX_TOKENS)) for p in prompts]
        checked = 0
        while eng.has_unfinished():
            n = len(lagged)
            eng.step()
            if len(lagged) > n and lagged[-1]:        # a native step caught rows up: their caches are exact
                up = [s for s in seqs if not s.is_finished and s.mtp.num_valid == s.kv.num_cached]
                _check_caches(model, eng, up, mode, 3)
                checked += len(up)
        assert [s.output_ids for s in seqs] == [reference(model, p, MAX_TOKENS) for p in prompts], mode
        assert sum(lagged) > 0 and checked > 0, f"{mode}: no native step caught a lagging row up"
        assert eng.stats.num_draft_accepted > 0


# ---- rows that need their logits stay on the call ---------------------------------------------------------------

LOGITS_KINDS = [greedy(MAX_TOKENS, logprobs=5), greedy(MAX_TOKENS, logprobs=0, frequency_penalty=1.5),
                greedy(MAX_TOKENS, presence_penalty=2.0, logprobs=2),
                greedy(MAX_TOKENS, repetition_penalty=1.8, logit_bias={208: -100.0, 453: -100.0, 77: 0.5}),
                SamplingParams(max_tokens=MAX_TOKENS, min_tokens=6, logit_bias={2: 8.0}, logprobs=1),
                greedy(MAX_TOKENS, frequency_penalty=-0.5, presence_penalty=0.5, repetition_penalty=1.3, logprobs=20),
                greedy(MAX_TOKENS)]


def on_the_call(eng) -> list[int]:
    """Counts the pure-decode steps the general path's runner ran (none may: they all belong to the native call)."""
    general = [0]
    execute = eng.paths.runner.execute

    def recording(rows, meta=None):
        general[0] += all(not r.is_prefill for r in rows)
        return execute(rows, meta)
    eng.paths.runner.execute = recording
    return general


@pytest.mark.parametrize("ckpt,K,mode", [("tiny1", 0, "eagle"), ("tiny1", 3, "eagle"), ("tiny3", 2, "eagle"),
                                         ("tiny3", 3, "vanilla")])
def test_rows_that_need_logits_stay_on_the_native_step_and_equal_plain_decoding(models, ckpt, K, mode) -> None:
    """A batch mixing logprobs (top 0..20), every penalty, logit_bias and min_tokens with plain rows: every decode
    step is one native call, and each request's tokens and float32 logprobs are bitwise those of the general path
    with the same settings, and of plain decoding alone without MTP."""
    model = models[ckpt]
    plist = [LOGITS_KINDS[i % len(LOGITS_KINDS)] for i in range(len(PROMPTS))]
    general, native = engines(model, nextn=K, mode=mode, max_batch_size=8)
    runs = []
    for eng in (general, native):
        seqs = run_to_end(eng, PROMPTS, plist)
        runs.append([(s.output_ids, s.returned.logprobs) for s in seqs])
    assert runs[0] == runs[1]
    seen = on_the_call(native)
    seqs = run_to_end(native, PROMPTS, plist)
    assert [(s.output_ids, s.returned.logprobs) for s in seqs] == runs[1]
    assert seen[0] == 0 and native.paths.native_step.num_replays > 0
    for p, sp, s in zip(PROMPTS, plist, seqs):
        alone = run_to_end(make_engine(model, max_batch_size=1), [p], sp)[0]
        assert s.output_ids == alone.output_ids and s.returned.logprobs == alone.returned.logprobs
        if sp.logprobs is not None:
            assert len(s.returned.logprobs) == len(s.output_ids) > 0
    if K:
        assert native.stats.num_draft_accepted > 0


def test_rows_that_need_logits_verify_in_one_call_on_the_general_step(models) -> None:
    """When the whole step cannot run as one call (step_for refuses: here always), a greedy batch still runs its
    target forward and verification as one call (NativeStep.target), then the eager drafter; rows with logprobs
    and penalties included, under a policy that lets rows lag: output and logprobs stay those of plain decoding."""
    model = models["tiny3"]
    prompts = PROMPTS[:4]
    plist = [greedy(MAX_TOKENS, logprobs=3, frequency_penalty=0.7), greedy(MAX_TOKENS, logprobs=1),
             greedy(MAX_TOKENS, repetition_penalty=1.4), greedy(MAX_TOKENS)]
    for mode in ("eagle", "vanilla"):
        _, eng = engines(model, nextn=3, mode=mode, max_batch_size=4, spec=dict(draft_len_policy="cost"))
        eng.paths.native_step.step_for = lambda rows: None
        # the drafter then runs apart from the target's call; and a draft priced below this model's bytes (its
        # MTP module reads about what a main layer does) so that rows draft from the first steps, as the test needs
        eng.spec.policy.costs.prior = CostPrior(draft_share=0.1)
        targets = [0]
        target = eng.paths.native_step.target

        def counting(rows, target=target):
            targets[0] += 1
            return target(rows)
        eng.paths.native_step.target = counting
        seen = on_the_call(eng)
        seqs = run_to_end(eng, prompts, plist)
        for p, sp, s in zip(prompts, plist, seqs):
            alone = run_to_end(make_engine(model, max_batch_size=1), [p], sp)[0]
            assert s.output_ids == alone.output_ids and s.returned.logprobs == alone.returned.logprobs, mode
        assert seen[0] == 0 and targets[0] > 0 and eng.stats.num_draft_accepted > 0


def test_logprob_ties_are_ordered_as_the_general_path(tiny1_dir, tmp_path) -> None:
    """A checkpoint whose LM head repeats every even token's row for the next odd token: every logit, and so every
    log-probability, comes in tied pairs, and each top-N list holds ties (ordered by id) and, with N odd, a pair
    cut at its end (torch's topk decides which one stays). The native step's logprobs equal the general path's."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mtp_core.loader import load_model
    from mtp_core.model import DeepseekV3ForCausalLM

    ckpt = tmp_path / "tied"
    shutil.copytree(tiny1_dir, ckpt)
    state = load_file(str(ckpt / "model.safetensors"))
    head = state["lm_head.weight"].clone()
    head[1::2] = head[0::2]
    state["lm_head.weight"] = head
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    model = load_model(ckpt, "float32", make_model=DeepseekV3ForCausalLM)[0]
    plist = [greedy(12, logprobs=n) for n in (1, 2, 3, 5, 8)]
    runs = []
    for eng in engines(model, nextn=1, mode="eagle", max_batch_size=5):
        runs.append([s.returned.logprobs for s in run_to_end(eng, PROMPTS[:5], plist)])
    assert eng.paths.native_step.num_replays > 0 and runs[0] == runs[1]
    tops = [e[2] for row in runs[1] for e in row]
    assert any(a[1] == b[1] and a[0] + 1 == b[0] for t in tops for a, b in zip(t, t[1:])), "no tied pair"

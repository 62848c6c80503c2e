"""The paged batched engine: batching invariance, chunked prefill, preemption, leaks, abort, errors.

Every expectation is the greedy output of one request decoded alone without MTP (`conftest.reference`),
so any batching, chunking, preemption or speculation effect shows up as a token difference.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import PROMPTS, OracleDrafter, greedy, make_engine, reference, run_to_end
from mtp_core.engine.engine import Engine
from mtp_core.sampling import SamplingParams

torch.set_num_threads(1)

MAX_TOKENS = 16
SPECS = {                      # name -> (checkpoint, nextn, mode)
    "nextn0": ("tiny1", 0, "auto"),
    "eagle2": ("tiny1", 2, "eagle"),
    "vanilla3": ("tiny3", 3, "vanilla"),
}
PARAMS = [greedy(MAX_TOKENS - i % 4) for i in range(len(PROMPTS))]      # mixed lengths 13..16


def expected(model, params=PARAMS) -> list[list[int]]:
    return [reference(model, p, sp.max_tokens) for p, sp in zip(PROMPTS, params)]


def assert_pool_clean(eng: Engine) -> None:
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    # free or cached-and-unreferenced (reclaimable): every block exactly once
    assert sorted([*eng.blocks.free_blocks, *eng.blocks.lru]) == list(range(eng.blocks.num_blocks))
    assert all(c == 0 for c in eng.blocks.ref_counts)


# ---- batching invariance ---------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("batch", [8, 3])
@pytest.mark.parametrize("spec", list(SPECS))
def test_batched_equals_one_at_a_time(models, tiny1_dir, tiny3_dir, make_llm, spec, batch, chunked, overlap):
    ckpt, nextn, mode = SPECS[spec]
    model_dir = {"tiny1": tiny1_dir, "tiny3": tiny3_dir}[ckpt]
    llm = make_llm(model_dir, nextn=nextn, mode=mode, max_batch_size=batch, enable_chunked_prefill=chunked,
                   max_num_tokens=16 if chunked else 8192, disable_overlap_scheduler=not overlap)
    assert llm.engine.overlap == (overlap and nextn > 0)
    outs = llm.generate(PROMPTS, PARAMS)
    want = expected(models[ckpt])
    assert [o.token_ids for o in outs] == want
    assert [o.text for o in outs] == [llm.tokenizer.decode(w) for w in want]
    assert_pool_clean(llm.engine)
    if nextn:
        assert llm.engine.stats.num_draft_accepted > 0


def test_prefill_asks_for_the_last_outputs_only_where_nothing_reads_the_others(tiny3_model):
    """Without MTP nothing reads a prompt position's hidden state but the last one's: the runner asks the forward for
    each row's last output (chunked prompts and decode rows alike), unless a row wants prompt logprobs; with MTP it
    asks for every output (the MTP forward reads each prompt position's). Greedy text and prompt logprobs are the
    same numbers either way."""
    asked: list[str] = []
    ps = [greedy(6), greedy(6, prompt_logprobs=2)]
    results = {}
    for nextn in (0, 2):
        eng = make_engine(tiny3_model, nextn=nextn, max_batch_size=2, enable_chunked_prefill=True,
                          max_num_tokens=8)
        forward = eng.paths.runner.path.forward

        def spying(ids, meta, caches, outputs="all", forward=forward):
            asked.append((nextn, outputs))
            return forward(ids, meta, caches, outputs)
        eng.paths.runner.path.forward = spying
        asked.clear()
        seqs = run_to_end(eng, PROMPTS[:2], greedy(6))
        assert {o for _, o in asked} == ({"last"} if nextn == 0 else {"all"}), asked
        assert [s.output_ids for s in seqs] == [reference(tiny3_model, p, 6) for p in PROMPTS[:2]]
        asked.clear()
        results[nextn] = run_to_end(eng, PROMPTS[2:4], ps)
        assert "all" in {o for _, o in asked}, asked            # a batch with a prompt-logprobs row
    for a, b in zip(results[0], results[2]):
        assert a.output_ids == b.output_ids and a.returned.prompt_logprobs == b.returned.prompt_logprobs


def test_staggered_arrivals_equal_one_at_a_time(tiny3_model):
    """In-flight batching: a new request joins every step while the others are decoding."""
    model = tiny3_model
    eng = make_engine(model, nextn=2, mode="vanilla", max_batch_size=4, enable_chunked_prefill=True,
                      max_num_tokens=12)
    seqs, pending = [], list(zip(PROMPTS, PARAMS))
    while pending or eng.has_unfinished():
        if pending:
            p, sp = pending.pop(0)
            seqs.append(eng.add_request(p, sp))
        eng.step()
    assert [s.output_ids for s in seqs] == expected(model)
    assert_pool_clean(eng)


def test_seeded_sampling_is_batch_invariant(tiny1_model):
    """A seeded request samples the same tokens alone and inside a batch of other sampled requests."""
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True)

    for nextn in (0, 2):
        alone = run_to_end(make_engine(tiny1_model, nextn=nextn, mode="eagle"), [PROMPTS[3]], params(5))[0]
        batch = run_to_end(make_engine(tiny1_model, nextn=nextn, mode="eagle"), [PROMPTS[1], PROMPTS[5], PROMPTS[3]],
                           [params(1), SamplingParams(max_tokens=9, temperature=1.2, ignore_eos=True), params(5)])
        assert batch[2].output_ids == alone.output_ids


def test_stop_token_ids_inside_blocks_match_baseline(tiny1_model):
    refs = [reference(tiny1_model, p, MAX_TOKENS) for p in PROMPTS]
    stop = sorted({r[5] for r in refs})
    params = SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=stop)
    want = [r[: next(i for i, t in enumerate(r) if t in stop)] for r in refs]
    for nextn in (0, 3):
        seqs = run_to_end(make_engine(tiny1_model, nextn=nextn, mode="eagle"), PROMPTS, params)
        assert [s.output_ids for s in seqs] == want
        assert all(s.finish_reason == "stop" for s in seqs)


def test_generate_refuses_a_params_list_of_the_wrong_length(tiny1_dir, make_llm):
    llm = make_llm(tiny1_dir)
    with pytest.raises(ValueError):
        llm.generate(PROMPTS[:3], [greedy(4)] * 2)


def test_chunked_prefill_really_chunks(tiny1_model):
    """max_num_tokens=16: the 23-token prompt needs two target forwards before its first token."""
    eng = make_engine(tiny1_model, enable_chunked_prefill=True, max_num_tokens=16)
    seq = eng.add_request(PROMPTS[5], greedy(4))
    eng.step()
    assert seq.kv.num_prefilled == 16 and seq.output_ids == [] and seq.kv.num_cached == 16
    eng.step()
    assert seq.kv.num_cached == 23 and seq.output_ids == reference(tiny1_model, PROMPTS[5], 4)[:1]
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == reference(tiny1_model, PROMPTS[5], 4)


# ---- preemption ------------------------------------------------------------------------------

@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("spec", list(SPECS))
def test_preemption_keeps_outputs(models, spec, chunked):
    ckpt, nextn, mode = SPECS[spec]
    model = models[ckpt]
    eng = make_engine(model, nextn=nextn, mode=mode, max_tokens_kv=64, tokens_per_block=4, max_batch_size=8,
                      enable_chunked_prefill=chunked, max_num_tokens=16 if chunked else 8192)
    seqs = run_to_end(eng, PROMPTS, PARAMS)
    assert eng.scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == expected(model)
    assert_pool_clean(eng)


def test_preempted_request_longer_than_max_num_tokens_finishes(tiny1_model):
    eng = make_engine(tiny1_model, max_num_tokens=16, max_tokens_kv=48, tokens_per_block=4)
    prompts = [PROMPTS[3], PROMPTS[6], PROMPTS[4]]
    seqs = [eng.add_request(p, greedy(14)) for p in prompts]
    for _ in range(200):
        if not eng.has_unfinished():
            break
        eng.step()
    assert eng.scheduler.num_preemptions > 0
    assert not eng.has_unfinished()
    assert [s.output_ids for s in seqs] == [reference(tiny1_model, p, 14) for p in prompts]


def test_prompt_longer_than_max_num_tokens_without_chunking(tiny1_model):
    eng = make_engine(tiny1_model, max_num_tokens=16)
    try:
        seq = eng.add_request(PROMPTS[5], greedy(4))                  # 23 tokens
    except ValueError as e:
        assert "max_num_tokens" in str(e)
        return
    for _ in range(50):
        if not eng.has_unfinished():
            break
        eng.step()
    assert seq.output_ids == reference(tiny1_model, PROMPTS[5], 4)


def test_request_outgrowing_the_whole_pool(tiny1_model, tiny1_dir, make_llm):
    eng = make_engine(tiny1_model, max_tokens_kv=24, tokens_per_block=4, nextn=2, mode="eagle")
    with pytest.raises(ValueError, match="KV"):
        eng.add_request(PROMPTS[5], greedy(4))                           # 23 + 1 + 2K > 24
    llm = make_llm(tiny1_dir, max_tokens_kv=24, tokens_per_block=4)
    out = llm.generate([PROMPTS[4]], greedy(40))[0]                      # fits at first, not at the end
    assert out.finish_reason == "length" and 0 < len(out.token_ids) < 40
    assert len(PROMPTS[4]) + len(out.token_ids) <= 24 + 1   # the newest token needs no KV slot yet
    assert_pool_clean(llm.engine)


# ---- leaks: exceptions and abort -------------------------------------------------------------

class FailOnce:
    """Wraps a callable; the n-th call raises RuntimeError, every other call passes through."""

    def __init__(self, fn, n: int) -> None:
        self.fn, self.n, self.calls = fn, n, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("injected failure")
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("where,n", [("runner", 1), ("runner", 4), ("drafter", 2), ("drafter", 5)])
def test_exception_mid_step_frees_blocks(tiny1_model, where, n):
    model = tiny1_model
    eng = make_engine(model, nextn=2, mode="eagle", max_batch_size=3, tokens_per_block=4)
    if where == "runner":
        eng.paths.runner.execute = FailOnce(eng.paths.runner.execute, n)
    else:
        eng.spec.drafter.propose = FailOnce(eng.spec.drafter.propose, n)
    seqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    with pytest.raises(RuntimeError, match="injected"):
        while eng.has_unfinished():
            eng.step()
    aborted = [s for s in seqs if s.finish_reason == "abort"]
    assert aborted and all(s.is_finished and s.kv.block_table == [] for s in aborted)
    while eng.has_unfinished():
        eng.step()
    assert_pool_clean(eng)
    want = expected(model)
    for i, s in enumerate(seqs):
        if s.finish_reason != "abort":                                   # the others are unaffected
            assert s.output_ids == want[i]


def test_exception_through_llm_generate_frees_blocks(tiny1_dir, make_llm):
    llm = make_llm(tiny1_dir, nextn=1, mode="eagle", tokens_per_block=4)
    llm.engine.spec.drafter.propose = FailOnce(llm.engine.spec.drafter.propose, 3)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(PROMPTS, PARAMS)
    assert not llm.engine.has_unfinished()
    assert_pool_clean(llm.engine)


def test_abort_running_and_waiting_requests(tiny3_model):
    model = tiny3_model
    eng = make_engine(model, nextn=3, mode="vanilla", max_batch_size=3, tokens_per_block=4)
    seqs = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    eng.step()
    eng.step()
    running, waiting = seqs[1], seqs[6]
    assert running.kv.block_table and not waiting.kv.block_table
    eng.abort(running)
    eng.abort(waiting)
    assert running.finish_reason == waiting.finish_reason == "abort" and running.kv.block_table == []
    while eng.has_unfinished():
        eng.step()
    assert_pool_clean(eng)
    want = expected(model)
    for i, s in enumerate(seqs):
        if i not in (1, 6):
            assert s.output_ids == want[i]
    assert len(waiting.output_ids) == 0 and len(running.output_ids) < len(want[1])


def test_abort_after_finish_is_a_no_op(tiny1_model):
    eng = make_engine(tiny1_model)
    seq = run_to_end(eng, [PROMPTS[2]], greedy(3))[0]
    assert seq.finish_reason == "length"
    eng.abort(seq)
    assert seq.finish_reason == "length" and seq.output_ids == reference(tiny1_model, PROMPTS[2], 3)
    assert_pool_clean(eng)


# ---- property test through the real engine ---------------------------------------------------

@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(K=st.integers(1, 3), tpb=st.sampled_from([1, 2, 4]), batch=st.integers(1, 4),
       pattern=st.lists(st.integers(0, 3), min_size=1, max_size=6),
       lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4),
       chunked=st.booleans(), overlap=st.booleans())
def test_engine_random_acceptance_patterns(tiny1_model, K, tpb, batch, pattern, lengths, chunked, overlap):
    model = tiny1_model
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))]
    step_of: dict[int, int] = {}

    def num_right(seq) -> int:
        i = step_of.get(seq.request_id, 0)
        step_of[seq.request_id] = i + 1
        return pattern[(i + seq.request_id) % len(pattern)]

    oracle = OracleDrafter(K, model.config.vocab_size, num_right)
    eng = make_engine(model, nextn=K, mode="eagle", drafter=oracle, tokens_per_block=tpb, max_batch_size=batch,
                      max_tokens_kv=160, enable_chunked_prefill=chunked, max_num_tokens=8 if chunked else 8192,
                      disable_overlap_scheduler=not overlap)
    seqs = []
    for p, n in zip(prompts, lengths):
        s = eng.add_request(p, greedy(n))
        oracle.futures[s.request_id] = p + reference(model, p, 20)
        seqs.append(s)
    while eng.has_unfinished():
        eng.step()
        for s in seqs:
            if not s.is_finished and not overlap:
                assert len(s.kv.block_table) == eng.blocks.blocks_for(s.kv.num_cached)
            elif not s.is_finished:   # the overlap scheduler may already hold the next step's reservation
                need = max(s.kv.num_cached + 2 * K, s.kv.num_prefilled + (8 if chunked else len(s.all_ids)) + K)
                assert eng.blocks.blocks_for(s.kv.num_cached) <= len(s.kv.block_table) <= eng.blocks.blocks_for(need)
        held = sum(len(s.kv.block_table) for s in seqs)
        assert held + eng.blocks.num_free_blocks == eng.blocks.num_blocks
    assert [s.output_ids for s in seqs] == [reference(model, p, 20)[:n] for p, n in zip(prompts, lengths)]
    assert_pool_clean(eng)


def test_close_stops_the_overlap_worker(tiny1_dir, make_llm):
    """close() joins the overlap scheduler's worker thread at once, even while something still holds the
    engine (without it the thread lives until the engine is garbage-collected)."""
    import gc
    import threading
    import time

    def workers() -> int:
        return sum(t.name.startswith("mtp-overlap") and t.is_alive() for t in threading.enumerate())

    # an engine of an earlier test that is garbage but not yet collected (a reference cycle: a test that patched
    # eng.step) keeps its worker until a collection; let it go first, or it may go in the middle of this test
    gc.collect()
    for _ in range(200):
        if not workers():
            break
        time.sleep(0.01)
    before = workers()
    llm = make_llm(tiny1_dir, nextn=2, mode="eagle")
    assert llm.engine.overlap
    llm.generate(["a b"], greedy(6))
    assert workers() == before + 1
    engine = llm.engine
    llm.close()
    assert workers() == before
    assert engine.overlap

"""The static decode step behind cuda_graph_config (mtp_core/engine/static_step.py), run eagerly on the
CPU over its static buffers: target forward, verification and the K Eagle draft forwards with fixed
shapes, padded batches and a scratch block. It must give token-for-token the eager engine's output.
Capture and replay on a GPU: tests/test_kernels_gpu.py (marked gpu)."""
from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS, THINK_IDS, greedy, make_engine, reference, run_to_end
from mtp_core.config import CudaGraphConfig
from mtp_core.engine.static_step import default_batch_sizes
from mtp_core.sampling import SamplingParams
from mtp_core.speculative.verifier import Relaxed

torch.set_num_threads(1)
MAX_TOKENS = 24


def graphs(*sizes: int, padding: bool = True) -> CudaGraphConfig:
    return CudaGraphConfig(batch_sizes=list(sizes) or None, enable_padding=padding)


def test_default_batch_sizes() -> None:
    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(6) == [1, 2, 4, 6]
    assert default_batch_sizes(8) == [1, 2, 4, 8]


def drafts_per_step(eng) -> list[list[list[int]]]:
    """Records every row's next drafts after each step (what the drafter, eager or static, proposed)."""
    log: list[list[list[int]]] = []
    step = eng.step

    def recording():
        done = step()
        log.append([list(s.mtp.drafts) for s in sorted(done, key=lambda s: s.request_id) if not s.is_finished])
        return done
    eng.step = recording
    return log


@pytest.mark.parametrize("ckpt,K", [("tiny1", 0), ("tiny1", 1), ("tiny1", 3), ("tiny3", 2), ("tiny3", 4)])
def test_static_step_is_token_exact_and_drafts_as_eager(models, ckpt, K) -> None:
    """Batches of 1..4 rows padded to captured sizes 1, 2, 4 (requests finish at different times): the
    output equals greedy without MTP, and every step's drafts equal the eager Eagle drafter's."""
    model = models[ckpt]
    prompts = PROMPTS[:7]
    params = [greedy(MAX_TOKENS - 3 * (i % 3)) for i in range(len(prompts))]
    drafts, stats = [], []
    for cg in (None, graphs(1, 2, 4)):
        eng = make_engine(model, nextn=K, mode="eagle", max_batch_size=4, cuda_graph_config=cg)
        drafts.append(drafts_per_step(eng))
        seqs = run_to_end(eng, prompts, params)
        for p, s, sp in zip(prompts, seqs, params):
            assert s.output_ids == reference(model, p, sp.max_tokens)
        stats.append((eng.stats.num_draft_proposed, eng.stats.num_draft_accepted, eng.num_steps))
    assert eng.paths.graphs is not None and sorted(eng.paths.graphs.steps) == [1, 2, 4] and eng.paths.graphs.num_replays > 0
    assert drafts[1] == drafts[0] and stats[1] == stats[0]
    if K:
        assert 0 < eng.stats.num_draft_accepted < eng.stats.num_draft_proposed
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks - 1      # only the scratch block is kept


def test_static_and_eager_steps_alternate(models) -> None:
    """Without padding a batch of 3 has no static step (sizes 1, 2, 4): those steps run eagerly, and
    prefill steps always do; the MTP caches stay consistent across the switches."""
    model = models["tiny1"]
    eng = make_engine(model, nextn=3, mode="eagle", max_batch_size=3, cuda_graph_config=graphs(1, 2, padding=False))
    seqs = run_to_end(eng, PROMPTS[2:5], [greedy(MAX_TOKENS), greedy(MAX_TOKENS - 8), greedy(MAX_TOKENS - 12)])
    for p, s in zip(PROMPTS[2:5], seqs):
        assert s.output_ids == reference(model, p, len(s.output_ids))
    assert 0 < eng.paths.graphs.num_replays < eng.num_steps
    eager = make_engine(model, nextn=3, mode="eagle", max_batch_size=3)
    run_to_end(eager, PROMPTS[2:5], [greedy(MAX_TOKENS), greedy(MAX_TOKENS - 8), greedy(MAX_TOKENS - 12)])
    assert eager.stats.num_draft_accepted == eng.stats.num_draft_accepted


def test_relaxed_static_equals_relaxed_eager(models) -> None:
    """Relaxed acceptance (thinking rows) inside the static step decides exactly as the eager verifier."""
    model = models["tiny1"]
    spec = dict(use_relaxed_acceptance_for_thinking=True, relaxed_topk=5, relaxed_delta=0.3)
    prompts = [[100, THINK_IDS[0], 200], [300, 301], [40, THINK_IDS[0], 41, 42]]
    outs = []
    for cg in (None, graphs(1, 2, 4)):
        eng = make_engine(model, nextn=3, mode="eagle", max_batch_size=4, spec=spec, cuda_graph_config=cg)
        outs.append([s.output_ids for s in run_to_end(eng, prompts, greedy(MAX_TOKENS))])
        if cg is not None:
            assert eng.paths.graphs.steps[4].relaxed == Relaxed(5, 0.3) and eng.paths.graphs.num_replays > 0
    assert outs[0] == outs[1]


def test_sampled_rows_and_vanilla_run_eagerly(models) -> None:
    model = models["tiny3"]
    eng = make_engine(model, nextn=2, mode="vanilla", max_batch_size=2, cuda_graph_config=graphs(1, 2))
    assert eng.paths.graphs is None                                            # Vanilla: every step eager
    seqs = run_to_end(eng, PROMPTS[:2], greedy(MAX_TOKENS))
    assert [s.output_ids for s in seqs] == [reference(model, p, MAX_TOKENS) for p in PROMPTS[:2]]
    eng = make_engine(model, nextn=2, mode="eagle", max_batch_size=2, cuda_graph_config=graphs(1, 2))
    run_to_end(eng, PROMPTS[:2], SamplingParams(max_tokens=8, temperature=0.8, seed=3))
    assert eng.paths.graphs.num_replays == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("K", [0, 3])
def test_captured_graphs_equal_eager_on_gpu(tiny1_dir, K) -> None:
    """On a GPU the static step is captured per batch size and replayed: same tokens and drafts as the
    eager GPU engine."""
    from mtp_core.loader import load_model
    from mtp_core.model import DeepseekV3ForCausalLM

    model = load_model(tiny1_dir, "float32", "cuda", make_model=DeepseekV3ForCausalLM)[0]
    outs, stats = [], []
    for cg in (None, graphs(1, 2, 4)):
        eng = make_engine(model, nextn=K, mode="eagle", max_batch_size=4, cuda_graph_config=cg, device="cuda")
        seqs = run_to_end(eng, PROMPTS[:6], greedy(MAX_TOKENS))
        outs.append([s.output_ids for s in seqs])
        stats.append((eng.stats.num_draft_proposed, eng.stats.num_draft_accepted))
    assert all(s.graph is not None for s in eng.paths.graphs.steps.values()) and eng.paths.graphs.num_replays > 0
    assert outs[0] == outs[1] and stats[0] == stats[1]


def test_static_step_never_reads_a_tensor_on_the_host(models, monkeypatch) -> None:
    """What a CUDA graph cannot hold: .item(), .tolist(), bool()/int() of a tensor (data-dependent host
    control flow). The static computation must do none of them (checked on CPU, where it runs eagerly)."""
    model = models["tiny3"]
    eng = make_engine(model, nextn=3, mode="eagle", max_batch_size=2, cuda_graph_config=graphs(2),
                      spec=dict(use_relaxed_acceptance_for_thinking=True, relaxed_topk=4, relaxed_delta=0.5))
    static = eng.paths.graphs.steps[2]
    original = static.forward
    calls = []

    def guarded() -> None:
        def refuse(name):
            def f(self, *a, **k):
                raise AssertionError(f"host read inside the static step: Tensor.{name}")
            return f
        with monkeypatch.context() as mp:
            for name in ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy"):
                mp.setattr(torch.Tensor, name, refuse(name))
            original()
        calls.append(1)
    static.forward = guarded
    seqs = run_to_end(eng, [PROMPTS[3], [100, THINK_IDS[0], 7]], greedy(12))
    assert calls and seqs[0].output_ids == reference(model, PROMPTS[3], 12)


def test_scratch_block_leaves_the_admission_pool(models) -> None:
    """The static step keeps one block for padded rows: a prompt that needs the whole pool is refused at
    admission (one-line error) instead of stalling the scheduler later."""
    model = models["tiny1"]
    prompt = list(range(10, 35))                                          # 25 tokens: needs 25 + 1 + 2K slots
    eager = make_engine(model, nextn=2, mode="eagle", max_tokens_kv=32, tokens_per_block=8, max_batch_size=1)
    run_to_end(eager, [prompt], greedy(2))
    eng = make_engine(model, nextn=2, mode="eagle", max_tokens_kv=32, tokens_per_block=8, max_batch_size=1,
                      cuda_graph_config=graphs(1))
    assert eng.pool_tokens == eager.pool_tokens - 8
    with pytest.raises(ValueError, match="KV slots"):
        eng.add_request(prompt, greedy(2))

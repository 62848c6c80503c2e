"""A draft vocabulary (speculative_config.draft_token_map, speculative/draft_vocab.py): MTP drafts scored over
the LM head's rows of a map's ids only. Lossless whatever the map (the target still scores every id); every
draft inside the map; a map of the whole vocabulary drafts exactly what no map does; the native chains
(mtp_step, eagle_draft) draft what the Python drafter does over the same map; the file and the CLI refuse bad
input in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS, greedy, make_engine, reference, run_to_end
from mtp_core import kernels
from mtp_core.model.forward_path import TorchForward
from mtp_core.native.native_decode import NativeDecoder
from mtp_core.speculative.draft_vocab import frequent_ids, load_token_map
from test_cuda_graphs import drafts_per_step, graphs

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent
MAX_TOKENS = 20
native = pytest.mark.skipif(not kernels.native_ops().cpu, reason=kernels.native_ops().summary)


def write_map(tmp_path: Path, ids, name: str = "map.json") -> str:
    p = tmp_path / name
    p.write_text(json.dumps(list(ids)))
    return str(p)


def a_map(model, tmp_path: Path) -> tuple[str, set[int]]:
    """Ids the reference outputs use, every other id left out beside them: a map that drops tokens the drafts
    would otherwise propose, while the target's own continuations stay draftable."""
    used = {t for p in PROMPTS[:6] for t in reference(model, p, MAX_TOKENS)}
    ids = sorted(used | set(range(0, model.config.vocab_size, 2)))
    return write_map(tmp_path, ids), set(ids)


# ---- the file ------------------------------------------------------------------------------------

def test_a_token_map_file_is_read_sorted_and_checked(tmp_path: Path) -> None:
    assert load_token_map(write_map(tmp_path, [9, 3, 5]), 10).tolist() == [3, 5, 9]
    (tmp_path / "obj.json").write_text(json.dumps({"token_ids": [4, 1], "vocab_size": 10}))
    assert load_token_map(tmp_path / "obj.json", 10).tolist() == [1, 4]
    (tmp_path / "bad.json").write_text("[1, 2")
    bad = [(tmp_path / "none.json", "is not a file"), (tmp_path / "bad.json", "is not JSON"),
           (write_map(tmp_path, [], "e.json"), "non-empty"), (write_map(tmp_path, [1, True], "b.json"), "integer"),
           (write_map(tmp_path, [1, 2.0], "f.json"), "integer"), (write_map(tmp_path, [1, 10], "o.json"), "id 10"),
           (write_map(tmp_path, [-1], "n.json"), "id -1"), (write_map(tmp_path, [3, 1, 3], "d.json"), "id 3 more")]
    for path, needle in bad:
        with pytest.raises(ValueError, match=needle) as e:
            load_token_map(path, 10)
        assert "\n" not in str(e.value) and "draft_token_map" in str(e.value)


def test_frequent_ids_rank_by_count_then_id_and_fill_with_unseen_ids() -> None:
    counts = Counter({7: 5, 2: 5, 9: 8, 4: 1, 11: 3})          # 11 is outside a vocabulary of 10
    assert frequent_ids(counts, 3, 10) == [9, 2, 7]
    assert frequent_ids(counts, 6, 10) == [9, 2, 7, 4, 0, 1]   # unseen ids fill in ascending order
    assert sorted(frequent_ids(counts, 10, 10)) == list(range(10))
    for size in (0, 11):
        with pytest.raises(ValueError, match="size"):
            frequent_ids(counts, size, 10)


# ---- the heads -----------------------------------------------------------------------------------

@native
@pytest.mark.parametrize("layout", ["packed", "direct"])
def test_the_native_draft_head_scores_the_heads_rows_bitwise(models, layout) -> None:
    """draft_logits over a map equals the full head's logits at those columns, bit for bit (each output row is
    computed alone), in both layouts; the decoder it came from and its target head are untouched."""
    model = models["tiny3"]
    nd = NativeDecoder.build(model, layout)
    ids = torch.tensor(sorted(set(range(3, model.config.vocab_size, 3)) | {1}))
    dv = nd.with_draft_vocab(model, ids)
    h = torch.randn(5, model.config.hidden_size)
    full = nd.logits(h)
    assert torch.equal(dv.draft_logits(h), full[:, ids])
    assert torch.equal(dv.logits(h), full) and torch.equal(nd.draft_logits(h), full)
    assert nd.draft_ids is None and torch.equal(dv.draft_ids, ids)
    assert "drafts over a vocabulary of" in dv.handle.summary() and "drafts over" not in nd.handle.summary()


def test_the_torch_draft_head_scores_the_heads_rows(models) -> None:
    model = models["tiny3"]
    ids = torch.tensor([0, 5, 17, 300])
    path = TorchForward(model, ids)
    h = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(path.draft_logits(h), model.compute_logits(h)[:, ids], rtol=1e-6, atol=1e-6)
    assert torch.equal(TorchForward(model).draft_logits(h), model.compute_logits(h))


# ---- decoding ------------------------------------------------------------------------------------

ROUTES = [pytest.param(dict(native_step=True), id="native-step"),
          pytest.param(dict(native_step=False), id="general-native"),
          pytest.param(dict(native_step=False, env={"MTP_CORE_NATIVE_DECODE": "0"}), id="torch")]


def skip_without_native(route: dict) -> None:
    if "env" not in route and not kernels.native_ops().cpu:       # the native routes need the native ops
        pytest.skip(kernels.native_ops().summary)


def engine_with(model, monkeypatch, route: dict, map_path: str | None, **kw):
    for k, v in route.get("env", {}).items():
        monkeypatch.setenv(k, v)
    if route.get("env"):
        monkeypatch.setattr(model, "native", None)
        monkeypatch.setattr(model, "decode_fused", False)
    spec = {"draft_token_map": map_path} if map_path else None
    eng = make_engine(model, native_step=route["native_step"], overlap_scheduler_on_cpu=False, spec=spec, **kw)
    assert eng.paths.forward_path.name == ("torch" if route.get("env") else "native")
    assert (eng.paths.forward_path.draft_ids is None) == (map_path is None)
    return eng


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("ckpt,K,mode", [("tiny1", 3, "eagle"), ("tiny3", 2, "eagle"), ("tiny3", 3, "vanilla")])
def test_drafts_over_a_map_are_lossless_and_inside_it(models, tmp_path, monkeypatch, route, ckpt, K, mode) -> None:
    """Batches of up to 4 rows finishing at different times: greedy output equals greedy without MTP; every
    draft of every step is an id of the map; the map changes what is drafted (drafts outside it are gone)."""
    skip_without_native(route)
    model = models[ckpt]
    path, ids = a_map(model, tmp_path)
    prompts = PROMPTS[:6]
    params = [greedy(MAX_TOKENS - 3 * (i % 3)) for i in range(len(prompts))]
    logs = []
    for m in (None, path):
        eng = engine_with(model, monkeypatch, route, m, nextn=K, mode=mode, max_batch_size=4)
        log = drafts_per_step(eng)
        seqs = run_to_end(eng, prompts, params)
        assert [s.output_ids for s in seqs] == [reference(model, p, sp.max_tokens) for p, sp in zip(prompts, params)]
        logs.append([d for step in log for row in step for d in row])
        assert eng.stats.num_draft_proposed > 0
    assert set(logs[1]) <= ids
    assert not set(logs[0]) <= ids, "the premise: without the map some drafts fall outside it"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_a_map_of_the_whole_vocabulary_drafts_what_no_map_does(models, tmp_path, monkeypatch, route, mode) -> None:
    skip_without_native(route)
    model = models["tiny3"]
    everything = write_map(tmp_path, reversed(range(model.config.vocab_size)))
    prompts = PROMPTS[:5]
    runs = []
    for m in (None, everything):
        eng = engine_with(model, monkeypatch, route, m, nextn=3, mode=mode, max_batch_size=4)
        log = drafts_per_step(eng)
        seqs = run_to_end(eng, prompts, greedy(MAX_TOKENS))
        runs.append((log, [s.output_ids for s in seqs], eng.stats.num_draft_proposed, eng.stats.num_draft_accepted))
    assert runs[1] == runs[0]


@native
@pytest.mark.parametrize("ckpt,K,mode", [("tiny1", 3, "eagle"), ("tiny3", 3, "eagle"), ("tiny3", 3, "vanilla")])
def test_the_native_step_drafts_over_a_map_as_the_general_path(models, tmp_path, ckpt, K, mode) -> None:
    """The native step's chains (mtp_step) and the general path's drafter (the eagle_draft op, or Vanilla's
    module calls and draft_logits) over the same map: the same drafts in every step, the same statistics."""
    model = models[ckpt]
    path, _ = a_map(model, tmp_path)
    prompts = PROMPTS[:7]
    params = [greedy(MAX_TOKENS - 3 * (i % 3)) for i in range(len(prompts))]
    runs = []
    for step in (False, True):
        eng = make_engine(model, nextn=K, mode=mode, max_batch_size=4, native_step=step,
                          overlap_scheduler_on_cpu=False, spec={"draft_token_map": path})
        log = drafts_per_step(eng)
        run_to_end(eng, prompts, params)
        runs.append((log, eng.stats.num_draft_proposed, eng.stats.num_draft_accepted))
        fused = eng.paths.native_step
        assert (fused is not None and fused.num_replays > 0) == step
    assert runs[1] == runs[0]


def test_the_static_step_drafts_over_a_map_as_the_eager_step(models, tmp_path) -> None:
    """The static (CUDA-graph) step, run on the CPU, against the eager general path over the same map: the same
    drafts in every step, the same statistics, the output of greedy decoding without MTP."""
    model = models["tiny3"]
    path, ids = a_map(model, tmp_path)
    prompts = PROMPTS[:7]
    params = [greedy(MAX_TOKENS - 3 * (i % 3)) for i in range(len(prompts))]
    runs = []
    for cg in (None, graphs(1, 2, 4)):
        eng = make_engine(model, nextn=3, mode="eagle", max_batch_size=4, cuda_graph_config=cg,
                          spec={"draft_token_map": path})
        log = drafts_per_step(eng)
        seqs = run_to_end(eng, prompts, params)
        assert [s.output_ids for s in seqs] == [reference(model, p, sp.max_tokens) for p, sp in zip(prompts, params)]
        runs.append((log, eng.stats.num_draft_proposed, eng.stats.num_draft_accepted))
    assert eng.paths.graphs is not None and eng.paths.graphs.num_replays > 0
    assert runs[1] == runs[0] and {d for step in runs[1][0] for row in step for d in row} <= ids


@native
def test_the_native_eagle_draft_over_a_map_equals_the_python_chain(models, tmp_path) -> None:
    """eagle_draft (one call) against the drafter's chain of per-forward calls and draft_logits, over a map."""
    model = models["tiny3"]
    path, _ = a_map(model, tmp_path)
    prompts = PROMPTS[:7]
    runs = []
    for one_call in (False, True):
        eng = make_engine(model, nextn=3, mode="eagle", max_batch_size=4, native_step=False,
                          overlap_scheduler_on_cpu=False, spec={"draft_token_map": path})
        if not one_call:
            eng.spec.drafter.runner.native = None
        log = drafts_per_step(eng)
        run_to_end(eng, prompts, greedy(MAX_TOKENS))
        runs.append((log, eng.caches[model.num_main_layers].clone()))
    assert runs[1][0] == runs[0][0] and torch.equal(runs[1][1], runs[0][1])


# ---- the CLI -------------------------------------------------------------------------------------

def mtp(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


def test_token_map_command_and_the_flag(tiny3_dir, tmp_path) -> None:
    """`mtp token-map` counts a dataset's ids (the most frequent first); the quickstart drafts over the map it
    wrote with the same text as without MTP; a bad map is a one-line error with a non-zero exit."""
    ds = tmp_path / "ds.jsonl"
    rows = [[40, 41, 41, 42], [41, 42, 43], [41, 9]]
    ds.write_text("".join(json.dumps({"task_id": i, "input_ids": r, "output_tokens": 4}) + "\n"
                          for i, r in enumerate(rows)))
    out = tmp_path / "map.json"
    r = mtp("token-map", "--dataset", str(ds), "--model_dir", str(tiny3_dir), "--size", "6", "--output", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["token_ids"] == [41, 42, 9, 40, 43, 0] and doc["counted_tokens"] == 9
    base = ["quickstart", "--model_dir", str(tiny3_dir), "--prompt", "Hello there", "--max_tokens", "10"]
    plain = mtp(*base)
    mapped = mtp(*base, "--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "3",
                 "--spec_decode_token_map", str(out))
    assert plain.returncode == 0 and mapped.returncode == 0, mapped.stderr
    assert mapped.stdout == plain.stdout
    yml = tmp_path / "extra.yml"
    yml.write_text(f"speculative_config:\n  decoding_type: MTP\n  max_draft_len: 2\n  draft_token_map: {out}\n")
    from_yaml = mtp(*base, "--extra_llm_api_options", str(yml), "--log_level", "info")
    assert from_yaml.returncode == 0 and from_yaml.stdout == plain.stdout, from_yaml.stderr
    assert "MTP drafts over 6 of" in from_yaml.stderr
    bad = mtp(*base, "--spec_decode_algo", "MTP", "--spec_decode_token_map", str(tmp_path / "missing.json"))
    err = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode != 0 and bad.stdout == "" and len(err) == 1 and "draft_token_map" in err[0], bad.stderr
    too_big = mtp("token-map", "--dataset", str(ds), "--model_dir", str(tiny3_dir), "--size", "100000",
                  "--output", str(tmp_path / "x.json"))
    assert too_big.returncode != 0 and "--size" in too_big.stderr and not (tmp_path / "x.json").exists()


@native
@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_the_confidence_gate_over_a_map_stops_where_the_eager_drafter_does(models, tmp_path, mode) -> None:
    """The gate's probabilities are normalised over the map's ids on both sides (the native chains' Gate and the
    drafter's softmax): the same drafts every step, ragged across rows, inside the map, plain greedy output."""
    from test_adaptive import confident

    model = confident(models["tiny3"])
    path, ids = a_map(model, tmp_path)
    prompts = PROMPTS[:6]
    runs = []
    for step in (False, True):
        eng = make_engine(model, nextn=3, mode=mode, max_batch_size=4, native_step=step,
                          overlap_scheduler_on_cpu=False,
                          spec={"draft_token_map": path, "draft_confidence_threshold": 0.3})
        log = drafts_per_step(eng)
        seqs = run_to_end(eng, prompts, greedy(MAX_TOKENS))
        assert [s.output_ids for s in seqs] == [reference(model, p, MAX_TOKENS) for p in prompts]
        runs.append((log, eng.stats.num_draft_proposed, eng.stats.num_draft_accepted))
    assert eng.paths.native_step.num_replays > 0 and runs[0] == runs[1]
    assert {d for step in runs[1][0] for row in step for d in row} <= ids
    assert len({len(row) for step in runs[1][0] for row in step}) > 1, "the gate never stopped a chain"


def test_the_sweep_gives_its_map_to_every_mtp_row(tiny3_dir, tmp_path) -> None:
    """`mtp sweep --spec_decode_token_map`: every MTP row drafts over the map (its row says so, and a map of one
    id that the target never emits here accepts nothing), nextn=0 has none."""
    one = write_map(tmp_path, [3])
    r = mtp("sweep", "--model_dir", str(tiny3_dir), "--max_nextn", "2", "--modes", "eagle", "--num_requests", "2",
            "--output_tokens", "8", "--no_plot", "--no_roofline", "--policy_nextn", "0", "--relaxed_nextn", "0",
            "--adaptive_nextn", "0",
            "--spec_decode_token_map", one, "--report_json", str(tmp_path / "s.json"))
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "s.json").read_text())["settings"]
    assert [(x["K"], x["draft_token_map"]) for x in rows] == [(0, None), (1, one), (2, one)]
    assert all(x["acceptance_length"] == 1.0 for x in rows)

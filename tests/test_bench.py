"""`mtp bench`, `mtp prepare-dataset`, `mtp sweep` and mtp_core.bench: metrics by hand, dataset format,
the CLI end to end on tiny checkpoints, exact output lengths with ignore_eos, roofline arithmetic, peers."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cli.app import app
from conftest import PROMPTS, THINK_IDS, make_engine
from mtp_core.bench.dataset import BenchRequest, encode_request, load_dataset, synthetic_requests, task_requests
from mtp_core.bench.metrics import (RequestRecord, decode_acceptance_length, decode_step_time_s, percentile,
                                    summarize_decoding, summarize_performance, summarize_streaming)
from mtp_core.bench.roofline import distinct_experts, measure_bandwidth, step_bytes, weight_bytes
from mtp_core.bench.runner import run_requests
from mtp_core.bench.sweep import sweep_settings
from mtp_core.chat_format import BOS
from mtp_core.request.stats import SpecStats
from mtp_core.tokenizer import Tokenizer
from mtp_factory.data import FAMILIES

torch.set_num_threads(1)
runner = CliRunner()
REPORT_KEYS = {"engine", "machine", "world_info", "request_info", "performance", "streaming_metrics",
               "decoding_stats", "dataset"}


def mtp(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def spec_stats(decode_steps: list[int], K: int) -> SpecStats:
    """A request's statistics: the prefill step (1 token, no drafts) then decode steps emitting n tokens each."""
    s = SpecStats()
    s.record_step(1, 0, 0)
    for n in decode_steps:
        s.record_step(n, K, n - 1)
    return s


def hand_records() -> list[RequestRecord]:
    return [RequestRecord(0, "a", 5, 11, 0.0, 0.1, 1.1, spec_stats([3, 2, 1, 3, 1], 2)),
            RequestRecord(1, "b", 7, 5, 0.5, 0.7, 2.7, spec_stats([2, 2], 2)),
            RequestRecord(2, "c", 4, 9, 1.0, 1.4, 3.0, spec_stats([3, 3, 2], 2))]


# ---- metrics, by hand ---------------------------------------------------------------------------------

def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([400.0, 100.0, 200.0], 50) == 200.0
    assert percentile([100.0, 200.0, 400.0], 90) == pytest.approx(360.0)     # rank 1.8
    assert percentile([100.0, 200.0, 400.0], 99) == pytest.approx(396.0)     # rank 1.98
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_performance_metrics_by_hand() -> None:
    info, perf = summarize_performance(hand_records())
    assert info["num_requests"] == 3 and info["total_output_tokens"] == 25 and info["total_input_tokens"] == 16
    assert info["avg_num_concurrent_requests"] == pytest.approx((1.1 + 2.2 + 2.0) / 3.0)
    assert perf["total_latency_ms"] == pytest.approx(3000.0)
    assert perf["request_throughput_req_s"] == pytest.approx(1.0)
    assert perf["total_output_throughput_tps"] == pytest.approx(25 / 3)
    assert perf["total_token_throughput_tps"] == pytest.approx(41 / 3)
    assert perf["per_user_output_throughput_tps"] == pytest.approx((11 / 1.1 + 5 / 2.2 + 9 / 2.0) / 3)
    assert perf["per_user_generation_tps"] == pytest.approx((10 / 1.0 + 4 / 2.0 + 8 / 1.6) / 3)
    assert perf["ttft_ms"] == pytest.approx((100 + 200 + 400) / 3)
    assert perf["tpot_ms"] == pytest.approx((100 + 500 + 200) / 3)       # (end - first) / (n - 1)
    ttft = perf["ttft_percentiles_ms"]
    assert (ttft["minimum"], ttft["p50"], ttft["maximum"]) == pytest.approx((100, 200, 400))
    assert (ttft["p90"], ttft["p99"]) == pytest.approx((360, 396))
    assert perf["tpot_percentiles_ms"]["p50"] == pytest.approx(200)
    assert perf["request_latency_percentiles_ms"]["p50"] == pytest.approx(2000)
    stream = summarize_streaming(hand_records(), enabled=False)
    assert stream["avg_ttft_ms"] == pytest.approx(perf["ttft_ms"]) and stream["itl_percentiles"] is None


def test_decoding_metrics_by_hand() -> None:
    d = summarize_decoding(hand_records(), 2, "MTP-eagle")
    assert (d["num_decoding_steps"], d["num_output_tokens"]) == (13, 25)
    assert d["acceptance_length"] == pytest.approx(25 / 13)
    assert (d["num_draft_tokens"], d["num_accepted_draft_tokens"]) == (20, 12)
    assert d["draft_acceptance_rate"] == pytest.approx(0.6)
    assert d["acceptance_per_position"] == pytest.approx([0.8, 0.4])
    assert d["spec_decode_num_drafts"] == 10
    assert d["spec_decode_num_accepted_tokens_per_pos"] == [8, 4]
    assert d["spec_decode_acceptance_length"] == pytest.approx(2.2)        # vLLM: 1 + accepted / drafts
    assert d["spec_decode_draft_acceptance_rate"] == pytest.approx(0.6)
    assert d["acceptance_length_percentiles"]["p50"] == pytest.approx(11 / 6)
    assert decode_acceptance_length(hand_records()) == pytest.approx(22 / 10)
    assert decode_step_time_s(hand_records()) == pytest.approx(4.6 / 10)


# ---- datasets -------------------------------------------------------------------------------------------

def test_dataset_lines_are_validated(tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text('{"task_id": 1, "prompt": "hi", "output_tokens": 4}\n\n'
                    '{"task_id": "x", "input_ids": [5, 6], "output_tokens": 2, "task": "add"}\n')
    reqs = load_dataset(good)
    assert [(r.task_id, r.prompt, r.input_ids, r.output_tokens) for r in reqs] == [(1, "hi", None, 4),
                                                                                  ("x", None, [5, 6], 2)]
    assert reqs[1].extra == {"task": "add"}
    for line, needle in [('{"task_id": 1, "prompt": "a", "input_ids": [1], "output_tokens": 2}', "exactly one"),
                         ('{"task_id": 1, "prompt": "a", "output_tokens": 0}', "output_tokens"),
                         ('{"prompt": "a", "output_tokens": 3}', "task_id"),
                         ('{"task_id": 1, "input_ids": [], "output_tokens": 3}', "input_ids"),
                         ('{"task_id": 1, "prompt": "a", "output_tokens": 3', "not valid JSON")]:
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"task_id": 0, "prompt": "ok", "output_tokens": 1}\n' + line + "\n")
        with pytest.raises(ValueError, match=needle) as e:
            load_dataset(bad)
        assert f"{bad}:2:" in str(e.value)


def test_task_and_synthetic_requests(tiny3_dir: Path) -> None:
    reqs = task_requests("all", 11, 7)
    assert [r.extra["task"] for r in reqs] == FAMILIES + FAMILIES[:2]           # round-robin over families
    assert all(r.prompt.startswith(BOS) and r.output_tokens == 7 for r in reqs)
    tok = Tokenizer.from_dir(tiny3_dir)
    ids = encode_request(tok, reqs[0])
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id     # no second BOS
    assert encode_request(tok, BenchRequest(0, 1, "plain text"))[0] == tok.bos_token_id
    syn = synthetic_requests(3, 16, 5, 40, frozenset(range(30)), seed=1)
    assert all(len(r.input_ids) == 16 and all(30 <= t < 40 for t in r.input_ids) for r in syn)
    with pytest.raises(ValueError, match="task_set"):
        task_requests("nope", 1, 1)


def test_prepare_dataset_cli(tmp_path: Path, tiny3_dir: Path) -> None:
    out = tmp_path / "ds.jsonl"
    r = mtp("prepare-dataset", "--output", out, "--num_requests", 4, "--output_tokens", 9, "--task_set", "mul",
            "--model_dir", tiny3_dir)
    assert r.exit_code == 0, r.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 4 and {"task_id", "prompt", "output_tokens"} <= set(lines[0])
    assert all(x["task"] == "mul" and x["output_tokens"] == 9 and "input_ids" not in x for x in lines)
    assert "input tokens avg" in r.stderr
    syn = tmp_path / "syn.jsonl"
    r = mtp("prepare-dataset", "--output", syn, "--num_requests", 2, "--output_tokens", 3, "--synthetic",
            "--input_tokens", 12, "--model_dir", tiny3_dir)
    assert r.exit_code == 0, r.stderr
    assert [len(x.input_ids) for x in load_dataset(syn)] == [12, 12]
    r = mtp("prepare-dataset", "--output", "-", "--num_requests", 2, "--output_tokens", 3, "--task_set", "general",
            "--model_dir", tiny3_dir)
    assert r.exit_code == 0 and len(r.stdout.splitlines()) == 2
    r = mtp("prepare-dataset", "--output", syn, "--num_requests", 2, "--output_tokens", 3, "--synthetic",
            "--model_dir", tiny3_dir)
    assert r.exit_code == 2 and r.stderr.strip() == "error: --synthetic needs --input_tokens N"


# ---- the engine driver --------------------------------------------------------------------------------

def test_ignore_eos_emits_exactly_output_tokens(tiny3_model) -> None:
    prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[6]]
    free = run_requests(make_engine(tiny3_model, eos=(), nextn=2), prompts, [20, 20, 20], concurrency=1)
    eos = free[0].output_ids[4]            # a token greedy decoding does emit: make it the EOS
    cut = free[0].output_ids.index(eos)
    engine = make_engine(tiny3_model, eos=(eos,), think_ids=THINK_IDS, nextn=2, max_batch_size=2)
    stopped = run_requests(engine, prompts, [20, 20, 20], concurrency=2, ignore_eos=False)
    assert stopped[0].num_output_tokens == cut and stopped[0].finish_reason == "stop"
    full = run_requests(engine, prompts, [20, 13, 20], concurrency=2, ignore_eos=True)
    assert [r.num_output_tokens for r in full] == [20, 13, 20]
    assert [r.output_ids for r in full] == [free[0].output_ids, free[1].output_ids[:13], free[2].output_ids]
    assert all(r.start_s <= r.first_token_s <= r.end_s for r in full)


# ---- mtp bench end to end -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench") / "ds.jsonl"
    rows = [{"task_id": "t0", "prompt": "Add 3 and 4.", "output_tokens": 8},
            {"task_id": "t1", "input_ids": PROMPTS[3], "output_tokens": 6},
            {"task_id": "t2", "prompt": "Sort 5, 1, 3.", "output_tokens": 10},
            {"task_id": "t3", "prompt": "never used", "output_tokens": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("concurrency, extra", [
    (1, []), (2, []),
    (1, ["--spec_decode_algo", "MTP", "--spec_decode_nextn", "2", "--spec_decode_draft_len_policy", "fixed"]),
    (2, ["--spec_decode_algo", "mtp", "--spec_decode_nextn", "3", "--mtp_mode", "eagle", "--streaming",
         "--spec_decode_draft_len_policy", "fixed"]),
    (2, ["--spec_decode_algo", "MTP", "--spec_decode_nextn", "3", "--mtp_mode", "eagle"]),      # the default policy
])
def test_bench_cli(tmp_path: Path, tiny3_dir: Path, dataset: Path, concurrency: int, extra: list[str]) -> None:
    report_path = tmp_path / "report.json"
    r = mtp("bench", "--model_dir", tiny3_dir, "--dataset", dataset, "--num_requests", 3, "--concurrency",
            concurrency, "--warmup", 1, "--num_threads", 1, "--report_json", report_path, *extra)
    assert r.exit_code == 0, r.stderr
    for title in ("PERFORMANCE OVERVIEW", "DECODING STATISTICS", "REQUEST DETAILS", "MACHINE", "DATASET DETAILS"):
        assert f"= {title}" in r.stdout
    rep = json.loads(report_path.read_text())
    assert REPORT_KEYS <= set(rep)
    q, p, d = rep["request_info"], rep["performance"], rep["decoding_stats"]
    assert q["num_requests"] == 3 and q["total_output_tokens"] == 8 + 6 + 10           # ignore_eos: exact
    tok = Tokenizer.from_dir(tiny3_dir)
    isl = [len(tok.encode("Add 3 and 4.")), len(PROMPTS[3]), len(tok.encode("Sort 5, 1, 3."))]
    assert q["avg_input_length"] == pytest.approx(sum(isl) / 3) and rep["dataset"]["max_isl"] == max(isl)
    for key in ("per_user_output_throughput_tps", "total_output_throughput_tps", "ttft_ms", "tpot_ms"):
        assert p[key] > 0
    assert p["total_output_throughput_tps"] == pytest.approx(24 / (p["total_latency_ms"] / 1e3))
    assert p["request_throughput_req_s"] == pytest.approx(3 / (p["total_latency_ms"] / 1e3))
    if concurrency == 1:
        assert q["avg_num_concurrent_requests"] <= 1.0 + 1e-9       # one request at a time
    else:
        assert q["avg_num_concurrent_requests"] > 1.0
    assert d["num_output_tokens"] == 24
    assert d["acceptance_length"] == pytest.approx(24 / d["num_decoding_steps"])
    K = int(extra[extra.index("--spec_decode_nextn") + 1]) if extra else 0
    assert d["max_draft_len"] == K and rep["world_info"]["concurrency"] == concurrency
    fixed = "fixed" in extra
    if K:
        decode_steps = d["num_decoding_steps"] - 3                  # every step after each request's prefill
        assert sum(d["drafts_per_step_histogram"]) == decode_steps
        assert sum(d["draft_limit_histogram"]) == decode_steps      # a choice per step but each request's last
        assert rep["draft_len_policy"]["policy"] == ("fixed" if fixed else "cost")
        assert rep["engine"]["speculative_config"]["draft_len_policy"] == rep["draft_len_policy"]["policy"]
        assert "Drafts chosen per step (0..K)" in r.stdout and "Draft-length policy" in r.stdout
    if K and fixed:
        assert d["spec_decode_num_drafts"] == decode_steps and d["num_draft_tokens"] == K * decode_steps
        assert len(d["spec_decode_num_accepted_tokens_per_pos"]) == K
        assert d["num_accepted_draft_tokens"] >= 24 - d["num_decoding_steps"]
        assert d["draft_acceptance_rate"] == pytest.approx(d["num_accepted_draft_tokens"] / d["num_draft_tokens"])
    elif not K:
        assert d["num_decoding_steps"] == 24 and d["num_draft_tokens"] == 0
    assert (rep["streaming_metrics"]["itl_percentiles"] is not None) == ("--streaming" in extra)
    if K and fixed:
        assert d["drafts_per_step_histogram"] == [0] * K + [d["spec_decode_num_drafts"]]     # fixed K: always K
        assert d["waste_verified_per_accepted"] == pytest.approx(d["num_draft_tokens"] / d["num_accepted_draft_tokens"])


def test_bench_cli_adaptive_statistics(tmp_path: Path, tiny3_dir: Path, dataset: Path) -> None:
    """A schedule that allows 1 draft at batch 1 and none from 2 requests on, through --report_json. Under the
    fixed policy, so that the schedule alone decides: the cost policy may keep a lone request at 0 (its MTP forward
    over the prompt and the tokens it decoded at batch 2 is a catch-up its few remaining tokens would not repay)."""
    report_path = tmp_path / "report.json"
    r = mtp("bench", "--model_dir", tiny3_dir, "--dataset", dataset, "--num_requests", 3, "--concurrency", 2,
            "--warmup", 0, "--num_threads", 1, "--report_json", report_path, "--spec_decode_algo", "MTP",
            "--spec_decode_nextn", "2", "--mtp_mode", "eagle", "--spec_decode_draft_len_schedule", "1:1,2:0",
            "--spec_decode_draft_len_policy", "fixed")
    assert r.exit_code == 0, r.stderr
    d = json.loads(report_path.read_text())["decoding_stats"]
    hist, limits = d["drafts_per_step_histogram"], d["draft_limit_histogram"]
    assert len(hist) <= 2 and hist[0] > 0 and sum(hist) == d["num_decoding_steps"] - 3
    assert limits[0] > 0 and len(limits) == 2 and d["mode"] == "MTP-eagle-adaptive"
    assert "Drafts per decode step (0..K)" in r.stdout


def test_bench_cli_errors(tmp_path: Path, tiny3_dir: Path, dataset: Path) -> None:
    r = mtp("bench", "--model_dir", tiny3_dir, "--dataset", tmp_path / "missing.jsonl")
    assert r.exit_code == 2 and "prepare-dataset" in r.stderr
    r = mtp("bench", "--model_dir", tiny3_dir, "--dataset", dataset, "--concurrency", 0)
    assert r.exit_code == 2 and "--concurrency" in r.stderr
    r = mtp("bench", "--model_dir", tiny3_dir, "--dataset", dataset, "--max_seq_len", 12, "--warmup", 0)
    assert r.exit_code == 2 and "max_seq_len" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# ---- sweep ------------------------------------------------------------------------------------------------

def test_sweep_settings() -> None:
    labels = [s.label for s in sweep_settings(3, 5)]
    assert labels[0] == "nextn=0" and len(labels) == 1 + 5 + 3 + 1
    assert labels[-1] == "vanilla K=3 relaxed(top10,d0.6)"
    one = sweep_settings(1, 2, relaxed_nextn=3)
    assert [(s.mode, s.K, s.relaxed) for s in one] == [("none", 0, False), ("eagle", 1, False),
                                                       ("eagle", 2, False), ("eagle", 2, True)]
    assert len(sweep_settings(0, 5)) == 1
    with_policy = sweep_settings(3, 2, relaxed_nextn=0, policy_nextn=5)
    assert [(s.label, s.K, s.policy) for s in with_policy[-2:]] == [("eagle policy (K<=5)", 5, "cost"),
                                                                   ("vanilla policy (K<=3)", 3, "cost")]
    assert all(s.policy == "fixed" for s in with_policy[:-2])
    with pytest.raises(ValueError, match="relaxed_nextn"):
        sweep_settings(2, 3, relaxed_nextn=3, relaxed_mode="vanilla")


def test_sweep_cli(tmp_path: Path, tiny3_dir: Path) -> None:
    png, report_path = tmp_path / "fig.png", tmp_path / "sweep.json"
    r = mtp("sweep", "--model_dir", tiny3_dir, "--num_requests", 2, "--output_tokens", 8, "--max_nextn", 2,
            "--relaxed_nextn", 2, "--warmup", 0, "--num_threads", 1, "--bandwidth_mib", 8, "--plot", png,
            "--report_json", report_path, "--accuracy", "--accuracy_per_family", 1, "--accuracy_max_tokens", 6,
            *(["--no_plot"] if importlib.util.find_spec("matplotlib") is None else []))
    assert r.exit_code == 0, r.stderr
    rep = json.loads(report_path.read_text())
    rows = rep["settings"]
    from cli.sweep import DEFAULT_CONFIDENCE
    c = f"c={DEFAULT_CONFIDENCE:g}"
    assert [x["label"] for x in rows] == ["nextn=0", "eagle K=1", "eagle K=2", "vanilla K=1", "vanilla K=2",
                                          "vanilla K=2 relaxed(top10,d0.6)", "eagle policy (K<=2)",
                                          "vanilla policy (K<=2)", f"eagle adaptive (K<=2 {c})",
                                          f"vanilla adaptive (K<=2 {c})"]
    assert [x["policy"] for x in rows] == [None] + ["fixed"] * 5 + ["cost"] * 2 + ["fixed"] * 2
    for x in rows[1:8]:      # a choice per step of a request but its last (2 requests): what the policy chose
        hist = x["chosen_drafts_histogram"]
        assert len(hist) <= 3 and sum(hist) == x["decoding_stats"]["num_decoding_steps"] - 2
    assert rows[1]["chosen_drafts_histogram"] == [0, rows[1]["decoding_stats"]["num_decoding_steps"] - 2]   # K=1
    adaptive = rows[-1]["decoding_stats"]
    assert sum(adaptive["drafts_per_step_histogram"]) == adaptive["num_decoding_steps"] - 2   # minus the prefills
    assert rows[-1]["mean_drafts_per_step"] <= 2
    for x in rows:
        assert x["label"] in r.stdout
        assert x["speedup"] == pytest.approx(x["tokens_per_s_user"] / rows[0]["tokens_per_s_user"])
        assert x["engine_efficiency"] == pytest.approx(x["speedup"] / x["acceptance_length"])
        assert x["decoding_stats"]["num_output_tokens"] == 16 and x["floor_step_ms"] > 0
    assert rows[0]["acceptance_length"] == 1.0 and rows[0]["speedup"] == 1.0
    acc = rep["accuracy"]
    assert set(acc["strict"]) == set(acc["relaxed"]) == {*FAMILIES, "add_3digit", "overall"}
    assert all(0.0 <= v <= 1.0 for v in [*acc["strict"].values(), *acc["relaxed"].values()])
    assert (acc["strict_setting"], acc["relaxed_setting"]) == ("vanilla K=2", "vanilla K=2 relaxed(top10,d0.6)")
    assert "task set" in r.stdout and "overall" in r.stdout
    plotted = importlib.util.find_spec("matplotlib") is not None
    assert png.is_file() == plotted and (tmp_path / "fig_accuracy.png").is_file() == plotted


# ---- roofline and peers -----------------------------------------------------------------------------------

def test_roofline_bytes_by_hand(tiny3_model) -> None:
    cfg = tiny3_model.config                           # H 64, 3 main layers (first dense), 3 MTP modules, fp32
    wb = weight_bytes(tiny3_model)
    H, V, I = cfg.hidden_size, cfg.vocab_size, cfg.moe_intermediate_size
    assert wb.head == V * H * 4
    assert set(wb.main_expert) == {1, 2} and set(wb.mtp_expert) == {0, 1, 2}
    assert wb.main_expert[1] == 3 * H * I * 4                              # gate, up, down
    everything = sum(t.numel() * t.element_size() for n, t in [*tiny3_model.named_parameters(),
                                                               *tiny3_model.named_buffers()]
                     if n.startswith(("model.layers.", "model.norm.", "lm_head.")))
    counted = wb.main_dense + wb.head + sum(wb.mtp_dense.values()) + 8 * (sum(wb.main_expert.values())
                                                                         + sum(wb.mtp_expert.values()))
    assert counted == everything
    assert distinct_experts(8, 2, 1) == pytest.approx(2.0)
    assert distinct_experts(8, 2, 3) == pytest.approx(8 * (1 - 0.75 ** 3))
    b = step_bytes(tiny3_model, wb, 2, "eagle", 1.5, context_len=10)
    kv = 10 * cfg.kv_cache_dim * 4
    assert b["main_weights"] == pytest.approx(wb.main_dense + wb.head + 2 * wb.main_expert[1] * distinct_experts(8, 2, 3))
    assert b["mtp_weights"] == pytest.approx(2 * (wb.mtp_dense[0] + wb.head)
                                             + wb.mtp_expert[0] * (distinct_experts(8, 2, 1.5) + 2.0))
    assert (b["main_kv"], b["mtp_kv"]) == pytest.approx((3 * kv, 2 * kv))
    assert step_bytes(tiny3_model, wb, 0, "none", 1.0, 10)["mtp_weights"] == 0
    assert measure_bandwidth(mib=8, repeats=2) > 1e6


def test_peers_match_our_greedy(tiny3_dir: Path, tiny3_model) -> None:
    pytest.importorskip("transformers")
    from mtp_core.bench.peers import run_hf_peers

    prompts = [PROMPTS[2], PROMPTS[4]]
    ours = run_requests(make_engine(tiny3_model, eos=()), prompts, [6, 6], concurrency=1)
    rows = run_hf_peers(tiny3_dir, prompts, [6, 6], torch.float32, pad_id=0, warmup=0,
                        reference=[r.output_ids for r in ours])
    assert [x["name"] for x in rows] == ["hf-generate", "hf-prompt-lookup(10)"]
    assert all(x["identical_to_ours"] == 2 and x["per_user_output_throughput_tps"] > 0 for x in rows)


def test_forward_costs_with_a_prompt_longer_than_one_kv_block(tiny3_model) -> None:
    """The sweep's one-MTP-forward / one-main-forward line times at the prompt's last position: with a
    prompt past the first KV block it used to index a freed (empty) block table (`mtp sweep --task_set
    general` crashed with IndexError)."""
    from mtp_core.bench.sweep import forward_costs
    from mtp_core.config import LLMConfig, SpeculativeConfig

    base = LLMConfig(model_dir="unused", speculative_config=SpeculativeConfig(num_nextn_predict_layers=0),
                     max_batch_size=1)
    engine_block = 64
    prompt = [(7 * i) % 200 + 10 for i in range(3 * engine_block + 5)]
    out = forward_costs(tiny3_model, base, [2], prompt, repeats=5)
    assert out["main_forward_ms"] > 0 and out["mtp_forward_ms"] > 0 and out["mtp_over_main"] > 0

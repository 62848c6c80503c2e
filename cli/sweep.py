"""`mtp sweep`: nextn = 0..K (Eagle; Vanilla up to the module count) and relaxed acceptance, one process.

The model is loaded once; every setting runs on a fresh Engine over the same weights. stdout: the table
(mode, K, AL, draft acceptance rate, tokens/s/user, speed-up over nextn=0, engine efficiency = speed-up /
AL, and the roofline floor vs measured step time), then the peers and the accuracy table when asked.
Writes the write-up's figure 7 (and figure 8 with --accuracy) as PNG when matplotlib is installed.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from cli.bench import BANDWIDTH_MIB, REPORT_JSON, llm_config, set_threads, write_json
from cli.common import run_or_exit, setup_logging
from cli.options import explicit_params, parameters, set_parameters
from mtp_core.config.engine import SWEEP_RELAXED_DELTA, SWEEP_RELAXED_K, SWEEP_RELAXED_TOPK
from mtp_core.config.flags import engine_flags
from mtp_core.config.schema import Flag

DEFAULT_PLOT = Path("mtp_sweep.png")
DEFAULT_CONFIDENCE = 0.3   # derived from measured step costs and the MTP head's calibration: docs/adaptive.md
RELAXED_OWN = ("relaxed_topk", "relaxed_delta")   # the sweep's relaxed row (the engine flags with its defaults)
ROW_OWN = (*RELAXED_OWN, "spec_decode_token_map")  # settings of the MTP rows, not of the loading config

# the sweep's own options; its engine flags are the schema's, in their brief form (cli/options.py)
OWN = {flag.key: flag for flag in (
    Flag("--dataset", "Benchmark dataset (default: held-out task prompts).", type=Optional[Path], default=None),
    Flag("--task_set", "Without --dataset: a task family, all, or general.", type=str, default="all"),
    Flag("--num_requests", "Requests per setting (the first N of the dataset).", type=int, default=9),
    Flag("--output_tokens", "Without --dataset: tokens per request.", type=int, default=128),
    Flag("--max_nextn", "Largest K of the sweep.", type=int, default=5),
    Flag("--modes", "Drafting modes, comma-separated.", type=str, default="eagle,vanilla"),
    Flag("--relaxed_nextn", "K of the relaxed-acceptance setting (0 = none).", type=int, default=SWEEP_RELAXED_K),
    dataclasses.replace(engine_flags()["relaxed_topk"].flag, default=SWEEP_RELAXED_TOPK),
    dataclasses.replace(engine_flags()["relaxed_delta"].flag, default=SWEEP_RELAXED_DELTA),
    Flag("--relaxed_mode", "auto | eagle | vanilla.", type=str, default="auto"),
    Flag("--policy_nextn", "Max K of the `eagle policy` / `vanilla policy` rows: the default draft-length policy, "
         "which picks 0..K drafts per step from measured costs (default: --max_nextn; 0 = none). Every other row is "
         "fixed K.", type=Optional[int], default=None),
    Flag("--adaptive_nextn", "Max K of the `eagle adaptive` / `vanilla adaptive` rows (default: --max_nextn; 0 = "
         "none).", type=Optional[int], default=None),
    Flag("--adaptive_confidence", "Adaptive rows: draft_confidence_threshold, or several comma-separated (one row "
         "each per mode); default: the value docs/adaptive.md derives for this engine.", type=str,
         default=str(DEFAULT_CONFIDENCE)),
    Flag("--adaptive_schedule", "Adaptive rows: draft_len_schedule, e.g. 1:4,4:2,16:0.", type=Optional[str],
         default=None),
    Flag("--adaptive_window", "Adaptive rows: acceptance_window (0 = off).", type=int, default=0),
    Flag("--adaptive_window_threshold", "Adaptive rows: acceptance_length_threshold.", type=float, default=0.0),
    dataclasses.replace(engine_flags()["spec_decode_token_map"].flag, default=None),   # every MTP row's
    Flag("--concurrency", "Requests in flight (1 = min-latency mode).", type=int, default=1),
    Flag("--warmup", "Requests run before measuring each setting.", type=int, default=1),
    Flag("--plot", "Figure 7 PNG (figure 8 goes beside it as *_accuracy.png).", type=Path, default=DEFAULT_PLOT),
    Flag("--no_plot", "Write no figure.", type=bool, default=False),
    BANDWIDTH_MIB,
    Flag("--accuracy", "Also score every task set, strict vs relaxed (figure 8).", type=bool, default=False),
    Flag("--accuracy_per_family", "Held-out questions per task set.", type=int, default=10),
    Flag("--accuracy_max_tokens", "Token limit of accuracy runs (EOS ends them).", type=int, default=768),
    Flag("--accuracy_concurrency", "Requests in flight in accuracy runs.", type=int, default=8),
    Flag("--peers", "Also time Hugging Face generate (plain, prompt lookup).", type=bool, default=False),
    Flag("--prompt_lookup_num_tokens", "Peers: prompt-lookup drafts.", type=int, default=10),
    REPORT_JSON,
)} | {
    "ignore_eos": (bool, typer.Option(True, "--ignore_eos/--no_ignore_eos", help="Emit exactly output_tokens.")),
    "roofline": (bool, typer.Option(True, "--roofline/--no_roofline", help="Measure bandwidth; add floor step times.")),
}
FLAGS = ("model_dir", "dataset", "task_set", "num_requests", "output_tokens", "max_nextn", "modes", "relaxed_nextn",
         "relaxed_topk", "relaxed_delta", "relaxed_mode", "policy_nextn", "adaptive_nextn", "adaptive_confidence",
         "adaptive_schedule", "adaptive_window", "adaptive_window_threshold", "spec_decode_token_map", "concurrency",
         "warmup", "ignore_eos", "dtype", "max_num_tokens", "max_seq_len", "kv_cache_fraction",
         "extra_llm_api_options", "num_threads", "plot", "no_plot", "roofline", "bandwidth_mib", "accuracy",
         "accuracy_per_family", "accuracy_max_tokens", "accuracy_concurrency", "peers", "prompt_lookup_num_tokens",
         "report_json", "log_level")


def sweep_command(ctx: typer.Context, **flags: Any) -> None:
    setup_logging(flags["log_level"])
    p = dict(ctx.params)
    run_or_exit(lambda: _run(ctx, p))


set_parameters(sweep_command, parameters(FLAGS, OWN, brief=True))


@dataclasses.dataclass
class _Loaded:
    """What every setting of the sweep shares: the model loaded once, its tokens, the nextn=0 engine config."""
    cfg: Any
    model: Any
    tok: Any
    eos: list[int]
    think: Any
    base: Any


def _run(ctx: typer.Context, p: dict[str, Any]) -> None:
    from mtp_core.bench import sweep as sw
    from mtp_core.bench.dataset import encode_request
    from mtp_core.bench.report import dataset_info, engine_info, machine_info

    set_threads(p["num_threads"])
    want_plot = _want_plot(p, "plot" in explicit_params(ctx))
    _check(p)
    requests, in_file = _requests(p)
    run = _load(ctx, p)
    settings = _settings(p, run.model.num_mtp_modules)
    prompts = [encode_request(run.tok, r) for r in requests]
    outs = [r.output_tokens for r in requests]
    ds = dataset_info(str(p["dataset"]) if p["dataset"] else f"<held-out task prompts: {p['task_set']}>", in_file,
                      prompts, outs, [r.extra.get("task") for r in requests])
    bandwidth = None
    if p["roofline"]:
        from mtp_core.bench.roofline import measure_bandwidth
        bandwidth = measure_bandwidth(p["bandwidth_mib"])
    rows, reference = _measure(run, settings, prompts, outs, ds, bandwidth, p)
    sw.add_speedups(rows)
    costs = sw.forward_costs(run.model, run.base, run.eos, prompts[0]) if run.model.num_mtp_modules else None
    peer_rows = _peers(run, prompts, outs, reference, p) if p["peers"] else None
    _print(rows, peer_rows, costs, bandwidth, p)
    report = {"engine": engine_info(run.cfg, run.model), "machine": machine_info(run.cfg.device), "dataset": ds,
              "settings": rows, "peers": peer_rows, "forward_costs": costs,
              "bandwidth_gb_s": bandwidth / 1e9 if bandwidth else None,
              "concurrency": p["concurrency"], "ignore_eos": p["ignore_eos"]}
    if p["accuracy"]:
        report["accuracy"] = _accuracy(sw, run.model, run.base, run.eos, run.think, run.tok, settings,
                                       p["accuracy_per_family"], p["accuracy_max_tokens"], p["accuracy_concurrency"])
        print("\n" + sw.format_accuracy(report["accuracy"]), flush=True)
    if want_plot:
        _plot(report, rows, run, p)
    if p["report_json"] is not None:
        write_json(p["report_json"], report)


def _want_plot(p: dict[str, Any], explicit_plot: bool) -> bool:
    """Whether a figure is written: not with --no_plot; without matplotlib only a note, unless --plot was typed."""
    if p["no_plot"]:
        return False
    try:
        from mtp_core.bench.plot import require_matplotlib
        require_matplotlib()
    except ValueError:
        if explicit_plot:
            raise
        print("note: matplotlib is not installed, so no figure is written (pip install matplotlib)", file=sys.stderr)
        return False
    return True


def _check(p: dict[str, Any]) -> None:
    """The options' checks that need no model (they fail before it loads)."""
    if p["peers"]:
        from mtp_core.bench.peers import require_transformers
        require_transformers()
    if p["num_requests"] < 1 or p["concurrency"] == 0 or p["warmup"] < 0:
        raise ValueError("--num_requests must be >= 1, --concurrency non-zero and --warmup >= 0")
    if p["accuracy"] and p["relaxed_nextn"] < 1:
        raise ValueError("--accuracy compares strict and relaxed acceptance at --relaxed_nextn; set it >= 1")
    if p["accuracy"]:
        from mtp_core.bench.eval_sets import read_manifest

        per_set = read_manifest().per_set
        if not 1 <= p["accuracy_per_family"] <= per_set:
            raise ValueError(f"--accuracy_per_family must be between 1 and {per_set} (the held-out questions "
                             "per set that ship with the model)")


def _requests(p: dict[str, Any]) -> tuple[list, int]:
    """The first --num_requests requests of --dataset (or of the held-out task prompts), and how many it holds."""
    from mtp_core.bench.dataset import load_dataset, task_requests

    requests = (load_dataset(p["dataset"]) if p["dataset"] is not None
                else task_requests(p["task_set"], p["num_requests"], p["output_tokens"]))
    return requests[:p["num_requests"]], len(requests)


def _load(ctx: typer.Context, p: dict[str, Any]) -> _Loaded:
    """The model, loaded once for every setting (each setting then builds its own Engine over it)."""
    from mtp_core.bench import sweep as sw
    from mtp_core.llm import LLM

    cfg = llm_config({k: v for k, v in ctx.params.items() if k not in ROW_OWN},
                     {k: v for k, v in explicit_params(ctx).items() if k not in ROW_OWN},
                     max(p["concurrency"], p["accuracy_concurrency"] if p["accuracy"] else 1, 1))
    llm = LLM(cfg)
    model, tok = llm.model, llm.tokenizer
    eos, think = sorted(llm.engine.stops.eos_token_ids), llm.engine.stops.think_ids
    del llm.engine
    return _Loaded(cfg, model, tok, eos, think, sw.setting_config(cfg, sw.Setting("none", 0)))


def _settings(p: dict[str, Any], num_modules: int) -> list:
    """The sweep's rows: nextn=0, fixed K per mode, the relaxed row, the policy rows, then one set of adaptive rows
    per --adaptive_confidence value."""
    from mtp_core.bench import sweep as sw
    from mtp_core.config.schedule import parse_schedule

    mode_list = tuple(m.strip() for m in p["modes"].split(",") if m.strip())
    text, max_nextn = p["adaptive_confidence"], p["max_nextn"]
    try:
        confidences = [float(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--adaptive_confidence takes numbers in [0, 1), comma-separated; got {text!r}") from None
    if not confidences or not all(0 <= c < 1 for c in confidences):
        raise ValueError(f"--adaptive_confidence must be in [0, 1), got {text}")
    schedule = parse_schedule(p["adaptive_schedule"], "--adaptive_schedule") if p["adaptive_schedule"] else None
    policy_nextn, adaptive_nextn = p["policy_nextn"], p["adaptive_nextn"]
    settings = sw.sweep_settings(num_modules, max_nextn, mode_list, p["relaxed_nextn"], p["relaxed_topk"],
                                 p["relaxed_delta"], p["relaxed_mode"],
                                 policy_nextn=max_nextn if policy_nextn is None else policy_nextn)
    for c in confidences:
        settings += sw.sweep_settings(num_modules, 0, mode_list, 0,
                                      adaptive_nextn=max_nextn if adaptive_nextn is None else adaptive_nextn,
                                      adaptive_confidence=c, adaptive_schedule=schedule,
                                      adaptive_window=p["adaptive_window"],
                                      adaptive_window_threshold=p["adaptive_window_threshold"])[1:]
    token_map = p["spec_decode_token_map"]
    return [dataclasses.replace(s, token_map=token_map) if s.K and token_map else s for s in settings]


def _measure(run: _Loaded, settings: list, prompts: list[list[int]], outs: list[int], ds: dict,
             bandwidth: Optional[float], p: dict[str, Any]) -> tuple[list[dict], Optional[list[list[int]]]]:
    """One table row per setting (with its roofline floor when the bandwidth was measured), and nextn=0's outputs
    up to EOS (what the peers are compared with)."""
    from mtp_core.bench import sweep as sw
    from mtp_core.bench.metrics import decode_acceptance_length, decode_step_time_s
    from mtp_core.bench.progress import request_progress
    from mtp_core.bench.roofline import roofline as roof

    rows, reference = [], None
    with request_progress(len(settings) * len(prompts), "sweep") as advance:
        for s in settings:
            records = sw.run_setting(run.model, run.base, run.eos, run.think, s, prompts, outs, p["concurrency"],
                                     p["warmup"], p["ignore_eos"], on_finish=advance)
            row = sw.summary_row(s, records)
            if s.K == 0:
                reference = [_until_eos(r.output_ids, run.eos) for r in records]
            if bandwidth:
                rf = roof(run.model, s.K, s.mode, decode_acceptance_length(records), ds["avg_isl"] + ds["avg_osl"] / 2,
                          bandwidth, decode_step_time_s(records))
                row["floor_step_ms"], row["roofline"] = rf["floor_step_ms"], rf
            rows.append(row)
    return rows, reference


def _peers(run: _Loaded, prompts: list[list[int]], outs: list[int], reference: Optional[list[list[int]]],
           p: dict[str, Any]) -> list[dict]:
    """--peers: Hugging Face generate on the same prompts (plain, and with prompt lookup)."""
    from mtp_core.bench.peers import run_hf_peers
    from mtp_core.bench.progress import request_progress

    with request_progress(2 * len(prompts), "peers") as advance:
        return run_hf_peers(run.cfg.model_dir, prompts, outs, next(run.model.parameters()).dtype,
                            run.eos[0] if run.eos else 0, p["prompt_lookup_num_tokens"], min(p["warmup"], 1),
                            reference if p["ignore_eos"] else None, on_finish=advance)


def _print(rows: list[dict], peer_rows: Optional[list[dict]], costs: Optional[dict], bandwidth: Optional[float],
           p: dict[str, Any]) -> None:
    """The table on stdout, then the lines under it: MTP's forward cost, the peers' note, the bandwidth."""
    from mtp_core.bench import sweep as sw
    from mtp_core.bench.report import machine_info

    print(sw.format_table(rows, peer_rows), flush=True)
    if costs:
        print(f"one MTP module forward / one main forward (1 token): {costs['mtp_over_main']:.3f} "
              f"({costs['mtp_forward_ms']:.3f} / {costs['main_forward_ms']:.3f} ms, "
              f"{'native' if costs['native'] else 'torch'} decode forward)", flush=True)
    if p["peers"]:
        from mtp_core.bench.peers import ASSISTED_NOTE
        print(f"note: {ASSISTED_NOTE}", flush=True)
    if bandwidth:
        print(f"roofline: memory bandwidth {bandwidth / 1e9:.2f} GB/s with {machine_info()['torch_num_threads']} "
              "thread(s); floor = bytes read per batch-1 step / bandwidth", flush=True)


def _plot(report: dict, rows: list[dict], run: _Loaded, p: dict[str, Any]) -> None:
    """Figure 7 (and figure 8 beside it with --accuracy); their paths go into the report."""
    from mtp_core.bench.plot import plot_accuracy, plot_sweep

    plot = p["plot"]
    report["plot"] = str(plot_sweep(rows, plot, f"{Path(run.cfg.model_dir).name}: MTP sweep"))
    print(f"figure: {report['plot']}", file=sys.stderr)
    if p["accuracy"]:
        acc_path = plot.with_name(plot.stem + "_accuracy" + plot.suffix)
        report["accuracy_plot"] = str(plot_accuracy(report["accuracy"], acc_path))
        print(f"figure: {acc_path}", file=sys.stderr)


def _until_eos(ids: list[int], eos: list[int]) -> list[int]:
    """Our output up to its first EOS: transformers' min_new_tokens forbids EOS, so only this prefix compares."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return list(ids)


def _accuracy(sw, model, base, eos, think, tok, settings, per_family: int, max_tokens: int, concurrency: int) -> dict:
    from mtp_core.bench.eval_sets import accuracy_records
    from mtp_core.bench.progress import request_progress

    relaxed = next((s for s in settings if s.relaxed), None)
    if relaxed is None:
        raise ValueError("--accuracy needs the relaxed setting; set --relaxed_nextn and --max_nextn >= 1")
    strict = sw.Setting(relaxed.mode, relaxed.K)
    records = accuracy_records(per_family)
    with request_progress(2 * len(records), "accuracy") as advance:
        return sw.run_accuracy(model, base, eos, think, tok, records, strict, relaxed, max_tokens, concurrency,
                               on_finish=advance)

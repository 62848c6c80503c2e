"""`mtp sweep`: nextn = 0..K (Eagle; Vanilla up to the module count) and relaxed acceptance, one process.

The model is loaded once; every setting runs on a fresh Engine over the same weights. stdout: the table
(mode, K, AL, draft acceptance rate, tokens/s/user, speed-up over nextn=0, engine efficiency = speed-up /
AL, and the roofline floor vs measured step time), then the peers and the accuracy table when asked.
Writes the write-up's figure 7 (and figure 8 with --accuracy) as PNG when matplotlib is installed.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from cli.bench import (DTYPE, EXTRA_OPTIONS, KV_FRACTION, LOG_LEVEL, MAX_NUM_TOKENS, MAX_SEQ_LEN, MODEL_DIR,
                       NUM_THREADS, REPORT_JSON, llm_config, set_threads, write_json)
from cli.common import run_or_exit, setup_logging
from cli.options import explicit_params

DEFAULT_PLOT = Path("mtp_sweep.png")
DEFAULT_CONFIDENCE = 0.3   # derived from measured step costs and the MTP head's calibration: docs/adaptive.md


def sweep_command(
    ctx: typer.Context,
    model_dir: Optional[Path] = MODEL_DIR,
    dataset: Optional[Path] = typer.Option(None, "--dataset",
                                             help="Benchmark dataset (default: held-out task prompts)."),
    task_set: str = typer.Option("all", "--task_set", help="Without --dataset: a task family, all, or general."),
    num_requests: int = typer.Option(9, "--num_requests", help="Requests per setting (the first N of the dataset)."),
    output_tokens: int = typer.Option(128, "--output_tokens", help="Without --dataset: tokens per request."),
    max_nextn: int = typer.Option(5, "--max_nextn", help="Largest K of the sweep."),
    modes: str = typer.Option("eagle,vanilla", "--modes", help="Drafting modes, comma-separated."),
    relaxed_nextn: int = typer.Option(3, "--relaxed_nextn", help="K of the relaxed-acceptance setting (0 = none)."),
    relaxed_topk: int = typer.Option(10, "--relaxed_topk", help="Relaxed acceptance: candidates from the top-k."),
    relaxed_delta: float = typer.Option(0.6, "--relaxed_delta", help="Relaxed acceptance: probability margin."),
    relaxed_mode: str = typer.Option("auto", "--relaxed_mode", help="auto | eagle | vanilla."),
    policy_nextn: Optional[int] = typer.Option(
        None, "--policy_nextn",
        help="Max K of the `eagle policy` / `vanilla policy` rows: the default draft-length policy, which picks "
             "0..K drafts per step from measured costs (default: --max_nextn; 0 = none). Every other row is fixed K."),
    adaptive_nextn: Optional[int] = typer.Option(
        None, "--adaptive_nextn",
        help="Max K of the `eagle adaptive` / `vanilla adaptive` rows (default: --max_nextn; 0 = none)."),
    adaptive_confidence: str = typer.Option(
        str(DEFAULT_CONFIDENCE), "--adaptive_confidence",
        help="Adaptive rows: draft_confidence_threshold, or several comma-separated (one row each per mode); "
             "default: the value docs/adaptive.md derives for this engine."),
    adaptive_schedule: Optional[str] = typer.Option(None, "--adaptive_schedule",
                                                    help="Adaptive rows: draft_len_schedule, e.g. 1:4,4:2,16:0."),
    adaptive_window: int = typer.Option(0, "--adaptive_window", help="Adaptive rows: acceptance_window (0 = off)."),
    adaptive_window_threshold: float = typer.Option(0.0, "--adaptive_window_threshold",
                                                    help="Adaptive rows: acceptance_length_threshold."),
    concurrency: int = typer.Option(1, "--concurrency", help="Requests in flight (1 = min-latency mode)."),
    warmup: int = typer.Option(1, "--warmup", help="Requests run before measuring each setting."),
    ignore_eos: bool = typer.Option(True, "--ignore_eos/--no_ignore_eos", help="Emit exactly output_tokens."),
    dtype: str = DTYPE,
    max_num_tokens: int = MAX_NUM_TOKENS,
    max_seq_len: Optional[int] = MAX_SEQ_LEN,
    kv_cache_fraction: float = KV_FRACTION,
    extra_llm_api_options: Optional[Path] = EXTRA_OPTIONS,
    num_threads: Optional[int] = NUM_THREADS,
    plot: Path = typer.Option(DEFAULT_PLOT, "--plot", help="Figure 7 PNG (figure 8 goes beside it as *_accuracy.png)."),
    no_plot: bool = typer.Option(False, "--no_plot", help="Write no figure."),
    roofline: bool = typer.Option(True, "--roofline/--no_roofline", help="Measure bandwidth; add floor step times."),
    bandwidth_mib: int = typer.Option(256, "--bandwidth_mib", help="Buffer size of the bandwidth measurement."),
    accuracy: bool = typer.Option(False, "--accuracy", help="Also score every task set, strict vs relaxed (figure 8)."),
    accuracy_per_family: int = typer.Option(10, "--accuracy_per_family", help="Held-out questions per task set."),
    accuracy_max_tokens: int = typer.Option(768, "--accuracy_max_tokens",
                                             help="Token limit of accuracy runs (EOS ends them)."),
    accuracy_concurrency: int = typer.Option(8, "--accuracy_concurrency", help="Requests in flight in accuracy runs."),
    peers: bool = typer.Option(False, "--peers", help="Also time Hugging Face generate (plain, prompt lookup)."),
    prompt_lookup_num_tokens: int = typer.Option(10, "--prompt_lookup_num_tokens", help="Peers: prompt-lookup drafts."),
    report_json: Optional[Path] = REPORT_JSON,
    log_level: str = LOG_LEVEL,
) -> None:
    setup_logging(log_level)

    def run() -> None:
        from mtp_core.bench import sweep as sw
        from mtp_core.bench.dataset import encode_request, load_dataset, task_requests
        from mtp_core.bench.metrics import decode_acceptance_length, decode_step_time_s
        from mtp_core.bench.progress import request_progress
        from mtp_core.bench.report import dataset_info, engine_info, machine_info
        from mtp_core.llm import LLM

        set_threads(num_threads)
        want_plot = not no_plot
        explicit_plot = "plot" in explicit_params(ctx)
        if want_plot:
            try:
                from mtp_core.bench.plot import require_matplotlib
                require_matplotlib()
            except ValueError:
                if explicit_plot:
                    raise
                print("note: matplotlib is not installed, so no figure is written (pip install matplotlib)",
                      file=sys.stderr)
                want_plot = False
        if peers:
            from mtp_core.bench.peers import require_transformers
            require_transformers()
        if num_requests < 1 or concurrency == 0 or warmup < 0:
            raise ValueError("--num_requests must be >= 1, --concurrency non-zero and --warmup >= 0")
        if accuracy and relaxed_nextn < 1:
            raise ValueError("--accuracy compares strict and relaxed acceptance at --relaxed_nextn; set it >= 1")
        if accuracy:
            from mtp_core.bench.eval_sets import read_manifest

            per_set = read_manifest().per_set
            if not 1 <= accuracy_per_family <= per_set:
                raise ValueError(f"--accuracy_per_family must be between 1 and {per_set} (the held-out questions "
                                 "per set that ship with the model)")
        requests = (load_dataset(dataset) if dataset is not None
                    else task_requests(task_set, num_requests, output_tokens))
        in_file = len(requests)
        requests = requests[:num_requests]
        own = ("relaxed_topk", "relaxed_delta")        # the sweep's relaxed setting, not an engine flag here
        cfg = llm_config({k: v for k, v in ctx.params.items() if k not in own},
                         {k: v for k, v in explicit_params(ctx).items() if k not in own},
                         max(concurrency, accuracy_concurrency if accuracy else 1, 1))
        llm = LLM(cfg)
        model, tok = llm.model, llm.tokenizer
        eos, think = sorted(llm.engine.eos_token_ids), llm.engine.think_ids
        del llm.engine
        base = sw.setting_config(cfg, sw.Setting("none", 0))
        mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
        from mtp_core.config.schedule import parse_schedule
        try:
            confidences = [float(c) for c in adaptive_confidence.split(",") if c.strip()]
        except ValueError:
            raise ValueError(f"--adaptive_confidence takes numbers in [0, 1), comma-separated; got "
                             f"{adaptive_confidence!r}") from None
        if not confidences or not all(0 <= c < 1 for c in confidences):
            raise ValueError(f"--adaptive_confidence must be in [0, 1), got {adaptive_confidence}")
        schedule = parse_schedule(adaptive_schedule, "--adaptive_schedule") if adaptive_schedule else None
        settings = sw.sweep_settings(model.num_mtp_modules, max_nextn, mode_list,
                                     relaxed_nextn, relaxed_topk, relaxed_delta, relaxed_mode,
                                     policy_nextn=max_nextn if policy_nextn is None else policy_nextn)
        for c in confidences:
            settings += sw.sweep_settings(model.num_mtp_modules, 0, mode_list, 0,
                                          adaptive_nextn=max_nextn if adaptive_nextn is None else adaptive_nextn,
                                          adaptive_confidence=c, adaptive_schedule=schedule,
                                          adaptive_window=adaptive_window,
                                          adaptive_window_threshold=adaptive_window_threshold)[1:]
        prompts = [encode_request(tok, r) for r in requests]
        outs = [r.output_tokens for r in requests]
        ds = dataset_info(str(dataset) if dataset else f"<held-out task prompts: {task_set}>", in_file, prompts, outs,
                          [r.extra.get("task") for r in requests])
        bandwidth = None
        if roofline:
            from mtp_core.bench.roofline import measure_bandwidth, roofline as roof
            bandwidth = measure_bandwidth(bandwidth_mib)
        rows, reference = [], None
        with request_progress(len(settings) * len(prompts), "sweep") as advance:
            for s in settings:
                records = sw.run_setting(model, base, eos, think, s, prompts, outs, concurrency, warmup, ignore_eos,
                                         on_finish=advance)
                row = sw.summary_row(s, records)
                if s.K == 0:
                    reference = [_until_eos(r.output_ids, eos) for r in records]
                if bandwidth:
                    rf = roof(model, s.K, s.mode, decode_acceptance_length(records), ds["avg_isl"] + ds["avg_osl"] / 2,
                              bandwidth, decode_step_time_s(records))
                    row["floor_step_ms"], row["roofline"] = rf["floor_step_ms"], rf
                rows.append(row)
        sw.add_speedups(rows)
        costs = sw.forward_costs(model, base, eos, prompts[0]) if model.num_mtp_modules else None
        peer_rows = None
        if peers:
            from mtp_core.bench.peers import ASSISTED_NOTE, run_hf_peers
            with request_progress(2 * len(prompts), "peers") as advance:
                peer_rows = run_hf_peers(cfg.model_dir, prompts, outs, next(model.parameters()).dtype,
                                         eos[0] if eos else 0, prompt_lookup_num_tokens, min(warmup, 1),
                                         reference if ignore_eos else None, on_finish=advance)
        print(sw.format_table(rows, peer_rows), flush=True)
        if costs:
            print(f"one MTP module forward / one main forward (1 token): {costs['mtp_over_main']:.3f} "
                  f"({costs['mtp_forward_ms']:.3f} / {costs['main_forward_ms']:.3f} ms, "
                  f"{'native' if costs['native'] else 'torch'} decode forward)", flush=True)
        if peers:
            print(f"note: {ASSISTED_NOTE}", flush=True)
        if bandwidth:
            print(f"roofline: memory bandwidth {bandwidth / 1e9:.2f} GB/s with {machine_info()['torch_num_threads']} "
                  "thread(s); floor = bytes read per batch-1 step / bandwidth", flush=True)
        report = {"engine": engine_info(cfg, model), "machine": machine_info(cfg.device), "dataset": ds,
                  "settings": rows, "peers": peer_rows, "forward_costs": costs, "bandwidth_gb_s": bandwidth / 1e9 if bandwidth else None,
                  "concurrency": concurrency, "ignore_eos": ignore_eos}
        if accuracy:
            report["accuracy"] = _accuracy(sw, model, base, eos, think, tok, settings, accuracy_per_family,
                                           accuracy_max_tokens, accuracy_concurrency)
            print("\n" + sw.format_accuracy(report["accuracy"]), flush=True)
        if want_plot:
            from mtp_core.bench.plot import plot_accuracy, plot_sweep
            report["plot"] = str(plot_sweep(rows, plot, f"{Path(cfg.model_dir).name}: MTP sweep"))
            print(f"figure: {report['plot']}", file=sys.stderr)
            if accuracy:
                acc_path = plot.with_name(plot.stem + "_accuracy" + plot.suffix)
                report["accuracy_plot"] = str(plot_accuracy(report["accuracy"], acc_path))
                print(f"figure: {acc_path}", file=sys.stderr)
        if report_json is not None:
            write_json(report_json, report)

    run_or_exit(run)


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

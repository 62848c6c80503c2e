"""`mtp bench`: trtllm-bench for this engine. Min-latency mode = `--concurrency 1` (batch 1, EOS ignored).

stdout: the report sections (engine, machine, requests, world, performance, decoding statistics,
dataset); stderr: logs and a progress bar (hidden when stderr is not a terminal). `--report_json` writes
the same numbers as JSON. Exit codes: 0 ok, 2 usage/config error, 1 runtime error, 130 Ctrl-C.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from cli.common import run_or_exit, setup_logging
from cli.options import brief_option, explicit_params, plain

# engine flags shared with `mtp sweep`, in their brief form (quickstart's names; declared by the config schema)
MODEL_DIR = brief_option("model_dir")
DTYPE = brief_option("dtype")
MAX_NUM_TOKENS = brief_option("max_num_tokens")
MAX_SEQ_LEN = brief_option("max_seq_len")
KV_FRACTION = brief_option("kv_cache_fraction")
EXTRA_OPTIONS = brief_option("extra_llm_api_options")
NUM_THREADS = brief_option("num_threads")
LOG_LEVEL = brief_option("log_level")
WARMUP = typer.Option(2, "--warmup", help="Requests run before measuring (not reported).")
REPORT_JSON = typer.Option(None, "--report_json", help="Write the report as JSON to this file.")


def llm_config(p: dict[str, Any], explicit: dict[str, Any], max_batch_size: int, spec_algo: Optional[str] = None):
    """LLMConfig from bench/sweep flags via quickstart's builder (flags the command lacks take their defaults)."""
    from cli.common import build_llm_config

    full = {k: plain(v) for k, v in p.items()}
    full.update(spec_decode_algo=spec_algo, max_batch_size=max_batch_size)
    return build_llm_config(full, explicit)


def set_threads(num_threads: Optional[int]) -> None:
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"--num_threads must be >= 1, got {num_threads}")
        import torch
        torch.set_num_threads(num_threads)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def request_rows(records: list, tokenizer: Any) -> list[dict]:
    return [{"task_id": r.task_id, "input_tokens": r.num_input_tokens, "output_tokens": r.num_output_tokens,
             "ttft_ms": r.ttft_s * 1e3, "e2e_ms": r.e2e_s * 1e3,
             "tpot_ms": None if r.tpot_s is None else r.tpot_s * 1e3, "decoding_steps": r.stats.num_steps,
             "acceptance_length": r.stats.acceptance_length, "finish_reason": r.finish_reason,
             "output": tokenizer.decode(r.output_ids)} for r in records]


def bench_command(
    ctx: typer.Context,
    dataset: Path = typer.Option(..., "--dataset", help="JSON lines: task_id, prompt or input_ids, output_tokens."),
    model_dir: Optional[Path] = MODEL_DIR,
    num_requests: int = typer.Option(0, "--num_requests", help="Use the first N requests (0 = all)."),
    concurrency: int = typer.Option(1, "--concurrency", help="Requests in flight (1 = min-latency mode; -1 = all)."),
    max_batch_size: Optional[int] = typer.Option(None, "--max_batch_size",
                                                 help="Engine batch (default: concurrency, or 8)."),
    max_num_tokens: int = MAX_NUM_TOKENS,
    max_seq_len: Optional[int] = MAX_SEQ_LEN,
    warmup: int = WARMUP,
    ignore_eos: bool = typer.Option(True, "--ignore_eos/--no_ignore_eos",
                                    help="Emit exactly output_tokens per request."),
    streaming: bool = typer.Option(False, "--streaming",
                                    help="Detokenize every step as a streaming client; report ITL."),
    spec_decode_algo: Optional[str] = brief_option("spec_decode_algo"),
    spec_decode_max_draft_len: int = brief_option("spec_decode_max_draft_len"),
    mtp_mode: str = brief_option("mtp_mode"),
    use_mtp_vanilla: bool = brief_option("use_mtp_vanilla"),
    use_relaxed_acceptance_for_thinking: bool = brief_option("use_relaxed_acceptance_for_thinking"),
    relaxed_topk: int = brief_option("relaxed_topk"),
    relaxed_delta: float = brief_option("relaxed_delta"),
    spec_decode_draft_len_policy: str = brief_option("spec_decode_draft_len_policy"),
    spec_decode_draft_confidence: float = brief_option("spec_decode_draft_confidence"),
    spec_decode_draft_len_schedule: Optional[str] = brief_option("spec_decode_draft_len_schedule"),
    spec_decode_acceptance_window: int = brief_option("spec_decode_acceptance_window"),
    spec_decode_acceptance_length_threshold: float = brief_option("spec_decode_acceptance_length_threshold"),
    dtype: str = DTYPE,
    kv_cache_fraction: float = KV_FRACTION,
    disable_kv_cache_reuse: bool = brief_option("disable_kv_cache_reuse"),
    extra_llm_api_options: Optional[Path] = EXTRA_OPTIONS,
    num_threads: Optional[int] = NUM_THREADS,
    replay_acceptance: Optional[str] = typer.Option(
        None, "--replay_acceptance",
        help="Benchmarks only: after every MTP forward, replace the drafts with the target's own greedy continuation "
             "(recorded by a run without MTP first), kept per position at these rates: 'r1' (DeepSeek-R1's "
             "0.92,0.72,0.36) or a list like 0.9,0.7. For random-weight checkpoints; labelled in the report."),
    roofline: bool = typer.Option(False, "--roofline", help="Measure memory bandwidth; print the floor step time."),
    bandwidth_mib: int = typer.Option(256, "--bandwidth_mib", help="Buffer size of the bandwidth measurement."),
    report_json: Optional[Path] = REPORT_JSON,
    request_json: Optional[Path] = typer.Option(None, "--request_json", help="Write per-request results here."),
    log_level: str = LOG_LEVEL,
    base_url: Optional[str] = typer.Option(None, "--base_url",
                                           help="Benchmark a running `mtp serve` (OpenAI API) at this URL over HTTP "
                                                "instead of loading the model here."),
    api_key: Optional[str] = typer.Option(None, "--api_key", envvar="MTP_API_KEY", show_envvar=True,
                                          help="With --base_url: send 'Authorization: Bearer KEY' (default: "
                                               "$MTP_API_KEY)."),
) -> None:
    setup_logging(log_level)

    def run() -> None:
        if base_url is not None:
            return _run_http(ctx, base_url, dataset, num_requests, concurrency, warmup, ignore_eos, report_json,
                             request_json, api_key)
        if "api_key" in explicit_params(ctx):
            raise ValueError("--api_key is for a server; use it with --base_url")
        from mtp_core.bench.dataset import encode_request, load_dataset
        from mtp_core.bench.metrics import decode_acceptance_length, decode_step_time_s
        from mtp_core.bench.progress import request_progress
        from mtp_core.bench.report import build_report, dataset_info, format_report
        from mtp_core.bench.runner import run_requests
        from mtp_core.llm import LLM

        set_threads(num_threads)
        for name, v in (("--num_requests", num_requests), ("--warmup", warmup)):
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if concurrency == 0 or concurrency < -1:
            raise ValueError(f"--concurrency must be >= 1 (or -1 for all at once), got {concurrency}")
        requests = load_dataset(dataset)
        in_file = len(requests)
        requests = requests[:num_requests] if num_requests else requests
        batch = max_batch_size if max_batch_size is not None else (concurrency if concurrency > 0 else 8)
        cfg = llm_config(ctx.params, explicit_params(ctx), batch, spec_decode_algo)
        llm = LLM(cfg, iter_log=None)
        prompts = [encode_request(llm.tokenizer, r) for r in requests]
        outs = [r.output_tokens for r in requests]
        replay = None
        if replay_acceptance is not None:
            if cfg.speculative_config is None:
                raise ValueError("--replay_acceptance replaces MTP drafts; turn MTP on (--spec_decode_algo MTP)")
            replay = _replay(llm, cfg, prompts, outs, concurrency, ignore_eos, replay_acceptance)
            llm.engine.replay = replay
            print(f"note: draft acceptance is {replay.label()}: the MTP forwards run, their drafts are replaced",
                  file=sys.stderr)
        if warmup:
            idx = [i % len(prompts) for i in range(warmup)]
            run_requests(llm.engine, [prompts[i] for i in idx], [outs[i] for i in idx], concurrency, ignore_eos)
        llm.engine.reset_prefix_cache()          # the measured run starts with an empty prefix cache
        with request_progress(len(prompts), "bench") as advance:
            records = run_requests(llm.engine, prompts, outs, concurrency, ignore_eos,
                                   task_ids=[r.task_id for r in requests], on_finish=advance,
                                   stream_decoder=llm.tokenizer.stream_decoder if streaming else None)
        ds = dataset_info(str(dataset), in_file, prompts, outs, [r.extra.get("task") for r in requests])
        report = build_report(records, cfg, llm.model, concurrency, streaming, ds,
                              {"warmup": warmup, "ignore_eos": ignore_eos})
        if cfg.speculative_config is not None:
            report["draft_len_policy"] = llm.engine.policy.summary()   # its cost table, acceptance, re-tries
        if replay is not None:
            report["replay_acceptance"] = {"rates": list(replay.rates), "label": replay.label(),
                                           "steps_replaced": replay.num_replaced}
        report["prefix_cache"] = {"enabled": cfg.kv_cache_config.enable_block_reuse,
                                  **llm.engine.blocks.stats.as_dict()}
        if roofline:
            from mtp_core.bench.roofline import measure_bandwidth, roofline as roof

            if concurrency != 1:
                print("warning: the roofline assumes batch 1; run it with --concurrency 1", file=sys.stderr)
            spec = cfg.speculative_config
            mode = "none" if spec is None else spec.resolved_mode(llm.model.num_mtp_modules)
            ctx_len = ds["avg_isl"] + ds["avg_osl"] / 2
            report["roofline"] = roof(llm.model, spec.max_draft_len if spec else 0, mode,
                                      decode_acceptance_length(records), ctx_len,
                                      measure_bandwidth(bandwidth_mib), decode_step_time_s(records))
        print(format_report(report), flush=True)
        if report_json is not None:
            write_json(report_json, report)
        if request_json is not None:
            write_json(request_json, request_rows(records, llm.tokenizer))

    run_or_exit(run)



def _replay(llm, cfg, prompts: list[list[int]], outs: list[int], concurrency: int, ignore_eos: bool, rates: str):
    """The acceptance replay of --replay_acceptance: every prompt's greedy continuation from an engine without MTP
    on the same model (its own small KV pool), then the replay that hands it out (speculative/replay.py)."""
    import dataclasses

    from mtp_core.bench.runner import run_requests
    from mtp_core.config import KvCacheConfig
    from mtp_core.engine.engine import Engine
    from mtp_core.speculative.replay import ReplayDrafts, parse_rates

    parsed = parse_rates(rates)
    need = max(len(p) + n for p, n in zip(prompts, outs)) + 16
    c = concurrency if concurrency > 0 else len(prompts)
    plain_cfg = dataclasses.replace(cfg, speculative_config=None,
                                    kv_cache_config=KvCacheConfig(max_tokens=max(need * min(c, 8), 1024)))
    plain = Engine(llm.model, plain_cfg, list(llm.tokenizer.eos_token_ids), llm.tokenizer.think_token_ids())
    try:
        records = run_requests(plain, prompts, outs, min(c, 8), ignore_eos)
    finally:
        plain.close()
    conts = {tuple(p): list(r.output_ids) for p, r in zip(prompts, records)}
    return ReplayDrafts(parsed, conts, llm.model.config.vocab_size)


def _run_http(ctx: typer.Context, base_url: str, dataset: Path, num_requests: int, concurrency: int, warmup: int,
              ignore_eos: bool, report_json: Optional[Path], request_json: Optional[Path],
              api_key: Optional[str] = None) -> None:
    """Client mode: the same report, measured over HTTP against a running server."""
    from mtp_core.bench.dataset import load_dataset
    from mtp_core.bench.http_client import build_http_report, get_json, run_http_requests, served_model
    from mtp_core.bench.progress import request_progress
    from mtp_core.bench.report import dataset_info, format_report

    engine_only = [f for f in explicit_params(ctx) if f not in (
        "dataset", "num_requests", "concurrency", "warmup", "ignore_eos", "report_json", "request_json",
        "log_level", "base_url", "num_threads", "streaming", "api_key")]   # over HTTP every request streams
    if engine_only:
        raise ValueError(f"--{engine_only[0]} configures a local engine; with --base_url the server's settings "
                         "apply (pass it to `mtp serve`)")
    for name, v in (("--num_requests", num_requests), ("--warmup", warmup)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    if concurrency == 0 or concurrency < -1:
        raise ValueError(f"--concurrency must be >= 1 (or -1 for all at once), got {concurrency}")
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base_url must start with http:// or https://, got {base_url!r}")
    requests = load_dataset(dataset)
    in_file = len(requests)
    requests = requests[:num_requests] if num_requests else requests
    info = get_json(base_url, "/server_info", api_key)
    model = served_model(base_url, api_key)
    jobs = [(r.task_id, r.input_ids if r.input_ids is not None else r.prompt, r.output_tokens) for r in requests]
    if warmup:
        run_http_requests(base_url, [jobs[i % len(jobs)] for i in range(warmup)], concurrency, ignore_eos, model,
                          api_key=api_key)
    with request_progress(len(jobs), "bench") as advance:
        results = run_http_requests(base_url, jobs, concurrency, ignore_eos, model, on_finish=advance,
                                    api_key=api_key)
    records = [r for r, _ in results]
    lengths = [range(r.num_input_tokens) for r in records]          # dataset_info needs only the lengths
    ds = dataset_info(str(dataset), in_file, lengths, [r.output_tokens for r in requests],  # type: ignore[arg-type]
                      [r.extra.get("task") for r in requests])
    report = build_http_report(records, info, concurrency, ds,
                               {"warmup": warmup, "ignore_eos": ignore_eos, "base_url": base_url})
    print(format_report(report), flush=True)
    if report_json is not None:
        write_json(report_json, report)
    if request_json is not None:
        rows = [{"task_id": r.task_id, "input_tokens": r.num_input_tokens, "output_tokens": r.num_output_tokens,
                 "ttft_ms": r.ttft_s * 1e3, "e2e_ms": r.e2e_s * 1e3,
                 "tpot_ms": None if r.tpot_s is None else r.tpot_s * 1e3, "decoding_steps": r.stats.num_steps,
                 "acceptance_length": r.stats.acceptance_length, "finish_reason": r.finish_reason, "output": text}
                for r, text in results]
        write_json(request_json, rows)

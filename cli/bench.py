"""`mtp bench`: trtllm-bench for this engine. Min-latency mode = `--concurrency 1` (batch 1, EOS ignored).

stdout: the report sections (engine, machine, requests, world, performance, decoding statistics,
dataset); stderr: logs and a progress bar (hidden when stderr is not a terminal). `--report_json` writes
the same numbers as JSON. Exit codes: 0 ok, 2 usage/config error, 1 runtime error, 130 Ctrl-C.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from cli.common import run_or_exit, setup_logging
from cli.options import explicit_params, help_order, parameters, plain, section_keys, set_parameters
from mtp_core.config.schema import Flag

# options `mtp sweep` shares
REPORT_JSON = Flag("--report_json", "Write the report as JSON to this file.", type=Optional[Path], default=None)
BANDWIDTH_MIB = Flag("--bandwidth_mib", "Buffer size of the bandwidth measurement.", type=int, default=256)

# bench's own options; its engine flags are the schema's, in their brief form (cli/options.py)
OWN = {flag.key: flag for flag in (
    Flag("--dataset", "JSON lines: task_id, prompt or input_ids, output_tokens.", type=Path, default=...),
    Flag("--num_requests", "Use the first N requests (0 = all).", type=int, default=0),
    Flag("--concurrency", "Requests in flight (1 = min-latency mode; -1 = all).", type=int, default=1),
    Flag("--max_batch_size", "Engine batch (default: concurrency, or 8).", type=Optional[int], default=None),
    Flag("--warmup", "Requests run before measuring (not reported).", type=int, default=2),
    Flag("--streaming", "Detokenize every step as a streaming client; report ITL.", type=bool, default=False),
    Flag("--replay_acceptance",
         "Benchmarks only: after every MTP forward, replace the drafts with the target's own greedy continuation "
         "(recorded by a run without MTP first), kept per position at these rates: 'r1' (DeepSeek-R1's "
         "0.92,0.72,0.36) or a list like 0.9,0.7. For random-weight checkpoints; labelled in the report.",
         type=Optional[str], default=None),
    Flag("--roofline", "Measure memory bandwidth; print the floor step time.", type=bool, default=False),
    BANDWIDTH_MIB, REPORT_JSON,
    Flag("--request_json", "Write per-request results here.", type=Optional[Path], default=None),
    Flag("--base_url", "Benchmark a running `mtp serve` (OpenAI API) at this URL over HTTP instead of loading the "
         "model here.", type=Optional[str], default=None),
)} | {
    "ignore_eos": (bool, typer.Option(True, "--ignore_eos/--no_ignore_eos",
                                      help="Emit exactly output_tokens per request.")),
    "api_key": (Optional[str], typer.Option(None, "--api_key", envvar="MTP_API_KEY", show_envvar=True,
                                            help="With --base_url: send 'Authorization: Bearer KEY' (default: "
                                                 "$MTP_API_KEY).")),
}
# the speculative flags as the schema declares them, the drafting mode filed after K
SPEC_FLAGS = help_order({"spec_decode_max_draft_len": ("mtp_mode", "use_mtp_vanilla")},
                        section_keys("speculative_config"))
FLAGS = ("dataset", "model_dir", "num_requests", "concurrency", "max_batch_size", "max_num_tokens", "max_seq_len",
         "warmup", "ignore_eos", "streaming", *SPEC_FLAGS, "dtype", "kv_cache_fraction",
         "disable_kv_cache_reuse", "extra_llm_api_options", "num_threads", "replay_acceptance", "roofline",
         "bandwidth_mib", "report_json", "request_json", "log_level", "base_url", "api_key")
# the options that mean something with --base_url (over HTTP every request streams)
HTTP_FLAGS = ("dataset", "num_requests", "concurrency", "warmup", "ignore_eos", "report_json", "request_json",
              "log_level", "base_url", "num_threads", "streaming", "api_key")


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


def request_rows(records: list, outputs: list[str]) -> list[dict]:
    """--request_json's rows: each request's numbers and its output text."""
    return [{"task_id": r.task_id, "input_tokens": r.num_input_tokens, "output_tokens": r.num_output_tokens,
             "ttft_ms": r.ttft_s * 1e3, "e2e_ms": r.e2e_s * 1e3,
             "tpot_ms": None if r.tpot_s is None else r.tpot_s * 1e3, "decoding_steps": r.stats.num_steps,
             "acceptance_length": r.stats.acceptance_length, "finish_reason": r.finish_reason,
             "output": text} for r, text in zip(records, outputs)]


def write_reports(p: dict[str, Any], report: dict, rows: Callable[[], list[dict]]) -> None:
    """--report_json and --request_json (rows: computed only when asked for)."""
    if p["report_json"] is not None:
        write_json(p["report_json"], report)
    if p["request_json"] is not None:
        write_json(p["request_json"], rows())


def bench_command(ctx: typer.Context, **flags: Any) -> None:
    setup_logging(flags["log_level"])
    p = dict(ctx.params)
    run_or_exit(lambda: _run_http(ctx, p) if p["base_url"] is not None else _run_local(ctx, p))


set_parameters(bench_command, parameters(FLAGS, OWN, brief=True))


def _check_counts(p: dict[str, Any]) -> None:
    """--num_requests, --warmup and --concurrency in range (checked alike locally and over HTTP)."""
    for name in ("num_requests", "warmup"):
        if p[name] < 0:
            raise ValueError(f"--{name} must be >= 0, got {p[name]}")
    if p["concurrency"] == 0 or p["concurrency"] < -1:
        raise ValueError(f"--concurrency must be >= 1 (or -1 for all at once), got {p['concurrency']}")


def _requests(p: dict[str, Any]) -> tuple[list, int]:
    """The dataset's first --num_requests requests (all with 0), and how many the file holds."""
    from mtp_core.bench.dataset import load_dataset

    requests = load_dataset(p["dataset"])
    return (requests[:p["num_requests"]] if p["num_requests"] else requests), len(requests)


def _run_local(ctx: typer.Context, p: dict[str, Any]) -> None:
    """Load the model here, run the dataset, print (and write) the report."""
    if "api_key" in explicit_params(ctx):
        raise ValueError("--api_key is for a server; use it with --base_url")
    from mtp_core.bench.dataset import encode_request
    from mtp_core.bench.report import dataset_info, format_report
    from mtp_core.llm import LLM

    set_threads(p["num_threads"])
    _check_counts(p)
    requests, in_file = _requests(p)
    concurrency = p["concurrency"]
    batch = p["max_batch_size"] if p["max_batch_size"] is not None else (concurrency if concurrency > 0 else 8)
    cfg = llm_config(ctx.params, explicit_params(ctx), batch, p["spec_decode_algo"])
    llm = LLM(cfg, iter_log=None)
    prompts = [encode_request(llm.tokenizer, r) for r in requests]
    outs = [r.output_tokens for r in requests]
    replay = _install_replay(llm, cfg, prompts, outs, p) if p["replay_acceptance"] is not None else None
    records = _measure(llm, requests, prompts, outs, p)
    ds = dataset_info(str(p["dataset"]), in_file, prompts, outs, [r.extra.get("task") for r in requests])
    report = _local_report(llm, cfg, records, ds, replay, p)
    print(format_report(report), flush=True)
    write_reports(p, report, lambda: request_rows(records, [llm.tokenizer.decode(r.output_ids) for r in records]))


def _measure(llm: Any, requests: list, prompts: list[list[int]], outs: list[int], p: dict[str, Any]) -> list:
    """--warmup requests, then the dataset on an empty prefix cache (measured requests never hit the warm-up's)."""
    from mtp_core.bench.progress import request_progress
    from mtp_core.bench.runner import run_requests

    concurrency, ignore_eos = p["concurrency"], p["ignore_eos"]
    if p["warmup"]:
        idx = [i % len(prompts) for i in range(p["warmup"])]
        run_requests(llm.engine, [prompts[i] for i in idx], [outs[i] for i in idx], concurrency, ignore_eos)
    llm.engine.reset_prefix_cache()          # the measured run starts with an empty prefix cache
    with request_progress(len(prompts), "bench") as advance:
        return run_requests(llm.engine, prompts, outs, concurrency, ignore_eos,
                            task_ids=[r.task_id for r in requests], on_finish=advance,
                            stream_decoder=llm.tokenizer.stream_decoder if p["streaming"] else None)


def _local_report(llm: Any, cfg: Any, records: list, ds: dict, replay: Any, p: dict[str, Any]) -> dict:
    from mtp_core.bench.report import build_report

    report = build_report(records, cfg, llm.model, p["concurrency"], p["streaming"], ds,
                          {"warmup": p["warmup"], "ignore_eos": p["ignore_eos"]})
    if cfg.speculative_config is not None:
        report["draft_len_policy"] = llm.engine.spec.policy.summary()   # its cost table, acceptance, re-tries
    if replay is not None:
        report["replay_acceptance"] = {"rates": list(replay.rates), "label": replay.label(),
                                       "steps_replaced": replay.num_replaced}
    report["prefix_cache"] = {"enabled": cfg.kv_cache_config.enable_block_reuse,
                              **llm.engine.blocks.stats.as_dict()}
    if p["roofline"]:
        report["roofline"] = _roofline(llm, cfg, records, ds, p)
    return report


def _roofline(llm: Any, cfg: Any, records: list, ds: dict, p: dict[str, Any]) -> dict:
    """--roofline: the floor step time at batch 1 from the measured memory bandwidth."""
    from mtp_core.bench.metrics import decode_acceptance_length, decode_step_time_s
    from mtp_core.bench.roofline import measure_bandwidth, roofline as roof

    if p["concurrency"] != 1:
        print("warning: the roofline assumes batch 1; run it with --concurrency 1", file=sys.stderr)
    spec = cfg.speculative_config
    mode = "none" if spec is None else spec.resolved_mode(llm.model.num_mtp_modules)
    ctx_len = ds["avg_isl"] + ds["avg_osl"] / 2
    return roof(llm.model, spec.max_draft_len if spec else 0, mode, decode_acceptance_length(records), ctx_len,
                measure_bandwidth(p["bandwidth_mib"]), decode_step_time_s(records))


def _install_replay(llm: Any, cfg: Any, prompts: list[list[int]], outs: list[int], p: dict[str, Any]) -> Any:
    """--replay_acceptance: the engine's drafts replaced by the target's own continuation at the given rates."""
    if cfg.speculative_config is None:
        raise ValueError("--replay_acceptance replaces MTP drafts; turn MTP on (--spec_decode_algo MTP)")
    replay = _replay(llm, cfg, prompts, outs, p["concurrency"], p["ignore_eos"], p["replay_acceptance"])
    llm.engine.spec.replay = replay
    print(f"note: draft acceptance is {replay.label()}: the MTP forwards run, their drafts are replaced",
          file=sys.stderr)
    return replay


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


def _run_http(ctx: typer.Context, p: dict[str, Any]) -> None:
    """Client mode: the same report, measured over HTTP against a running server."""
    from mtp_core.bench.http_client import build_http_report, get_json, served_model
    from mtp_core.bench.report import dataset_info, format_report

    engine_only = [f for f in explicit_params(ctx) if f not in HTTP_FLAGS]
    if engine_only:
        raise ValueError(f"--{engine_only[0]} configures a local engine; with --base_url the server's settings "
                         "apply (pass it to `mtp serve`)")
    _check_counts(p)
    base_url, api_key = p["base_url"], p["api_key"]
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base_url must start with http:// or https://, got {base_url!r}")
    requests, in_file = _requests(p)
    info = get_json(base_url, "/server_info", api_key)
    model = served_model(base_url, api_key)
    jobs = [(r.task_id, r.input_ids if r.input_ids is not None else r.prompt, r.output_tokens) for r in requests]
    results = _measure_http(base_url, model, jobs, p)
    records = [r for r, _ in results]
    lengths = [range(r.num_input_tokens) for r in records]          # dataset_info needs only the lengths
    ds = dataset_info(str(p["dataset"]), in_file, lengths, [r.output_tokens for r in requests],  # type: ignore[arg-type]
                      [r.extra.get("task") for r in requests])
    report = build_http_report(records, info, p["concurrency"], ds,
                               {"warmup": p["warmup"], "ignore_eos": p["ignore_eos"], "base_url": base_url})
    print(format_report(report), flush=True)
    write_reports(p, report, lambda: request_rows(records, [text for _, text in results]))


def _measure_http(base_url: str, model: str, jobs: list, p: dict[str, Any]) -> list:
    """--warmup requests, then the dataset, each a streamed request to the server."""
    from mtp_core.bench.http_client import run_http_requests
    from mtp_core.bench.progress import request_progress

    concurrency, ignore_eos, api_key = p["concurrency"], p["ignore_eos"], p["api_key"]
    if p["warmup"]:
        run_http_requests(base_url, [jobs[i % len(jobs)] for i in range(p["warmup"])], concurrency, ignore_eos, model,
                          api_key=api_key)
    with request_progress(len(jobs), "bench") as advance:
        return run_http_requests(base_url, jobs, concurrency, ignore_eos, model, on_finish=advance, api_key=api_key)

"""The benchmark report: a JSON-ready dict with trtllm-bench's sections, and its text rendering.

Sections: engine, machine, world_info, request_info, performance, streaming_metrics, decoding_stats,
dataset (plus roofline when measured). `format_report` prints them in trtllm-bench's layout.
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from mtp_core.bench.metrics import (RequestRecord, summarize_decoding, summarize_performance,
                                    summarize_streaming)
from mtp_core.config import LLMConfig

RULE = "=" * 59


def version() -> str:
    try:
        from importlib.metadata import version as dist_version
        return dist_version("mtp-core")
    except Exception:  # noqa: BLE001 - not installed as a distribution (source checkout)
        return "0.1.0+source"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def machine_info(device: str = "cpu") -> dict:
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {
        "platform": platform.platform(), "cpu": _cpu_model(), "logical_cpus": os.cpu_count(),
        "usable_cpus": affinity, "torch_num_threads": torch.get_num_threads(), "memory_gib": _memory_gib(),
        "python": sys.version.split()[0], "torch": torch.__version__, "device": device, "gpu": None,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def mode_name(cfg: LLMConfig, num_modules: int) -> str:
    spec = cfg.speculative_config
    if spec is None:
        return "none"
    name = f"MTP-{spec.resolved_mode(num_modules)}"
    if spec.use_relaxed_acceptance_for_thinking:
        name += f"-relaxed(top{spec.relaxed_topk},delta{spec.relaxed_delta:g})"
    if spec.adaptive:
        name += "-adaptive"
    return name


def engine_info(cfg: LLMConfig, model: Any) -> dict:
    from mtp_core.loader.quant import detect_quant_format

    spec = cfg.speculative_config
    quant = detect_quant_format(Path(cfg.model_dir), model.config.raw)
    return {
        "model": Path(cfg.model_dir).name, "model_path": str(cfg.model_dir), "version": version(),
        "backend": "pytorch", "device": cfg.device, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "kv_cache_dtype": cfg.kv_cache_config.dtype, "quantization": quant.name if quant else "none",
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_mtp_modules": model.num_mtp_modules,
        "speculative_config": None if spec is None else {
            "decoding_type": spec.decoding_type, "max_draft_len": spec.max_draft_len,
            "mtp_mode": spec.resolved_mode(model.num_mtp_modules),
            "use_relaxed_acceptance_for_thinking": spec.use_relaxed_acceptance_for_thinking,
            "relaxed_topk": spec.relaxed_topk, "relaxed_delta": spec.relaxed_delta,
            "draft_len_policy": spec.draft_len_policy,
            "draft_confidence_threshold": spec.draft_confidence_threshold,
            "draft_len_schedule": spec.draft_len_schedule, "acceptance_window": spec.acceptance_window,
            "acceptance_length_threshold": spec.acceptance_length_threshold,
            "draft_token_map": spec.draft_token_map},
    }


def world_info(cfg: LLMConfig, concurrency: int) -> dict:
    return {
        "tp_size": cfg.tensor_parallel_size, "pp_size": 1, "ep_size": cfg.moe_expert_parallel_size, "world_size": 1,
        "max_batch_size": cfg.max_batch_size, "max_num_tokens": cfg.max_num_tokens,
        "concurrency": concurrency if concurrency > 0 else None, "scheduling_policy": "fcfs (preempt: recompute)",
        "kv_cache_percentage": cfg.kv_cache_config.free_gpu_memory_fraction, "num_threads": torch.get_num_threads(),
    }


def dataset_info(path: Optional[str], num_in_file: int, prompts: list[list[int]], output_tokens: list[int],
                 tasks: list[Optional[str]]) -> dict:
    isl = [len(p) for p in prompts]
    counts: dict[str, int] = {}
    for t in tasks:
        if t:
            counts[t] = counts.get(t, 0) + 1
    return {
        "path": path, "num_requests_in_file": num_in_file, "num_requests_used": len(prompts),
        "avg_isl": sum(isl) / len(isl), "max_isl": max(isl), "min_isl": min(isl),
        "avg_osl": sum(output_tokens) / len(output_tokens), "max_osl": max(output_tokens),
        "min_osl": min(output_tokens), "tasks": counts,
    }


def build_report(records: list[RequestRecord], cfg: LLMConfig, model: Any, concurrency: int, streaming: bool,
                 dataset: dict, extra_request_info: Optional[dict] = None) -> dict:
    request_info, performance = summarize_performance(records)
    request_info.update(extra_request_info or {})
    spec = cfg.speculative_config
    return {
        "engine": engine_info(cfg, model),
        "machine": machine_info(cfg.device),
        "world_info": world_info(cfg, concurrency),
        "request_info": request_info,
        "performance": performance,
        "streaming_metrics": summarize_streaming(records, streaming),
        "decoding_stats": summarize_decoding(records, spec.max_draft_len if spec else 0,
                                             mode_name(cfg, model.num_mtp_modules)),
        "dataset": dataset,
    }


# ---- text ---------------------------------------------------------------------------------------

def _section(title: str, rows: list[tuple[str, Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4f}"
        return "-" if v is None else str(v)
    width = max(len(k) for k, _ in rows) + 2
    return "\n".join([RULE, f"= {title}", RULE] + [f"{k + ':':<{width}}{fmt(v)}" for k, v in rows]) + "\n"


def _breakdown(tag: str, stats: Optional[dict]) -> list[tuple[str, Any]]:
    if not stats:
        return []
    return [(f"[{tag}] {k.upper()}", stats[k]) for k in ("minimum", "maximum", "average", "p50", "p90", "p95", "p99")]


def format_report(r: dict) -> str:
    e, m, w, q, p, s, d, ds = (r[k] for k in ("engine", "machine", "world_info", "request_info", "performance",
                                              "streaming_metrics", "decoding_stats", "dataset"))
    out = [_section("PYTORCH BACKEND", [("Model", e["model"]), ("Model Path", e["model_path"]),
                                        ("mtp Version", e["version"]), ("Dtype", e["dtype"]),
                                        ("KV Cache Dtype", e["kv_cache_dtype"]), ("Quantization", e["quantization"]),
                                        ("MTP modules", e["num_mtp_modules"])]),
           _section("MACHINE", [("CPU", m["cpu"]), ("Usable CPUs", m["usable_cpus"]),
                                ("Torch threads", m["torch_num_threads"]), ("Device", m["gpu"] or m["device"]),
                                ("Torch", m["torch"])]),
           _section("REQUEST DETAILS", [("Number of requests", q["num_requests"]),
                                        ("Number of concurrent requests", q["avg_num_concurrent_requests"]),
                                        ("Average Input Length (tokens)", q["avg_input_length"]),
                                        ("Average Output Length (tokens)", q["avg_output_length"])]),
           _section("WORLD + RUNTIME INFORMATION", [("TP Size", w["tp_size"]), ("EP Size", w["ep_size"]),
                                                    ("Max Runtime Batch Size", w["max_batch_size"]),
                                                    ("Max Runtime Tokens", w["max_num_tokens"]),
                                                    ("Concurrency", w["concurrency"] or "unlimited"),
                                                    ("KV Memory Percentage", w["kv_cache_percentage"])]),
           _section("PERFORMANCE OVERVIEW", [
               ("Request Throughput (req/sec)", p["request_throughput_req_s"]),
               ("Total Output Throughput (tokens/sec)", p["total_output_throughput_tps"]),
               ("Total Token Throughput (tokens/sec)", p["total_token_throughput_tps"]),
               ("Total Latency (ms)", p["total_latency_ms"]),
               ("Average request latency (ms)", p["avg_request_latency_ms"]),
               ("Per User Output Throughput [w/ ctx] (tps/user)", p["per_user_output_throughput_tps"]),
               ("Per User Output Speed (tps/user)", p["per_user_generation_tps"]),
               ("Average time-to-first-token [TTFT] (ms)", p["ttft_ms"]),
               ("Average time-per-output-token [TPOT] (ms)", p["tpot_ms"]),
               *_breakdown("TTFT", p["ttft_percentiles_ms"]), *_breakdown("TPOT", p["tpot_percentiles_ms"]),
               *_breakdown("Latency", p["request_latency_percentiles_ms"]),
               *_breakdown("ITL", s["itl_percentiles"])])]
    out.append(_decoding_section(r, d))
    out += _optional_sections(r)
    out.append(_section("DATASET DETAILS", [("Dataset Path", ds["path"]),
                                            ("Number of Sequences", ds["num_requests_used"]),
                                            ("Average ISL", ds["avg_isl"]), ("Average OSL", ds["avg_osl"]),
                                            ("Max ISL", ds["max_isl"]), ("Max OSL", ds["max_osl"])]))
    return "\n".join(out)


def _decoding_section(r: dict, d: dict) -> str:
    """DECODING STATISTICS: acceptance, drafts per step, the draft-length policy."""
    per_pos = ", ".join(f"{x:.3f}" for x in d["acceptance_per_position"]) or "-"
    return _section(f"DECODING STATISTICS ({d['mode']})", [
        *([("DRAFT ACCEPTANCE", r["replay_acceptance"]["label"])] if r.get("replay_acceptance") else []),
        *([("Draft vocabulary (token map)", m)] if (m := (r["engine"].get("speculative_config") or {}).get(
            "draft_token_map")) else []),
        ("Max draft length (K)", d["max_draft_len"]), ("Decoding steps", d["num_decoding_steps"]),
        ("Drafts proposed", d["num_draft_tokens"]), ("Drafts accepted", d["num_accepted_draft_tokens"]),
        ("Draft acceptance rate", d["draft_acceptance_rate"]), ("Acceptance length (AL)", d["acceptance_length"]),
        ("AL of the steps that drafted", d.get("drafting_acceptance_length", 0.0)),
        ("Share of decode steps that drafted", d.get("drafting_share", 0.0)),
        ("Acceptance per draft position", f"[{per_pos}]"),
        ("Accepted / proposed per position", "[" + ", ".join(
            f"{a}/{n}" for a, n in zip(d["accepted_per_position"], d["proposed_per_position"])) + "]"),
        ("Drafts per decode step (0..K)", d["drafts_per_step_histogram"]),
        ("Mean drafts per decode step", d["mean_drafts_per_step"]),
        ("Drafts chosen per step (0..K)", d["draft_limit_histogram"]),
        *([("Draft-length policy", r["draft_len_policy"]["policy"]),
           ("Policy re-tries of other counts", r["draft_len_policy"]["num_explorations"])]
          if r.get("draft_len_policy") else []),
        ("Waste (verified / accepted)", d["waste_verified_per_accepted"]),
        ("Acceptance-window pauses", d["num_window_pauses"]),
        *_breakdown("AL", d["acceptance_length_percentiles"])])


def _optional_sections(r: dict) -> list[str]:
    """PREFIX CACHE and ROOFLINE, when the report has them."""
    out = []
    if r.get("prefix_cache"):
        pc = r["prefix_cache"]
        out.append(_section("PREFIX CACHE (KV block reuse)", [
            ("Enabled", pc["enabled"]), ("Prompt tokens reused", f"{pc['reused_tokens']} of {pc['prompt_tokens']}"),
            ("Token hit rate", pc["token_hit_rate"]),
            ("Full blocks hit", f"{pc['hit_blocks']} of {pc['queried_blocks']}"),
            ("Block hit rate", pc["block_hit_rate"]), ("Blocks copied (copy-on-write)", pc["copied_blocks"]),
            ("Cached blocks evicted", pc["evicted_blocks"])]))
    if r.get("roofline"):
        rf = r["roofline"]
        out.append(_section("ROOFLINE (batch 1)", [
            ("Memory bandwidth (GB/s)", rf["bandwidth_gb_s"]), ("Bytes read per step (MB)", rf["step_bytes"] / 1e6),
            ("Floor step time (ms)", rf["floor_step_ms"]), ("Measured step time (ms)", rf["measured_step_ms"]),
            ("Floor / measured", rf["floor_over_measured"])]))
    return out

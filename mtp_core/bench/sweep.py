"""`mtp sweep`: nextn = 0..K_max for each drafting mode, plus relaxed acceptance, over ONE loaded model.

Each setting gets a fresh Engine (its own KV pool and drafter) over the same weights. The table is the
write-up's figure 7: AL, draft acceptance rate, tokens/s/user, speed-up over nextn=0 and engine
efficiency = speed-up / AL (1.0 would mean drafting and verifying K tokens costs nothing extra).
`run_accuracy` is its figure 8: exact match per task set with strict vs relaxed acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from mtp_core.bench.metrics import RequestRecord, decode_step_time_s, summarize_decoding, summarize_performance
from mtp_core.bench.runner import run_requests
from mtp_core.config import LLMConfig, SpeculativeConfig
from mtp_core.config.engine import SWEEP_RELAXED_DELTA, SWEEP_RELAXED_K, SWEEP_RELAXED_TOPK
from mtp_core.engine.engine import Engine


@dataclass(frozen=True)
class Setting:
    mode: str                     # none | eagle | vanilla
    K: int
    relaxed: bool = False
    relaxed_topk: int = 1
    relaxed_delta: float = 0.0
    # the draft-length policy (speculative/policy.py): every row but `eagle policy` / `vanilla policy` is
    # fixed, so that K means K drafts per step
    policy: str = "fixed"
    # adaptive draft length (rows `eagle adaptive` / `vanilla adaptive`; K is then the maximum)
    adaptive: bool = False
    confidence: float = 0.0
    schedule: Optional[tuple[tuple[int, int], ...]] = None
    window: int = 0
    window_threshold: float = 0.0
    token_map: Optional[str] = None   # speculative_config.draft_token_map of every MTP row (None: every id)

    @property
    def label(self) -> str:
        if self.K == 0:
            return "nextn=0"
        if self.policy == "cost" and not self.adaptive:
            return f"{self.mode} policy (K<={self.K})"
        if self.adaptive:
            parts = [f"K<={self.K}"] + ([f"c={self.confidence:g}"] if self.confidence else []) \
                + ([f"sched={','.join(f'{b}:{k}' for b, k in self.schedule)}"] if self.schedule else []) \
                + ([f"win={self.window}@{self.window_threshold:g}"] if self.window else [])
            return f"{self.mode} adaptive ({' '.join(parts)})" + (" + policy" if self.policy == "cost" else "")
        if self.relaxed:
            return f"{self.mode} K={self.K} relaxed(top{self.relaxed_topk},d{self.relaxed_delta:g})"
        return f"{self.mode} K={self.K}"


def sweep_settings(num_modules: int, max_nextn: int = 5, modes: tuple[str, ...] = ("eagle", "vanilla"),
                   relaxed_nextn: int = SWEEP_RELAXED_K, relaxed_topk: int = SWEEP_RELAXED_TOPK,
                   relaxed_delta: float = SWEEP_RELAXED_DELTA,
                   relaxed_mode: str = "auto", adaptive_nextn: int = 0, adaptive_confidence: float = 0.0,
                   adaptive_schedule: Optional[dict[int, int]] = None, adaptive_window: int = 0,
                   adaptive_window_threshold: float = 0.0, policy_nextn: int = 0) -> list[Setting]:
    """nextn=0; Eagle K=1..max_nextn; Vanilla K=1..min(max_nextn, modules) (skipped with one module, where
    it is Eagle K=1); one relaxed setting at K=relaxed_nextn (0 = none); with policy_nextn, the default
    draft-length policy (draft_len_policy cost, K <= policy_nextn) per mode; then the adaptive rows."""
    if max_nextn < 0 or relaxed_nextn < 0:
        raise ValueError("--max_nextn and --relaxed_nextn must be >= 0")
    bad = [m for m in modes if m not in ("eagle", "vanilla")]
    if bad:
        raise ValueError(f"unknown mode {bad[0]!r} in --modes; use eagle and/or vanilla")
    out = [Setting("none", 0)]
    if num_modules == 0:
        return out
    if "eagle" in modes:
        out += [Setting("eagle", k) for k in range(1, max_nextn + 1)]
    if "vanilla" in modes and num_modules > 1:
        out += [Setting("vanilla", k) for k in range(1, min(max_nextn, num_modules) + 1)]
    k = min(relaxed_nextn, max_nextn)
    if k > 0:
        mode = relaxed_mode
        if mode == "auto":
            mode = "vanilla" if 1 < num_modules and k <= num_modules else "eagle"
        if mode == "vanilla" and k > num_modules:
            raise ValueError(f"relaxed Vanilla at K={k} needs {k} MTP modules, the checkpoint has {num_modules}; "
                             "lower --relaxed_nextn or use --relaxed_mode eagle")
        out.append(Setting(mode, k, True, relaxed_topk, relaxed_delta))
    if policy_nextn < 0:
        raise ValueError("--policy_nextn must be >= 0")
    for mode in modes if policy_nextn else ():
        if mode == "vanilla" and num_modules < 2:
            continue
        out.append(Setting(mode, min(policy_nextn, num_modules) if mode == "vanilla" else policy_nextn, policy="cost"))
    if adaptive_nextn < 0:
        raise ValueError("--adaptive_nextn must be >= 0")
    sched = tuple(sorted(adaptive_schedule.items())) if adaptive_schedule else None
    for mode in modes if adaptive_nextn else ():
        k = min(adaptive_nextn, num_modules) if mode == "vanilla" else adaptive_nextn
        if mode == "vanilla" and num_modules < 2:
            continue
        if sched:
            sched_k = tuple((b, min(v, k)) for b, v in sched)
        else:
            sched_k = None
        out.append(Setting(mode, k, adaptive=True, confidence=adaptive_confidence, schedule=sched_k,
                           window=adaptive_window, window_threshold=adaptive_window_threshold))
    return out


def setting_config(base: LLMConfig, s: Setting) -> LLMConfig:
    spec = None if s.K == 0 else SpeculativeConfig(
        num_nextn_predict_layers=s.K, mtp_mode=s.mode, use_relaxed_acceptance_for_thinking=s.relaxed,
        relaxed_topk=s.relaxed_topk, relaxed_delta=s.relaxed_delta, draft_len_policy=s.policy,
        draft_confidence_threshold=s.confidence,
        draft_len_schedule=dict(s.schedule) if s.schedule else None, acceptance_window=s.window,
        acceptance_length_threshold=s.window_threshold, draft_token_map=s.token_map)
    cfg = replace(base, speculative_config=spec)
    cfg.validate()
    return cfg


def run_setting(model: Any, base: LLMConfig, eos: list[int], think_ids: Optional[tuple[int, int]], s: Setting,
                prompts: list[list[int]], output_tokens: list[int], concurrency: int = 1, warmup: int = 1,
                ignore_eos: bool = True, on_finish: Optional[Callable[..., None]] = None) -> list[RequestRecord]:
    engine = Engine(model, setting_config(base, s), eos, think_ids)
    if warmup:
        run_requests(engine, prompts[:warmup], output_tokens[:warmup], concurrency, ignore_eos)
        engine.reset_prefix_cache()        # measured requests must not hit the warm-up's cached prompts
    return run_requests(engine, prompts, output_tokens, concurrency, ignore_eos, on_finish=on_finish)


def forward_costs(model: Any, base: LLMConfig, eos: list[int], prompt: list[int], repeats: int = 200) -> dict:
    """One target forward vs one MTP module forward, 1 token each, at the context of `prompt` (a throwaway
    engine: the timed calls rewrite the cache slot of the prompt's last position). Best of 5 rounds."""
    import time

    import torch

    from mtp_core.model import AttentionMetadata
    from mtp_core.sampling import SamplingParams

    engine = Engine(model, setting_config(base, Setting("eagle", 1)), eos, None)
    # more than one token to generate, so the request is still running (its KV blocks held) after its prefill
    seq = engine.add_request(list(prompt), SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished() and seq.kv.num_cached < len(prompt):
        engine.step()
    pos = len(prompt) - 1
    if seq.is_finished or len(seq.kv.block_table) * engine.blocks.tokens_per_block <= pos:
        raise RuntimeError("forward_costs: the timing request lost its KV blocks before the timed calls")
    meta = AttentionMetadata.build([[pos]], [list(seq.kv.block_table)], engine.blocks.tokens_per_block,
                                   use_absorbed=True, device=base.device)
    ids = torch.tensor(prompt[-1:], device=base.device)
    out: dict[str, float] = {}
    with torch.inference_mode():
        path = engine.paths.forward_path
        hidden = path.forward(ids, meta, engine.caches)
        calls = {"main_forward_ms": lambda: path.forward(ids, meta, engine.caches),
                 "mtp_forward_ms": lambda: path.mtp_forward(0, ids, hidden, meta, engine.caches)}
        for name, f in calls.items():
            f()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(max(1, repeats // 5)):
                    f()
                best = min(best, (time.perf_counter() - t0) / max(1, repeats // 5))
            out[name] = best * 1e3
    if not seq.is_finished:
        engine.abort(seq)
    out["mtp_over_main"] = out["mtp_forward_ms"] / out["main_forward_ms"]
    out["native"] = engine.paths.forward_path.name == "native"
    return out


def summary_row(s: Setting, records: list[RequestRecord]) -> dict:
    info, perf = summarize_performance(records)
    dec = summarize_decoding(records, s.K, s.label)
    return {
        "label": s.label, "mode": s.mode, "K": s.K, "relaxed": s.relaxed, "adaptive": s.adaptive,
        "policy": s.policy if s.K else None, "draft_token_map": s.token_map,
        "mean_drafts_per_step": dec["mean_drafts_per_step"], "drafts_per_step_histogram": dec["drafts_per_step_histogram"],
        "chosen_drafts_histogram": dec["draft_limit_histogram"],
        "waste_verified_per_accepted": dec["waste_verified_per_accepted"],
        "acceptance_length": dec["acceptance_length"], "draft_acceptance_rate": dec["draft_acceptance_rate"],
        "acceptance_per_position": dec["acceptance_per_position"],
        "tokens_per_s_user": perf["per_user_output_throughput_tps"],
        "generation_tokens_per_s_user": perf["per_user_generation_tps"],
        "ttft_ms": perf["ttft_ms"], "tpot_ms": perf["tpot_ms"],
        "measured_step_ms": (decode_step_time_s(records) or 0.0) * 1e3,
        "avg_input_length": info["avg_input_length"], "avg_output_length": info["avg_output_length"],
        "performance": perf, "decoding_stats": dec,
    }


def add_speedups(rows: list[dict]) -> list[dict]:
    """speed-up = tokens/s/user over nextn=0's; engine efficiency = speed-up / AL. With a roofline:
    ideal speed-up = AL x floor(nextn=0) / floor(this setting) (the ceiling the bytes impose at batch 1:
    the verify forward reads the experts of every token it checks) and speed-up / ideal."""
    base = next((r for r in rows if r["K"] == 0), None)
    if base is None or not base["tokens_per_s_user"]:
        raise ValueError("the sweep needs its nextn=0 row to compute speed-ups")
    for r in rows:
        r["speedup"] = r["tokens_per_s_user"] / base["tokens_per_s_user"]
        r["engine_efficiency"] = r["speedup"] / r["acceptance_length"] if r["acceptance_length"] else None
        if r.get("floor_step_ms") and base.get("floor_step_ms"):
            r["ideal_speedup"] = r["acceptance_length"] * base["floor_step_ms"] / r["floor_step_ms"]
            r["speedup_over_ideal"] = r["speedup"] / r["ideal_speedup"]
            r["floor_over_measured"] = r["floor_step_ms"] / r["measured_step_ms"] if r["measured_step_ms"] else None
    return rows


def best_lossless(rows: list[dict]) -> dict:
    """The fastest strict-acceptance fixed-K MTP row (nextn=0 when there is none)."""
    mtp = [r for r in rows if r["K"] > 0 and not r["relaxed"] and not r.get("adaptive") and r.get("policy") != "cost"]
    return max(mtp, key=lambda r: r["speedup"]) if mtp else rows[0]


def format_table(rows: list[dict], peers: Optional[list[dict]] = None) -> str:
    roof = any(r.get("floor_step_ms") is not None for r in rows)
    head = f"{'setting':<34}{'mode':<9}{'K':>3}{'AL':>8}{'accept':>8}{'tok/s/user':>12}{'speedup':>9}{'effic.':>8}"
    head += f"{'drafts':>8}{'waste':>7}"
    head += f"{'floor ms':>10}{'step ms':>9}{'floor/step':>11}{'ideal':>8}{'sp/ideal':>9}" if roof else ""
    lines = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['label']:<34}{r['mode']:<9}{r['K']:>3}{r['acceptance_length']:>8.3f}"
                f"{r['draft_acceptance_rate']:>8.3f}{r['tokens_per_s_user']:>12.2f}{r['speedup']:>8.2f}x"
                f"{(r['engine_efficiency'] or 0):>8.3f}")
        line += f"{r.get('mean_drafts_per_step') or 0:>8.2f}" + (
            f"{r['waste_verified_per_accepted']:>7.2f}" if r.get("waste_verified_per_accepted") else f"{'-':>7}")
        if roof:
            line += (f"{r.get('floor_step_ms') or 0:>10.3f}{r['measured_step_ms']:>9.3f}"
                     f"{r.get('floor_over_measured') or 0:>11.3f}{r.get('ideal_speedup') or 0:>7.2f}x"
                     f"{r.get('speedup_over_ideal') or 0:>9.3f}")
        lines.append(line)
    if peers:
        base = next(r for r in rows if r["K"] == 0)
        best = best_lossless(rows)
        lines += ["", f"{'peer (same checkpoint, same prompts)':<40}{'tok/s/user':>12}{'vs nextn=0':>12}"
                      f"{'vs best MTP':>13}{'same output':>13}"]
        for p in peers:
            same = "-" if p["identical_to_ours"] is None else f"{p['identical_to_ours']}/{p['num_requests']}"
            lines.append(f"{p['name']:<40}{p['per_user_output_throughput_tps']:>12.2f}"
                         f"{p['per_user_output_throughput_tps'] / base['tokens_per_s_user']:>11.2f}x"
                         f"{p['per_user_output_throughput_tps'] / best['tokens_per_s_user']:>12.2f}x{same:>13}")
    return "\n".join(lines)


def run_accuracy(model: Any, base: LLMConfig, eos: list[int], think_ids: Optional[tuple[int, int]],
                 tokenizer: Any, records: list[dict], strict: Setting, relaxed: Setting, max_tokens: int,
                 concurrency: int, on_finish: Optional[Callable[..., None]] = None) -> dict:
    """Exact match per task set (bench.scoring.score) with strict and with relaxed acceptance; EOS honoured."""
    from mtp_core.bench.dataset import BenchRequest, encode_request
    from mtp_core.bench.scoring import score

    prompts = [encode_request(tokenizer, BenchRequest(i, max_tokens, r["prompt"])) for i, r in enumerate(records)]
    out: dict[str, Any] = {"max_tokens": max_tokens, "num_questions": len(records)}
    for key, s in (("strict", strict), ("relaxed", relaxed)):
        recs = run_setting(model, base, eos, think_ids, s, prompts, [max_tokens] * len(prompts), concurrency,
                           warmup=0, ignore_eos=False, on_finish=on_finish)
        out[key] = score(records, [tokenizer.decode(r.output_ids) for r in recs])
        out[f"{key}_setting"] = s.label
        out[f"{key}_acceptance_length"] = summarize_decoding(recs, s.K, s.label)["acceptance_length"]
    return out


def format_accuracy(acc: dict) -> str:
    lines = [f"{'task set':<12}{'strict':>9}{'relaxed':>9}{'delta':>9}", "-" * 39]
    tasks = [t for t in acc["strict"] if t != "overall"] + ["overall"]
    for task in tasks:
        a, b = acc["strict"][task], acc["relaxed"].get(task, 0.0)
        lines.append(f"{task:<12}{100 * a:>8.1f}%{100 * b:>8.1f}%{100 * (b - a):>+8.1f}p")
    lines.insert(len(lines) - 1, "-" * 39)
    lines.append(f"AL: strict {acc['strict_acceptance_length']:.3f} ({acc['strict_setting']}), "
                 f"relaxed {acc['relaxed_acceptance_length']:.3f} ({acc['relaxed_setting']})")
    return "\n".join(lines)

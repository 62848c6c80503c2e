"""Per-request records and the benchmark's summary statistics (trtllm-bench definitions).

Per request: TTFT = first token - submission; TPOT = (end - first token) / (output tokens - 1); output
throughput per user = output tokens / (end - submission) ("w/ ctx", first token included); generation
speed = (output tokens - 1) / (end - first token). Whole run: total latency = last end - first submission;
total output throughput = all output tokens / total latency. Percentiles interpolate linearly between
the two nearest ranks (numpy's default). Speculative statistics: AL = output tokens / decoding steps
(the prefill step that emits the first token counts as a step), draft acceptance rate = accepted /
proposed drafts, acceptance per draft position i = steps whose draft i was accepted / steps that
proposed one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from mtp_core.request.stats import SpecStats

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    index: int                      # position in the dataset
    task_id: Any
    num_input_tokens: int
    num_output_tokens: int
    start_s: float                  # submission (perf_counter seconds)
    first_token_s: float
    end_s: float
    stats: SpecStats = field(default_factory=SpecStats)
    chunk_times_s: list[float] = field(default_factory=list)   # when each step's new tokens arrived
    output_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.start_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> Optional[float]:
        n = self.num_output_tokens
        return (self.end_s - self.first_token_s) / (n - 1) if n > 1 else None

    @property
    def output_throughput_tps(self) -> float:
        return self.num_output_tokens / self.e2e_s if self.e2e_s > 0 else 0.0

    @property
    def generation_tps(self) -> Optional[float]:
        gen = self.end_s - self.first_token_s
        return (self.num_output_tokens - 1) / gen if self.num_output_tokens > 1 and gen > 0 else None


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default) for q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def percentile_stats(values: list[Optional[float]], scale: float = 1.0) -> Optional[dict[str, float]]:
    """{minimum, maximum, average, p50, p90, p95, p99} of the non-None values (times `scale`)."""
    vals = [x * scale for x in values if x is not None]
    if not vals:
        return None
    out = {"minimum": min(vals), "maximum": max(vals), "average": sum(vals) / len(vals)}
    out.update({f"p{q}": percentile(vals, q) for q in PERCENTILES})
    return out


def _avg(values: list[Optional[float]]) -> Optional[float]:
    vals = [x for x in values if x is not None]
    return sum(vals) / len(vals) if vals else None


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1e3


def merged_stats(records: list[RequestRecord]) -> SpecStats:
    total = SpecStats()
    for r in records:
        total.merge(r.stats)
    return total


def summarize_performance(records: list[RequestRecord]) -> tuple[dict, dict]:
    """-> (request_info, performance) sections."""
    if not records:
        raise ValueError("no finished request to summarize")
    start, end = min(r.start_s for r in records), max(r.end_s for r in records)
    total_s = end - start
    out_tok = sum(r.num_output_tokens for r in records)
    in_tok = sum(r.num_input_tokens for r in records)
    per = lambda x: x / total_s if total_s > 0 else 0.0  # noqa: E731
    ttft = [r.ttft_s for r in records]
    tpot = [r.tpot_s for r in records]
    user = [r.output_throughput_tps for r in records]
    gen = [r.generation_tps for r in records]
    latency = [r.e2e_s for r in records]
    request_info = {
        "num_requests": len(records),
        "avg_num_concurrent_requests": sum(latency) / total_s if total_s > 0 else 0.0,
        "avg_input_length": in_tok / len(records),
        "avg_output_length": out_tok / len(records),
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
    }
    performance = {
        "total_latency_ms": total_s * 1e3,
        "avg_request_latency_ms": _avg(latency) * 1e3,
        "request_throughput_req_s": per(len(records)),
        "total_output_throughput_tps": per(out_tok),
        "total_token_throughput_tps": per(out_tok + in_tok),
        "per_user_output_throughput_tps": _avg(user),
        "per_user_generation_tps": _avg(gen),
        "ttft_ms": _ms(_avg(ttft)),
        "tpot_ms": _ms(_avg(tpot)),
        "ttft_percentiles_ms": percentile_stats(ttft, 1e3),
        "tpot_percentiles_ms": percentile_stats(tpot, 1e3),
        "request_latency_percentiles_ms": percentile_stats(latency, 1e3),
        "per_user_output_throughput_percentiles_tps": percentile_stats(user),
        # trtllm-bench's names for the same numbers
        "system_output_throughput_tok_s": per(out_tok),
        "system_total_throughput_tok_s": per(out_tok + in_tok),
        "output_throughput_per_user_tok_s": _avg(user),
    }
    return request_info, performance


def summarize_streaming(records: list[RequestRecord], enabled: bool) -> dict:
    """trtllm-bench's streaming section; inter-token latency (gaps between chunks) only when streamed."""
    itl = [b - a for r in records for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:])]
    return {
        "enabled": enabled,
        "token_output_speed_tok_s": _avg([r.generation_tps for r in records]),
        "avg_ttft_ms": _avg([r.ttft_s for r in records]) * 1e3,
        "avg_tpot_ms": _ms(_avg([r.tpot_s for r in records])),
        "ttft_percentiles": percentile_stats([r.ttft_s for r in records], 1e3),
        "tpot_percentiles": percentile_stats([r.tpot_s for r in records], 1e3),
        "gen_tps_percentiles": percentile_stats([r.generation_tps for r in records]),
        "itl_percentiles": percentile_stats(itl, 1e3) if enabled else None,
    }


def summarize_decoding(records: list[RequestRecord], max_draft_len: int, mode: str) -> dict:
    """Speculative statistics, under trtllm-bench's and vLLM's names (vLLM's AL counts decode steps only)."""
    s = merged_stats(records)
    num_drafts = s.proposed_per_position[0] if s.proposed_per_position else 0
    per_req = [(r.stats.num_draft_proposed, r.stats.num_draft_accepted, r.stats.draft_acceptance_rate,
                r.stats.acceptance_length) for r in records]
    spec = max_draft_len > 0
    return {
        "mode": mode,
        "max_draft_len": max_draft_len,
        "num_decoding_steps": s.num_steps,
        "num_output_tokens": s.num_output_tokens,
        "acceptance_length": s.acceptance_length,
        "draft_acceptance_rate": s.draft_acceptance_rate,
        "num_draft_tokens": s.num_draft_proposed,
        "num_accepted_draft_tokens": s.num_draft_accepted,
        "acceptance_per_position": s.acceptance_per_position,
        "accepted_per_position": list(s.accepted_per_position),
        "proposed_per_position": list(s.proposed_per_position),
        "num_draft_tokens_percentiles": percentile_stats([p[0] for p in per_req]) if spec else None,
        "num_accepted_draft_tokens_percentiles": percentile_stats([p[1] for p in per_req]) if spec else None,
        "draft_acceptance_rate_percentiles": percentile_stats([p[2] for p in per_req]) if spec else None,
        "acceptance_length_percentiles": percentile_stats([p[3] for p in per_req]),
        "spec_decode_num_drafts": num_drafts,
        "spec_decode_num_draft_tokens": s.num_draft_proposed,
        "spec_decode_num_accepted_tokens": s.num_draft_accepted,
        "spec_decode_num_accepted_tokens_per_pos": list(s.accepted_per_position),
        "spec_decode_acceptance_length": 1.0 + s.num_draft_accepted / num_drafts if num_drafts else 1.0,
        "spec_decode_draft_acceptance_rate": s.draft_acceptance_rate,
        # adaptive draft length (histograms indexed by a number of drafts, 0..K)
        "drafts_per_step_histogram": list(s.drafts_per_step),
        "mean_drafts_per_step": s.mean_drafts_per_step,
        "drafting_acceptance_length": s.drafting_acceptance_length,
        "drafting_share": s.drafting_share,
        "draft_limit_histogram": list(s.draft_limit_per_step),
        "waste_verified_per_accepted": s.waste if s.num_draft_accepted else None,
        "num_window_pauses": s.num_window_pauses,
    }


def decode_step_time_s(records: list[RequestRecord]) -> Optional[float]:
    """Mean time of one decoding step after the first token: sum(end - first) / sum(steps - 1).

    Equals decode-phase AL / decode-phase tokens-per-second, i.e. 1 / (tokens/s / AL) per step."""
    steps = sum(max(r.stats.num_steps - 1, 0) for r in records)
    t = sum(r.end_s - r.first_token_s for r in records)
    return t / steps if steps else None


def decode_acceptance_length(records: list[RequestRecord]) -> float:
    """AL of the decode phase only: (output tokens - first tokens) / (steps - prefill steps)."""
    steps = sum(max(r.stats.num_steps - 1, 0) for r in records)
    tokens = sum(max(r.num_output_tokens - 1, 0) for r in records)
    return tokens / steps if steps else 1.0

"""GET /metrics: Prometheus text exposition format (version 0.0.4), written without a client library.

Names follow vLLM's (`vllm:x` is `mtp_x` here) where vLLM has the metric. Two sources:
- the API process (`RequestMetrics`, filled by the output thread): requests finished by reason, failed;
  (`ErrorCounts`, filled where errors are answered): every error answer by status and reason;
  histograms of time to first token, inter-token latency (between two outputs of a request: one engine
  step, 1..K+1 tokens), end-to-end latency (both from the moment the HTTP request arrived, tokenization
  included) and queue time (arrival at the engine to its first scheduled step, measured by the engine);
- the engine (`EngineStats`, the snapshot that comes with every output batch): requests running /
  waiting, KV blocks free / total, prompt and generation tokens, engine steps and a histogram of their
  time, speculative decoding (drafts proposed and accepted, per draft position, AL, drafting steps by the
  number of drafts the policy chose), the prefix cache.
Values are read without a lock: each is a number one thread updates, so a scrape may mix two neighbouring
iterations, never a torn value.
"""
from __future__ import annotations

import bisect
import threading
from typing import Any, Optional

from mtp_core.serve.engine_core import STEP_BUCKETS_S
from mtp_core.serve.messages import PREFIX_FIELDS, EngineStats

TTFT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                 0.75, 1.0, 2.5, 5.0)
REQUEST_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
                     120.0, 240.0, 480.0, 960.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)          # per bucket (not cumulative); the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1


class RequestMetrics:
    """Request-level metrics of the API process (written by the output thread only)."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.itl = Histogram(ITL_BUCKETS_S)
        self.e2e = Histogram(REQUEST_BUCKETS_S)
        self.queue = Histogram(REQUEST_BUCKETS_S)
        self.requests_by_reason: dict[str, int] = {}
        self.requests_failed = 0

    def finished(self, reason: str) -> None:
        self.requests_by_reason[reason] = self.requests_by_reason.get(reason, 0) + 1


class ErrorCounts:
    """Error answers by HTTP status and reason (the error object's code), counted where they are sent: the route
    handlers, the middlewares (401, 413, a bad X-Request-Id) and a stream's error event. Updated on the event loop
    (and by any thread that answers a request: the lock keeps the sum)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()

    def add(self, status: int, reason: Optional[str]) -> None:
        key = (status, reason or "none")
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Text:
    """The exposition text being written: one metric (HELP, TYPE, samples) or histogram at a time."""

    def __init__(self, model_name: str) -> None:
        self.lbl = f'model_name="{_esc(model_name)}"'
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lbl = self.lbl
        self.lines.append(f"# HELP {name} {help_}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            self.lines.append(f"{name}{{{lbl}{labels}}} {value:.10g}" if isinstance(value, float)
                              else f"{name}{{{lbl}{labels}}} {value}")

    def histogram(self, name: str, help_: str, h: Any, cumulative: bool = False) -> None:
        lbl, lines = self.lbl, self.lines
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} histogram")
        total = 0
        for i, b in enumerate(h.buckets):
            total = h.counts[i] if cumulative else total + h.counts[i]
            lines.append(f'{name}_bucket{{{lbl},le="{b}"}} {total}')
        lines.append(f'{name}_bucket{{{lbl},le="+Inf"}} {h.count}')
        lines.append(f"{name}_sum{{{lbl}}} {h.sum:.10g}")
        lines.append(f"{name}_count{{{lbl}}} {h.count}")


def render_metrics(req: RequestMetrics, eng: EngineStats, model_name: str,
                   errors: Optional[ErrorCounts] = None) -> str:
    out = _Text(model_name)
    _engine_state(out, eng)
    _requests(out, req, eng, errors)
    _spec_decode(out, eng)
    return "\n".join(out.lines) + "\n"


def _engine_state(out: _Text, eng: EngineStats) -> None:
    """The running batch, the queue, the KV pool, preemptions and the prefix cache."""
    metric = out.metric
    metric("mtp_num_requests_running", "gauge", "Requests in the engine's running batch.", [("", eng.num_running)])
    metric("mtp_num_requests_waiting", "gauge", "Requests waiting for admission.", [("", eng.num_waiting)])
    metric("mtp_kv_cache_free_blocks", "gauge", "Free KV cache blocks.", [("", eng.kv_free_blocks)])
    metric("mtp_kv_cache_total_blocks", "gauge", "KV cache blocks requests can use.", [("", eng.kv_total_blocks)])
    metric("mtp_num_preemptions_total", "counter", "Requests preempted (recomputed later).",
           [("", eng.num_preemptions)])
    if eng.prefix_cache is not None:   # prefix caching (kv_cache_config.enable_block_reuse)
        helps = ("Prompt tokens looked up in the prefix cache.", "Prompt tokens served from the prefix cache.",
                 "Full prompt blocks looked up.", "Full prompt blocks found in the cache.",
                 "Reused / looked-up prompt tokens.", "Cached blocks evicted for new contents.")
        for name, text, value in zip(PREFIX_FIELDS, helps, eng.prefix_cache):
            metric(f"mtp_prefix_cache_{name}", "gauge" if name.endswith("rate") else "counter", text,
                   [("", value if name.endswith("rate") else int(value))])


def _requests(out: _Text, req: RequestMetrics, eng: EngineStats, errors: Optional[ErrorCounts]) -> None:
    """Requests by outcome, errors, tokens, the request latencies and the engine steps."""
    metric, histogram = out.metric, out.histogram
    reasons = dict(req.requests_by_reason)
    metric("mtp_request_success_total", "counter", "Finished requests by finish reason (abort: client gone or "
           "cut at shutdown).",
           [(f',finished_reason="{r}"', n) for r, n in sorted(reasons.items())] or [(',finished_reason="stop"', 0)])
    metric("mtp_request_failure_total", "counter", "Requests whose generation or output processing raised.",
           [("", req.requests_failed)])
    metric("mtp_request_rejected_total", "counter", "Requests the engine refused at admission.",
           [("", eng.requests_rejected)])
    if errors is not None:
        metric("mtp_http_errors_total", "counter", "Error answers (HTTP 4xx and 5xx, a stream's error event included) "
               "by status and reason (the error object's code).",
               [(f',status="{st}",reason="{_esc(r)}"', n) for (st, r), n in sorted(dict(errors.counts).items())])
    metric("mtp_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", eng.prompt_tokens)])
    metric("mtp_generation_tokens_total", "counter", "Generated tokens.", [("", eng.generation_tokens)])
    histogram("mtp_time_to_first_token_seconds", "Time from the HTTP request's arrival to its first token.",
              req.ttft)
    histogram("mtp_inter_token_latency_seconds", "Time between two outputs of a request (one engine step, "
              "1..K+1 tokens).", req.itl)
    histogram("mtp_e2e_request_latency_seconds", "Time from the HTTP request's arrival to its last token.", req.e2e)
    histogram("mtp_request_queue_time_seconds", "Time from the engine receiving a request to its first step.",
              req.queue)
    metric("mtp_engine_steps_total", "counter", "Engine steps.", [("", eng.steps)])
    metric("mtp_engine_step_failures_total", "counter", "Engine steps that raised.", [("", eng.step_failures)])

    class _Steps:
        buckets, counts, sum, count = STEP_BUCKETS_S, eng.step_buckets, eng.step_seconds, eng.steps
    histogram("mtp_engine_step_seconds", "Time of one engine step.", _Steps, cumulative=True)


def _spec_decode(out: _Text, eng: EngineStats) -> None:
    """Speculative decoding: drafts proposed and accepted (per position), the policy's choices, AL."""
    metric, stats = out.metric, eng.spec
    proposed = list(stats.proposed_per_position)
    accepted = list(stats.accepted_per_position)
    metric("mtp_spec_decode_num_drafts_total", "counter", "Decoding steps that proposed drafts.",
           [("", proposed[0] if proposed else 0)])
    metric("mtp_spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
           [("", stats.num_draft_proposed)])
    metric("mtp_spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
           [("", stats.num_draft_accepted)])
    metric("mtp_spec_decode_num_accepted_tokens_per_pos_total", "counter",
           "Steps whose draft at this position was accepted.",
           [(f',position="{i}"', n) for i, n in enumerate(accepted)])
    metric("mtp_spec_decode_num_proposed_tokens_per_pos_total", "counter",
           "Steps that proposed a draft at this position.", [(f',position="{i}"', n) for i, n in enumerate(proposed)])
    metric("mtp_spec_decode_acceptance_per_position", "gauge", "Accepted / proposed drafts at this position.",
           [(f',position="{i}"', a / p if p else 0.0) for i, (a, p) in enumerate(zip(accepted, proposed))])
    metric("mtp_spec_decode_chosen_drafts_total", "counter", "Drafting steps of a request by the number of drafts "
           "chosen for its next step (the draft-length policy, within the explicit limits).",
           [(f',drafts="{k}"', n) for k, n in enumerate(stats.draft_limit_per_step)])
    steps, tokens = stats.num_steps, stats.num_output_tokens
    metric("mtp_spec_decode_decoding_steps_total", "counter", "Decoding steps over all requests (a request's "
           "first-token step included).", [("", steps)])
    metric("mtp_spec_decode_acceptance_length", "gauge", "AL: output tokens per decoding step.",
           [("", tokens / steps if steps else 0.0)])
    metric("mtp_spec_decode_draft_acceptance_rate", "gauge", "Accepted / proposed draft tokens.",
           [("", stats.num_draft_accepted / stats.num_draft_proposed if stats.num_draft_proposed else 0.0)])

"""GET /metrics: Prometheus text exposition format (version 0.0.4), written without a client library.

Gauges: requests running / waiting, KV blocks free / total. Counters: requests finished by reason,
failed, rejected; prompt and generation tokens; engine steps; speculative decoding (steps that proposed
drafts, draft tokens proposed and accepted, accepted and proposed per draft position, drafting steps by the
number of drafts chosen). A histogram of the engine step time. Derived gauges: acceptance length (AL = tokens / decoding steps), draft acceptance rate,
acceptance per draft position. Values are read without a lock: each is a plain int the loop thread
updates, so a scrape may mix two neighbouring steps, never a torn value.
"""
from __future__ import annotations

from typing import Any

from mtp_core.serve.engine_loop import STEP_BUCKETS_S


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(loop: Any, model_name: str) -> str:
    eng = loop.engine
    c = loop.counters
    stats = eng.stats
    lbl = f'model_name="{_esc(model_name)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{{{lbl}{labels}}} {value:.10g}" if isinstance(value, float)
                         else f"{name}{{{lbl}{labels}}} {value}")

    metric("mtp_num_requests_running", "gauge", "Requests in the engine's running batch.", [("", loop.num_running)])
    metric("mtp_num_requests_waiting", "gauge", "Requests waiting for admission.", [("", loop.num_waiting)])
    blocks = eng.blocks
    metric("mtp_kv_cache_free_blocks", "gauge", "Free KV cache blocks.", [("", blocks.num_free_blocks)])
    metric("mtp_kv_cache_total_blocks", "gauge", "KV cache blocks requests can use.",
           [("", blocks.num_blocks - (1 if eng.graphs is not None else 0))])
    reasons = dict(c.requests_by_reason)
    pc = getattr(blocks, "stats", None)
    if pc is not None:   # prefix caching (kv_cache_config.enable_block_reuse)
        for name, kind, text, value in (
                ("queries_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.", pc.prompt_tokens),
                ("hits_tokens_total", "counter", "Prompt tokens served from the prefix cache.", pc.reused_tokens),
                ("queries_blocks_total", "counter", "Full prompt blocks looked up.", pc.queried_blocks),
                ("hits_blocks_total", "counter", "Full prompt blocks found in the cache.", pc.hit_blocks),
                ("token_hit_rate", "gauge", "Reused / looked-up prompt tokens.", pc.token_hit_rate),
                ("evicted_blocks_total", "counter", "Cached blocks evicted for new contents.", pc.evicted_blocks)):
            metric(f"mtp_prefix_cache_{name}", kind, text, [("", value)])
    metric("mtp_request_success_total", "counter", "Finished requests by finish reason (abort: client gone).",
           [(f',finished_reason="{r}"', n) for r, n in sorted(reasons.items())] or [(',finished_reason="stop"', 0)])
    metric("mtp_request_failure_total", "counter", "Requests whose generation raised.", [("", c.requests_failed)])
    metric("mtp_request_rejected_total", "counter", "Requests the engine refused at admission.",
           [("", c.requests_rejected)])
    metric("mtp_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", [("", c.prompt_tokens)])
    metric("mtp_generation_tokens_total", "counter", "Generated tokens.", [("", c.generation_tokens)])
    metric("mtp_engine_steps_total", "counter", "Engine steps.", [("", c.steps)])
    metric("mtp_engine_step_failures_total", "counter", "Engine steps that raised.", [("", c.step_failures)])
    lines.append("# HELP mtp_engine_step_seconds Time of one engine step.")
    lines.append("# TYPE mtp_engine_step_seconds histogram")
    cum = 0
    for b, n in zip(STEP_BUCKETS_S, c.step_buckets):
        cum = n          # buckets are cumulative already (a step counts in every bucket >= its time)
        lines.append(f'mtp_engine_step_seconds_bucket{{{lbl},le="{b}"}} {cum}')
    lines.append(f'mtp_engine_step_seconds_bucket{{{lbl},le="+Inf"}} {c.steps}')
    lines.append(f"mtp_engine_step_seconds_sum{{{lbl}}} {c.step_seconds:.10g}")
    lines.append(f"mtp_engine_step_seconds_count{{{lbl}}} {c.steps}")
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
    steps, out = stats.num_steps, stats.num_output_tokens
    metric("mtp_spec_decode_decoding_steps_total", "counter", "Decoding steps over all requests (a request's "
           "first-token step included).", [("", steps)])
    metric("mtp_spec_decode_acceptance_length", "gauge", "AL: output tokens per decoding step.",
           [("", out / steps if steps else 0.0)])
    metric("mtp_spec_decode_draft_acceptance_rate", "gauge", "Accepted / proposed draft tokens.",
           [("", stats.num_draft_accepted / stats.num_draft_proposed if stats.num_draft_proposed else 0.0)])
    return "\n".join(lines) + "\n"

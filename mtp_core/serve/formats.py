"""OpenAI's JSON for the parts of a choice, shared by the streamed and the non-streamed response: logprobs
objects (chat, completions), forced JSON tool calls, usage and the spec_decode_stats extension.

A logprobs entry, as the output thread names it (outputs.py): (text, logprob, [(text, logprob, bytes)] top,
id, bytes) per token; an echo's prompt entries start with None (the first prompt token has no logprob).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from mtp_core.request.stats import SpecStats


def chat_logprobs(entries: list) -> dict:
    """OpenAI's chat logprobs object: content, one entry per token (its text, bytes, top_logprobs)."""
    return {"content": [{"token": t, "logprob": lp, "bytes": raw,
                         "top_logprobs": [{"token": u, "logprob": v, "bytes": ub} for u, v, ub in top]}
                        for t, lp, top, _, raw in entries],
            "refusal": None}


def completion_logprobs(entries: list, top_n: int, offset: int, prompt: Optional[list] = None,
                        first_text: str = "") -> tuple[dict, int]:
    """OpenAI's completions logprobs object for an echo's prompt entries (if given) then `entries`, text offsets
    from `offset`; (object, the next offset). The first prompt token (entry None) is listed with its text,
    `first_text`, and no logprob. top_logprobs holds the top_n and the chosen token (so up to top_n + 1
    entries, as OpenAI says)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if prompt:
        if prompt[0] is None:
            out["tokens"].append(first_text)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(offset)
            offset += len(out["tokens"][-1])
        offset = _add_tokens(out, prompt[1:], top_n, offset)
    return out, _add_tokens(out, entries, top_n, offset)


def _add_tokens(out: dict[str, list], entries: list, top_n: int, offset: int) -> int:
    for e in entries:
        if e is None:
            continue
        t, lp, top = e[0], e[1], e[2]
        out["tokens"].append(t)
        out["token_logprobs"].append(lp)
        d: dict[str, float] = {}
        for u, v, _ in top[:top_n]:
            d.setdefault(u, v)          # two ids with the same text: the likelier one's value
        d.setdefault(t, lp)
        out["top_logprobs"].append(d)
        out["text_offset"].append(offset)
        offset += len(t)
    return offset


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def forced_calls(tool: Any, content: str, named_id: str) -> Optional[list[dict]]:
    """The tool_calls of a forced call's whole output in the grammar's JSON (a named call's arguments object, or
    `required`'s list of {name, parameters}); None if it does not parse. A named call keeps `named_id`, the id its
    streamed deltas carried."""
    try:
        data = json.loads(content)
    except ValueError:
        return None
    if tool.choice == "named":
        return [{"id": named_id, "type": "function", "function": {"name": tool.name, "arguments": content}}]
    return [{"id": call_id(), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}}
            for c in data]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def spec_stats(stats: Optional[SpecStats]) -> Optional[dict]:
    """Extension: this request's speculative-decoding counters (what `mtp bench --base_url` reports)."""
    if stats is None:
        return None
    return {"decoding_steps": stats.num_steps, "output_tokens": stats.num_output_tokens,
            "draft_tokens": stats.num_draft_proposed, "accepted_draft_tokens": stats.num_draft_accepted,
            "proposed_per_position": list(stats.proposed_per_position),
            "accepted_per_position": list(stats.accepted_per_position)}


def sum_stats(stats: list[Optional[SpecStats]]) -> Optional[SpecStats]:
    """The spec_decode_stats of a response: the one request's, or the sum over its choices."""
    stats = [s for s in stats if s is not None]
    if len(stats) <= 1:
        return stats[0] if stats else None
    tot = SpecStats()
    for s in stats:
        tot.merge(s)
    return tot

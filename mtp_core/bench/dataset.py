"""Benchmark datasets: JSON lines `{"task_id", "prompt" | "input_ids", "output_tokens"}` (trtllm-bench's format).

Readers validate every line and say which line is wrong. Writers build datasets from the shipped model's
held-out task prompts (already chat-rendered, BOS included) and its general-text prompts (standard-library
text), both read from its eval directory (`eval_sets`), or from random token ids of a fixed length (synthetic).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from mtp_core.bench.eval_sets import eval_records, general_chunks, read_manifest


@dataclass
class BenchRequest:
    task_id: Any
    output_tokens: int
    prompt: Optional[str] = None
    input_ids: Optional[list[int]] = None
    extra: dict = field(default_factory=dict)      # e.g. task / answer of a held-out task prompt

    def to_json(self) -> dict:
        d: dict[str, Any] = {"task_id": self.task_id}
        if self.input_ids is not None:
            d["input_ids"] = list(self.input_ids)
        else:
            d["prompt"] = self.prompt
        d["output_tokens"] = self.output_tokens
        d.update(self.extra)
        return d


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_request(d: Any, where: str) -> BenchRequest:
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
    if "task_id" not in d:
        raise ValueError(f"{where}: missing task_id")
    out = d.get("output_tokens")
    if not _is_int(out) or out < 1:
        raise ValueError(f"{where}: output_tokens must be a positive integer, got {out!r}")
    prompt, ids = d.get("prompt"), d.get("input_ids")
    if (prompt is None) == (ids is None):
        raise ValueError(f"{where}: give exactly one of prompt or input_ids")
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise ValueError(f"{where}: prompt must be a non-empty string")
    if ids is not None and (not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids)):
        raise ValueError(f"{where}: input_ids must be a non-empty list of non-negative integers")
    extra = {k: v for k, v in d.items() if k not in ("task_id", "prompt", "input_ids", "output_tokens")}
    return BenchRequest(d["task_id"], out, prompt, list(ids) if ids is not None else None, extra)


def load_dataset(path: str | Path) -> list[BenchRequest]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset {path} not found; write one with `mtp prepare-dataset --output {path}`")
    requests = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        requests.append(parse_request(d, f"{path}:{n}"))
    if not requests:
        raise ValueError(f"dataset {path} holds no request")
    return requests


def write_dataset(path: str | Path, requests: list[BenchRequest]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in requests), encoding="utf-8")
    return path


def encode_request(tokenizer: Any, req: BenchRequest) -> list[int]:
    """Token ids of a request; a prompt that already starts with the BOS text gets no second BOS."""
    if req.input_ids is not None:
        return list(req.input_ids)
    bos = getattr(tokenizer, "bos_token", None)
    has_bos = bool(bos) and req.prompt.startswith(bos)
    return tokenizer.encode(req.prompt, add_special_tokens=not has_bos)


# ---- writers -------------------------------------------------------------------------------------

def task_requests(task_set: str, num_requests: int, output_tokens: int, seed: int = 1234) -> list[BenchRequest]:
    """Held-out task prompts of one family, or of every family round-robin (`all`), or general text (a sample
    drawn with `seed`). The task prompts ship drawn with one seed: another `seed` is refused for them."""
    sets = read_manifest()
    if task_set not in ("all", "general", *sets.families):
        raise ValueError(f"unknown --task_set {task_set!r}; use all, general or one of {', '.join(sets.families)}")
    if num_requests < 1 or output_tokens < 1:
        raise ValueError("--num_requests and --output_tokens must be >= 1")
    if task_set == "general":
        chunks = general_chunks()
        order = random.Random(f"bench-general-{seed}").sample(range(len(chunks)), min(num_requests, len(chunks)))
        return [BenchRequest(f"general-{i}", output_tokens, chunks[c], extra={"task": "general"})
                for i, c in enumerate(order)]
    if seed != sets.seed:
        raise ValueError(f"--seed {seed}: the held-out task prompts ship with the model, drawn with seed {sets.seed}; "
                         "--seed applies to --task_set general and --synthetic")
    families = list(sets.families) if task_set == "all" else [task_set]
    per_family = math.ceil(num_requests / len(families))
    if per_family > sets.per_set:
        raise ValueError(f"--num_requests {num_requests} needs {per_family} held-out prompts per family and "
                         f"{sets.per_set} ship with the model; use --num_requests {sets.per_set * len(families)} "
                         "or fewer")
    records = {f: eval_records(f, per_family) for f in families}
    out: list[BenchRequest] = []
    for i in range(per_family):
        for f in families:
            if len(out) < num_requests:
                r = records[f][i]
                out.append(BenchRequest(f"{f}-{i}", output_tokens, r["prompt"],
                                        extra={"task": f, "answer": r["answer"]}))
    return out


def synthetic_requests(num_requests: int, input_tokens: int, output_tokens: int, vocab_size: int,
                       exclude: frozenset[int] = frozenset(), seed: int = 0) -> list[BenchRequest]:
    """Random token ids in [0, vocab_size) minus `exclude` (special tokens), `input_tokens` per request
    (trtllm's token-norm-dist with stdev 0)."""
    if num_requests < 1 or input_tokens < 1 or output_tokens < 1:
        raise ValueError("--num_requests, --input_tokens and --output_tokens must be >= 1")
    allowed = [t for t in range(vocab_size) if t not in exclude]
    if not allowed:
        raise ValueError(f"no token ids to draw from: vocab_size {vocab_size} with {len(exclude)} excluded")
    rng = random.Random(f"bench-synthetic-{seed}")
    return [BenchRequest(i, output_tokens, input_ids=[rng.choice(allowed) for _ in range(input_tokens)])
            for i in range(num_requests)]


def shared_prefix_ids(num_tokens: int, tokenizer: Any, allowed: Optional[list[int]] = None, seed: int = 0) -> list[int]:
    """A prefix of exactly num_tokens ids: the BOS (if the tokenizer has one), then standard-library text
    (or, with `allowed`, random ids drawn from it, as --synthetic)."""
    if num_tokens < 1:
        raise ValueError(f"--shared_prefix must be >= 1, got {num_tokens}")
    bos = getattr(tokenizer, "bos_token_id", None)
    head = [bos] if bos is not None and allowed is None else []
    need = num_tokens - len(head)
    if allowed is not None:
        rng = random.Random(f"bench-shared-prefix-{seed}")
        return [rng.choice(allowed) for _ in range(need)]
    body: list[int] = []
    for chunk in general_chunks():
        body += tokenizer.encode(chunk + "\n\n", add_special_tokens=False)
        if len(body) >= need:
            return head + body[:need]
    raise ValueError(f"--shared_prefix {num_tokens} is longer than the text available for it; lower it")


def with_shared_prefix(requests: list[BenchRequest], prefix: list[int], tokenizer: Any) -> list[BenchRequest]:
    """Every request becomes input_ids = prefix + its own tokens (a leading BOS of its own is dropped when
    the prefix starts with it), so all share exactly len(prefix) tokens."""
    bos = getattr(tokenizer, "bos_token_id", None)
    out = []
    for r in requests:
        ids = encode_request(tokenizer, r) if r.input_ids is None else list(r.input_ids)
        if prefix and bos is not None and prefix[0] == bos and ids[:1] == [bos]:
            ids = ids[1:]
        out.append(BenchRequest(r.task_id, r.output_tokens, input_ids=prefix + ids,
                                extra={**r.extra, "shared_prefix": len(prefix)}))
    return out

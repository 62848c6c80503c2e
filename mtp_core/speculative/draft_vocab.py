"""A draft vocabulary: the token ids MTP drafts are scored over (speculative_config.draft_token_map).

At real widths the LM head is the largest read of a draft: Moonlight's 163,840 x 2,048 bf16 head is 671 MB, read
once per draft, more than the MTP module's own forward (BENCHMARKS.md, issue 39). Scored over the N ids of a map,
a draft's head reads N rows (a copy of them, made once per engine: N x hidden x 2 bytes in bf16) and its argmax
runs over N columns. Verification is untouched: the target scores every id, so greedy output stays the output
without MTP and sampled output keeps the target's distribution; only acceptance can drop, since a token outside
the map is never proposed. The idea is frequency-ranked drafting (FR-Spec) and SGLang's speculative token map;
`mtp token-map` writes a map from a dataset's token frequencies (and the model's own greedy continuations).

The file: JSON, a list of distinct token ids, or an object whose "token_ids" is one (what `mtp token-map`
writes, with its provenance beside it). The engine sorts the ids, so a map of the whole vocabulary drafts exactly
what no map does (ties go to the lower id either way).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

WHO = "speculative_config.draft_token_map"


def _ids_of(doc: Any) -> Any:
    return doc.get("token_ids") if isinstance(doc, dict) else doc


def load_token_map(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The map at `path` as int64 ids, ascending; a one-line ValueError saying what to change otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{WHO}: {p} is not a file; write one with `mtp token-map --output {p}`")
    try:
        ids = _ids_of(json.loads(p.read_text(encoding="utf-8")))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{WHO}: {p} is not JSON ({e}); give a JSON list of token ids, as `mtp token-map` "
                         f"writes") from None
    if not isinstance(ids, list) or not ids or \
            not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{WHO}: {p} must hold a non-empty JSON list of integer token ids (or "
                         f'{{"token_ids": [...]}}), as `mtp token-map` writes')
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{WHO}: {p} lists token id {bad}, outside the model's vocabulary of {vocab_size}; "
                         f"write the map for this model (`mtp token-map --model_dir`)")
    if len(set(ids)) != len(ids):
        twice = next(i for i, n in Counter(ids).items() if n > 1)
        raise ValueError(f"{WHO}: {p} lists token id {twice} more than once; list each id once")
    return torch.tensor(sorted(ids), dtype=torch.long)


def frequent_ids(counts: Counter, size: int, vocab_size: int) -> list[int]:
    """The `size` most frequent ids of `counts` (ties: the lower id first); ids never counted fill the rest in
    ascending order. Ordered by rank."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"the map's size must be in [1, {vocab_size}] (the vocabulary), got {size}")
    ranked = [i for i, _ in sorted(((i, n) for i, n in counts.items() if 0 <= i < vocab_size and n > 0),
                                   key=lambda x: (-x[1], x[0]))][:size]
    if len(ranked) < size:
        seen = set(ranked)
        ranked += [i for i in range(vocab_size) if i not in seen][:size - len(ranked)]
    return ranked

"""Acceptance replay: a benchmark-only stand-in for a trained MTP head (`mtp bench --replay_acceptance`).

Real-width checkpoints here have random weights (`mtp make-scale`), so their MTP heads propose nothing the target
accepts: they measure the cost of drafting, never its gain. The replay lets a benchmark meet a realistic
acceptance at real widths. The engine still runs every MTP forward and LM head of its drafter (every cost is
paid); after each step the drafts it proposed are replaced, row by row, with the target's own greedy
continuation of that request (recorded beforehand by a run without MTP over the same prompts), each position
kept with its rate given the previous ones were, and a wrong token from the first that is not (and after it).
Greedy decoding is batch-invariant, so the target accepts exactly the kept positions: the accepted counts
follow the rates, and the output is the plain greedy output, as always.

Default rates: DeepSeek-R1's, from TensorRT-LLM's published acceptance lengths with MTP at nextn 1, 2, 3 =
1.92, 2.58, 2.82: a_1 = 0.92, a_1 a_2 = 0.66 (a_2 = 0.72), a_1 a_2 a_3 = 0.24 (a_3 = 0.36).

Every output of a run that uses it says so; it is off unless asked for, and no test of exactness uses it.
"""
from __future__ import annotations

import random
import zlib
from typing import Optional, Sequence

R1_RATES = (0.92, 0.72, 0.36)
PRESETS = {"r1": R1_RATES}


def parse_rates(text: str) -> tuple[float, ...]:
    """'r1' or comma-separated conditional acceptance rates per draft position, each in [0, 1]."""
    text = text.strip().lower()
    if text in PRESETS:
        return PRESETS[text]
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--replay_acceptance {text!r}: give 'r1' or rates per draft position like 0.9,0.7,0.4")
    if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"--replay_acceptance {text!r}: every rate must be in [0, 1]")
    return rates


class ReplayDrafts:
    """Replaces a row's drafts (see the module docstring). continuations: prompt ids -> the target's greedy output
    for that prompt, at least as long as the run asks for; rates[j]: the chance that draft j + 1 is kept when the
    drafts before it were (positions past the rates are never kept)."""

    def __init__(self, rates: Sequence[float], continuations: dict[tuple[int, ...], list[int]], vocab_size: int,
                 seed: int = 0) -> None:
        self.rates = tuple(rates)
        self.continuations = continuations
        self.vocab_size = vocab_size
        self.seed = seed
        self._rng: dict[int, random.Random] = {}     # per request, seeded by its prompt: runs repeat exactly
        self.num_replaced = 0

    def label(self) -> str:
        return "replayed at " + " / ".join(f"{r:g}" for r in self.rates) + " per draft position (benchmark only)"

    def __call__(self, seq, drafts: list[int]) -> list[int]:
        cont: Optional[list[int]] = self.continuations.get(tuple(seq.prompt_ids))
        if cont is None or not drafts:
            return drafts
        rng = self._rng.get(seq.request_id)
        if rng is None:
            rng = self._rng[seq.request_id] = random.Random(self.seed ^ zlib.crc32(bytes(str(seq.prompt_ids), "ascii")))
        n = len(seq.output_ids)                     # the drafts predict output tokens n, n + 1, ...
        out, alive = [], True
        for j in range(len(drafts)):
            truth = cont[n + j] if n + j < len(cont) else None
            alive = alive and truth is not None and j < len(self.rates) and rng.random() < self.rates[j]
            if alive:
                out.append(truth)
            else:                                   # a token the target does not choose here
                out.append((truth + 1) % self.vocab_size if truth is not None else drafts[j])
        self.num_replaced += 1
        return out

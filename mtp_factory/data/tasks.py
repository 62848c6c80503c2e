"""The task families and the train/eval split.

A family is an operand sampler, a trace renderer and a canonical form of the operands. The split is a
hash of (family, canonical operands), so a held-out question never appears in training, whatever the
seed: `sample_operands(..., split="train")` rejects operands whose hash lands in the eval share.
The canonical form ignores operand order where the answer does (a + b vs b + a, the order of a list
to sort), so even a reordered eval question is never trained on.
"""
from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Callable

from mtp_factory.data import arithmetic, lists, multiplication, words
from mtp_factory.data.phrasing import Trace

SPLITS = ("train", "eval")
_MAX_TRIES = 100_000


@dataclass(frozen=True)
class Family:
    name: str
    sample: Callable[[random.Random], tuple]            # operands, as they appear in the question
    render: Callable[[Any, random.Random], Trace]
    canonical: Callable[[tuple], tuple]                 # the key the split is decided on
    weight: float                                       # share of training examples
    eval_percent: int = 10                              # share of the operand space held out
    # later trace styles where they differ: {style: renderer}; a style without an entry uses its parent's
    # (STYLE_PARENTS; style 2 is `render`)
    later: dict[int, Callable[[Any, random.Random], Trace]] = field(default_factory=dict)


def _unordered(ops: tuple) -> tuple:
    return tuple(sorted(ops))


FAMILY_SPECS: dict[str, Family] = {f.name: f for f in (
    Family("add", arithmetic.sample_add, arithmetic.render_add, _unordered, 0.17),
    Family("sub", arithmetic.sample_sub, arithmetic.render_sub, tuple, 0.17, later={3: arithmetic.render_sub_v3}),
    Family("mul", multiplication.sample_mul, multiplication.render_mul, _unordered, 0.20,
           later={4: multiplication.render_mul_v4}),
    Family("sort", lists.sample_sort, lists.render_sort, lambda ops: tuple(sorted(ops[1])), 0.10,
           later={7: lists.render_sort_v7, 8: lists.render_sort_v9}),
    Family("count", words.sample_count, words.render_count, tuple, 0.09,
           later={3: words.render_count_v3, 6: words.render_count_v6}),
    Family("compare", lists.sample_compare, lists.render_compare, lambda ops: tuple(sorted(ops[:2])), 0.08,
           later={3: lists.render_compare_v3, 4: lists.render_compare_v4, 5: lists.render_compare_v5,
                  9: lists.render_compare_v9}),
    Family("max", lists.sample_max, lists.render_max, _unordered, 0.07, later={3: lists.render_max_v3}),
    # Only ~350 words: hold out a fifth of them so 50 distinct eval questions exist.
    Family("reverse", words.sample_reverse, words.render_reverse, tuple, 0.07, eval_percent=20,
           later={3: words.render_reverse_v3}),
    Family("parity", lists.sample_parity, lists.render_parity, tuple, 0.05),
)}


def check_family(family: str) -> Family:
    if family not in FAMILY_SPECS:
        raise ValueError(f"unknown task family {family!r}; use one of {', '.join(FAMILY_SPECS)}")
    return FAMILY_SPECS[family]


def split_of(family: str, ops: tuple) -> str:
    """'eval' for the held-out share of the operand space of `family`, else 'train'."""
    spec = check_family(family)
    digest = hashlib.sha256(f"{family}:{spec.canonical(ops)!r}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % 100 < spec.eval_percent else "train"


def sample_operands(family: str, rng: random.Random, split: str = "train") -> tuple:
    spec = check_family(family)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use 'train' or 'eval'")
    for _ in range(_MAX_TRIES):
        ops = spec.sample(rng)
        if split_of(family, ops) == split:
            return ops
    raise AssertionError(f"no {split} operands for {family} after {_MAX_TRIES} draws")


# Each later style changes a few families of the style it is built on (its parent) and keeps the rest.
STYLE_PARENTS = {3: 2, 4: 3, 5: 4, 6: 5, 7: 5, 8: 7, 9: 8}
TRACE_STYLES = (2, *STYLE_PARENTS)


def render(family: str, ops: tuple, rng: random.Random, style: int = 2) -> Trace:
    """The trace for fixed operands; only the wording depends on `rng`. Style 3 (the v3 traces) differs from
    style 2 for sub, count, compare, max and reverse; style 4 from style 3 for mul (column method only) and
    compare (the goal stated first and copied last); style 5 from style 4 for compare only (the digit pairs
    written beside the two numbers, a line naming both the larger and the smaller); style 6 from style 5
    for count only (the target written once, each letter checked without it); style 7 from style 5 (not 6)
    for sort only (each number of a pass compared with the running pick digit by digit); style 8 from style 7
    for sort only (every pass writes the whole list, numbers taken earlier marked `out`); style 9 from style 8
    for compare only (the line of the two lengths ends with its verdict). The question (drawn
    first) is the same in all."""
    spec = check_family(family)
    if style not in TRACE_STYLES:
        raise ValueError(f"unknown trace style {style!r}; use one of {', '.join(map(str, TRACE_STYLES))}")
    while style != 2:
        if style in spec.later:
            return spec.later[style](ops, rng)
        style = STYLE_PARENTS[style]
    return spec.render(ops, rng)


def generate(family: str, rng: random.Random, split: str = "train", style: int = 2) -> Trace:
    """One (question, reasoning, answer, summary) of `family` from `split`."""
    return render(family, sample_operands(family, rng, split), rng, style)


# The families as plain (rng, split) -> Trace functions.
TASKS: dict[str, Callable[[random.Random, str], Trace]] = {
    name: functools.partial(generate, name) for name in FAMILY_SPECS
}

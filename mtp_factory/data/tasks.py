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
from functools import partial
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
    # the renderer from a later trace style on (TRACE_STYLES): {style: renderer}; `render` is style 2's
    later: dict[int, Callable[[Any, random.Random], Trace]] = field(default_factory=dict)


def _unordered(ops: tuple) -> tuple:
    return tuple(sorted(ops))


FAMILY_SPECS: dict[str, Family] = {f.name: f for f in (
    Family("add", arithmetic.sample_add, arithmetic.render_add, _unordered, 0.17),
    Family("sub", arithmetic.sample_sub, arithmetic.render_sub, tuple, 0.17,
           later={4: partial(arithmetic.render_sub, explicit_sign=True)}),
    Family("mul", multiplication.sample_mul, multiplication.render_mul, _unordered, 0.20,
           later={4: partial(multiplication.render_mul, column_only=True)}),
    Family("sort", lists.sample_sort, lists.render_sort, lambda ops: tuple(sorted(ops[1])), 0.10,
           later={7: partial(lists.render_sort, compare_hint=True), 8: lists.render_sort_marking_taken}),
    Family("count", words.sample_count, words.render_count, tuple, 0.09, later={4: words.render_count_beside_target}),
    Family("compare", lists.sample_compare, lists.render_compare, lambda ops: tuple(sorted(ops[:2])), 0.08,
           later={4: lists.render_compare_by_mark, 5: lists.render_compare_side_by_side,
                  9: partial(lists.render_compare_side_by_side, length_verdict=True)}),
    Family("max", lists.sample_max, lists.render_max, _unordered, 0.07, later={4: lists.render_max_digitwise}),
    # Only ~350 words: hold out a fifth of them so 50 distinct eval questions exist.
    Family("reverse", words.sample_reverse, words.render_reverse, tuple, 0.07, eval_percent=20,
           later={4: partial(words.render_reverse, spell_joined=True)}),
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


@functools.lru_cache(maxsize=1)
def drill_pieces() -> tuple[str, ...]:
    """Words whose reversal is a training question: the spelling drill's made-up words (words.render_spell_drill)
    are cut from these only, so no piece of a held-out reverse word is drilled that no training word also has."""
    return tuple(w for w in words.WORDS if split_of("reverse", (w,)) == "train")


def sample_operands(family: str, rng: random.Random, split: str = "train") -> tuple:
    spec = check_family(family)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use 'train' or 'eval'")
    for _ in range(_MAX_TRIES):
        ops = spec.sample(rng)
        if split_of(family, ops) == split:
            return ops
    raise AssertionError(f"no {split} operands for {family} after {_MAX_TRIES} draws")


# The trace styles, oldest first: each changes a few families of the style before it and keeps the rest.
#   2  every step computable from what is already written (column sums with labelled columns, a selection
#      sort copying the remaining list with running picks, numbered letters for reverse, ...)
#   4  each decision between two tokens written side by side first: sub states the sign by comparing the
#      operands digit by digit, count writes each letter beside the target, max compares each number with
#      the running maximum digit by digit, compare states its goal first and names each digit pair by its
#      count mark, reverse spells the joined word a letter per token in training; mul by the column method only
#   5  compare: the digit pairs written beside the two numbers, then a line naming the larger and the smaller
#   7  sort: each number of a pass compared with the running pick digit by digit
#   8  sort: every pass writes the whole list, the numbers taken earlier marked `out`
#   9  compare: the line of the two lengths ends with its verdict
# The question (drawn first) and the answer are the same in every style. The numbers are those the recipes
# name; 3 and 6 were styles of recipes that live in git history (mtp_core/assets/tiny-r1/HISTORY.md).
TRACE_STYLES = (2, 4, 5, 7, 8, 9)


def render(family: str, ops: tuple, rng: random.Random, style: int = 2) -> Trace:
    """The trace for fixed operands in trace style `style`; only the wording depends on `rng`."""
    spec = check_family(family)
    if style not in TRACE_STYLES:
        raise ValueError(f"unknown trace style {style!r}; use one of {', '.join(map(str, TRACE_STYLES))}")
    for earlier in reversed(TRACE_STYLES[:TRACE_STYLES.index(style) + 1]):     # the newest change up to `style`
        if earlier in spec.later:
            return spec.later[earlier](ops, rng)
    return spec.render(ops, rng)


def generate(family: str, rng: random.Random, split: str = "train", style: int = 2) -> Trace:
    """One (question, reasoning, answer, summary) of `family` from `split`."""
    return render(family, sample_operands(family, rng, split), rng, style)

"""Training strings for the shipped model: a chat example (`render_prompt(question) +
render_completion(reasoning, final)`), a general-text chunk from the standard library (`general_text`) or
a drill block. Everything is a function of the seed (and, for general text, of the Python minor version).
The held-out evaluation sets are written by `eval_sets`.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

from mtp_core.bench.scoring import ANSWER_PREFIX, format_answer
from mtp_core.chat_format import render_completion, render_prompt
from mtp_factory.data import general_text
from mtp_factory.data.arithmetic import render_fact_drill
from mtp_factory.data.phrasing import Trace, maybe, ngram_predictability, spelled
from mtp_factory.data.tasks import FAMILY_SPECS, check_family, drill_pieces, generate, render
from mtp_factory.data.words import render_spell_drill

FAMILIES: list[str] = list(FAMILY_SPECS)


@dataclass(frozen=True)
class Example:
    task: str
    question: str
    reasoning: str      # the text between `<think>\n` and `\n</think>`
    answer: str         # the reference answer, e.g. "579" or "3, 7, 12"
    prompt: str         # rendered generation prompt (ends with `<think>\n`)
    completion: str     # rendered completion (reasoning, `</think>`, final answer section, EOS)


def build_example(family: str, trace: Trace, rng: random.Random) -> Example:
    """Render a trace; the final section is `The answer is X.`, sometimes after a restating line."""
    final = format_answer(trace.answer)
    if trace.spelled_answer:    # "The answer is" + the answer tokenized a letter per token + "."
        final = ANSWER_PREFIX + spelled(" " + trace.answer) + "."
    if trace.summary and maybe(rng, 0.5):
        final = f"{trace.summary}\n\n{final}"
    return Example(family, trace.question, trace.reasoning, trace.answer, render_prompt(trace.question),
                   render_completion(trace.reasoning, final))


def sample_example(family: str, rng: random.Random, split: str = "train", style: int = 2) -> Example:
    check_family(family)
    return build_example(family, generate(family, rng, split, style), rng)


def example_for(family: str, operands: tuple, rng: random.Random, style: int = 2) -> Example:
    """The example for fixed operands (e.g. `(123, 456)` for "add"); only the wording depends on `rng`."""
    check_family(family)
    return build_example(family, render(family, operands, rng, style), rng)


def training_texts(seed: int, num_examples: int, general_fraction: float = 0.15,
                   family_weights: dict[str, float] | None = None, drill_fraction: float = 0.0,
                   style: int = 2, spell_drill_fraction: float = 0.0) -> Iterator[str]:
    """`num_examples` chat examples (families mixed by weight; `family_weights` overrides the default
    shares, families it leaves out keep theirs) interleaved with general-text chunks.

    General chunks are added whenever they fall below `general_fraction` of all characters so far
    (characters stand in for tokens), so the share holds at every prefix of the stream. With
    `drill_fraction` > 0, that share of the examples is a single-digit fact drill (`render_fact_drill`)
    instead of a chat example (drawn from its own rng, so the chat examples are those of drill 0 thinned);
    `spell_drill_fraction` likewise for the spelling drill (`words.render_spell_drill`).
    """
    if not 0.0 <= drill_fraction < 1.0:
        raise ValueError(f"drill_fraction must be in [0, 1), got {drill_fraction}")
    drill_rng = random.Random(f"drill-{seed}")
    spell_rng = random.Random(f"spell-{seed}")
    if not 0.0 <= drill_fraction + spell_drill_fraction < 1.0:
        raise ValueError(f"drill_fraction + spell_drill_fraction must be in [0, 1), got "
                         f"{drill_fraction} + {spell_drill_fraction}; lower one of them")
    if not 0.0 <= general_fraction < 1.0:
        raise ValueError(f"general_fraction must be in [0, 1), got {general_fraction}")
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    rng = random.Random(f"train-{seed}")
    general_rng = random.Random(f"general-{seed}")
    over = family_weights or {}
    unknown = sorted(set(over) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown task families in family_weights: {', '.join(unknown)}")
    weights = [over.get(f, FAMILY_SPECS[f].weight) for f in FAMILIES]
    chunks = general_text.load_chunks() if general_fraction > 0 else ()
    ratio = general_fraction / (1.0 - general_fraction)
    order: list[int] = []
    task_chars = general_chars = 0
    for _ in range(num_examples):
        if drill_fraction and drill_rng.random() < drill_fraction:
            text = render_fact_drill(drill_rng)
        elif spell_drill_fraction and spell_rng.random() < spell_drill_fraction:
            text = render_spell_drill(spell_rng, drill_pieces())
        else:
            example = sample_example(rng.choices(FAMILIES, weights)[0], rng, style=style)
            text = example.prompt + example.completion
        task_chars += len(text)
        yield text
        while chunks and general_chars < ratio * task_chars:
            if not order:
                order = list(range(len(chunks)))
                general_rng.shuffle(order)
            chunk = general_text.render_general(chunks[order.pop()])
            general_chars += len(chunk)
            yield chunk


def estimate_predictability(seed: int = 0, per_family: int = 400, order: int = 3) -> dict[str, float]:
    """Per family (and 'overall'): the order-gram predictability of completions (see phrasing)."""
    rng = random.Random(f"predictability-{seed}")
    result, everything = {}, []
    for family in FAMILIES:
        texts = [sample_example(family, rng).completion for _ in range(per_family)]
        result[family] = ngram_predictability(texts, order)
        everything += texts
    result["overall"] = ngram_predictability(everything, order)
    return result


def describe_data(seed: int = 0, per_family: int = 2) -> str:
    """A plain-text description with `per_family` training samples per family, for the model card."""
    rng = random.Random(f"describe-{seed}")
    total = sum(spec.weight for spec in FAMILY_SPECS.values())
    parts = ["Task families (share of training examples, held-out share of operand space):"]
    for name, spec in FAMILY_SPECS.items():
        parts.append(f"  {name}: {spec.weight / total:.0%} of examples, {spec.eval_percent}% held out")
    parts.append(f"General text: {len(general_text.STDLIB_MODULES)} standard-library modules "
                 f"({general_text.fingerprint()}); license {general_text.LICENSE}.")
    for family in FAMILIES:
        for i in range(per_family):
            ex = sample_example(family, rng)
            parts.append(f"--- {family} sample {i + 1}\nPROMPT: {ex.prompt!r}\nCOMPLETION:\n{ex.completion}")
    return "\n".join(parts)

"""The later trace styles (4, 5, 7, 8, 9; data.tasks.TRACE_STYLES): from style 4 every decision of the count,
compare, max and sub traces compares tokens written next to each other, and the reversed word is spelled a
character per token in training; later styles rewrite compare and sort. Each property is recomputed here
from the operands, so a wrong step in any trace fails a test; the shipped recipe switches styles, drills and
rows at its steps."""
from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mtp_core.bench.scoring import extract_answer
from mtp_factory.data import example_for, sample_example
from mtp_factory.data.phrasing import SPELL_CLOSE, SPELL_OPEN, compare_steps, strip_spelled
from mtp_factory.data.phrasing import WORDS
from mtp_factory.data.tasks import FAMILY_SPECS, TRACE_STYLES, render, sample_operands, split_of
from mtp_factory.recipes import RECIPES
from mtp_factory.trainer import batch_for_step, encode_training_text, rows_at, trace_style_at

V3_FAMILIES = ("sub", "count", "compare", "max", "reverse")     # style 4 rewrites these and mul
ASSET_TOKENIZER = Path(__file__).resolve().parent.parent / "mtp_core" / "assets" / "tiny-r1" / "tokenizer.json"


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(ASSET_TOKENIZER))


@pytest.mark.parametrize("family", list(FAMILY_SPECS))
def test_v3_keeps_the_question_and_answer_of_v2(family: str) -> None:
    """Held-out sets are written from style 2; a style-4 model is asked exactly the same questions."""
    rng = random.Random(family)
    for k in range(200):
        ops = sample_operands(family, rng, "eval" if k % 2 else "train")
        v2 = render(family, ops, random.Random(k), style=2)
        v3 = render(family, ops, random.Random(k), style=4)
        assert (v3.question, v3.answer) == (v2.question, v2.answer)
        if family != "mul":         # mul's style-2 trace is already the column method about half the time
            assert (v3.reasoning != v2.reasoning) == (family in V3_FAMILIES)


def test_unknown_style_is_refused() -> None:
    with pytest.raises(ValueError, match="trace style"):
        render("add", (1, 2), random.Random(0), style=max(TRACE_STYLES) + 1)
    for removed in (3, 6):      # styles of recipes that live in git history
        with pytest.raises(ValueError, match="trace style"):
            render("add", (1, 2), random.Random(0), style=removed)


@pytest.mark.parametrize("family", V3_FAMILIES)
def test_v3_final_answer_is_the_reference(family: str) -> None:
    rng = random.Random(1)
    for _ in range(300):
        ex = sample_example(family, rng, style=4)
        assert extract_answer(strip_spelled(ex.completion)) == ex.answer


_CHECK = re.compile(r"^([a-z]) vs ([a-z])(?:: | -> )(no|yes \((\d+)\)|yes, (\d+))$")


def test_count_v3_compares_each_letter_with_the_target_in_place() -> None:
    rng = random.Random(2)
    for _ in range(300):
        ex = sample_example("count", rng, style=4)
        letter = re.search(r"'([a-z])'", ex.question).group(1)
        word = re.search(r'"([a-z]+)"', ex.question).group(1)
        line = next(l for l in ex.reasoning.splitlines() if " vs " in l)
        body = re.sub(r"^(Checking: |Each letter against '[a-z]': |Compare: )", "", line)
        items = re.split(r", (?=[a-z] vs)|; ", body.rstrip("."))
        assert len(items) == len(word), line
        running = 0
        for c, item in zip(word, items):
            m = _CHECK.match(item)
            assert m, item
            assert (m.group(1), m.group(2)) == (c, letter)
            running += c == letter
            assert (m.group(3) == "no") == (c != letter), item
            if c == letter:
                assert int(m.group(4) or m.group(5)) == running
        assert ex.answer == str(word.count(letter))


def test_compare_steps_stop_at_the_first_difference() -> None:
    assert compare_steps(71, 78) == "71 vs 78: 7 = 7, 1 < 8"
    assert compare_steps(5, 63) == "5 vs 63: 1 digit vs 2 digits"
    assert compare_steps(979, 856) == "979 vs 856: 9 > 8"
    assert compare_steps(44, 44) == "44 vs 44: 4 = 4, 4 = 4"


def test_max_v3_compares_each_number_with_the_running_max() -> None:
    rng = random.Random(3)
    for _ in range(300):
        ex = sample_example("max", rng, style=4)
        values = [int(v) for v in re.findall(r"\d+", ex.question)]
        steps = [l for l in ex.reasoning.splitlines() if " vs " in l]
        assert len(steps) == len(values) - 1
        cur = values[0]
        for v, line in zip(values[1:], steps):
            assert compare_steps(v, cur) in line, (line, v, cur)
            verdict = line.rsplit("; ", 1)[1]
            assert any(w in verdict for w in ("new max", "now", "bigger")) == (v > cur), line
            cur = max(cur, v)
            assert re.findall(r"\d+", verdict) == [str(cur)], line
        assert ex.answer == str(max(values))


def test_compare_v3_names_each_digit_by_its_count_mark() -> None:
    rng = random.Random(4)
    for _ in range(300):
        ex = sample_example("compare", rng, style=4)
        a, b = (int(v) for v in re.findall(r"\d+", ex.question)[:2])
        lines = ex.reasoning.splitlines()       # the goal, the counted digits, then both lengths
        assert f"{len(str(a))}" in lines[2] and f"{len(str(b))}" in lines[2]
        marks = [re.match(r"(?:Digit|Position|Mark) (\d+): (\d) ([=<>]) (\d)", l) for l in lines]
        marks = [m for m in marks if m]
        if len(str(a)) != len(str(b)):
            assert not marks
            continue
        for m in marks:
            k, x, rel, y = int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4))
            assert (x, y) == (int(str(a)[k - 1]), int(str(b)[k - 1]))
            assert rel == ("=" if x == y else ">" if x > y else "<")
        assert marks[-1].group(3) != "=" or a == b


def test_sub_v3_states_the_sign_before_anything_that_depends_on_it() -> None:
    rng = random.Random(5)
    for _ in range(300):
        ex = sample_example("sub", rng, style=4)
        a, b = (int(v) for v in re.findall(r"\d+", ex.question)[:2])
        if ex.question.startswith("Subtract"):
            b, a = a, b
        first = ex.reasoning.splitlines()[0]
        assert compare_steps(a, b) in first
        assert ("negative: compute" in first) == (a < b), first
        assert ex.answer == str(a - b)


def test_reverse_v3_spells_the_joined_word_a_letter_per_token(tok) -> None:
    rng = random.Random(6)
    for _ in range(100):
        ex = sample_example("reverse", rng, style=4)
        text = ex.prompt + ex.completion
        assert text.count(SPELL_OPEN) == 2 and text.count(SPELL_CLOSE) == 2
        ids = encode_training_text(tok, text)
        assert tok.decode(ids, skip_special_tokens=False) == strip_spelled(text)
        pieces = [tok.id_to_token(i) for i in ids]
        # the answer line: "The answer is" then " w" and one token per remaining letter
        start = len(pieces) - len(ex.answer) - 2
        assert pieces[start:-2] == ["Ġ" + ex.answer[0]] + list(ex.answer[1:]), pieces[-12:]


def test_encode_training_text_without_spans_is_the_plain_encoding(tok) -> None:
    rng = random.Random(7)
    for family in FAMILY_SPECS:
        ex = sample_example(family, rng, style=4)
        text = ex.prompt + ex.completion
        if SPELL_OPEN not in text:
            assert encode_training_text(tok, text) == tok.encode(text, add_special_tokens=False).ids


def test_v3_traces_start_at_the_recipes_step_and_leave_earlier_batches_alone(tok) -> None:
    v3 = RECIPES["tiny-r1"]
    before = replace(v3, v3_traces_from=-1)
    s = v3.v3_traces_from
    assert torch.equal(batch_for_step(tok, v3, s - 1), batch_for_step(tok, before, s - 1))
    later = batch_for_step(tok, v3, s)
    assert not torch.equal(later, batch_for_step(tok, before, s))
    text = tok.decode(later.flatten().tolist(), skip_special_tokens=False)
    assert SPELL_OPEN not in text and " vs " in text


def test_example_for_passes_the_style() -> None:
    v2 = example_for("count", ("banana", "a"), random.Random(0), style=2)
    v3 = example_for("count", ("banana", "a"), random.Random(0), style=4)
    assert " vs " in v3.reasoning and " vs " not in v2.reasoning
    assert v3.answer == v2.answer == "3"


@pytest.mark.parametrize("style,base,changed", [(4, 2, (*V3_FAMILIES, "mul")), (5, 4, ("compare",)),
                                                (7, 5, ("sort",)), (8, 7, ("sort",)),
                                                (9, 8, ("compare",))])
def test_each_later_style_changes_only_its_families(style: int, base: int, changed: tuple[str, ...]) -> None:
    rng = random.Random(style)
    for family in FAMILY_SPECS:
        differs = 0
        for k in range(50):
            ops = sample_operands(family, rng)
            before = render(family, ops, random.Random(k), style=base)
            after = render(family, ops, random.Random(k), style=style)
            assert (after.question, after.answer) == (before.question, before.answer)
            differs += after != before
        assert differs == 0 if family not in changed else differs > 10, (family, differs)


def test_mul_v4_uses_the_column_method_only() -> None:
    rng = random.Random(12)
    for _ in range(300):
        ex = sample_example("mul", rng, style=4)
        assert not re.search(r"place value|Break|Split \d+ as|Write \d+ =|Add them|Adding:|Sum:", ex.reasoning), ex.reasoning
        assert extract_answer(ex.completion) == ex.answer


def test_compare_v4_states_the_goal_first_and_copies_it_last() -> None:
    rng = random.Random(13)
    for _ in range(300):
        ex = sample_example("compare", rng, style=4)
        want = "smaller" if re.search(r"smaller|less", ex.question) else "larger"
        lines = ex.reasoning.splitlines()
        assert want in lines[0] and ("smaller" if want == "larger" else "larger") not in lines[0]
        assert lines[-1] == f"We need the {want} one: {ex.answer}."


def test_compare_v5_compares_beside_the_numbers_and_names_both() -> None:
    rng = random.Random(15)
    orders = set()
    for _ in range(300):
        ex = sample_example("compare", rng, style=5)
        a, b = (int(x) for x in re.findall(r"\d+", ex.question))
        want = "smaller" if re.search(r"smaller|less", ex.question) else "larger"
        lines = ex.reasoning.splitlines()
        assert want in lines[0] and ("smaller" if want == "larger" else "larger") not in lines[0]
        assert lines[-3] == f"{compare_steps(a, b)}, so {a} {'>' if a > b else '<'} {b}."
        halves = {f"the larger is {max(a, b)}", f"the smaller is {min(a, b)}"}
        named = lines[-2].removeprefix("So ").removesuffix(".").split(" and ")
        assert set(named) == halves
        orders.add(named[0].split(" is ")[0])
        assert lines[-1] == f"We need the {want} one: {ex.answer}."
        assert int(ex.answer) == (min(a, b) if want == "smaller" else max(a, b))
    assert orders == {"the larger", "the smaller"}     # both orders of the naming line occur


def test_spell_drill_spells_each_made_up_word_and_cuts_it_from_training_words_only() -> None:
    from mtp_factory.data.tasks import drill_pieces
    from mtp_factory.data.words import render_spell_drill
    held_out = [w for w in WORDS if split_of("reverse", (w,)) == "eval"]
    assert held_out and not set(held_out) & set(drill_pieces())
    rng = random.Random(18)
    for _ in range(100):
        block = render_spell_drill(rng, drill_pieces())
        assert block.endswith("\n\n") and "The answer is" not in block
        for line in block.strip().splitlines()[1:]:
            word, spelled_out = re.fullmatch(r'"([a-z]+)": (.*)\.', line).groups()
            letters = re.sub(r"[\d:, -]", "", spelled_out)
            assert letters == word, line


def test_spell_drill_share_and_its_absence(tok) -> None:
    from mtp_factory.data.dataset import training_texts
    plain = list(training_texts(3, 400, general_fraction=0.0, style=5))
    drilled = list(training_texts(3, 400, general_fraction=0.0, style=5, spell_drill_fraction=0.2))
    blocks = [t for t in drilled if t.startswith(("Spelling practice:", "Spell each one:", "Letters of some"))]
    assert 50 <= len(blocks) <= 110
    assert [t for t in drilled if t not in blocks] == plain[:len(drilled) - len(blocks)]
    with pytest.raises(ValueError, match="spell_drill_fraction"):
        next(training_texts(3, 4, drill_fraction=0.5, spell_drill_fraction=0.5))


def test_tiny_r1_drills_spelling_only_from_its_step(tok) -> None:
    r = RECIPES["tiny-r1"]
    start, undrilled = r.spell_drill_from, replace(r, spell_drill_fraction=0.0)
    for step in (0, 14000, start - 3, start - 2, start - 1):
        assert torch.equal(batch_for_step(tok, r, step), batch_for_step(tok, undrilled, step))
    drilled = [tok.decode(batch_for_step(tok, r, s).flatten().tolist()) for s in range(start, start + 4)]
    assert any("Spelling practice:" in t or "Spell each one:" in t or "Letters of some" in t for t in drilled)


def test_sort_v7_compares_each_number_with_the_running_pick() -> None:
    rng = random.Random(19)
    for _ in range(200):
        ex = sample_example("sort", rng, style=7)
        asc = "ascending" in ex.question or "smallest to largest" in ex.question or "increasing" in ex.question
        passes = [ln for ln in ex.reasoning.splitlines() if re.match(r"(Scan|Remaining|Pass \d+|Left): ", ln)]
        assert passes
        for line in passes:
            items = line.split(": ", 1)[1].removesuffix(".")
            first, *rest = re.split(r", (?=\d+ [\[(])", items)
            cur = int(first)
            for item in rest:
                v, hint, pick_ = re.fullmatch(r"(\d+) [\[(](.*); (\d+)[\])]", item).groups()
                v = int(v)
                if len(str(v)) == len(str(cur)):
                    assert hint == compare_steps(v, cur).split(": ", 1)[1]
                else:
                    assert hint == ("longer" if len(str(v)) > len(str(cur)) else "shorter")
                cur = min(v, cur) if asc else max(v, cur)
                assert int(pick_) == cur
        assert extract_answer(ex.completion) == ex.answer


def test_sort_v9_writes_every_number_each_pass_and_marks_the_taken_ones_out() -> None:
    rng = random.Random(23)
    for _ in range(200):
        ex = sample_example("sort", rng, style=8)
        values = [int(v) for v in re.search(r"(\d+(?:, \d+)+)", ex.question).group(1).split(", ")]
        asc = "ascending" in ex.question or "smallest to largest" in ex.question or "increasing" in ex.question
        lines = ex.reasoning.splitlines()
        passes = [i for i, ln in enumerate(lines) if re.match(r"(Scan|Pass \d+|Round \d+|Now): ", ln)]
        assert len(passes) == len(values) - 1
        taken: list[int] = []      # positions in the question's order
        for i in passes:
            items = re.split(r", (?=\d+(?: out| [\[(]|,|$))", lines[i].split(": ", 1)[1].removesuffix("."))
            assert len(items) == len(values)
            cur = None
            for pos, (v, item) in enumerate(zip(values, items)):
                if pos in taken:
                    assert item == f"{v} out"
                elif cur is None:
                    assert item == str(v)
                    cur = pos
                else:
                    w, hint, pick_ = re.fullmatch(r"(\d+) [\[(](.*); (\d+)[\])]", item).groups()
                    assert int(w) == v
                    c = values[cur]
                    if len(str(v)) == len(str(c)):
                        assert hint == compare_steps(v, c).split(": ", 1)[1]
                    else:
                        assert hint == ("longer" if len(str(v)) > len(str(c)) else "shorter")
                    if (v < c) if asc else (v > c):
                        cur = pos
                    assert int(pick_) == values[cur]
            assert str(values[cur]) in lines[i + 1]     # the take line names the pick
            taken.append(cur)
        assert [values[p] for p in taken] + [v for p, v in enumerate(values) if p not in taken] == \
            sorted(values, reverse=not asc)
        assert extract_answer(ex.completion) == ex.answer


@pytest.mark.parametrize("start,styles,shapes", [
    (13100, (2, 4), ((4, 512, 0.5), (4, 512, 0.5))),
    (16600, (4, 5), ((4, 512, 0.5), (4, 512, 0.5))),
    (20100, (5, 7), ((4, 512, 0.5), (4, 512, 0.5))),
    (22100, (7, 8), ((4, 512, 0.5), (3, 768, 1 / 3))),
    (24100, (8, 9), ((3, 768, 1 / 3), (3, 768, 1 / 3)))])
def test_tiny_r1_switches_style_and_rows_at_its_steps(tok, start, styles, shapes) -> None:
    """The shipped recipe changes trace style (and at 22,100 its rows) exactly at `start`: the batches before
    are those of the recipe stopped before the switch, the batches from it on differ."""
    r = RECIPES["tiny-r1"]
    before = replace(r, trace_styles=tuple(t for t in r.trace_styles if t[0] < start),
                     row_shapes=tuple(t for t in r.row_shapes if t[0] < start),
                     v3_traces_from=r.v3_traces_from if r.v3_traces_from < start else -1)
    assert tuple(trace_style_at(r, s) for s in (start - 1, start)) == styles
    assert tuple(rows_at(r, s) for s in (start - 1, start)) == shapes
    for step in (start - 2, start - 1):
        assert torch.equal(batch_for_step(tok, r, step), batch_for_step(tok, before, step))
    assert batch_for_step(tok, r, start).shape == shapes[1][:2]
    assert any(not torch.equal(batch_for_step(tok, r, s), batch_for_step(tok, before, s)) for s in range(start, start + 3))


def test_compare_v9_states_whether_the_lengths_match_before_comparing() -> None:
    rng = random.Random(29)
    for _ in range(300):
        ex = sample_example("compare", rng, style=9)
        a, b = (int(x) for x in re.findall(r"\d+", ex.question)[:2])
        verdict = re.search(r"has \d+(?: digits?)?: (.*)\.$", ex.reasoning, re.M).group(1)
        assert verdict == ("the same length" if len(str(a)) == len(str(b))
                           else f"{a if len(str(a)) > len(str(b)) else b} is longer")
        assert f"{compare_steps(a, b)}, so {a} {'>' if a > b else '<'} {b}." in ex.reasoning
        assert extract_answer(ex.completion) == ex.answer

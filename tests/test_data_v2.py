"""tiny-r1 v2 data: every step of the sort, count, reverse and compare traces is recomputed from the text
written before it (the property that makes a trace learnable exactly), the single-digit fact drill is
correct, and the drill share of the training stream is what was asked for."""
from __future__ import annotations

import random
import re

import pytest

from mtp_core.chat_format import BOS, USER
from mtp_factory.data import example_for, sample_example, training_texts
from mtp_factory.data.arithmetic import render_fact_drill

_MARK = re.compile(r"^(\d+)(?: \((\d+)\)| -> (\d+)| \[(\d+)\])?$")


def _parse_marked(items: str) -> list[tuple[int, int | None]]:
    out = []
    for item in items.split(", "):
        m = _MARK.match(item)
        assert m, item
        mark = next((g for g in m.groups()[1:] if g is not None), None)
        out.append((int(m.group(1)), None if mark is None else int(mark)))
    return out


@pytest.mark.parametrize("split", ["train", "eval"])
def test_sort_passes_copy_the_remaining_list_and_mark_the_running_pick(split: str) -> None:
    rng = random.Random(5)
    for _ in range(300):
        ex = sample_example("sort", rng, split)
        values = [int(x) for x in re.search(r"(\d+(?:, \d+)+)", ex.question).group(1).split(", ")]
        desc = any(w in ex.question for w in ("descending", "largest to smallest", "decreasing"))
        lines = ex.reasoning.splitlines()
        passes = [i for i, l in enumerate(lines) if re.match(r"(Scan|Remaining|Pass \d+|Left): ", l)]
        assert len(passes) == len(values) - 1, ex.reasoning
        rest, picked = list(values), []
        for i in passes:
            marked = _parse_marked(lines[i].split(": ", 1)[1].rstrip("."))
            assert [v for v, _ in marked] == rest                      # the copy of what is left
            assert marked[0][1] is None
            cur = marked[0][0]
            for v, m in marked[1:]:                                     # the running pick
                cur = max(cur, v) if desc else min(cur, v)
                assert m == cur, lines[i]
            assert re.search(rf"\b{cur}\.$", lines[i + 1]), lines[i + 1]   # the pick is taken
            rest.remove(cur)
            picked.append(cur)
        assert picked + rest == sorted(values, reverse=desc)
        assert ex.answer == ", ".join(map(str, picked + rest))


def test_count_marks_every_occurrence_with_a_running_count() -> None:
    rng = random.Random(6)
    for _ in range(300):
        ex = sample_example("count", rng)
        word = re.search(r'"([a-z]+)"', ex.question).group(1)
        letter = re.search(r"'([a-z])'", ex.question).group(1)
        line = next(l for l in ex.reasoning.splitlines() if l.count(", ") >= len(word) - 1 and "(" in l or "->" in l
                    or "[" in l or (letter not in word and re.fullmatch(r"[^:]*?:? ?([a-z], )+[a-z]\.", l)))
        items = line.split(": ", 1)[-1].rstrip(".").split(", ")
        assert [it[0] for it in items] == list(word), line
        running = 0
        for it, c in zip(items, word):
            if c == letter:
                running += 1
                assert re.fullmatch(rf"{c} (\({running}\)|\(that's {running}\)|-> {running}|\[{running}\])", it), it
            else:
                assert it == c
        assert ex.answer == str(word.count(letter))


def test_reverse_numbers_the_letters_and_counts_down() -> None:
    rng = random.Random(7)
    forms = (r"(\d+) ([a-z])", r"(\d+):([a-z])", r"([a-z])(\d+)")
    for _ in range(300):
        ex = sample_example("reverse", rng)
        word = re.search(r'"([a-z]+)"', ex.question).group(1)
        lines = ex.reasoning.splitlines()
        numbered = [l for l in lines if re.match(r"(Letters|Forwards|Numbered|Backwards|Reversed|From the end|"
                                                  r"Counting down): ", l)]
        assert len(numbered) == 2, ex.reasoning
        seqs = []
        for l in numbered:
            pairs = []
            for it in l.split(": ", 1)[1].rstrip(".").split(", "):
                m = next(m for f in forms if (m := re.fullmatch(f, it)))
                a, b = m.groups()
                pairs.append((int(a), b) if a.isdigit() else (int(b), a))
            seqs.append(pairs)
        assert seqs[0] == [(i + 1, c) for i, c in enumerate(word)]
        assert seqs[1] == seqs[0][::-1]
        assert ex.answer == word[::-1]


def test_compare_counts_the_digits_of_both_numbers() -> None:
    rng = random.Random(8)
    for _ in range(300):
        ex = sample_example("compare", rng)
        a, b = (int(x) for x in re.findall(r"\d+", ex.question)[:2])
        first = ex.reasoning.splitlines()[0]
        for x in (a, b):
            m = re.search(rf"(?:^|\. |: ){x}: (.*?)\.(?: |$)", first)
            assert m, first
            marks = re.findall(r"(\d) (?:\((\d+)\)|-> (\d+))|(\d):(\d+)", m.group(1))
            got = [(int(t[0] or t[3]), int(t[1] or t[2] or t[4])) for t in marks]
            assert got == [(int(d), k + 1) for k, d in enumerate(str(x))], first


def test_fact_drill_lines_are_all_correct() -> None:
    rng = random.Random(9)
    forms = ((r"(\d+) \+ (\d+) = (\d+)", lambda a, b: a + b), (r"(\d+) plus (\d+) is (\d+)", lambda a, b: a + b),
             (r"(\d+) \+ (\d+) makes (\d+)", lambda a, b: a + b),
             (r"(\d+) \+ (\d+) \+ 1 = (\d+)", lambda a, b: a + b + 1),
             (r"(\d+) plus (\d+) plus the carry 1 is (\d+)", lambda a, b: a + b + 1),
             (r"(\d+) - (\d+) = (\d+)", lambda a, b: a - b), (r"(\d+) minus (\d+) is (\d+)", lambda a, b: a - b),
             (r"(\d+) [×*] (\d+) = (\d+)", lambda a, b: a * b), (r"(\d+) times (\d+) is (\d+)", lambda a, b: a * b))
    seen = set()
    for _ in range(200):
        text = render_fact_drill(rng)
        assert text.endswith("\n\n") and BOS not in text
        for line in text.strip().splitlines()[1:]:
            hit = [(f, fn) for f, fn in forms if re.fullmatch(f, line)]
            assert hit, line
            a, b, c = (int(x) for x in re.fullmatch(hit[0][0], line).groups())
            assert c == hit[0][1](a, b) and c >= 0, line
            assert b <= 9 and (a <= 9 or (" - " in line and 10 <= a <= 18 and b > a - 10)), line
            seen.add(line)
    assert len(seen) > 300


def test_drill_fraction_in_the_training_stream() -> None:
    texts = list(training_texts(seed=2, num_examples=2000, general_fraction=0.0, drill_fraction=0.1))
    assert texts == list(training_texts(seed=2, num_examples=2000, general_fraction=0.0, drill_fraction=0.1))
    drills = [t for t in texts if not t.startswith(BOS + USER)]
    assert len(texts) == 2000 and 150 < len(drills) < 250
    assert all(re.match(r"(Digit facts|Practice|Single-digit facts|Facts to remember)", t) for t in drills)
    with pytest.raises(ValueError, match="drill_fraction"):
        next(training_texts(seed=2, num_examples=1, drill_fraction=1.0))


def test_hand_checked_v2_traces() -> None:
    ex = example_for("sort", ("asc", (42, 7, 19, 88, 3)), random.Random(0))
    assert ex.answer == "3, 7, 19, 42, 88"
    assert re.search(r"42, 7 (\(7\)|-> 7|\[7\]), 19 (\(7\)|-> 7|\[7\]), 88 (\(7\)|-> 7|\[7\]), 3 (\(3\)|-> 3|\[3\])\.",
                     ex.reasoning), ex.reasoning
    ex = example_for("reverse", ("planet",), random.Random(0))
    assert ex.answer == "tenalp" and re.search(r"(6 t|6:t|t6), (5 e|5:e|e5), (4 n|4:n|n4)", ex.reasoning)

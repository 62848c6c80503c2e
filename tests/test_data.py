"""Tests for the training/evaluation data (mtp_factory.data): answers recomputed from the question text by
hand-written parsers, arithmetic in every trace re-evaluated, train/eval disjointness, determinism,
answer extraction on decoded text, variability of traces, and the predictability estimate."""
from __future__ import annotations

import json
import random
import re

import pytest
import torch

from mtp_core.chat_format import BOS, EOS, THINK_END, THINK_START, USER
from mtp_core.bench.eval_sets import load_eval_set
from mtp_core.bench.scoring import extract_answer, score
from mtp_factory.data import (
    FAMILIES, describe_data, estimate_predictability, example_for, sample_example, training_texts, write_eval_sets,
)

torch.set_num_threads(1)

_NUM = re.compile(r"-?\d+")


def _nums(q: str) -> list[int]:
    return [int(x) for x in _NUM.findall(q)]


def _word_letter(q: str) -> tuple[str, str | None]:
    word = re.search(r'"([a-z]+)"', q).group(1)
    letter = re.search(r"'([a-z])'", q)
    return word, letter.group(1) if letter else None


def expected_answer(task: str, q: str) -> str:
    """The answer computed from the question text alone (independent of the generator)."""
    n = _nums(q)
    if task == "add":
        return str(n[0] + n[1])
    if task == "sub":
        a, b = (n[1], n[0]) if q.startswith("Subtract") else (n[0], n[1])
        return str(a - b)
    if task == "mul":
        return str(n[0] * n[1])
    if task == "sort":
        desc = any(w in q for w in ("descending", "largest to smallest", "decreasing"))
        return ", ".join(str(v) for v in sorted(n, reverse=desc))
    if task == "count":
        word, letter = _word_letter(q)
        return str(word.count(letter))
    if task == "compare":
        return str(min(n) if re.search(r"smaller|less", q) else max(n))
    if task == "max":
        return str(max(n))
    if task == "reverse":
        return _word_letter(q)[0][::-1]
    if task == "parity":
        return "even" if n[0] % 2 == 0 else "odd"
    raise AssertionError(task)


def question_key(task: str, q: str) -> tuple:
    """Operands up to the order the answer ignores, parsed from the question text."""
    n = _nums(q)
    if task in ("count", "reverse"):
        return (task,) + _word_letter(q)
    if task == "sub":
        return (task,) + ((n[1], n[0]) if q.startswith("Subtract") else (n[0], n[1]))
    return (task,) + tuple(sorted(n))


_EXPR = r"-?\d+(?:\s*[-+×*]\s*\d+)*"
_LEFT = re.compile(rf"({_EXPR})\s*$")
_RIGHT = re.compile(rf"^\s*({_EXPR})")


def wrong_equations(text: str) -> list[str]:
    """Every 'expression = expression' in `text` whose two sides differ ('3 + 4 = 8' is returned)."""
    bad = []
    for line in text.splitlines():
        for m in re.finditer("=", line):
            left, right = _LEFT.search(line[:m.start()]), _RIGHT.match(line[m.end():])
            if left and right:
                lhs, rhs = (eval(s.replace("×", "*")) for s in (left.group(1), right.group(1)))
                if lhs != rhs:
                    bad.append(line)
    return bad


def test_equation_checker_catches_errors() -> None:
    assert wrong_equations("Tens: 4 × 6 + 4 = 28, write 8.\nWrite 347 = 300 + 40 + 7.") == []
    assert wrong_equations("Adding: 12 + 280 = 148.") == ["Adding: 12 + 280 = 148."]
    assert wrong_equations("Write 347 = 3 + 40 + 700.") != []
    assert wrong_equations("So 456 - 123 = 333, and 123 - 456 = -333.") == []


@pytest.mark.parametrize("split", ["train", "eval"])
def test_answers_and_working_are_correct(split: str) -> None:
    rng = random.Random(11)
    for task in FAMILIES:
        for _ in range(150):
            ex = sample_example(task, rng, split)
            assert ex.answer == expected_answer(task, ex.question), (task, ex.question)
            assert wrong_equations(ex.reasoning) == [], (task, ex.reasoning)
            assert "The answer is" not in ex.reasoning and "\n\n" not in ex.reasoning
            assert ex.prompt == BOS + USER + ex.question + "<｜Assistant｜>" + THINK_START + "\n"
            assert ex.completion.startswith(ex.reasoning + "\n" + THINK_END + "\n\n")
            assert ex.completion.endswith(f"The answer is {ex.answer}.{EOS}")


def test_hand_checked_examples() -> None:
    rng = random.Random(0)
    assert example_for("add", (4821, 379), rng).answer == "5200"
    assert example_for("sub", (123, 456), rng).answer == "-333"
    assert example_for("mul", (37, 24), rng).answer == "888"
    assert example_for("sort", ("desc", (5, 40, 12)), rng).answer == "40, 12, 5"
    assert example_for("count", ("strawberry", "r"), rng).answer == "3"
    assert example_for("compare", (4821, 4819, "smaller"), rng).answer == "4819"
    assert example_for("reverse", ("planet",), rng).answer == "tenalp"
    assert example_for("parity", (347,), rng).answer == "odd"


def test_training_texts_are_deterministic_and_mixed() -> None:
    first = list(training_texts(seed=3, num_examples=400))
    assert first == list(training_texts(seed=3, num_examples=400))
    assert first != list(training_texts(seed=4, num_examples=400))
    chat = [t for t in first if t.startswith(BOS + USER)]
    general = [t for t in first if not t.startswith(BOS + USER)]
    assert len(chat) == 400 and all(t.startswith(BOS) and THINK_START not in t for t in general)
    share = sum(map(len, general)) / sum(map(len, first))
    assert 0.13 < share < 0.17, share
    assert all(t.startswith(BOS + USER) for t in training_texts(seed=3, num_examples=50, general_fraction=0.0))
    questions = [t[len(BOS + USER):t.index("<｜Assistant｜>")] for t in chat]
    assert {family_of(q) for q in questions} == set(FAMILIES)


def test_eval_sets_are_deterministic_and_disjoint_from_training(tmp_path) -> None:
    paths = write_eval_sets(tmp_path / "a", per_family=40, seed=5)
    again = write_eval_sets(tmp_path / "b", per_family=40, seed=5)
    assert [p.name for p in paths] == [f"eval_{t}.jsonl" for t in FAMILIES] + ["eval_add_3digit.jsonl"]
    assert [p.read_bytes() for p in paths] == [p.read_bytes() for p in again]
    eval_keys = set()
    for path in paths:
        records = load_eval_set(path)
        assert len(records) == 40 and all(set(r) == {"task", "question", "prompt", "answer"} for r in records)
        family = "add" if records[0]["task"] == "add_3digit" else None
        keys = {question_key(family or r["task"], r["question"]) for r in records}
        assert len(keys) == 40                          # distinct questions
        for r in records:
            assert family_of(r["question"]) == (family or r["task"])
            assert r["answer"] == expected_answer(family or r["task"], r["question"])
            if family:                                  # the 3-digit target set: both operands 3 digits
                assert [len(n) for n in re.findall(r"\d+", r["question"])] == [3, 3]
            assert r["prompt"].endswith(r["question"] + "<｜Assistant｜>" + THINK_START + "\n")
        eval_keys |= keys
    for seed in (0, 1):
        for text in training_texts(seed=seed, num_examples=3000, general_fraction=0.0):
            question = text[len(BOS + USER):text.index("<｜Assistant｜>")]
            assert question_key(family_of(question), question) not in eval_keys, question


_FAMILY_RULES = (   # first match wins
    ("count", ("'",)), ("reverse", ('"',)), ("sort", ("order",)), ("max", ("largest number", "maximum", "biggest")),
    ("compare", ("Which",)), ("parity", ("even", "parity")), ("mul", ("×", "*", "times", "Multiply", "product")),
    ("sub", (" - ", "minus", "Subtract", "difference")),
)


def family_of(q: str) -> str:
    """Which family a question belongs to, from its wording only."""
    return next((task for task, marks in _FAMILY_RULES if any(m in q for m in marks)), "add")


def test_extract_answer_on_decoded_text() -> None:
    with_markers = "Ones: 9 + 0 = 9. Write 9.\n</think>\n\n123 + 456 = 579.\n\nThe answer is 579."
    assert extract_answer(with_markers) == "579"
    assert extract_answer(with_markers + EOS) == "579"
    assert extract_answer(with_markers + EOS + BOS + "Tens: 7 + 5\n\nThe answer is 8") == "579"
    skipped = "Ones: 9 + 0 = 9. Write 9.\n\n\n123 + 456 = 579.\n\nThe answer is 579."
    assert extract_answer(skipped) == "579"
    assert extract_answer("Start.\n</think>\n\nThe answer is -42.\n") == "-42"
    assert extract_answer("</think>\n\nThe answer is 3 ,7,12 .") == "3, 7, 12"
    assert extract_answer("Ones: 9 + 0 = 9. Write 9.\nTens: 7 + 5") is None          # cut off mid-thought
    assert extract_answer("The answer is 5.\n</think>\n\n") is None                  # nothing after </think>
    assert extract_answer("") is None


def test_extract_answer_through_a_real_tokenizer() -> None:
    from mtp_core.tokenizer_build import train_bpe_tokenizer
    tok = train_bpe_tokenizer(list(training_texts(seed=0, num_examples=200)), vocab_size=400)
    ex = sample_example("sort", random.Random(2))
    ids = tok.encode(ex.prompt + ex.completion).ids
    for skip in (True, False):
        text = tok.decode(ids[len(tok.encode(ex.prompt).ids):], skip_special_tokens=skip)
        assert extract_answer(text) == ex.answer


def test_score_per_family() -> None:
    records = [{"task": "add", "answer": "579"}, {"task": "add", "answer": "10"},
               {"task": "sort", "answer": "1, 2, 3"}, {"task": "parity", "answer": "odd"}]
    generations = ["x\n</think>\n\nThe answer is 579.", "x\n\n\nThe answer is 11.",
                   "x\n</think>\n\nThe answer is 1,2, 3.", "x\nTens: 7 + 5"]
    assert score(records, generations) == {"add": 0.5, "overall": 0.5, "parity": 0.0, "sort": 1.0}
    with pytest.raises(ValueError):
        score(records, generations[:2])


@pytest.mark.parametrize("task,ops,minimum", [
    ("add", (48213, 9876), 60), ("sub", (5003, 478), 40), ("mul", (37, 24), 60), ("mul", (347, 6), 30),
    ("sort", ("asc", (45, 12, 7, 33, 20)), 40), ("count", ("strawberry", "r"), 30),
    ("compare", (78773, 78719, "larger"), 30), ("max", (12, 45, 7, 33, 8), 40),
    ("reverse", ("planet",), 20), ("parity", (347,), 15),
])
def test_fixed_question_has_many_traces(task: str, ops: tuple, minimum: int) -> None:
    examples = [example_for(task, ops, random.Random(i)) for i in range(200)]
    assert len({e.answer for e in examples}) == 1
    distinct = len({e.reasoning for e in examples})
    assert distinct >= minimum, distinct


def test_predictability_is_high_but_not_total() -> None:
    est = estimate_predictability(seed=0, per_family=300, order=3)
    print("word 3-gram predictability:", {k: round(v, 3) for k, v in est.items()})
    assert set(est) == set(FAMILIES) | {"overall"}
    assert 0.6 < est["overall"] < 0.95
    assert all(v < 0.99 for v in est.values())


def test_errors_and_description() -> None:
    with pytest.raises(ValueError):
        sample_example("division", random.Random(0))
    with pytest.raises(ValueError):
        next(training_texts(seed=0, num_examples=1, general_fraction=1.0))
    text = describe_data(seed=0)
    assert all(f"--- {t} sample 2" in text for t in FAMILIES) and "PSF" in text
    json.dumps(text)

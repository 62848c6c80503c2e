"""Exact-match scoring of the shipped model's answers (`mtp sweep --accuracy`, the evaluation scripts).

Every training completion ends with the line `The answer is X.` (the factory writes it with
`format_answer`) after `</think>` and a blank line, and the phrase "The answer is" never occurs inside a
reasoning trace. So the final answer is read from the last paragraph of the generated text (after the last
`</think>` if one is visible), which works whether the decoder kept `<think>`/`</think>` or skipped them:
with them skipped the text is `reasoning\\n\\n\\nThe answer is X.` and the last paragraph is still the
answer line. Text after a visible EOS (generation with ignore_eos) is cut off first.
"""
from __future__ import annotations

import re
from collections import defaultdict

from mtp_core.chat_format import EOS, SPECIAL_TOKENS, THINK_END

ANSWER_PREFIX = "The answer is"
_ANSWER_RE = re.compile(r"The answer is\s*(.*?)\s*$", re.DOTALL)
_PARAGRAPH_RE = re.compile(r"\n\s*\n")


def format_answer(answer: str) -> str:
    """The final answer line of a completion."""
    return f"{ANSWER_PREFIX} {answer}."


def normalize_answer(answer: str) -> str:
    """Collapse whitespace, drop one trailing period, tighten list commas: ' 3 ,7, 12. ' -> '3, 7, 12'."""
    text = " ".join(answer.split())
    if text.endswith("."):
        text = text[:-1].rstrip()
    return re.sub(r"\s*,\s*", ", ", text)


def extract_answer(generated_text: str) -> str | None:
    """The normalized final answer in `generated_text`, or None when there is no answer line."""
    text = generated_text.split(EOS, 1)[0]         # anything generated past EOS is not the answer
    if THINK_END in text:
        text = text.rsplit(THINK_END, 1)[1]
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "")
    paragraphs = [p for p in _PARAGRAPH_RE.split(text.strip()) if p.strip()]
    if not paragraphs:
        return None
    last = paragraphs[-1]
    start = last.rfind(ANSWER_PREFIX)
    if start < 0:
        return None
    match = _ANSWER_RE.match(last[start:].split("\n", 1)[0])
    answer = normalize_answer(match.group(1)) if match else ""
    return answer or None


def score(records: list[dict], generations: list[str]) -> dict[str, float]:
    """Exact-match accuracy per task family and 'overall' (held-out records, see `eval_sets`)."""
    if len(records) != len(generations):
        raise ValueError(f"got {len(records)} records but {len(generations)} generations; pass one per record")
    hits: dict[str, list[int]] = defaultdict(list)
    for record, text in zip(records, generations):
        predicted = extract_answer(text)
        correct = predicted is not None and predicted == normalize_answer(record["answer"])
        hits[record["task"]].append(int(correct))
        hits["overall"].append(int(correct))
    return {task: sum(v) / len(v) for task, v in sorted(hits.items())}

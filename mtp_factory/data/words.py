"""Counting a letter in a word and reversing a word: samplers and trace renderers."""
from __future__ import annotations

import random
import string

from mtp_factory.data.phrasing import WORDS, Trace, maybe, pick, spelled, times


# ------------------------------------------------------------------ counting a letter

def sample_count(rng: random.Random) -> tuple[str, str]:
    word = pick(rng, WORDS)
    letter = pick(rng, word) if maybe(rng, 0.75) else pick(rng, string.ascii_lowercase)
    return word, letter


def _count_opening(word: str, letter: str, rng: random.Random) -> tuple[str, list[str]]:
    """The question, an opening line and the word spelled out (shared by both count traces)."""
    question = pick(rng, (f"How many times does the letter '{letter}' appear in \"{word}\"?",
                          f"How many '{letter}'s are in the word \"{word}\"?",
                          f"Count the letter '{letter}' in \"{word}\".",
                          f"In the word \"{word}\", how many times does '{letter}' occur?"))
    lines = [pick(rng, (f"Let me spell \"{word}\" and count the {letter}'s.",
                        f"I'll go through \"{word}\" letter by letter.",
                        f"Spell it out and look for '{letter}'."))]
    lines.append(pick(rng, ("-", " ", ", ")).join(word) + ".")
    return question, lines


def render_count(ops: tuple[str, str], rng: random.Random) -> Trace:
    word, letter = ops
    count = word.count(letter)
    question, lines = _count_opening(word, letter, rng)
    # Letter by letter with a running count: each step needs only the previous mark and one letter.
    mark = pick(rng, ("{c} ({n})", "{c} (that's {n})", "{c} -> {n}", "{c} [{n}]"))
    marked, running = [], 0
    for c in word:
        running += c == letter
        marked.append(mark.format(c=c, n=running) if c == letter else c)
    lines.append(pick(rng, ("", "Counting: ", "Going through: ", f"Marking each '{letter}': ")) + ", ".join(marked) + ".")
    if count == 0:
        lines.append(pick(rng, (f"So '{letter}' does not appear; the count is 0.", f"No {letter} at all, so 0.")))
    else:
        lines.append(pick(rng, (f"So '{letter}' appears {times(count)} in \"{word}\".", f"That makes {count}.",
                                f"Total: {count}.")))
        if maybe(rng, 0.5):
            lines.append(pick(rng, (f"The last mark is {count}, so the count is {count}.",
                                    f"Checking the marks again: the highest is {count}. Yes.")))
    return Trace(question, "\n".join(lines), str(count))


def render_count_beside_target(ops: tuple[str, str], rng: random.Random) -> Trace:
    """Style 4: every letter is written next to the target letter before the yes/no, so the decision compares
    two tokens a step apart (style 2's marks have to recall the target from the question, which models trained
    on them never learned)."""
    word, letter = ops
    count = word.count(letter)
    question, lines = _count_opening(word, letter, rng)
    no, yes, sep = pick(rng, (("{c} vs {t}: no", "{c} vs {t}: yes ({n})", ", "),
                              ("{c} vs {t} -> no", "{c} vs {t} -> yes, {n}", "; ")))
    checked, running = [], 0
    for c in word:
        running += c == letter
        checked.append((yes if c == letter else no).format(c=c, t=letter, n=running))
    lines.append(pick(rng, ("", "Checking: ", f"Each letter against '{letter}': ", "Compare: ")) + sep.join(checked) + ".")
    if count == 0:
        lines.append(pick(rng, (f"No yes at all, so '{letter}' does not appear; the count is 0.",
                                "Every answer is no, so 0.")))
    else:
        lines.append(pick(rng, (f"The last yes is number {count}, so '{letter}' appears {times(count)}.",
                                f"{count} yes in all. Total: {count}.", f"That makes {count}.")))
    return Trace(question, "\n".join(lines), str(count))


# ------------------------------------------------------------------ reversing a word

def sample_reverse(rng: random.Random) -> tuple[str]:
    return (pick(rng, WORDS),)


def render_reverse(ops: tuple[str], rng: random.Random, spell_joined: bool = False) -> Trace:
    """With `spell_joined` (style 4) the joined word and the answer are spelled a letter per token in training
    and the check line is left out (without it a model has to emit BPE pieces such as "ab" from the letters
    a, b)."""
    (word,) = ops
    rev = word[::-1]
    question = pick(rng, (f"Reverse the word \"{word}\".", f"What is \"{word}\" spelled backwards?",
                          f"Write \"{word}\" in reverse order."))
    lines = [pick(rng, (f"Spell \"{word}\" forwards, then read it backwards.",
                        "Let me list the letters and reverse them.",
                        f"I'll take the letters of \"{word}\" from last to first."))]
    # Numbered letters forwards, then the numbers counted down: each backwards step looks up one number.
    numbered = pick(rng, ("{i} {c}", "{i}:{c}", "{c}{i}"))
    fwd = [numbered.format(i=i + 1, c=c) for i, c in enumerate(word)]
    lines.append(pick(rng, ("Letters: ", "Forwards: ", "Numbered: ")) + ", ".join(fwd) + ".")
    if maybe(rng, 0.4):
        lines.append(f"The last number is {len(word)}, so \"{word}\" has {len(word)} letters.")
    lines.append(pick(rng, ("Backwards: ", "Reversed: ", "From the end: ", "Counting down: "))
                 + ", ".join(fwd[::-1]) + ".")
    lines.append(pick(rng, ("So the letters are ", "In order: ", "That spells ")) + pick(rng, ("-", " ")).join(rev) + ".")
    joined = pick(rng, ("Joined:", "Put together:", "So the reversed word is"))
    if spell_joined:
        lines.append(joined + spelled(" " + rev) + ".")
        return Trace(question, "\n".join(lines), rev, spelled_answer=True)
    lines.append(f"{joined} {rev}.")
    if maybe(rng, 0.5):
        lines.append(f"Check: the first letter {word[0]} is now last, and the last letter {word[-1]} is now first.")
    return Trace(question, "\n".join(lines), rev)


# ------------------------------------------------------------------ spelling drill (training only)

def render_spell_drill(rng: random.Random, sources: tuple[str, ...], num_words: int = 6) -> str:
    """A plain-text block of made-up words (two or three 2-4 letter pieces of `sources`, real words:
    tasks.drill_pieces()), each spelled in a form the count and reverse traces use. Not a chat example: it
    drills how the tokenizer's pieces are spelled, the first step of every count and reverse trace and the step
    reverse fails at most."""
    lines = [pick(rng, ("Spelling practice:", "Spell each one:", "Letters of some made-up words:"))]
    for _ in range(num_words):
        parts = []
        for _ in range(rng.randint(2, 3)):
            w, n = pick(rng, sources), rng.randint(2, 4)
            i = rng.randint(0, max(len(w) - n, 0))
            parts.append(w[i:i + n])
        word = "".join(parts)[:10]
        numbered = pick(rng, ("{i} {c}", "{i}:{c}", "{c}{i}"))
        spelled_out = pick(rng, ("-".join(word), " ".join(word), ", ".join(word),
                                 ", ".join(numbered.format(i=i + 1, c=c) for i, c in enumerate(word))))
        lines.append(f"\"{word}\": {spelled_out}.")
    return "\n".join(lines) + "\n\n"

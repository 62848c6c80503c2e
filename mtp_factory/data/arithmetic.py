"""Addition and subtraction: operand samplers and trace renderers.

Each renderer takes the operands and an rng and returns a `Trace`. The digit-level working (column by
column, right to left, with explicit carries or borrows) is a fixed function of the operands; the rng
only picks wording (through a `Phraser`) and optional lines.
"""
from __future__ import annotations

import random

from mtp_factory.data.phrasing import Phraser, Trace, cap, compare_steps, digits_of, maybe, pick, place


def random_number(rng: random.Random, num_digits: int) -> int:
    low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
    return rng.randint(low, 10 ** num_digits - 1)


def digit_word(n: int) -> str:
    return "1 digit" if n == 1 else f"{n} digits"


# ------------------------------------------------------------------ addition

def sample_add(rng: random.Random) -> tuple[int, int]:
    return random_number(rng, rng.randint(1, 5)), random_number(rng, rng.randint(1, 5))


def _add_line(i: int, a: int, b: int, carry: int, ph: Phraser) -> str:
    """One column: '{label}{a} + {b} (+ carry) = {s}{tail}' in one of several wordings."""
    s = a + b + carry
    d, c = s % 10, s // 10
    # the place label is always written: it tells the model which digits of the operands to fetch
    label = ph.choose("add.label", (f"{place(i)}: ", f"{place(i)} column: ", f"{place(i)} digits: "))
    if ph.index("add.eq", 2) == 0:
        eq = f"{a} + {b}" + (ph.choose("add.carry", (" + 1", " + 1 carried", " + 1 from the carry")) if carry else "")
        eq += f" = {s}"
    else:
        eq = f"{a} plus {b}" + (" plus the carry 1" if carry else "") + f" {ph.choose('add.verb', ('makes', 'gives', 'is'))} {s}"
    tail = ph.choose("add.tail", (f". Write {d}" + (", carry 1." if c else "."), f", so write {d} and carry {c}.",
                                  f"; digit {d}, carry {c}.", f", so {d} down and carry {c}."))
    return cap(label + eq + tail)


def column_add_steps(x: int, y: int, ph: Phraser) -> tuple[list[str], int]:
    """One line per column, right to left; returns the lines and the final carry (0 or 1)."""
    dx, dy = digits_of(x)[::-1], digits_of(y)[::-1]
    lines, carry = [], 0
    for i in range(max(len(dx), len(dy))):
        a = dx[i] if i < len(dx) else 0
        b = dy[i] if i < len(dy) else 0
        line = _add_line(i, a, b, carry, ph)
        lines.append(ph.connect(line) if i > 0 else line)
        carry = (a + b + carry) // 10
    return lines, carry


def render_add(ops: tuple[int, int], rng: random.Random) -> Trace:
    a, b = ops
    s = a + b
    ph = Phraser(rng)
    question = pick(rng, (
        f"What is {a} + {b}?", f"Compute {a} + {b}.", f"Calculate the sum of {a} and {b}.",
        f"Add {a} and {b}.", f"What do you get when you add {a} and {b}?", f"Find {a} plus {b}.",
    ))
    lines = [pick(rng, (
        f"Let me add {a} and {b} column by column, starting from the right.",
        f"I need to add {a} and {b}. I'll go digit by digit from the ones place.",
        f"Okay, {a} + {b}. Let me line up the digits and add from right to left.",
        f"We want {a} + {b}. Adding column by column from the right:",
        f"Alright, adding {a} and {b}, one column at a time.",
    ))]
    if maybe(rng, 0.5):
        lines.append(f"{a} has {digit_word(len(str(a)))} and {b} has {digit_word(len(str(b)))}.")
    if maybe(rng, 0.1):
        lines.append(pick(rng, ("Hmm, let me be careful with the carries.", "I'll keep track of the carries.")))
    steps, carry = column_add_steps(a, b, ph)
    lines += steps
    if carry:
        lines.append(pick(rng, ("The carry 1 becomes a new leading digit.",
                                "There is a carry left over, so put 1 in front.",
                                "Bring down the final carry of 1.")))
    lines.append(pick(rng, (f"So {a} + {b} = {s}.", f"Reading the digits from left to right gives {s}.",
                            f"That gives {s}.", f"Putting it together: {s}.")))
    if maybe(rng, 0.5):
        lines.append(pick(rng, (
            f"Let me double-check by adding in the other order: {b} + {a} = {s}. Yes.",
            f"Quick check on the last digit: {a % 10} + {b % 10} ends in {s % 10}, and {s} ends in {s % 10}. Good.",
            f"Check: {s} - {b} = {a}. That matches.",
        )))
    return Trace(question, "\n".join(lines), str(s), f"{a} + {b} = {s}.")


# ------------------------------------------------------------------ subtraction

def sample_sub(rng: random.Random) -> tuple[int, int]:
    a, b = sample_add(rng)
    if a < b and maybe(rng, 0.6):   # about 30% of questions have a negative result
        a, b = b, a
    return a, b


def _sub_line(i: int, t: int, u: int, borrow_in: int, ph: Phraser) -> tuple[str, int, int]:
    """One column of top - bottom; returns the line, the result digit and the borrow out."""
    eff = t - borrow_in
    borrow_out = 1 if eff < u else 0
    d = eff + 10 * borrow_out - u
    label = ph.choose("sub.label", (f"{place(i)}: ", f"{place(i)} column: "))
    lhs = f"{t} - 1" if borrow_in else f"{t}"
    if borrow_out:
        body = ph.choose("sub.borrow", (f"{lhs} is less than {u}, so borrow: ", f"{lhs} < {u}, borrow 1: ",
                                        f"{lhs} - {u} needs a borrow: ")) + f"{eff + 10} - {u} = {d}."
    elif borrow_in:
        body = ph.choose("sub.paid", (f"{t} - 1 - {u} = {d}.", f"{t} - 1 (borrowed) = {eff}, and {eff} - {u} = {d}.",
                                      f"after the borrow {t} becomes {eff}, and {eff} - {u} = {d}."))
    else:
        body = f"{t} - {u} = {d}" + ph.choose("sub.plain", (".", ", no borrow needed."))
    return cap(label + body), d, borrow_out


def render_sub(ops: tuple[int, int], rng: random.Random, explicit_sign: bool = False) -> Trace:
    """With `explicit_sign` (style 4) the first line compares the operands digit by digit and states the sign."""
    a, b = ops
    top, bot = max(a, b), min(a, b)
    r = top - bot
    ph = Phraser(rng)
    question = pick(rng, (f"What is {a} - {b}?", f"Compute {a} - {b}.", f"Subtract {b} from {a}.",
                          f"Calculate {a} minus {b}.", f"Find the difference {a} - {b}."))
    lines = []
    if explicit_sign:
        # which operand is larger is worked out before the first word that depends on it (without this line
        # models misjudged the sign of same-length pairs such as 9743 - 8443)
        lines.append(pick(rng, ("Which is bigger? ", "First the sign. ", "")) + compare_steps(a, b)
                     + (f", so {b} is bigger and the result is negative: compute {b} - {a}, then add a minus sign."
                        if a < b else f", so {a} is not smaller and the result is not negative."))
    elif a < b:
        lines.append(pick(rng, (
            f"{b} is bigger than {a}, so the result will be negative. I'll compute {b} - {a} and then add a minus sign.",
            f"Since {a} < {b}, the answer is negative: work out {b} - {a} first.",
            f"Here the second number is larger, so compute {b} - {a} and make it negative.",
        )))
    lines.append(pick(rng, (f"Let me subtract {bot} from {top} column by column from the right.",
                            "I'll subtract digit by digit, borrowing when needed.",
                            f"Okay, {top} - {bot}. Start with the ones.",
                            f"Alright, column subtraction of {bot} from {top}.")))
    dt, db = digits_of(top)[::-1], digits_of(bot)[::-1]
    borrow, out = 0, []
    for i in range(len(dt)):
        line, d, borrow = _sub_line(i, dt[i], db[i] if i < len(db) else 0, borrow, ph)
        lines.append(ph.connect(line) if i > 0 else line)
        out.append(d)
    raw = "".join(str(d) for d in reversed(out))
    if raw != str(r):
        lines.append(pick(rng, (f"That reads {raw}, which is just {r}.", f"Dropping the leading zeros: {r}.")))
    if a < b:
        lines.append(pick(rng, (f"So {b} - {a} = {r}, and {a} - {b} = -{r}.",
                                f"Adding the minus sign: {a} - {b} = -{r}.")))
    else:
        lines.append(pick(rng, (f"So {a} - {b} = {r}.", f"That gives {r}.", f"The difference is {r}.")))
    if maybe(rng, 0.5):
        lines.append(pick(rng, (f"Check: {r} + {bot} = {top}. Correct.",
                                f"Let me verify: {bot} + {r} = {top}. Yes.")))
    return Trace(question, "\n".join(lines), str(a - b), f"{a} - {b} = {a - b}.")


# ------------------------------------------------------------------ single-digit fact drill (training only)

def render_fact_drill(rng: random.Random, num_facts: int = 16) -> str:
    """A plain-text block of single-digit facts in the forms the column traces use: sums (with and
    without a carry), subtractions with and without a borrow, and products. Not a chat example and not
    a question: it drills the facts every multi-digit trace is built from, nothing else."""
    lines = [pick(rng, ("Digit facts:", "Practice:", "Single-digit facts.", "Facts to remember:"))]
    for _ in range(num_facts):
        kind = rng.choices(("add", "add1", "sub", "subb", "mul"), weights=(4, 2, 2, 2, 3))[0]
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        if kind == "add":
            lines.append(pick(rng, (f"{a} + {b} = {a + b}", f"{a} plus {b} is {a + b}", f"{a} + {b} makes {a + b}")))
        elif kind == "add1":
            lines.append(pick(rng, (f"{a} + {b} + 1 = {a + b + 1}", f"{a} plus {b} plus the carry 1 is {a + b + 1}")))
        elif kind == "sub":
            a, b = max(a, b), min(a, b)
            lines.append(pick(rng, (f"{a} - {b} = {a - b}", f"{a} minus {b} is {a - b}")))
        elif kind == "subb":
            b = rng.randint(1, 9)
            a = rng.randint(0, b - 1)
            lines.append(f"{a + 10} - {b} = {a + 10 - b}")
        else:
            lines.append(pick(rng, (f"{a} × {b} = {a * b}", f"{a} times {b} is {a * b}", f"{a} * {b} = {a * b}")))
    return "\n".join(lines) + "\n\n"

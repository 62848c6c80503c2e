"""Multiplication (1×1, 2×1, 3×1 and 2×2 digits): operand sampler and trace renderer.

Two methods, chosen per trace: column multiplication (right to left, with carries) or splitting the
many-digit factor into place values. A 2×2 product splits the second factor into tens and ones,
works out both partial products (in either order) and adds them column by column.
"""
from __future__ import annotations

import random

from mtp_factory.data.arithmetic import column_add_steps, random_number
from mtp_factory.data.phrasing import Phraser, Trace, cap, digits_of, maybe, pick, place


def sample_mul(rng: random.Random) -> tuple[int, int]:
    kind = rng.choices(("1x1", "2x1", "3x1", "2x2"), weights=(1.0, 4.5, 1.5, 3.0))[0]
    if kind == "1x1":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
    elif kind == "2x2":
        a, b = random_number(rng, 2), random_number(rng, 2)
    else:
        a, b = random_number(rng, 2 if kind == "2x1" else 3), rng.randint(2, 9)
    return (b, a) if maybe(rng, 0.5) else (a, b)


def _column(big: int, m: int, ph: Phraser) -> list[str]:
    """big × one digit m, right to left with carries: 'Tens: 4 × 6 + 4 = 28, write 8, carry 2.'"""
    lines, carry = [], 0
    ds = digits_of(big)[::-1]
    for i, dig in enumerate(ds):
        p = dig * m + carry
        label = ph.choose("mul.label", (f"{place(i)}: ", f"{place(i)} digit: "))
        if carry:
            eq = ph.choose("mul.carry", (f"{dig} × {m} + {carry} = {p}", f"{dig} × {m} = {dig * m}, plus {carry} is {p}",
                                         f"{dig} × {m} = {dig * m}, plus the carried {carry} makes {p}"))
        else:
            eq = f"{dig} × {m} = {p}"
        if i == len(ds) - 1:
            tail = ph.choose("mul.last", (f", write {p}.", f". Write {p}.", f", so {p} goes in front."))
        else:
            tail = ph.choose("mul.tail", (f", write {p % 10}, carry {p // 10}.", f". Write {p % 10} and carry {p // 10}.",
                                          f", put down {p % 10}, carry {p // 10}."))
        line = cap(label + eq + tail)
        lines.append(ph.connect(line) if i > 0 else line)
        carry = p // 10
    return lines


def _split(big: int, m: int, ph: Phraser, high_first: bool) -> list[str]:
    """big × one digit m by place values: 347 × 6 = 300 × 6 + 40 × 6 + 7 × 6."""
    parts = [d * 10 ** k for k, d in enumerate(digits_of(big)[::-1]) if d]   # ones first
    if len(parts) <= 1:
        return [f"{big} × {m} = {big * m}."]
    joined = " + ".join(str(x) for x in reversed(parts))
    lines = [ph.choose("mul.split", (f"Break {big} into place values: {joined}.", f"Split {big} as {joined}.",
                                     f"Write {big} = {joined}."))]
    if high_first:
        parts.reverse()
    for k, x in enumerate(parts):
        line = ph.choose("mul.part", (f"{x} × {m} = {x * m}.", f"{m} × {x} = {x * m}.", f"{x} times {m} is {x * m}."))
        lines.append(ph.connect(line, ("", "Then ", "And ")) if k > 0 else line)
    lines.append(ph.choose("mul.sum", ("Add them: ", "Adding: ", "Sum: ")) + " + ".join(str(x * m) for x in parts)
                 + f" = {big * m}.")
    return lines


def _by_digit(big: int, m: int, ph: Phraser, method: int) -> list[str]:
    return _column(big, m, ph) if method == 0 else _split(big, m, ph, high_first=ph.index("mul.order", 2) == 0)


def render_mul(ops: tuple[int, int], rng: random.Random, column_only: bool = False) -> Trace:
    """With `column_only` (style 4) always the column method: every digit of every partial product and of
    their sum on its own step."""
    a, b = ops
    p = a * b
    ph = Phraser(rng)
    question = pick(rng, (f"What is {a} × {b}?", f"Compute {a} × {b}.", f"Multiply {a} by {b}.",
                          f"What is {a} times {b}?", f"Calculate the product of {a} and {b}.",
                          f"What is {a} * {b}?"))
    method = rng.randrange(2)
    if column_only:     # the place-value method sums partial products in one step ("560 + 72 = 572")
        method = 0
    if a < 10 and b < 10:
        lines = [pick(rng, (f"{a} × {b} = {p}.", f"From the times table, {a} × {b} = {p}.",
                            f"{a} times {b} is {p}."))]
    elif a < 10 or b < 10:
        big, m = (a, b) if b < 10 else (b, a)
        if method == 0:
            intro = (f"Multiply {big} by {m} digit by digit.", f"Let me work out {big} × {m} from the right.")
        else:
            intro = (f"I'll multiply each part of {big} by {m}.", f"Let me work out {big} × {m} by place value.")
        lines = [pick(rng, intro)]
        lines += _by_digit(big, m, ph, method)
    else:
        lines = _two_by_two(a, b, ph, method)
    lines.append(pick(rng, (f"So {a} × {b} = {p}.", f"That gives {p}.", f"The product is {p}.")))
    if maybe(rng, 0.5):
        lines.append(pick(rng, (
            f"Check with the other order: {b} × {a} = {p}. Yes.",
            f"Last digit check: {a % 10} × {b % 10} = {a % 10 * (b % 10)}, which ends in {p % 10}, like {p}. Good.",
        )))
    return Trace(question, "\n".join(lines), str(p), f"{a} × {b} = {p}.")


def _two_by_two(a: int, b: int, ph: Phraser, method: int) -> list[str]:
    bt, bo = divmod(b, 10)
    if bo == 0:
        lines = [f"{b} is {bt} tens, so compute {a} × {bt} and multiply by 10."]
        lines += _by_digit(a, bt, ph, method)
        return lines + [f"{a} × {bt} = {a * bt}, and times 10 that is {a * b}."]
    lines = [ph.choose("mul.plan", (f"Split {b} into {bt * 10} and {bo}.",
                                    f"I'll write {b} as {bt * 10} + {bo} and multiply {a} by each part.",
                                    f"Use {a} × {b} = {a} × {bt * 10} + {a} × {bo}."))]
    ones = _by_digit(a, bo, ph, method) + [f"So {a} × {bo} = {a * bo}."]
    tens = _by_digit(a, bt, ph, method) + [f"So {a} × {bt} = {a * bt}, and {a} × {bt * 10} = {a * bt * 10}."]
    ones_first = maybe(ph.rng, 0.5)
    first, second = (f"{a} × {bo}", f"{a} × {bt * 10}") if ones_first else (f"{a} × {bt * 10}", f"{a} × {bo}")
    lines.append(ph.choose("mul.head1", (f"{first}:", f"First, {first}:")))
    lines += ones if ones_first else tens
    lines.append(ph.choose("mul.head2", (f"{second}:", f"Now {second}:", f"Next, {second}:")))
    lines += tens if ones_first else ones
    x, y = (a * bo, a * bt * 10) if ones_first else (a * bt * 10, a * bo)
    lines.append(ph.choose("mul.add", (f"Now add {x} + {y}.", f"Adding the two parts: {x} + {y}.")))
    steps, carry = column_add_steps(x, y, ph)
    lines += steps
    if carry:
        lines.append("The final carry 1 goes in front.")
    lines.append(f"Total: {a * b}.")
    return lines

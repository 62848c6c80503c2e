"""Addition, subtraction and multiplication: operand samplers and trace renderers.

Each renderer takes the operands and an rng and returns a `Trace`. The digit-level working is a fixed
function of the operands; the rng only picks the wording style (once per trace), optional lines and, in
multiplication, the method and the order of the partial products.
"""
from __future__ import annotations

import random

from mtp_core.data.phrasing import Trace, digits_of, maybe, pick, place, style_for_line, with_connector


def _random_number(rng: random.Random, num_digits: int) -> int:
    low = 0 if num_digits == 1 else 10 ** (num_digits - 1)
    return rng.randint(low, 10 ** num_digits - 1)


def _digit_word(n: int) -> str:
    return "1 digit" if n == 1 else f"{n} digits"


# ------------------------------------------------------------------ addition

def sample_add(rng: random.Random) -> tuple[int, int]:
    return _random_number(rng, rng.randint(1, 5)), _random_number(rng, rng.randint(1, 5))


def _add_line(i: int, a: int, b: int, carry: int, style: int, rng: random.Random) -> str:
    s = a + b + carry
    d, c = s % 10, s // 10
    if style == 0:
        lhs = f"{place(i).capitalize()}: {a} + {b}" + (f" + {carry}" if carry else "")
        write = pick(rng, ("Write", "Write down", "Put"))
        tail = pick(rng, (", carry 1.", ", carry the 1.", " and carry 1.")) if c else "."
        return f"{lhs} = {s}. {write} {d}{tail}"
    if style == 1:
        plus = pick(rng, (" + 1 carried", " + the carry 1")) if carry else ""
        tail = pick(rng, (f"so write {d} and carry {c}", f"so I write {d} and carry {c}", f"giving {d}, carry {c}"))
        return f"{a} + {b}{plus} = {s}, {tail}."
    extra = " plus the carry 1" if carry else ""
    verb = pick(rng, ("makes", "gives", "is"))
    return f"{place(i).capitalize()} column: {a} plus {b}{extra} {verb} {s}; digit {d}, carry {c}."


def column_add_steps(x: int, y: int, style: int, rng: random.Random) -> tuple[list[str], int]:
    """One line per column, right to left; returns the lines and the final carry (0 or 1)."""
    dx, dy = digits_of(x)[::-1], digits_of(y)[::-1]
    lines, carry = [], 0
    for i in range(max(len(dx), len(dy))):
        a = dx[i] if i < len(dx) else 0
        b = dy[i] if i < len(dy) else 0
        line = _add_line(i, a, b, carry, style_for_line(rng, style, 3), rng)
        lines.append(with_connector(rng, line) if i > 0 else line)
        carry = (a + b + carry) // 10
    return lines, carry


def render_add(ops: tuple[int, int], rng: random.Random) -> Trace:
    a, b = ops
    s = a + b
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
        lines.append(f"{a} has {_digit_word(len(str(a)))} and {b} has {_digit_word(len(str(b)))}.")
    if maybe(rng, 0.1):
        lines.append(pick(rng, ("Hmm, let me be careful with the carries.", "I'll keep track of the carries.")))
    steps, carry = column_add_steps(a, b, rng.randrange(3), rng)
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


def _sub_step(i: int, t: int, u: int, borrow_in: int, style: int, rng: random.Random) -> tuple[str, int, int]:
    """One column of top - bottom; returns the line, the result digit and the borrow out."""
    eff = t - borrow_in
    borrow_out = 1 if eff < u else 0
    d = eff + 10 * borrow_out - u
    if style == 0:
        head = f"{place(i).capitalize()}: "
        if not borrow_in and not borrow_out:
            return head + f"{t} - {u} = {d}.", d, 0
        borrow = pick(rng, ("borrow 1 to get", "borrow from the next digit:", "so borrow, making it"))
        if not borrow_in:
            less = pick(rng, (f"{t} < {u}", f"{t} is less than {u}"))
            return head + f"{less}, {borrow} {t + 10}. {t + 10} - {u} = {d}.", d, 1
        text = head + f"{t} - 1 " + pick(rng, ("(borrowed)", "(for the borrow)")) + f" = {eff}"
        if not borrow_out:
            return text + f". {eff} - {u} = {d}.", d, 0
        return text + f", which is less than {u}, {borrow} {eff + 10}. {eff + 10} - {u} = {d}.", d, 1
    lhs = f"{t}{' - 1' if borrow_in else ''} - {u}"
    if not borrow_out:
        return f"{lhs} = {d}" + pick(rng, (".", ", no borrow.", ", fine.")), d, 0
    return f"{lhs} " + pick(rng, ("needs a borrow:", "is negative, so borrow:")) + f" {eff + 10} - {u} = {d}.", d, 1


def render_sub(ops: tuple[int, int], rng: random.Random) -> Trace:
    a, b = ops
    top, bot = max(a, b), min(a, b)
    r = top - bot
    question = pick(rng, (f"What is {a} - {b}?", f"Compute {a} - {b}.", f"Subtract {b} from {a}.",
                          f"Calculate {a} minus {b}.", f"Find the difference {a} - {b}."))
    lines = []
    if a < b:
        lines.append(pick(rng, (
            f"{b} is bigger than {a}, so the result will be negative. I'll compute {b} - {a} and then add a minus sign.",
            f"Since {a} < {b}, the answer is negative: work out {b} - {a} first.",
            f"Here the second number is larger, so compute {b} - {a} and make it negative.",
        )))
    lines.append(pick(rng, (f"Let me subtract {bot} from {top} column by column from the right.",
                            f"I'll subtract digit by digit, borrowing when needed.",
                            f"Okay, {top} - {bot}. Start with the ones.",
                            f"Alright, column subtraction of {bot} from {top}.")))
    style = rng.randrange(2)
    dt, db = digits_of(top)[::-1], digits_of(bot)[::-1]
    borrow, out = 0, []
    for i in range(len(dt)):
        u = db[i] if i < len(db) else 0
        line, d, borrow = _sub_step(i, dt[i], u, borrow, style_for_line(rng, style, 2), rng)
        lines.append(with_connector(rng, line) if i > 0 else line)
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


# ------------------------------------------------------------------ multiplication

def sample_mul(rng: random.Random) -> tuple[int, int]:
    kind = rng.choices(("1x1", "2x1", "3x1", "2x2"), weights=(1.0, 4.5, 1.5, 3.0))[0]
    if kind == "1x1":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
    elif kind == "2x2":
        a, b = _random_number(rng, 2), _random_number(rng, 2)
    else:
        a, b = _random_number(rng, 2 if kind == "2x1" else 3), rng.randint(2, 9)
    return (b, a) if maybe(rng, 0.5) else (a, b)


def _mul_column(big: int, m: int, style: int, rng: random.Random) -> list[str]:
    """big × one digit m, right to left with carries."""
    lines, carry = [], 0
    ds = digits_of(big)[::-1]
    for i, dig in enumerate(ds):
        p = dig * m + carry
        last = i == len(ds) - 1
        write = pick(rng, ("write", "put down"))
        if style_for_line(rng, style, 2) == 0:
            text = f"{dig} × {m} = {dig * m}"
            if carry:
                text += pick(rng, (f", plus carry {carry} = {p}", f", plus the carried {carry} makes {p}"))
            tail = f"{p}." if last or p < 10 else f"{p % 10}" + pick(rng, (", carry ", " and carry ")) + f"{p // 10}."
            text += f". {write.capitalize()} {tail}"
        else:
            text = f"{place(i).capitalize()}: {dig} × {m}" + (f" + {carry}" if carry else "") + f" = {p}"
            text += f", {write} {p}." if last else f", {write} {p % 10}, carry {p // 10}."
        lines.append(with_connector(rng, text) if i > 0 else text)
        carry = p // 10
    return lines


def _mul_split(big: int, m: int, rng: random.Random, high_first: bool) -> list[str]:
    """big × one digit m by place values: 347 × 6 = 300 × 6 + 40 × 6 + 7 × 6."""
    parts = [d * 10 ** k for k, d in enumerate(digits_of(big)[::-1]) if d]   # ones first
    if len(parts) <= 1:
        return [f"{big} × {m} = {big * m}."]
    joined = " + ".join(str(x) for x in reversed(parts))
    lines = [pick(rng, (f"Break {big} into place values: {joined}.", f"Split {big} as {joined}.",
                        f"Write {big} = {joined}."))]
    if high_first:
        parts.reverse()
    for k, x in enumerate(parts):
        text = f"{m} × {x} = {x * m}." if maybe(rng, 0.3) else f"{x} × {m} = {x * m}."
        lines.append(with_connector(rng, text, 0.5, ("Then ", "And ")) if k > 0 else text)
    lines.append(pick(rng, ("Add them: ", "Adding: ", "Sum: ")) + " + ".join(str(x * m) for x in parts)
                 + f" = {big * m}.")
    return lines


def _mul_by_digit(big: int, m: int, rng: random.Random, method: int, style: int) -> list[str]:
    if method == 0:
        return _mul_column(big, m, style, rng)
    return _mul_split(big, m, rng, high_first=style == 0)


def render_mul(ops: tuple[int, int], rng: random.Random) -> Trace:
    a, b = ops
    p = a * b
    question = pick(rng, (f"What is {a} × {b}?", f"Compute {a} × {b}.", f"Multiply {a} by {b}.",
                          f"What is {a} times {b}?", f"Calculate the product of {a} and {b}.",
                          f"What is {a} * {b}?"))
    method, style = rng.randrange(2), rng.randrange(2)
    if a < 10 and b < 10:
        lines = [pick(rng, (f"{a} × {b} = {p}.", f"From the times table, {a} × {b} = {p}.",
                            f"{a} times {b} is {p}."))]
    elif a < 10 or b < 10:
        big, m = (a, b) if b < 10 else (b, a)
        lines = [pick(rng, (f"Multiply {big} by {m} digit by digit.", f"Let me work out {big} × {m}.",
                            f"I'll multiply each part of {big} by {m}."))]
        lines += _mul_by_digit(big, m, rng, method, style)
    else:
        lines = _render_2x2(a, b, rng, method, style)
    lines.append(pick(rng, (f"So {a} × {b} = {p}.", f"That gives {p}.", f"The product is {p}.")))
    if maybe(rng, 0.5):
        lines.append(pick(rng, (
            f"Check with the other order: {b} × {a} = {p}. Yes.",
            f"Last digit check: {a % 10} × {b % 10} = {a % 10 * (b % 10)}, which ends in {p % 10}, like {p}. Good.",
        )))
    return Trace(question, "\n".join(lines), str(p), f"{a} × {b} = {p}.")


def _render_2x2(a: int, b: int, rng: random.Random, method: int, style: int) -> list[str]:
    bt, bo = divmod(b, 10)
    if bo == 0:
        lines = [f"{b} is {bt} tens, so compute {a} × {bt} and multiply by 10."]
        lines += _mul_by_digit(a, bt, rng, method, style)
        return lines + [f"{a} × {bt} = {a * bt}, and times 10 that is {a * b}."]
    lines = [pick(rng, (f"Split {b} into {bt * 10} and {bo}.",
                        f"I'll write {b} as {bt * 10} + {bo} and multiply {a} by each part.",
                        f"Use {a} × {b} = {a} × {bt * 10} + {a} × {bo}."))]
    ones = [f"{a} × {bo}:"] + _mul_by_digit(a, bo, rng, method, style) + [f"So {a} × {bo} = {a * bo}."]
    tens = [f"{a} × {bt * 10}:"] + _mul_by_digit(a, bt, rng, method, style)
    tens.append(f"So {a} × {bt} = {a * bt}, and {a} × {bt * 10} = {a * bt * 10}.")
    ones_first = maybe(rng, 0.5)
    lines += ones + tens if ones_first else tens + ones
    x, y = (a * bo, a * bt * 10) if ones_first else (a * bt * 10, a * bo)
    lines.append(pick(rng, (f"Now add {x} + {y}.", f"Adding the two parts: {x} + {y}.")))
    steps, carry = column_add_steps(x, y, 1, rng)
    lines += steps
    if carry:
        lines.append("The final carry 1 goes in front.")
    lines.append(f"Total: {a * b}.")
    return lines

"""Small helpers that put controlled randomness into reasoning traces.

The wording of each recurring step (its label, verb, connector) comes from a `Phraser`: a preferred
option per trace, kept about half the time, so a trace has a style yet every step boundary stays
uncertain. Openings, re-checks and asides are optional lines. The digit-level working is a fixed
function of the operands, so the uncertainty a perfect model faces sits at phrase boundaries.
`ngram_predictability` gives a rough measure of how predictable the traces are.
"""
from __future__ import annotations

import random
import re
from collections import Counter, defaultdict
from typing import Iterable, NamedTuple, Sequence


class Trace(NamedTuple):
    """What a task family produces for one question (`summary` is an optional restating line;
    `spelled_answer`: the final answer is tokenized letter by letter in training, see `spelled`)."""
    question: str
    reasoning: str
    answer: str
    summary: str = ""
    spelled_answer: bool = False


# A span of a training text that is tokenized one character per token (BPE would merge it): the reversal
# family builds its word letter by letter, and a model that has to emit canonical BPE pieces ("rek" + "ab")
# must know every piece's spelling to do that. The decoded text is identical either way. The markers are
# private-use characters that only the reversal traces of style 4 on write and only the trainer's encoder
# reads (it drops them).
SPELL_OPEN, SPELL_CLOSE = "\ue000", "\ue001"


def spelled(text: str) -> str:
    """`text` marked to be tokenized a character per token in training (a leading space joins the first)."""
    return SPELL_OPEN + text + SPELL_CLOSE


def strip_spelled(text: str) -> str:
    """The plain text of a training string (the spelled-span markers removed)."""
    return text.replace(SPELL_OPEN, "").replace(SPELL_CLOSE, "")


PLACES = ("ones", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands")

# Common English words (3-10 letters) for the letter-counting and word-reversal families.
WORDS: tuple[str, ...] = tuple(dict.fromkeys("""
apple banana cherry grape lemon mango melon orange peach pear plum berry strawberry raspberry
blueberry coconut pepper tomato potato carrot onion garlic butter cheese bread honey sugar coffee
water river ocean island forest desert valley mountain canyon meadow garden flower tree leaf branch
root seed stone rock sand cloud rain storm thunder snow winter summer autumn spring morning evening
night today tomorrow yesterday moment minute hour second season planet comet rocket galaxy moon star
sun earth world country city village street bridge tower castle palace temple school library museum
market office kitchen bedroom window door table chair pillow blanket mirror bottle basket bucket
candle lantern ladder hammer needle thread button pocket jacket sweater shirt trousers boots hat
glove scarf umbrella wallet ticket letter paper pencil marker eraser notebook journal story poem song
music guitar piano violin trumpet drum dance party picnic holiday travel journey voyage harbor anchor
sailor pirate captain soldier doctor nurse teacher student farmer baker butcher painter writer
singer player driver pilot engineer lawyer banker tailor hunter fisher keeper dragon tiger lion
zebra giraffe monkey rabbit turtle parrot penguin dolphin whale shark salmon octopus spider beetle
butterfly mosquito elephant kangaroo squirrel hedgehog raccoon buffalo camel donkey horse pony
sheep goat chicken duck goose eagle falcon owl raven sparrow pigeon swallow robin kitten puppy
mirror balloon bubble puzzle riddle secret mystery treasure diamond silver golden copper iron
marble crystal velvet cotton silk wool leather rubber plastic metal wooden glass purple yellow
green orange scarlet crimson violet indigo brown black white gray happy sleepy hungry thirsty
angry brave clever gentle quiet noisy lucky simple strange narrow shallow hollow yellow mellow
follow borrow sorrow arrow barrel cellar collar dollar pillar error mirror terror carrier
committee coffee toffee address access success possess assess mississippi tennessee banana
parallel illegal balloon cabbage rabbit pepper hippo apple giggle juggle puzzle bubble pebble
little middle bottle kettle settle battle cattle rattle paddle saddle puddle cuddle
computer keyboard monitor printer network program python number letter answer question problem
system engine signal string integer decimal fraction average total counter reverse sorting
between before after during inside outside above below around across against along among
through without within beyond always never often seldom maybe really almost already
""".split()))


def pick(rng: random.Random, options: Sequence[str]) -> str:
    return options[rng.randrange(len(options))]


def maybe(rng: random.Random, p: float) -> bool:
    return rng.random() < p


class Phraser:
    """Wording choices for one trace: each recurring slot (a step's label, its verb, its connector) gets
    a preferred option on first use, kept with probability `stickiness` at each later use and otherwise
    swapped for another option, uniformly. So a trace has a recognisable style but stays uncertain at
    every step boundary, the way a person's (or R1's) writing does.
    """

    def __init__(self, rng: random.Random, stickiness: float = 0.5) -> None:
        self.rng = rng
        self.stickiness = stickiness
        self._preferred: dict[str, int] = {}

    def index(self, slot: str, num_options: int) -> int:
        if slot not in self._preferred:
            self._preferred[slot] = self.rng.randrange(num_options)
            return self._preferred[slot]
        main = self._preferred[slot]
        if num_options > 1 and not maybe(self.rng, self.stickiness):
            return (main + 1 + self.rng.randrange(num_options - 1)) % num_options
        return main

    def choose(self, slot: str, options: Sequence[str]) -> str:
        return options[self.index(slot, len(options))]

    def connect(self, line: str, options: Sequence[str] = ("", "Next, ", "Then ", "Now ")) -> str:
        """Start a later step with a connective word (or none): 'Then ones: ...'."""
        word = self.choose("connector", options)
        return word + line[0].lower() + line[1:] if word else line


def cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def digits_of(n: int) -> list[int]:
    """Decimal digits of a non-negative integer, most significant first: 4821 -> [4, 8, 2, 1]."""
    return [int(c) for c in str(n)]


def place(i: int) -> str:
    """Place name of the i-th column counted from the right (0 = ones)."""
    return PLACES[i]


def compare_steps(v: int, w: int) -> str:
    """'71 vs 78: 7 = 7, 1 < 8': the lengths when they differ ('5 vs 63: 1 digit vs 2 digits'), else the
    digits from the left up to the first difference, each compared pair written next to the numbers."""
    sv, sw = str(v), str(w)
    if len(sv) != len(sw):
        return f"{v} vs {w}: {len(sv)} digit{'s' * (len(sv) > 1)} vs {len(sw)} digit{'s' * (len(sw) > 1)}"
    steps = []
    for x, y in zip(sv, sw):
        steps.append(f"{x} {'=' if x == y else '>' if x > y else '<'} {y}")
        if x != y:
            break
    return f"{v} vs {w}: " + ", ".join(steps)


def times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def number_list(values: Iterable[int]) -> str:
    return ", ".join(str(v) for v in values)


_WORD_RE = re.compile(r"\d+|[A-Za-z]+|[^\sA-Za-z\d]")


def words_for_predictability(text: str) -> list[str]:
    """Word/punctuation units with every number replaced by <N> (the digits are computed, not phrased)."""
    return ["<N>" if w[0].isdigit() else w for w in _WORD_RE.findall(text)]


def ngram_predictability(texts: Sequence[str], order: int = 3) -> float:
    """Accuracy of the best order-`order` predictor of the next unit, fitted on `texts` themselves.

    For each context of `order` previous units the best predictor guesses the most frequent next unit,
    so the score is sum over contexts of max-count / total count. Numbers count as one determined unit
    `<N>`; a rough stand-in for how much of a trace a strong model can predict one step ahead.
    """
    counts: dict[tuple[str, ...], Counter[str]] = defaultdict(Counter)
    for text in texts:
        units = ["<S>"] * order + words_for_predictability(text)
        for i in range(order, len(units)):
            counts[tuple(units[i - order:i])][units[i]] += 1
    total = sum(sum(c.values()) for c in counts.values())
    if total == 0:
        raise ValueError("ngram_predictability needs at least one non-empty text")
    return sum(max(c.values()) for c in counts.values()) / total

"""The training data of the shipped recipe's chain (`tiny-r1`) and of `smoke` stay byte for byte what they
were when the factory left mtp_core: digests of the encoded batch of steps on both sides of every switch of
tiny-r1 (family mix at 150, 16,600, 18,100, 20,100 and 22,100; trace style at 13,100, 16,600, 20,100,
22,100 and 24,100; spelling drill from 18,100; rows of 768 tokens from 22,100), of smoke's four steps, and
of the texts smoke's tokenizer is trained on. Computed before the move, so any change of the generators,
the mix, the styles or the encoding fails here."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from mtp_factory.data import general_text
from mtp_factory.data.dataset import training_texts
from mtp_factory.recipes import RECIPES
from mtp_factory.trainer import batch_for_step

SHIPPED_TOKENIZER = Path(__file__).resolve().parent.parent / "mtp_core" / "assets" / "tiny-r1" / "tokenizer.json"
# the general text mixed into every stream is the standard library of the Python that made the digests
GENERAL_TEXT = "python3.11-d2d90ad83e614a9b"

BATCH_DIGESTS = {
    "tiny-r1": {0: "4001d1a13342205a", 1: "83795ae8d1df1343", 149: "bba139b0d9f179d5", 150: "48d00bc66225ca45",
                13099: "d29b29b86af00a8c", 13100: "f5a97555db58befd", 16599: "90163f07bfa6b686",
                16600: "e4007f8a0ed7b042", 18099: "e4b1cd0960375543", 18100: "42f2aeec69a0d0b9",
                20100: "a34175e3651e3dac", 22099: "568e1201a6b969dd", 22100: "1a5ce617c74c4f8c",
                24100: "d542f1045868c889", 26099: "d51b084ca9d932e6"},
    "smoke": {0: "06ca14bdf72dcaca", 1: "7237b32917c80571", 2: "9f19d1bd5ea3788d", 3: "18b2488846b55eda"},
}
SMOKE_TOKENIZER_TEXTS = ("744d1d53e0823b56", 207)     # (digest, number of texts)


def _same_general_text() -> None:
    if general_text.fingerprint() != GENERAL_TEXT:
        pytest.skip(f"general text is {general_text.fingerprint()}, the digests were made with {GENERAL_TEXT}")


def batch_digest(batch: torch.Tensor) -> str:
    """sha256 of a [rows, tokens] batch's shape and its int64 little-endian ids, first 16 hex digits."""
    h = hashlib.sha256(repr(tuple(batch.shape)).encode())
    h.update(batch.numpy().astype("<i8").tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("recipe", sorted(BATCH_DIGESTS))
def test_training_batches_are_pinned(recipe: str) -> None:
    _same_general_text()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(SHIPPED_TOKENIZER))
    got = {step: batch_digest(batch_for_step(tok, RECIPES[recipe], step)) for step in BATCH_DIGESTS[recipe]}
    assert got == BATCH_DIGESTS[recipe]


def test_smoke_tokenizer_texts_are_pinned() -> None:
    """`smoke` trains its own tokenizer (tiny-r1 starts from the shipped one): its texts are pinned too."""
    _same_general_text()
    r = RECIPES["smoke"]
    texts = list(training_texts(seed=r.seed + 7919, num_examples=r.tokenizer_examples,
                                general_fraction=r.general_fraction))
    assert (hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16], len(texts)) == SMOKE_TOKENIZER_TEXTS

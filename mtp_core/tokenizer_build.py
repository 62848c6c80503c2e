"""Train small byte-level BPE tokenizers in the project's chat format and write them as a checkpoint.

Token ids 0..6 are fixed (see `chat_format.SPECIAL_TOKENS`)::

    0 <｜pad｜>   1 <｜begin▁of▁sentence｜>   2 <｜end▁of▁sentence｜>   3 <｜User｜>
    4 <｜Assistant｜>   5 <think>   6 </think>

then the 256 byte symbols, then the learned merges. BOS is added at encode time both by
tokenizer_config.json (`add_bos_token: true`, read by transformers 4 and `mtp_core.tokenizer`) and by
tokenizer.json's post-processor (read by transformers 5, which ignores `add_bos_token`). Ids 0..4 are special tokens (skipped by
`decode(skip_special_tokens=True)`); `<think>`/`</think>` are added tokens that are *not* special, as
in DeepSeek-R1's tokenizer, so they always encode as one token but stay visible in decoded text.
Digits are always split into single-digit tokens. The files written load with both
`mtp_core.tokenizer.Tokenizer.from_dir` and `transformers.AutoTokenizer.from_pretrained`.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Iterable, Union

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from mtp_core.chat_format import (
    BOS, CHAT_TEMPLATE, EOS, PAD, SPECIAL_TOKENS, THINK_END, THINK_START, render_completion,
    render_prompt,
)

_NON_SPECIAL = (THINK_START, THINK_END)
_MIN_VOCAB = len(SPECIAL_TOKENS) + 256

# Standard-library modules whose source makes a small, varied, offline English/code corpus.
_CORPUS_MODULES = ("textwrap", "string", "colorsys", "bisect", "heapq", "fractions", "shlex", "graphlib")


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with single-digit splitting and the chat-format tokens at ids 0..6."""
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} is too small; use at least {_MIN_VOCAB} "
                         f"({len(SPECIAL_TOKENS)} special tokens + 256 bytes)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # BOS in tokenizer.json too: transformers 5 ignores add_bos_token when tokenizer.json exists.
    bos = (BOS, tok.token_to_id(BOS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[bos])
    # The trainer marks every token it was given as special; `<think>`/`</think>` must not be.
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        if entry["content"] in _NON_SPECIAL:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


def write_tokenizer_files(out_dir: Union[str, Path], tok: Tokenizer, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in (PAD, BOS, EOS):
        if tok.token_to_id(name) is None:
            raise ValueError(f"tokenizer lacks {name!r}; build it with train_bpe_tokenizer")
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})


def default_corpus() -> list[str]:
    """A small offline corpus (~100-200 KB): stdlib source plus chat-format samples with numbers."""
    texts: list[str] = []
    for name in _CORPUS_MODULES:
        texts.append(inspect.getsource(__import__(name)))
    for i in range(200):
        a, b = 17 * i + 3, 29 * i + 11
        question = f"What is {a} + {b}? Also compute {a} * {b % 97}."
        reasoning = f"We add {a} and {b}: {a} + {b} = {a + b}. Then {a} * {b % 97} = {a * (b % 97)}."
        answer = f"The sum is {a + b} and the product is {a * (b % 97)}."
        texts.append(render_prompt(question) + render_completion(reasoning, answer))
    texts.append("Unicode samples: café, naïve, 東京は日本の首都です。 数学 123, emoji 😀🚀✨, Ω ≈ 3.14159.")
    return texts


def build_tiny_tokenizer(out_dir: Union[str, Path], vocab_size: int = 512,
                         model_max_length: int = 4096) -> Tokenizer:
    """Train on `default_corpus()` and write the tokenizer files into `out_dir` (well under a second)."""
    tok = train_bpe_tokenizer(default_corpus(), vocab_size)
    write_tokenizer_files(out_dir, tok, model_max_length)
    return tok


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

"""Prompt text -> token ids, off the event loop, with the context check first where a byte bound allows it.

Tokenization runs in worker threads through `Tokenizer.encode_released` (the Rust tokenizer releases the
GIL), chat templates too (Python, so they share the GIL, but in slices: the event loop keeps answering).
Texts over LARGE_TEXT characters go to their own one-thread pool, so a 10 MB prompt never queues the
short ones behind it.

The byte bound: when a token can never cover more than `max_token_bytes` bytes of input text, a text of
n bytes has at least ceil(n / max_token_bytes) tokens, and a text with more characters than
max_token_bytes * max_seq_len is rejected (400, context_length_exceeded) before it is tokenized. That
holds for a BPE model with no normalizer, no fused unknown token and pre-tokenizers that keep every byte
(ByteLevel, Digits, Punctuation, Metaspace, Split that isolates or merges): DeepSeek-V3's tokenizer and the
shipped model's. For any other tokenizer `max_token_bytes` is None and the check waits for the ids.
"""
from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from mtp_core.serve.tools import TemplateTools

log = logging.getLogger("mtp.serve")

LARGE_TEXT = 64 * 1024                  # characters: larger texts are tokenized on the large-text pool
_KEEPS_EVERY_BYTE = {"ByteLevel", "Digits", "Punctuation", "Metaspace", "UnicodeScripts", "Split"}
T = TypeVar("T")


def max_token_bytes(tokenizer_json: Path) -> Optional[int]:
    """The most bytes of input text one token can stand for, or None when no such bound is known."""
    try:
        data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model = data.get("model") or {}
    if data.get("normalizer") is not None or model.get("type") != "BPE" or model.get("fuse_unk"):
        return None
    pre = data.get("pre_tokenizer")
    parts = [] if pre is None else (pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else [pre])
    byte_level = False
    for p in parts:
        kind = p.get("type")
        if kind not in _KEEPS_EVERY_BYTE or (kind == "Split" and p.get("behavior") == "Removed"):
            return None
        byte_level |= kind == "ByteLevel"
    vocab = model.get("vocab") or {}
    # ByteLevel: every character of a vocabulary entry stands for one input byte; otherwise an entry's UTF-8
    # bytes are at least the input it covers (Metaspace's 3-byte U+2581 stands for a 1-byte space)
    longest = max((len(k) if byte_level else len(k.encode("utf-8")) for k in vocab), default=0)
    added = max((len(t.get("content", "").encode("utf-8")) for t in data.get("added_tokens") or []), default=0)
    unk = 4 if model.get("unk_token") else 0          # an unknown character: one code point, at most 4 bytes
    bound = max(longest, added, unk)
    return bound or None


class PromptEncoder:
    def __init__(self, tokenizer: Any, model_dir: Optional[str], max_seq_len: int) -> None:
        self.tok = tokenizer
        self.max_seq_len = max_seq_len
        self.max_token_bytes = max_token_bytes(Path(model_dir) / "tokenizer.json") if model_dir else None
        self.template_tools = TemplateTools.probe(tokenizer)     # what the chat template does with tools
        self._small = ThreadPoolExecutor(2, thread_name_prefix="mtp-tokenize")
        self._large = ThreadPoolExecutor(1, thread_name_prefix="mtp-tokenize-large")

    def min_tokens(self, num_chars: int) -> int:
        """A lower bound on the tokens of a text of num_chars characters (0 when none is known)."""
        if self.max_token_bytes is None:
            return 0
        return -(-num_chars // self.max_token_bytes)          # every character is at least one byte

    async def run(self, fn: Callable[[], T], size: int) -> T:
        pool = self._large if size > LARGE_TEXT else self._small
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self.run(lambda: self.tok.encode_released(text, add_special_tokens=add_special_tokens),
                              len(text))

    async def encode_chat(self, messages: list[dict], size: int, tools: Optional[list[dict]] = None,
                          add_generation_prompt: bool = True, continue_final: bool = False) -> list[int]:
        def work() -> list[int]:
            return self.tok.encode_released(self.render_chat(messages, tools, add_generation_prompt, continue_final),
                                            add_special_tokens=False)     # the template has the BOS
        return await self.run(work, size)

    def render_chat(self, messages: list[dict], tools: Optional[list[dict]] = None, add_generation_prompt: bool = True,
                    continue_final: bool = False) -> str:
        """The chat template's text. continue_final: the text ends with the last message's content, left open for
        the model to continue (what it renders after that content, an end of turn, is cut)."""
        kw = {"tools": tools} if tools else {}
        text = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kw)
        if continue_final:
            last = messages[-1].get("content") or ""
            at = text.rfind(last) if last else -1
            if at < 0:
                raise ValueError("continue_final_message needs a last message with content the chat template renders")
            text = text[:at + len(last)]
        return text

    def close(self) -> None:
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)

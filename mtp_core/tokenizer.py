"""A checkpoint's tokenizer: encode, decode, chat template and streaming detokenization.

Reads only data files from the model directory (never code, never `auto_map`):
`tokenizer.json` (required, via the `tokenizers` package), `tokenizer_config.json`, `chat_template.jinja`
and `generation_config.json` (all optional).

BOS/EOS follow transformers' fast tokenizers: when `tokenizer_config.json` sets `add_bos_token` or
`add_eos_token`, `encode(add_special_tokens=True)` adds exactly what those flags say (a missing flag
counts as false); when it sets neither, the post-processor stored in `tokenizer.json` decides.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from mtp_core.chat_format import THINK_END, THINK_START

_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


def _token_str(value: Any, key: str, path: Path) -> Optional[str]:
    """A special-token entry of tokenizer_config.json: a string, {"content": ...} or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{key} in {path} must be a string or {{\"content\": ...}}, got {value!r}")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix or remove it") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _pick_chat_template(model_dir: Path, config: dict) -> Optional[str]:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"tokenizer_config.json in {model_dir} has chat templates {sorted(named)} "
                             "but none named 'default'")
        template = named["default"]
    return template if isinstance(template, str) else None


class Tokenizer:
    """Tokenizer of one checkpoint directory; build it with `Tokenizer.from_dir(model_dir)`."""

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: Optional[str] = None,
                 eos_token: Optional[str] = None, pad_token: Optional[str] = None,
                 add_bos_token: Optional[bool] = None, add_eos_token: Optional[bool] = None,
                 chat_template: Optional[str] = None, extra_eos_token_ids: Sequence[int] = (),
                 bos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None,
                 source: str = "<memory>") -> None:
        self._tok = backend
        self._source = source
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self._bos_id = self._required_id(bos_token, "bos_token") if bos_token else bos_token_id
        self._pad_id = self._required_id(pad_token, "pad_token") if pad_token else pad_token_id
        eos_ids = [self._required_id(eos_token, "eos_token")] if eos_token else []
        self._eos_ids = list(dict.fromkeys(eos_ids + [int(i) for i in extra_eos_token_ids]))
        # None/None: leave BOS/EOS to tokenizer.json's post-processor (transformers does the same).
        self._explicit = add_bos_token is not None or add_eos_token is not None
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        if self._explicit and self.add_bos_token and self._bos_id is None:
            raise ValueError(f"add_bos_token is true but {source} names no bos_token; set one or disable it")
        if self._explicit and self.add_eos_token and not eos_ids:
            raise ValueError(f"add_eos_token is true but {source} names no eos_token; set one or disable it")
        self.chat_template = chat_template
        self._compiled: Optional[jinja2.Template] = None

    @classmethod
    def from_dir(cls, model_dir: Union[str, Path]) -> "Tokenizer":
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"tokenizer.json not found in {path}; point model_dir at a checkpoint that has one")
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
        cfg_path = path / "tokenizer_config.json"
        cfg = _read_json(cfg_path)
        gen = _read_json(path / "generation_config.json")
        bos_id = gen.get("bos_token_id")
        pad_id = gen.get("pad_token_id")
        return cls(
            backend,
            bos_token=_token_str(cfg.get("bos_token"), "bos_token", cfg_path),
            eos_token=_token_str(cfg.get("eos_token"), "eos_token", cfg_path),
            pad_token=_token_str(cfg.get("pad_token"), "pad_token", cfg_path),
            add_bos_token=cfg.get("add_bos_token"),
            add_eos_token=cfg.get("add_eos_token"),
            chat_template=_pick_chat_template(path, cfg),
            extra_eos_token_ids=_id_list(gen.get("eos_token_id")),
            bos_token_id=int(bos_id) if isinstance(bos_id, int) else None,
            pad_token_id=int(pad_id) if isinstance(pad_id, int) else None,
            source=str(path),
        )

    def _required_id(self, token: str, key: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"{key} {token!r} of {self._source} is not in its tokenizer.json vocabulary")
        return tid

    # ---- vocabulary ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._bos_id

    @property
    def eos_token_ids(self) -> list[int]:
        """tokenizer_config.json's eos first, then generation_config.json's eos ids (deduplicated)."""
        return list(self._eos_ids)

    @property
    def pad_token_id(self) -> Optional[int]:
        return self._pad_id

    def token_id(self, token: str) -> Optional[int]:
        """Exact vocabulary lookup (added tokens included); None when absent."""
        return self._tok.token_to_id(token)

    def think_token_ids(self) -> Optional[tuple[int, int]]:
        """(`<think>` id, `</think>` id) when both are in the vocabulary, else None."""
        start, end = self.token_id(THINK_START), self.token_id(THINK_END)
        return None if start is None or end is None else (start, end)

    # ---- text <-> ids ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings inside `text` map to their ids."""
        if not self._explicit:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids = [self._bos_id] + ids
        if add_special_tokens and self.add_eos_token:
            ids = ids + [self._eos_ids[0]]
        return ids

    def encode_released(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, releasing the GIL while the Rust tokenizer runs (`tokenizers`' batch call does; its
        single-text call does not), so other Python threads go on meanwhile; the same ids as `encode`."""
        if not self._explicit:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token:
            ids = [self._bos_id] + ids
        if add_special_tokens and self.add_eos_token:
            ids = ids + [self._eos_ids[0]]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True, keep: Sequence[int] = ()) -> "IncrementalDetokenizer":
        """keep: special tokens shown even though the others are skipped (a tool-call parser reads its markup)."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, keep=keep)

    def special_ids(self, tokens: Sequence[str]) -> list[int]:
        """The ids of those of `tokens` that are special tokens of this vocabulary (decoding skips them)."""
        added = self._tok.get_added_tokens_decoder()
        ids = [self._tok.token_to_id(t) for t in tokens]
        return [i for i in ids if i is not None and i in added and added[i].special]

    # ---- chat template ------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the checkpoint's Jinja template."""
        if self.chat_template is None:
            raise ValueError(f"{self._source} has no chat template (tokenizer_config.json 'chat_template' "
                             "or chat_template.jinja); pass a raw prompt instead")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template, self._source)
        return self._compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            pad_token=self.pad_token or "", **kwargs,
        )


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, indent: Optional[int] = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _compile_template(source: str, where: str) -> jinja2.Template:
    """Compile like transformers does: sandboxed, trim/lstrip blocks, loop controls."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template of {where} does not compile: {exc}") from exc


class IncrementalDetokenizer:
    """Feed token ids one at a time; get back only text that is complete.

    Keeps a window `ids[prefix:]` whose head `ids[prefix:read]` was already emitted. A new id emits
    `decode(ids[prefix:])` minus `decode(ids[prefix:read])`, unless that text ends in U+FFFD (an
    unfinished multi-byte character), in which case it is held back until a later id completes it.
    `flush()` at the end emits whatever is left, so the pieces always join to `decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, keep: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # skip every special token but `keep`: decode without skipping, the others left out first
        self._drop = None
        if keep and skip_special_tokens:
            added = tokenizer._tok.get_added_tokens_decoder()
            self._drop = {i for i, t in added.items() if t.special} - set(keep)
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    def feed(self, token_id: int) -> str:
        """Add one id; return the newly completed text ("" when nothing is complete yet)."""
        self._ids.append(int(token_id))
        head = self._decode(self._ids[self._prefix:self._read])
        window = self._decode(self._ids[self._prefix:])
        if len(window) <= len(head) or window.endswith(_REPLACEMENT) or not window.startswith(head):
            return ""
        piece = window[len(head):]
        self._prefix, self._read = self._read, len(self._ids)
        self._text += piece
        return piece

    def _decode(self, ids: list[int]) -> str:
        if self._drop is None:
            return self._tok.decode(ids, self._skip)
        return self._tok.decode([i for i in ids if i not in self._drop], skip_special_tokens=False)

    def flush(self) -> str:
        """Emit what is still held back (possibly a trailing U+FFFD if the ids end mid-character)."""
        full = self._decode(self._ids)
        piece = full[len(self._text):] if full.startswith(self._text) else ""
        self._prefix = self._read = len(self._ids)
        self._text += piece
        return piece

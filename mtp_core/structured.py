"""Structured output through xgrammar: a grammar's token mask at every position of a verify row.

A request's `SamplingParams.guided` names a grammar: ("json_object", ""), ("json_schema", schema JSON),
("regex", pattern) or ("choice", JSON list of strings). The engine gives the sequence a `GrammarMatcher`
(compiled grammars are cached per spec). Verification of a guided row walks its positions in order:

    position i: mask = the matcher's allowed tokens after the output and the drafts accepted so far
                choice_i = argmax (greedy) or a sample (temperature) of the masked, processed logits
                draft d_{i+1} == choice_i: accepted, the matcher takes it; else the row ends with choice_i

and then rolls the matcher back over the drafts it took: the engine commits the emitted tokens (which stop
at EOS, a stop id or max_tokens) into the matcher one by one, as it appends them. So each emitted token is
what plain decoding chooses under the same mask, and a draft the grammar forbids is rejected. With
`guided_after_think` (the server sets it when a reasoning parser is on) the grammar starts after `</think>`
(the thinking text is free), as in vLLM; otherwise it applies from the first token, and `<think>` /
`</think>` are never allowed inside the grammar's text.

Worked example (tests/test_structured.py): choice grammar {"yes", "no"}; a row [t, d1="n", d2="x"] whose
logits prefer "x" at position 1: position 0 allows "y"/"n" (and their multi-character tokens), picks "n" =
d1, accepted; position 1 allows only "o": the masked argmax is "o" != d2, so the row emits "n", "o".
"""
from __future__ import annotations

import json
import re
import threading
from typing import Any, Iterator, Optional

import numpy as np
import torch

from mtp_core.sampling import SamplingParams, sample_tokens
from mtp_core.speculative.verifier import accept_while_equal

GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "tool_calls")
# an internal error's location in xgrammar's messages ("[12:00:00] /project/cpp/x.cc:123: "): not the client's business
_WHERE = re.compile(r"^\s*(\[[0-9:]+\]\s*)?([^\s:]+\.(cc|cpp|h|hpp|py):\d+:?\s*)?")


class GrammarBackend:
    """xgrammar over the engine's tokenizer: compiles (and caches) grammars and makes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], max_rollback: int,
                 forbid: tuple[int, ...] = ()) -> None:
        try:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast
        except ImportError as e:       # pragma: no cover - depends on the environment
            raise ValueError(f"structured output needs the xgrammar package ({e}); pip install xgrammar") from None
        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer._tok)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.vocab_size = vocab_size
        self.stop_ids = set(stop_ids)
        self.forbid = list(forbid)          # never inside the grammar's text: <think> and </think>
        self._json_ids: Optional[list[int]] = None
        self.max_rollback = max(max_rollback, 1)
        self._cache: dict[tuple[str, str], Any] = {}
        self._lock = threading.Lock()

    def compile(self, guided: tuple[str, str]) -> Any:
        kind, spec = guided
        with self._lock:
            hit = self._cache.get((kind, spec))
            if hit is not None:
                return hit
            try:
                # compact JSON (no free whitespace between tokens, as vLLM's xgrammar backend can be set to): a
                # model that likes whitespace cannot pad the object until max_tokens
                if kind == "json_object":       # any JSON object (OpenAI's json_object mode), not an array
                    compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
                elif kind == "json_schema":
                    compiled = self.compiler.compile_json_schema(spec, strict_mode=True, any_whitespace=False)
                elif kind == "regex":
                    compiled = self.compiler.compile_regex(spec)
                elif kind == "choice":
                    options = json.loads(spec)
                    ebnf = "root ::= " + " | ".join(json.dumps(o) for o in options)
                    compiled = self.compiler.compile_grammar(ebnf)
                elif kind == "tool_calls":
                    compiled = self.compiler.compile_grammar(tool_calls_grammar(self.xgr, json.loads(spec)))
                else:
                    raise ValueError(f"unknown structured output kind {kind!r}; use one of {', '.join(GUIDED_KINDS)}")
            except ValueError:
                raise
            except Exception as e:  # noqa: BLE001 - xgrammar's own errors: a bad schema or regex
                first = _WHERE.sub("", str(e).splitlines()[0]) if str(e) else ""
                what = "the tools' parameters" if kind == "tool_calls" else f"the {kind}"
                raise ValueError(f"{what} cannot be compiled to a grammar: {first[:200] or type(e).__name__}") from None
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[(kind, spec)] = compiled
            return compiled

    def matcher(self, guided: tuple[str, str]) -> "Guide":
        # (tool_calls: the markup needs newlines; its JSON strings exclude raw control characters in xgrammar's rule)
        forbid = self.forbid
        if guided[0] in ("json_object", "json_schema"):
            forbid = self._json_forbid()
        return Guide(self.xgr.GrammarMatcher(self.compile(guided), max_rollback_tokens=self.max_rollback), forbid,
                     self)

    def _json_forbid(self) -> list[int]:
        """JSON (compact, as compiled here) never needs a byte below 0x20, and inside a string such a byte must be
        escaped (RFC 8259; xgrammar's string rule lets raw ones through): tokens holding one are forbidden, so
        every JSON output parses with a strict parser."""
        if self._json_ids is None:
            ctrl = [i for i, b in enumerate(self.info.decoded_vocab[:self.vocab_size])
                    if i not in self.stop_ids and any(c < 0x20 for c in b)]
            self._json_ids = sorted(set(ctrl) | set(self.forbid))
        return self._json_ids

    def new_bitmask(self) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(1, self.vocab_size)

    def mask(self, guide: "Guide", logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """logits [V] (float32) with the tokens the grammar forbids at -inf (a copy)."""
        guide.matcher.fill_next_token_bitmask(bitmask)
        row = logits.view(1, -1).clone()
        self.xgr.apply_token_bitmask_inplace(row, bitmask)
        if guide.forbid:
            row[0, guide.forbid] = float("-inf")
        return row.view(-1)


def tool_calls_grammar(xgr: Any, spec: dict) -> Any:
    """Tool calls in DeepSeek's markup: `<｜tool▁calls▁begin｜>`, `min`..`max` calls to the `tools` ([name, parameters
    schema] pairs), each one's arguments a compact JSON value of its schema, then `<｜tool▁calls▁end｜>` (and the
    grammar ends: the next token is EOS). format "deepseek-v3" (V3, R1): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    \\n```json\\nARGS\\n```<｜tool▁call▁end｜>`, newline-separated; "deepseek-v3.1": `<｜tool▁call▁begin｜>NAME
    <｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`."""
    from mtp_core.chat_format import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP

    def lit(text: str) -> Any:
        return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text))

    v3 = spec["format"] == "deepseek-v3"
    calls = []
    for name, schema in spec["tools"]:
        head = TOOL_CALL_BEGIN + ("function" + TOOL_SEP + name + "\n```json\n" if v3 else name + TOOL_SEP)
        args = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        calls.append(xgr.Grammar.concat(lit(head), args, lit(("\n```" if v3 else "") + TOOL_CALL_END)))
    call = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    sep = "\n" if v3 else ""
    options = []
    for n in range(spec["min"], spec["max"] + 1):
        parts = [lit(TOOL_CALLS_BEGIN), call]
        for _ in range(n - 1):
            parts += [lit(sep), call] if sep else [call]
        options.append(xgr.Grammar.concat(*parts, lit(TOOL_CALLS_END)))
    return options[0] if len(options) == 1 else xgr.Grammar.union(*options)


class Guide:
    """A request's grammar matcher and the token ids it never allows (think tokens; control bytes for JSON)."""

    def __init__(self, matcher: Any, forbid: list[int], backend: Optional[GrammarBackend] = None) -> None:
        self.matcher, self.forbid, self.backend = matcher, forbid, backend
        self.masks: Optional[torch.Tensor] = None    # guided_masks' rows, kept from step to step
        self.masks_np: Optional[np.ndarray] = None   # ... and a numpy view of them
        self.allowed: Optional[np.ndarray] = None    # [words] int32: every bit set but the forbidden tokens'

    def accept_token(self, tok: int) -> bool:
        return self.matcher.accept_token(tok)

    def rollback(self, n: int) -> None:
        self.matcher.rollback(n)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def verify_guided_row(backend: GrammarBackend, matcher: "Guide", logits: torch.Tensor, drafts: list[int],
                      params: SamplingParams, generator: Optional[torch.Generator], thinking: bool,
                      think_ids: Optional[tuple[int, int]]) -> list[int]:
    """One guided row: logits [K+1, V] (processed), drafts [K]. Returns the emitted tokens (accepted drafts,
    then the bonus): strict acceptance (speculative/verifier.py: accept_while_equal) against the choice under
    the grammar's mask at each position; the matcher is left where it was."""
    taken = [0]
    out = accept_while_equal(_guided_choices(backend, matcher, logits, params, generator, thinking, think_ids,
                                             taken), drafts)
    if taken[0]:
        matcher.rollback(taken[0])
    return out


def _guided_choices(backend: GrammarBackend, matcher: "Guide", logits: torch.Tensor, params: SamplingParams,
                    generator: Optional[torch.Generator], thinking: bool, think_ids: Optional[tuple[int, int]],
                    taken: list[int]) -> Iterator[int]:
    """The choice at each position of a guided row, made only once the drafts before it are accepted (the mask
    continues after them, the generator draws in order). Ends early where the row ends even on a match: a stop
    token, the grammar's end or a draft it rejects. taken[0]: the drafts the matcher took (to roll back)."""
    bitmask = backend.new_bitmask()
    for i in range(logits.shape[0]):
        row = logits[i] if thinking else backend.mask(matcher, logits[i], bitmask)
        tok = int(sample_tokens(row.view(1, -1), params, generator)[0])
        yield tok
        # the draft equal to tok is accepted
        if not thinking and tok in backend.stop_ids:
            return                      # (the grammar's end: the engine stops at the stop token)
        if think_ids is not None and tok == think_ids[0]:
            thinking = True
        elif think_ids is not None and tok == think_ids[1]:
            thinking = False
        elif not thinking:
            if matcher.is_terminated() or not matcher.accept_token(tok):
                return
            taken[0] += 1


class Guided:
    """The acceptance rule of a guided row (speculative/verifier.py): `verify_guided_row` on the processed
    logits. The native step verifies greedy guided rows inside its call (with `guided_masks`); sampled ones take
    the general path."""
    name = "guided"

    def __init__(self, think_ids: Optional[tuple[int, int]], greedy: bool) -> None:
        self.think_ids = think_ids
        self.fused: tuple[str, ...] = ("native",) if greedy else ()

    @classmethod
    def pair(cls, think_ids: Optional[tuple[int, int]]) -> tuple["Guided", "Guided"]:
        """The rules of greedy and of sampled guided rows (Acceptance's `guided`)."""
        return cls(think_ids, True), cls(think_ids, False)

    def verify_row(self, logits: torch.Tensor, drafts: torch.Tensor, seq: Any) -> list[int]:
        after_think = seq.params.guided_after_think and self.think_ids is not None
        dec = seq.decoding
        return verify_guided_row(dec.matcher.backend, dec.matcher, logits, drafts.tolist(), seq.params, dec.generator,
                                 after_think and dec.in_thinking, self.think_ids if after_think else None)


def guided_masks(backend: GrammarBackend, guide: Guide, drafts: list[int], thinking: bool,
                 think_ids: Optional[tuple[int, int]]) -> tuple[torch.Tensor, list[bool], int]:
    """verify_guided_row's masks for the native step, made before the target's logits exist: the row [t, d_1..d_k]
    walks its drafts as if each were accepted, and position i's mask is the one verify_guided_row uses there once
    d_1..d_i are accepted (the forbidden tokens cleared too). Where verify_guided_row would stop even on a match (a
    stop token, the grammar's end or a draft it rejects, after draft i) no later position is reached, so the walk
    stops and the row may accept at most i drafts. Returns (masks [n, ceil(V / 32)] int32, xgrammar's layout: a set
    bit allows the token; whether each of the n positions has a mask (none inside <think> with guided_after_think);
    the most drafts the row may accept). The matcher is left where it was."""
    if guide.masks is None or guide.masks.shape[0] < len(drafts) + 1:
        guide.masks = backend.xgr.allocate_token_bitmask(len(drafts) + 1, backend.vocab_size)
        guide.masks_np = guide.masks.numpy()
    if guide.forbid and guide.allowed is None:
        bits = np.ones(guide.masks.shape[1] * 32, dtype=bool)
        bits[guide.forbid] = False                        # bit t % 32 of word t // 32 (little-endian words)
        guide.allowed = np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)
    matcher, masks = guide.matcher, guide.masks
    fill, stops = matcher.fill_next_token_bitmask, backend.stop_ids
    start, end = think_ids if think_ids is not None else (-1, -1)
    n, cap, taken = 0, len(drafts), 0
    # verify_guided_row asks is_terminated() before each draft it feeds; the matcher terminates only by accepting a
    # stop token (xgrammar's default), which the walk never feeds, so the answer is the same all along: ask once
    terminated = matcher.is_terminated()
    thinks: Optional[list[bool]] = [] if think_ids is not None else None
    for i in range(len(drafts) + 1):
        n += 1
        if thinks is not None:
            thinks.append(thinking)
        if not thinking:
            fill(masks, i)
        if i == len(drafts):
            break
        d = drafts[i]
        if not thinking and d in stops:
            cap = i
            break
        if d == start:
            thinking = True
        elif d == end:
            thinking = False
        elif not thinking:
            if terminated or not matcher.accept_token(d):
                cap = i
                break
            taken += 1
    if taken:
        matcher.rollback(taken)
    if guide.allowed is not None:
        np.bitwise_and(guide.masks_np[:n], guide.allowed, out=guide.masks_np[:n])
    return masks[:n], [True] * n if thinks is None else [not t for t in thinks], cap

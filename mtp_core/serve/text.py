"""Token ids -> the text a client sees: incremental detokenization, stop strings, the reasoning split.

`OutputText` is fed each engine step's new token ids and returns the new text per channel. Without a
reasoning parser there is one channel, `content`. With `deepseek-r1` (vLLM's convention) the tokens
before `</think>` form `reasoning_content` and the ones after it `content`; the split is made on the
`</think>` token id, so it never depends on how the text is cut into pieces. When the prompt does not
leave the model inside `<think>` (no `<think>` in it after the last `</think>`) and the output has no
`<think>`, everything is content.

Stop strings: the text is held back by up to (longest stop string - 1) characters, so a stop string that
straddles two steps is still found before any part of it is sent; the text is cut before the stop string.
With `include_stop_str_in_output` the text ends with the stop string instead (the earliest match; of
two that start there, the shorter). The streamed pieces always concatenate to exactly the non-streamed text.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence


class _StopBuffer:
    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include                   # include_stop_str_in_output: the text ends with the stop string
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        buf = self.pending + piece
        hits = [(i, i + len(s)) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.pending = ""
            start, end = min(hits)
            return buf[:end] if self.include else buf[:start]
        cut = max(len(buf) - self.hold, 0)
        self.pending = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


class OutputText:
    def __init__(self, tokenizer: Any, stops: list[str], think_ids: Optional[tuple[int, int]] = None,
                 starts_in_reasoning: bool = False, include_stop: bool = False, keep: Sequence[int] = ()) -> None:
        self.tok = tokenizer
        self.think_ids = think_ids                        # set only with a reasoning parser
        self.in_reasoning = bool(think_ids) and starts_in_reasoning
        self.saw_think_start = False
        # keep: special tokens the content shows (tool-call markup, where a vocabulary has it as special tokens)
        self.decoders = {"content": tokenizer.stream_decoder(keep=keep) if keep else tokenizer.stream_decoder()}
        self.stops = {"content": _StopBuffer(stops, include_stop)}
        if think_ids:
            self.decoders["reasoning_content"] = tokenizer.stream_decoder()
            self.stops["reasoning_content"] = _StopBuffer(stops, include_stop)
        self.text = {k: "" for k in self.decoders}
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        return any(b.stopped for b in self.stops.values())

    def feed(self, token_ids: list[int]) -> dict[str, str]:
        """New text per channel for these tokens (channels with nothing new are left out)."""
        out: dict[str, str] = {}
        for t in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            if self.think_ids:
                if t == self.think_ids[0]:
                    self.in_reasoning = True
                    continue
                if t == self.think_ids[1]:
                    if self.in_reasoning:
                        self._add(out, "reasoning_content", self._close("reasoning_content"))
                    self.in_reasoning = False
                    continue
            ch = "reasoning_content" if self.in_reasoning else "content"
            self._add(out, ch, self.stops[ch].push(self.decoders[ch].feed(t)))
        return out

    def _close(self, ch: str) -> str:
        return self.stops[ch].push(self.decoders[ch].flush()) + self.stops[ch].flush()

    def finish(self) -> dict[str, str]:
        """The text still held back, at the end of generation."""
        out: dict[str, str] = {}
        for ch in self.decoders:
            self._add(out, ch, self._close(ch))
        return out

    def _add(self, out: dict[str, str], ch: str, piece: str) -> None:
        if piece:
            out[ch] = out.get(ch, "") + piece
            self.text[ch] += piece

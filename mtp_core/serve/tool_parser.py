"""DeepSeek-V3 / R1 tool-call markup in a model's output -> content and OpenAI tool calls, incrementally.

The formats read (markers: mtp_core/chat_format.py):

    V3, R1   CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
             \\n<｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1     ...<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...

and the slips R1 makes (as llama.cpp reads them): the opening marker written <｜tool_calls_begin｜>, <｜tool calls
begin｜>, <｜tool\\_calls\\_begin｜> or <｜tool▁calls｜>; a call without its <｜tool▁call▁begin｜> (`function<｜tool▁sep｜>`
right after the opening marker); whitespace around the fence. A <｜tool▁call▁begin｜> outside a section opens one.

The rules, which hold however the text is cut into pieces (`feed` takes any split; the pieces of the result always
join to what one `feed` of the whole text gives):
- content is the text outside the markup: before it and after <｜tool▁calls▁end｜>. Only a tail that could still be
  the start of an opening marker is held back.
- a call is announced (index, name) once its header is complete; its arguments follow as they arrive, minus a tail
  that could still be the closing fence or <｜tool▁call▁end｜>. The arguments are the model's text between the fence
  (or <｜tool▁sep｜> in V3.1) and the closing, without surrounding whitespace; they are not re-serialised, and a model
  can write invalid JSON there (as OpenAI says of its own models).
- markup is only dropped once it makes a call: text that stops fitting the markup (a header that is not one, text
  between two calls) is content from there on, as it was written, markers included, and nothing after it is parsed.
  A section the output ends inside keeps the calls announced so far (the last one with the arguments it got: the
  finish reason says `length` when max_tokens cut it); an unfinished header or marker is content.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from mtp_core.chat_format import TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_SEP

# R1's spellings of the opening marker (llama.cpp accepts the same ones)
CALLS_BEGIN_VARIANTS = (TOOL_CALLS_BEGIN, "<｜tool_calls_begin｜>", "<｜tool calls begin｜>",
                        "<｜tool\\_calls\\_begin｜>", "<｜tool▁calls｜>")
_OPENERS = CALLS_BEGIN_VARIANTS + (TOOL_CALL_BEGIN,)
_BARE_CALL = "function" + TOOL_SEP               # R1: a call without its <｜tool▁call▁begin｜>
_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
_FENCE = re.compile(r"[ \t]*```(?:json)?[ \t]*\n")
_FENCE_START = re.compile(r"[ \t]*(?:`{0,2}|```(?:j|js|jso|json)?[ \t]*)")   # what can still become a fence
_MAX_HEADER = 160                               # characters a header may take before it is not one

TEXT, SECTION, HEADER, ARGS, PLAIN = range(5)


@dataclass
class CallDelta:
    index: int
    name: Optional[str] = None                   # the call's first delta: its name
    arguments: str = ""


@dataclass
class ParseDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add_args(self, index: int, piece: str) -> None:
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += piece
        else:
            self.calls.append(CallDelta(index, None, piece))


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class ToolCallParser:
    """One choice's output text, fed piece by piece (`feed`), then `finish`."""

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self._state = TEXT
        self._buf = ""                          # text not decided yet
        self._pending = ""                      # markup taken since the last call began: content if it goes wrong
        self._fenced = False                    # the current call's arguments close with ``` (V3, R1)
        self._sent = 0                          # characters of the current call's arguments given out

    def feed(self, text: str) -> ParseDelta:
        self._buf += text
        out = ParseDelta()
        self._run(out, final=False)
        return out

    def finish(self) -> ParseDelta:
        """The end of the output: what was held back."""
        out = ParseDelta()
        self._run(out, final=True)
        rest = self._pending + self._buf
        if self._state == ARGS:               # cut inside a call: it keeps the arguments it got
            self._args(out, self._buf, closed=False)
        elif rest.strip():
            out.content += rest
        self._buf = self._pending = ""
        self._state = PLAIN
        return out

    # ---- the states --------------------------------------------------------------------------
    def _run(self, out: ParseDelta, final: bool) -> None:
        while True:
            state = self._state
            if state == TEXT:
                done = self._text(out, final)
            elif state == SECTION:
                done = self._section(out, final)
            elif state == HEADER:
                done = self._header(out, final)
            elif state == ARGS:
                done = self._args_until_end(out, final)
            else:
                out.content += self._buf
                self._buf = ""
                done = True
            if done:
                return

    def _text(self, out: ParseDelta, final: bool) -> bool:
        buf = self._buf
        hits = [(i, m) for i, m in ((buf.find(m), m) for m in _OPENERS) if i >= 0]
        if hits:
            i, m = min(hits)
            out.content += buf[:i]
            self._pending = m
            self._buf = buf[i + len(m):]
            self._state = HEADER if m == TOOL_CALL_BEGIN else SECTION
            return False
        keep = 0 if final else _partial_suffix(buf, _OPENERS)
        out.content += buf[:len(buf) - keep]
        self._buf = buf[len(buf) - keep:]
        return True

    def _section(self, out: ParseDelta, final: bool) -> bool:
        """Between the opening marker, the calls and the closing marker: whitespace only."""
        rest = self._buf.lstrip()
        ws = self._buf[:len(self._buf) - len(rest)]
        if not rest:
            return True
        if rest.startswith(TOOL_CALL_BEGIN):
            self._pending += ws + TOOL_CALL_BEGIN
            self._buf = rest[len(TOOL_CALL_BEGIN):]
            self._state = HEADER
            return False
        if rest.startswith(TOOL_CALLS_END):
            self._pending = ""
            self._buf = rest[len(TOOL_CALLS_END):]
            self._state = TEXT
            return False
        if rest.startswith(_BARE_CALL):
            self._pending += ws
            self._buf = rest
            self._state = HEADER
            return False
        if not final and any(m.startswith(rest) for m in (TOOL_CALL_BEGIN, TOOL_CALLS_END, _BARE_CALL)):
            return True
        return self._malformed(out)

    def _header(self, out: ParseDelta, final: bool) -> bool:
        """After <｜tool▁call▁begin｜>: `function<｜tool▁sep｜>NAME\\n```json\\n` (V3, R1) or `NAME<｜tool▁sep｜>` (V3.1)."""
        buf = self._buf
        j = buf.find(TOOL_SEP)
        if j < 0:
            head = buf[:len(buf) - _partial_suffix(buf, (TOOL_SEP,))].strip()
            if not final and len(buf) <= _MAX_HEADER and (not head or _NAME.fullmatch(head)):
                return True
            return self._malformed(out)
        head, rest = buf[:j].strip(), buf[j + len(TOOL_SEP):]
        if head == "function" and not rest.lstrip().startswith(("{", "[")):
            k = rest.find("\n")
            if k < 0:
                if not final and len(rest) <= _MAX_HEADER and (not rest.strip() or _NAME.fullmatch(rest.strip())):
                    return True
                return self._malformed(out)
            name, after = rest[:k].strip(), rest[k + 1:]
            fence = _FENCE.match(after)
            if fence is None:
                if not final and _FENCE_START.fullmatch(after) and _NAME.fullmatch(name):
                    return True
                return self._malformed(out)
            start, fenced = j + len(TOOL_SEP) + k + 1 + fence.end(), True
        else:
            name, start, fenced = head, j + len(TOOL_SEP), False
        if not _NAME.fullmatch(name):
            return self._malformed(out)
        self.calls.append(ParsedCall(name))
        out.calls.append(CallDelta(len(self.calls) - 1, name))
        self._pending = ""
        self._buf = buf[start:]
        self._fenced, self._sent = fenced, 0
        self._state = ARGS
        return False

    def _args_until_end(self, out: ParseDelta, final: bool) -> bool:
        e = self._buf.find(TOOL_CALL_END)
        if e < 0:
            if not final:
                self._args(out, self._buf, closed=False)
            return True
        self._args(out, self._buf[:e], closed=True)
        self._buf = self._buf[e + len(TOOL_CALL_END):]
        self._state = SECTION
        return False

    def _args(self, out: ParseDelta, text: str, closed: bool) -> None:
        """Gives out the current call's arguments in `text` (all of them once `closed`: <｜tool▁call▁end｜> came), less
        what could still be the closing."""
        if not closed:
            text = text[:len(text) - _partial_suffix(text, (TOOL_CALL_END,))]
        text = text.strip()
        if self._fenced:
            # open: any backticks at the end may be the fence; closed: the fence is the last three
            if not closed:
                text = text.rstrip("`").rstrip()
            elif text.endswith("```"):
                text = text[:-3].rstrip()
        if len(text) > self._sent:
            piece = text[self._sent:]
            self._sent = len(text)
            self.calls[-1].arguments += piece
            out.add_args(len(self.calls) - 1, piece)

    def _malformed(self, out: ParseDelta) -> bool:
        out.content += self._pending + self._buf
        self._pending = self._buf = ""
        self._state = PLAIN
        return True

"""The DeepSeek-V3 / R1 tool-call parser (mtp_core/serve/tool_parser.py), table-tested against hand-written
expectations: the V3 and R1 formats (R1's misspelt opening markers, a call without its begin marker, loose fences),
V3.1's, several calls, text before and after, malformed and cut-off markup. Every case is fed whole, split at every
character into two pieces and at a grid of places into three, byte by byte through a UTF-8 decoder, and token by
token through the shipped model's tokenizer and streaming detokenizer: the result is the same each time, names come
once, and argument pieces join to the arguments.
"""
from __future__ import annotations

import codecs

import pytest

from mtp_core.serve.tool_parser import ToolCallParser

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE, CLOSE = "\n```json\n", "\n```"
W = CB + "function" + SEP + "get_weather" + FENCE + '{"city": "Paris"}' + CLOSE + CE
T = CB + "function" + SEP + "get_time" + FENCE + '{"zone": "UTC", "fmt": "H:M"}' + CLOSE + CE
PARIS, UTC = ("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "UTC", "fmt": "H:M"}')

# (id, model output, content, [(name, arguments)])
CASES = [
    ("plain text", "The answer is 4.", "The answer is 4.", []),
    ("text with a fullwidth bar", "a ｜ b <｜tool c <｜", "a ｜ b <｜tool c <｜", []),
    ("v3 one call", B + W + E, "", [PARIS]),
    ("v3 text before", "Let me check.\n\n" + B + W + E, "Let me check.\n\n", [PARIS]),
    ("v3 two calls", "x" + B + W + "\n" + T + E, "x", [PARIS, UTC]),
    ("v3 text after the section", "a" + B + W + E + " done", "a done", [PARIS]),
    ("v3 fence without json", B + CB + "function" + SEP + "f\n```\n[1, 2]\n```" + CE + E, "", [("f", "[1, 2]")]),
    ("v3 arguments with backticks and markup in strings",
     B + CB + "function" + SEP + "run" + FENCE + '{"code": "a```b <｜x <｜tool▁call▁e"}' + CLOSE + CE + E,
     "", [("run", '{"code": "a```b <｜x <｜tool▁call▁e"}')]),
    ("v3 invalid JSON is kept as written", B + CB + "function" + SEP + "f" + FENCE + "{city: Paris" + CLOSE + CE + E,
     "", [("f", "{city: Paris")]),
    ("r1 misspelt opener 1", "<｜tool_calls_begin｜>" + W + E, "", [PARIS]),
    ("r1 misspelt opener 2", "<｜tool calls begin｜>" + W + E, "", [PARIS]),
    ("r1 misspelt opener 3", "<｜tool\\_calls\\_begin｜>" + W + E, "", [PARIS]),
    ("r1 short opener", "<｜tool▁calls｜>" + W + E, "", [PARIS]),
    ("r1 call without its begin marker",
     B + "function" + SEP + "get_weather" + FENCE + '{"city": "Paris"}' + CLOSE + CE + E, "", [PARIS]),
    ("r1 loose fence", B + CB + "function" + SEP + "get_weather \n  ```json  \n" + '{"city": "Paris"}' + "\n```  \n"
     + CE + E, "", [PARIS]),
    ("v3.1 two calls", "ok" + B + CB + "get_weather" + SEP + '{"city": "Paris"}' + CE + CB + "get_time" + SEP
     + '{"zone": "UTC", "fmt": "H:M"}' + CE + E, "ok", [PARIS, UTC]),
    ("v3.1 a function named function", B + CB + "function" + SEP + '{"a": 1}' + CE + E, "", [("function", '{"a": 1}')]),
    ("a call begin marker opens a section", "so " + W, "so ", [PARIS]),
    ("empty section", "a" + B + E + "b", "ab", []),
    # malformed: from where the markup stops fitting, the text is content as written
    ("malformed header", "a" + B + CB + "function" + SEP + "bad name!\n```json\n{}\n```" + CE + E,
     "a" + B + CB + "function" + SEP + "bad name!\n```json\n{}\n```" + CE + E, []),
    ("malformed fence", B + CB + "function" + SEP + "f\nnot a fence {}" + CE + E,
     B + CB + "function" + SEP + "f\nnot a fence {}" + CE + E, []),
    ("text between calls", B + W + "\nwait, " + T + E, "\nwait, " + T + E, [PARIS]),
    ("a header without a separator", B + CB + "just some words here" + CE + E,
     B + CB + "just some words here" + CE + E, []),
    # cut off (max_tokens) or ended early (EOS)
    ("cut inside the arguments", "a" + B + CB + "function" + SEP + "get_weather" + FENCE + '{"city": "Pa',
     "a", [("get_weather", '{"city": "Pa')]),
    ("cut inside the closing fence", B + CB + "function" + SEP + "f" + FENCE + '{"a": 1}\n``', "", [("f", '{"a": 1}')]),
    ("cut after a call", B + W + "\n", "", [PARIS]),
    ("cut inside a header", "a" + B + CB + "function" + SEP + "get_wea", "a" + B + CB + "function" + SEP + "get_wea",
     []),
    ("cut inside the opener", "Hi <｜tool▁ca", "Hi <｜tool▁ca", []),
    ("only the opener", B, B, []),
    ("cut inside the second call's header", B + W + "\n" + CB + "func", "\n" + CB + "func", [PARIS]),
]


def _run(pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[tuple[str, str]]]:
    """(content, calls from the streamed deltas, calls as the parser holds them at the end)."""
    p = ToolCallParser()
    content, streamed = "", {}
    for d in [p.feed(x) for x in pieces] + [p.finish()]:
        content += d.content
        for c in d.calls:
            if c.name is not None:
                assert c.index not in streamed, "a call is announced once"
                streamed[c.index] = [c.name, ""]
            streamed[c.index][1] += c.arguments
    return content, [tuple(streamed[i]) for i in sorted(streamed)], [(c.name, c.arguments) for c in p.calls]


@pytest.mark.parametrize("text,content,calls", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_whole_and_split_at_every_character(text, content, calls) -> None:
    assert _run([text]) == (content, calls, calls)
    for i in range(len(text) + 1):
        assert _run([text[:i], text[i:]]) == (content, calls, calls), i
    step = max(1, len(text) // 25)
    for i in range(0, len(text) + 1, step):
        for j in range(i, len(text) + 1, step):
            assert _run([text[:i], text[i:j], text[j:]]) == (content, calls, calls), (i, j)
    assert _run(list(text)) == (content, calls, calls)


@pytest.mark.parametrize("text,content,calls", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_byte_by_byte(text, content, calls) -> None:
    """The text arrives one UTF-8 byte at a time (a detokenizer gives out a character once its bytes are there)."""
    dec = codecs.getincrementaldecoder("utf-8")()
    pieces = [dec.decode(bytes([b])) for b in text.encode("utf-8")]
    assert _run(pieces) == (content, calls, calls)


@pytest.fixture(scope="module")
def shipped_tok():
    from cli.common import DEFAULT_MODEL_DIR
    from mtp_core.tokenizer import Tokenizer

    return Tokenizer.from_dir(DEFAULT_MODEL_DIR)


@pytest.mark.parametrize("text,content,calls", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_token_by_token_through_the_detokenizer(shipped_tok, text, content, calls) -> None:
    """The shipped model's tokenizer has no markup tokens: a marker is several tokens, some holding part of a
    fullwidth character; the streaming detokenizer's pieces parse like the whole text."""
    ids = shipped_tok.encode(text, add_special_tokens=False)
    stream = shipped_tok.stream_decoder()
    pieces = [stream.feed(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert _run(pieces) == (content, calls, calls)


def test_arguments_stream_as_they_are_written() -> None:
    """Nothing is held to the end: content before the markup comes before the markup is complete, a call's name
    once its header is, and its arguments before the closing fence arrives."""
    p = ToolCallParser()
    assert p.feed("Let me look.").content == "Let me look."
    assert p.feed(B + CB + "function" + SEP).content == ""
    d = p.feed("get_weather" + FENCE)
    assert [(c.index, c.name) for c in d.calls] == [(0, "get_weather")]
    assert p.feed('{"city": ').calls[0].arguments == '{"city":'        # the space may still be closing whitespace
    assert p.feed('"Paris"}').calls[0].arguments == ' "Paris"}'
    assert p.feed("\n``").calls == []
    d = p.feed("`" + CE + "\n" + CB + "function" + SEP + "get_time" + FENCE + "{")
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [(1, "get_time", "{")]
    d = p.feed("}" + CLOSE + CE + E + "Done.")
    assert d.content == "Done." and d.calls[0].arguments == "}"
    assert [(c.name, c.arguments) for c in p.calls] == [PARIS, ("get_time", "{}")]


def test_markup_kept_where_the_vocabulary_has_it_as_special_tokens(shipped_tok, tmp_path) -> None:
    """A checkpoint whose markers are special tokens (one id each): plain decoding drops them; the text a tool parser
    reads keeps them (and still drops the other special tokens, EOS here)."""
    import shutil

    import tokenizers

    from cli.common import DEFAULT_MODEL_DIR
    from mtp_core.chat_format import TOOL_MARKUP
    from mtp_core.serve.text import OutputText
    from mtp_core.tokenizer import Tokenizer

    d = tmp_path / "special"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / f, d / f)
    backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    backend.add_special_tokens(list(TOOL_MARKUP))
    backend.save(str(d / "tokenizer.json"))
    tok = Tokenizer.from_dir(d)
    keep = tok.special_ids(TOOL_MARKUP)
    assert len(keep) == len(TOOL_MARKUP) and shipped_tok.special_ids(TOOL_MARKUP) == []
    text = "Hi" + B + W + E
    ids = tok.encode(text, add_special_tokens=False) + tok.eos_token_ids[:1]
    assert sum(i in keep for i in ids) == 5 and tok.decode(ids) == "Hi" + W.replace(CB, "").replace(SEP, "").replace(CE, "")
    out = OutputText(tok, [], keep=keep)
    pieces = [out.feed([i]).get("content", "") for i in ids] + [out.finish().get("content", "")]
    assert "".join(pieces) == text
    assert _run(pieces) == ("Hi", [PARIS], [PARIS])

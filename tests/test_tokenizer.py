"""Tokenizer layer: chat format, tiny BPE builder, checkpoint Tokenizer, streaming detokenizer.

Hand-computed ids for tokenizers from `build_tiny_tokenizer`: ids 0..6 are the chat-format tokens, then
the 256 byte symbols of byte-level BPE sorted by code point. Printable ASCII '!'..'~' (byte-level maps
them to themselves) come first, so id(c) = 7 + ord(c) - ord('!'): '0' -> 22, '7' -> 29. Then come
'¡'..'¬' (12) and '®'..'ÿ' (82), ids 101..194, then U+0100.. for bytes 0x00-0x20 in order:
'\\n' (0x0A) -> 'Ċ' -> 195 + 10 = 205, ' ' (0x20) -> 'Ġ' -> 195 + 32 = 227.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers
import torch

from mtp_core.chat_format import CHAT_TEMPLATE, TOOLS_INSTRUCTIONS, render_completion, render_prompt
from mtp_core.tokenizer import Tokenizer
from mtp_core.tokenizer_build import build_tiny_tokenizer, train_bpe_tokenizer

torch.set_num_threads(1)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
ZERO, NEWLINE, SPACE = 22, 205, 227


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_tok")
    build_tiny_tokenizer(out, vocab_size=512)
    return out


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def _variant(src: Path, dst: Path, **config_changes) -> Path:
    """Copy a tokenizer dir, then set (value) or drop (None) keys of its tokenizer_config.json."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key, value in config_changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    return dst


def test_chat_format_helpers_exact():
    assert render_prompt("What is 2+2?") == (
        "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n")
    assert render_completion("2 plus 2 is 4.", "4") == "2 plus 2 is 4.\n</think>\n\n4<｜end▁of▁sentence｜>"


def test_digits_are_single_tokens(tok, tiny_dir):
    assert tok.encode("2024", add_special_tokens=False) == [ZERO + 2, ZERO, ZERO + 2, ZERO + 4]
    assert tok.encode(" 7", add_special_tokens=False) == [SPACE, ZERO + 7]
    backend = tokenizers.Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    merged_digits = [t for t in backend.get_vocab() if sum(ch.isdigit() for ch in t) > 1]
    assert merged_digits == []  # the corpus is full of numbers, yet no token holds two digits


def test_special_tokens_ids_and_encoding(tok):
    expected = {"<｜pad｜>": 0, BOS: 1, EOS: 2, USER: 3, ASSISTANT: 4, "<think>": 5, "</think>": 6}
    assert {s: tok.token_id(s) for s in expected} == expected
    assert tok.token_id("no such token") is None
    ids = tok.encode(render_prompt("7"), add_special_tokens=False)
    assert ids == [1, 3, ZERO + 7, 4, 5, NEWLINE]
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, [2], 0)
    assert tok.vocab_size == 512


def test_bos_follows_config(tok, tiny_dir, tmp_path):
    assert tok.encode("7") == [1, ZERO + 7]
    assert tok.encode("7", add_special_tokens=False) == [ZERO + 7]
    no_bos = Tokenizer.from_dir(_variant(tiny_dir, tmp_path / "a", add_bos_token=False))
    assert no_bos.encode("7") == [ZERO + 7]
    dict_bos = Tokenizer.from_dir(_variant(tiny_dir, tmp_path / "b", bos_token={"content": BOS},
                                           add_eos_token=True))
    assert dict_bos.encode("7") == [1, ZERO + 7, 2]
    # Neither flag set: tokenizer.json's post-processor (BOS) decides, as in transformers 5.
    unset = Tokenizer.from_dir(_variant(tiny_dir, tmp_path / "c", add_bos_token=None, add_eos_token=None))
    assert unset.encode("7") == [1, ZERO + 7]


def test_decode_skips_special_tokens_but_keeps_think_tags(tok):
    assert tok.decode([1, 3, ZERO + 7, 4, 2]) == "7"
    assert tok.decode([1, 3, ZERO + 7, 4, 2], skip_special_tokens=False) == BOS + USER + "7" + ASSISTANT + EOS
    assert tok.decode([5, ZERO + 4, 6, NEWLINE]) == "<think>4</think>\n"


def test_chat_template_renders_exactly(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert tok.apply_chat_template(messages) == (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>What is 2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>"
        "<｜User｜>And 3+3?<｜Assistant｜><think>\n")
    assert tok.apply_chat_template(messages[1:3], add_generation_prompt=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>")
    assert tok.apply_chat_template([{"role": "user", "content": "q"}]) == render_prompt("q")
    with pytest.raises(ValueError, match="unsupported chat role critic; use system, user, assistant or tool"):
        tok.apply_chat_template([{"role": "critic", "content": "x"}])


def test_chat_template_renders_tools_in_deepseek_markup(tok):
    """The tool list after the system text; an assistant's calls (arguments a JSON string, or an object as
    transformers users pass them), newline-separated; a run of tool results; then the next turn as any other."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "get_time"}}]
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "a", "content": "rain"}, {"role": "tool", "content": "9:00"},
                {"role": "assistant", "content": "Rain."}]
    head = "<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n" + TOOLS_INSTRUCTIONS
    assert tok.apply_chat_template(messages, tools=tools) == (
        head + '\n{"name": "get_weather", "parameters": {"type": "object"}}\n{"name": "get_time"}'
        "<｜User｜>Oslo?<｜Assistant｜><｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜>\n'
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>rain<｜tool▁output▁end｜>\n"
        "<｜tool▁output▁begin｜>9:00<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
        "<｜Assistant｜>Rain.<｜end▁of▁sentence｜><｜Assistant｜><think>\n")
    # tool results last: the outputs close, then the generation prompt; no system text: the list right after BOS
    assert tok.apply_chat_template(messages[1:4], tools=tools[1:]).endswith(
        "<｜tool▁output▁begin｜>rain<｜tool▁output▁end｜><｜tool▁outputs▁end｜><｜Assistant｜><think>\n")
    assert tok.apply_chat_template(messages[1:2], tools=tools[1:]).startswith(
        "<｜begin▁of▁sentence｜>## Tools\nYou can call")
    # without tools (and with tools=[]) the conversation renders as it always did
    assert tok.apply_chat_template(messages[:2], tools=[]) == tok.apply_chat_template(messages[:2])


def test_chat_template_sources(tiny_dir, tmp_path):
    missing = Tokenizer.from_dir(_variant(tiny_dir, tmp_path / "a", chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        missing.apply_chat_template([{"role": "user", "content": "q"}])
    jinja_dir = _variant(tiny_dir, tmp_path / "b")
    (jinja_dir / "chat_template.jinja").write_text("{{ bos_token }}[{{ messages[0]['content'] }}]")
    assert Tokenizer.from_dir(jinja_dir).apply_chat_template([{"role": "user", "content": "q"}]) == BOS + "[q]"


def test_transformers_agrees(tok, tiny_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)
    texts = ["Hello world", "  leading spaces and 12345", "emoji 😀 and 東京 ✨", "",
             render_prompt("What is 17 + 4?") + render_completion("17 + 4 = 21", "21")]
    for text in texts:
        ids = tok.encode(text)
        assert hf(text)["input_ids"] == ids, text
        assert hf.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)
        assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi 42"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(messages)
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "<｜begin▁of▁sentence｜>S<｜User｜>Hi 42<｜Assistant｜><think>\n"
    # tools, calls and results: transformers' own sandbox renders the same text
    tools = [{"type": "function", "function": {"name": "f", "description": "d é", "parameters": {"type": "object"}}}]
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": "é"}}}]}
    with_tools = messages + [call, {"role": "tool", "content": "r"}]
    assert hf.apply_chat_template(with_tools, tools=tools, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(with_tools, tools=tools)


def test_shipped_model_has_the_project_template():
    from cli.common import DEFAULT_MODEL_DIR

    cfg = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["chat_template"] == CHAT_TEMPLATE


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_reassembles(tok, skip):
    ids = ([1] + tok.encode("Thinking 🤔 about 東京 and café ✨ 42!", add_special_tokens=False) + [3]
           + tok.encode("日本語😀", add_special_tokens=False) + [6, 2])
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # some ids really are partial characters
    stream = tok.stream_decoder(skip_special_tokens=skip)
    pieces = [stream.feed(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert stream.flush() == ""
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip) == stream.text


def test_incremental_detokenizer_holds_partial_character(tok):
    ids = tok.encode("a😀", add_special_tokens=False)
    assert len(ids) >= 3  # 'a' plus the emoji's 4 bytes in at least two tokens
    stream = tok.stream_decoder()
    assert stream.feed(ids[0]) == "a"
    assert [stream.feed(i) for i in ids[1:-1]] == [""] * (len(ids) - 2)
    assert stream.flush() == "\ufffd"  # the ids stop mid-character: same as decode
    assert stream.text == tok.decode(ids[:-1])


def _word_level_dir(path: Path, generation_eos) -> Path:
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<s>", "</s>"])
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


def test_tokenizer_without_think_tokens(tmp_path):
    tok = Tokenizer.from_dir(_word_level_dir(tmp_path / "w", [2, 4]))
    assert tok.think_token_ids() is None
    assert tok.encode("hello world </s>") == [1, 3, 4, 2]
    assert tok.eos_token_ids == [2, 4]
    assert tok.pad_token_id is None
    assert Tokenizer.from_dir(_word_level_dir(tmp_path / "v", 4)).eos_token_ids == [2, 4]


def test_think_ids_found(tok):
    assert tok.think_token_ids() == (5, 6)


def test_errors(tmp_path, tiny_dir):
    with pytest.raises(ValueError, match=r"tokenizer\.json not found in .*nowhere"):
        Tokenizer.from_dir(tmp_path / "nowhere")
    bad = _variant(tiny_dir, tmp_path / "bad", bos_token="<not-a-token>")
    with pytest.raises(ValueError, match="not in its tokenizer.json vocabulary"):
        Tokenizer.from_dir(bad)
    with pytest.raises(ValueError, match="vocab_size=100 is too small"):
        train_bpe_tokenizer(["abc"], 100)


def test_template_constant_is_what_the_builder_writes(tiny_dir):
    cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert (cfg["add_bos_token"], cfg["add_eos_token"], cfg["tokenizer_class"]) == \
        (True, False, "PreTrainedTokenizerFast")

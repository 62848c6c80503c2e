"""The tokenizer over HTTP, as vLLM serves it: POST /tokenize, POST /detokenize, GET /tokenizer_info.

    POST /tokenize    {"prompt": text, "add_special_tokens": true}                        text -> ids
                      {"messages": [...], "add_generation_prompt": true, "tools": [...],
                       "continue_final_message": false, "add_special_tokens": false}      the chat template -> ids
                      -> {"count", "max_model_len", "tokens", "token_strs"} (token_strs with "return_token_strs": true:
                         each id's vocabulary entry)
    POST /detokenize  {"tokens": [ids]} -> {"prompt": text} (special tokens kept, as transformers' decode does)
    GET /tokenizer_info  the tokenizer's settings: its special tokens, add_bos_token, the chat template, ...

`model` may be sent (another one is a 404). The chat form renders exactly what POST /v1/chat/completions would
(developer as system, tools and tool calls as tools.py puts them). lm-evaluation-harness's `tokenizer_backend=auto`
(and `remote`) uses /tokenizer_info (it needs `eos_token`), /tokenize and /detokenize to work with the server's own
tokenizer.
"""
from __future__ import annotations

from typing import Any, Optional

from pydantic import Field

from mtp_core.serve.parse import parse_json, validate_body
from mtp_core.serve.protocol import APIError, Message, _Strict, short_repr
from mtp_core.serve.state import ServerState
from mtp_core.serve.tools import check_history, template_messages, with_tools


class TokenizeText(_Strict):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Strict):
    model: Optional[str] = None
    messages: list[Message] = Field(min_length=1)
    tools: Optional[list[Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False             # the template writes the BOS
    return_token_strs: bool = False


class Detokenize(_Strict):
    model: Optional[str] = None
    tokens: list[int]


def _check_model(state: ServerState, model: Optional[str]) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f"the model {short_repr(model)} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found")


async def tokenize(state: ServerState, raw: bytes) -> dict:
    data = parse_json(raw)
    chat = "messages" in data
    req = validate_body(data, TokenizeChat if chat else TokenizeText)
    _check_model(state, req.model)
    if chat:
        if req.add_generation_prompt and req.continue_final_message:
            raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true; send one",
                           param="continue_final_message")
        template = f"the chat template of {state.model_name}"
        caps = state.prompts.template_tools
        messages = template_messages(req.messages)
        check_history(messages, caps, template)
        messages, tools = with_tools(messages, list(req.tools), caps) if req.tools else (messages, None)
        size = sum(len(m["content"] or "") for m in messages)

        def work() -> list[int]:
            text = state.prompts.render_chat(messages, tools, req.add_generation_prompt, req.continue_final_message)
            return state.tokenizer.encode_released(text, add_special_tokens=req.add_special_tokens)
        try:
            ids = await state.prompts.run(work, size)
        except ValueError as e:
            raise APIError(400, str(e).splitlines()[0], param="messages") from None
    else:
        ids = await state.prompts.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = None
    if req.return_token_strs:
        backend = state.tokenizer._tok
        strs = [backend.id_to_token(i) for i in ids]
    return {"count": len(ids), "max_model_len": state.max_seq_len, "tokens": ids, "token_strs": strs}


async def detokenize(state: ServerState, raw: bytes) -> dict:
    req = validate_body(parse_json(raw), Detokenize)
    _check_model(state, req.model)
    vocab = state.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {short_repr(bad)} is outside the vocabulary [0, {vocab}); send valid ids",
                       param="tokens")
    text = await state.prompts.run(lambda: state.tokenizer.decode(req.tokens, skip_special_tokens=False),
                                   len(req.tokens))
    return {"prompt": text}


def tokenizer_info(state: ServerState) -> dict:
    tok = state.tokenizer
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "pad_token": tok.pad_token, "add_bos_token": tok.add_bos_token, "add_eos_token": tok.add_eos_token,
            "bos_token_id": tok.bos_token_id, "eos_token_ids": tok.eos_token_ids, "vocab_size": tok.vocab_size,
            "model_max_length": state.max_seq_len, "chat_template": tok.chat_template}

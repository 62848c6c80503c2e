"""Request bodies of the OpenAI API, strictly validated, and OpenAI error objects.

Bodies are parsed (parse.py) with pydantic in strict mode (`"5"` is not an integer, `5.0` is not an integer;
an integer is a valid float). Every field of OpenAI's API reference for the two endpoints is accepted; a field no API
defines is a 400 that names it. Fields that ask for something this server cannot do (audio, `suffix`, ...) are
accepted at their neutral value only; any other value is a 400 that says what to send instead (code
unsupported_value). Tools and tool_choice are checked in tools.py, which knows the chat template. Fields with no
meaning here (`user`, `store`, `metadata`, `service_tier`, `reasoning_effort`, ...) are accepted and ignored
(docs/serving.md lists them). Extensions (vLLM's names): `top_k`, `min_p`, `repetition_penalty`, `min_tokens`,
`stop_token_ids`, `include_stop_str_in_output`, `ignore_eos`.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


# the code of a 4xx raised without one
DEFAULT_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                 413: "request_too_large"}
# fields whose other values ask for what this server does not do: their 400s have the code unsupported_value
NOT_IMPLEMENTED = frozenset({"suffix", "functions", "function_call", "audio", "modalities", "prediction",
                             "web_search_options"})


class APIError(Exception):
    """An error answered with an OpenAI-style error object: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or DEFAULT_CODES.get(status)     # every 4xx has a code (the reason /metrics counts it by)

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
                503: "service_unavailable"}.get(self.status, "server_error" if self.status >= 500
                                                 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


SEED_MIN, SEED_MAX = -2 ** 63, 2 ** 64 - 1      # what torch.Generator.manual_seed takes
MAX_STOP_STRINGS = 64                           # each one is searched for after every engine step


def short_repr(v: Any, n: int = 60) -> str:
    """A value for an error message: its repr, cut to n characters."""
    r = repr(v)
    return r if len(r) <= n else r[:n - 3] + "..."


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: Optional[bool] = None     # ignored (no obfuscation padding is sent)


MAX_N = 128                                     # choices per prompt (n, best_of)
MAX_CHOICES = 256                               # choices per request (prompts x best_of)
MAX_LOGPROBS = 20


class _Common(_Strict):
    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None                  # extension (vLLM, SGLang, TensorRT-LLM)
    min_p: Optional[float] = None                # extension
    n: int = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None   # extension
    include_stop_str_in_output: bool = False     # extension
    seed: Optional[int] = None
    ignore_eos: bool = False                     # extension
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None   # extension
    min_tokens: Optional[int] = None             # extension
    logit_bias: Optional[dict[str, Union[int, float]]] = None
    structured_outputs: Optional[dict[str, Any]] = None   # extension (vLLM's): {"json" | "regex" | "choice": ...}
    user: Optional[str] = None                   # ignored

    def unsupported(self) -> Optional[tuple[str, str]]:
        """(param, message) for a field set to a value this server cannot honour."""
        if not 1 <= self.n <= MAX_N:
            return "n", f"n must be in [1, {MAX_N}], got {short_repr(self.n)}"
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            return "seed", f"seed must be an integer in [-2^63, 2^64 - 1], got {short_repr(self.seed)}"
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            return "stop", f"stop holds {len(stops)} strings; send at most {MAX_STOP_STRINGS}"
        if self.stop_token_ids is not None and len(self.stop_token_ids) > 1024:
            return "stop_token_ids", f"stop_token_ids holds {len(self.stop_token_ids)} ids; send at most 1024"
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v is not None and not -2.0 <= v <= 2.0:
                return name, f"{name} must be in [-2, 2], got {short_repr(v)}"
        if self.repetition_penalty is not None and not 0 < self.repetition_penalty <= 100:
            return "repetition_penalty", f"repetition_penalty must be in (0, 100], got {short_repr(self.repetition_penalty)}"
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            return "min_p", f"min_p must be in [0, 1], got {short_repr(self.min_p)}"
        if self.min_tokens is not None and self.min_tokens < 0:
            return "min_tokens", f"min_tokens must be >= 0, got {short_repr(self.min_tokens)}"
        if self.logit_bias:
            if len(self.logit_bias) > 1024:
                return "logit_bias", f"logit_bias holds {len(self.logit_bias)} entries; send at most 1024"
            for k, v in self.logit_bias.items():
                if not k.isdigit():
                    return "logit_bias", f"logit_bias keys must be token ids, got {short_repr(k)}"
                if not -100 <= v <= 100:
                    return "logit_bias", f"logit_bias values must be in [-100, 100], got {short_repr(v)} for {short_repr(k)}"
        return None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        base = super().unsupported()
        if base:
            return base
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return "logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {short_repr(self.logprobs)}"
        if self.best_of is not None:
            if not 1 <= self.best_of <= MAX_N:
                return "best_of", f"best_of must be in [1, {MAX_N}], got {short_repr(self.best_of)}"
            if self.best_of < self.n:
                return "best_of", f"best_of ({self.best_of}) must be >= n ({self.n})"
            if self.stream and self.best_of > 1:
                return "best_of", "best_of > 1 cannot be streamed; send stream: false or best_of: 1"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported; omit it"
        return None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str                                # a JSON string, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def plain(self) -> dict:
        return {"id": self.id, "type": self.type,
                "function": {"name": self.function.name, "arguments": self.function.arguments}}


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")   # e.g. refusal, audio: null from some clients
    role: str
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None   # an assistant's calls (rendered by the chat template)
    tool_call_id: Optional[str] = None            # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None   # tool_choice required: false = exactly one call
    functions: Optional[list[Any]] = None        # deprecated by OpenAI for tools
    function_call: Optional[Union[str, dict[str, Any]]] = None
    response_format: Optional[dict[str, Any]] = None
    audio: Optional[dict[str, Any]] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    # accepted and ignored: nothing here depends on them
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None

    def unsupported(self) -> Optional[tuple[str, str]]:
        base = super().unsupported()
        if base:
            return base
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                return "top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {short_repr(self.top_logprobs)}"
            if not self.logprobs:
                return "top_logprobs", "top_logprobs needs logprobs: true"
        if self.functions:
            return "functions", "functions (deprecated) are not supported; send tools"
        if self.function_call not in (None, "none", "auto"):
            return "function_call", "function_call is not supported; omit it"
        if self.audio is not None:
            return "audio", "audio output is not supported; omit audio"
        if self.modalities not in (None, ["text"]):
            return "modalities", 'only modalities ["text"] is supported; omit it'
        if self.prediction is not None:
            return "prediction", "predicted outputs are not supported; omit prediction"
        if self.web_search_options is not None:
            return "web_search_options", "web search is not supported; omit web_search_options"
        for name, allowed in (("service_tier", ("auto", "default", "flex", "scale", "priority")),
                              ("reasoning_effort", ("none", "minimal", "low", "medium", "high")),
                              ("verbosity", ("low", "medium", "high"))):
            v = getattr(self, name)
            if v is not None and v not in allowed:
                return name, f"{name} must be one of {', '.join(allowed)}, got {short_repr(v)}"
        return None

    def guided(self) -> Optional[tuple[str, str]]:
        """response_format (OpenAI's) or structured_outputs (the extension) as SamplingParams.guided;
        APIError(400) for a malformed one."""
        rf = self.response_format
        if rf is not None and rf.get("type") not in (None, "text"):
            if self.structured_outputs:
                raise APIError(400, "send response_format or structured_outputs, not both", param="response_format")
            kind = rf.get("type")
            if kind == "json_object":
                return "json_object", ""
            if kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON Schema object",
                                   param="response_format.json_schema")
                return "json_schema", json.dumps(schema)
            raise APIError(400, f"response_format type {short_repr(kind)} is not supported; use text, json_object or "
                                "json_schema", param="response_format.type", code="unsupported_value")
        return structured(self.structured_outputs)


def structured(so: Optional[dict[str, Any]]) -> Optional[tuple[str, str]]:
    """The structured_outputs extension: exactly one of json (a schema object, or a string of one), regex (a
    string), choice (a non-empty list of strings)."""
    if not so:
        return None
    keys = [k for k in ("json", "regex", "choice") if so.get(k) is not None]
    extra = [k for k in so if k not in ("json", "regex", "choice")]
    if extra:
        raise APIError(400, f"structured_outputs.{extra[0]} is not supported; use json, regex or choice",
                       param=f"structured_outputs.{extra[0]}", code="unsupported_value")
    if len(keys) != 1:
        raise APIError(400, "structured_outputs needs exactly one of json, regex, choice", param="structured_outputs")
    k, v = keys[0], so[keys[0]]
    if k == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                raise APIError(400, "structured_outputs.json is not valid JSON", param="structured_outputs.json") \
                    from None
        if not isinstance(v, dict):
            raise APIError(400, "structured_outputs.json must be a JSON Schema object", param="structured_outputs.json")
        return "json_schema", json.dumps(v)
    if k == "regex":
        if not isinstance(v, str) or not v:
            raise APIError(400, "structured_outputs.regex must be a non-empty string", param="structured_outputs.regex")
        return "regex", v
    if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
        raise APIError(400, "structured_outputs.choice must be a non-empty list of non-empty strings",
                       param="structured_outputs.choice")
    return "choice", json.dumps(v)

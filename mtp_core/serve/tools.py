"""Tools in a chat request: what the chat template does with them, how the request is rendered and answered.

What a template can do is found once, by rendering three probe conversations (`TemplateTools.probe`): does it
render the `tools` list, an assistant's `tool_calls` (and in DeepSeek-V3's markup, V3/R1's `function<sep>NAME` or
V3.1's `NAME<sep>ARGS`), `tool` messages. Then, per request (`plan_tools`):

    tool_choice        template with DeepSeek markup                        any other template
    none, no tools     tools not rendered; the output is text               the same
    auto               tools rendered; the output parsed (tool_parser.py)   400 (no parser for its format)
    required           tools rendered; the grammar makes 1 to               the grammar makes a JSON list of
                       MAX_PARALLEL_TOOL_CALLS calls in the markup          {"name", "parameters"} (vLLM's)
                       (parallel_tool_calls false: 1), then the end
    named function     tools rendered; the grammar makes that one call      the grammar makes its arguments object

"Rendered" is the template's own rendering of `tools` where it has one; a DeepSeek template that renders calls but
not the tool list (DeepSeek-V3's and R1's own templates) gets the list as system text in the markup it parses
(`## Tools`, chat_format.TOOLS_INSTRUCTIONS, one JSON object per function), appended to the last system message.
History: an assistant's `tool_calls` and `tool` messages go to the template as OpenAI sends them (arguments a JSON
string); a template that would drop them is a 400, never a prompt without the model's own calls.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from mtp_core.chat_format import TOOL_CALL_BEGIN, TOOL_SEP, TOOLS_INSTRUCTIONS
from mtp_core.serve.protocol import APIError, ChatCompletionRequest, Message, short_repr

MAX_PARALLEL_TOOL_CALLS = 4      # tool_choice required, parallel_tool_calls unset or true: at most this many calls
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_PROBE = "mtp_probe_fn"
_PROBE_ARG = "mtp_probe_arg"
_PROBE_RESULT = "mtp_probe_result"


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template does with tools (found by rendering, never by reading its source)."""
    renders_definitions: bool = False     # the `tools` list appears in the prompt
    renders_calls: bool = False           # an assistant's tool_calls appear in the prompt
    renders_results: bool = False         # a tool message's content appears in the prompt
    call_format: Optional[str] = None     # "deepseek-v3" (V3, R1) | "deepseek-v3.1": the markup of the calls

    @classmethod
    def probe(cls, tokenizer: Any) -> "TemplateTools":
        if getattr(tokenizer, "chat_template", None) is None:
            return cls()
        user = {"role": "user", "content": "u"}
        call = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_probe", "type": "function",
             "function": {"name": _PROBE, "arguments": json.dumps({_PROBE_ARG: 1})}}]}
        result = {"role": "tool", "tool_call_id": "call_probe", "content": _PROBE_RESULT}
        tool = {"type": "function", "function": {"name": _PROBE, "description": "d",
                                                 "parameters": {"type": "object", "properties": {}}}}

        def render(messages: list[dict], **kw: Any) -> str:
            try:
                return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kw)
            except Exception:  # noqa: BLE001 - a template that cannot render this conversation
                return ""

        defs = render([user], tools=[tool])
        calls = render([user, call])
        results = render([user, call, result])
        renders_calls = _PROBE in calls and _PROBE_ARG in calls
        fmt = None
        if renders_calls and TOOL_CALL_BEGIN + "function" + TOOL_SEP + _PROBE in calls:
            fmt = "deepseek-v3"
        elif renders_calls and TOOL_CALL_BEGIN + _PROBE + TOOL_SEP in calls:
            fmt = "deepseek-v3.1"
        return cls(_PROBE in defs, renders_calls, _PROBE_RESULT in results, fmt)


@dataclass(frozen=True)
class ToolMode:
    """How a choice's output is read."""
    choice: str                    # "auto" | "required" | "named"
    markup: bool                   # DeepSeek markup, parsed as it streams; else the JSON of the grammar (forced)
    name: Optional[str] = None     # named: the function


@dataclass
class ToolPlan:
    messages: list[dict]                     # for the template
    tools: Optional[list[dict]] = None       # passed to the template as `tools`
    mode: Optional[ToolMode] = None
    guided: Optional[tuple[str, str]] = None  # the grammar of a forced call


def template_messages(messages: list[Message]) -> list[dict]:
    """A request's messages as the template takes them: developer is system; an assistant's tool_calls and a tool
    message's tool_call_id are passed on (OpenAI's shapes)."""
    out = []
    for i, m in enumerate(messages):
        if m.role == "function":
            raise APIError(400, f"messages[{i}] has role function (deprecated by OpenAI); send role tool with "
                                "tool_call_id", param=f"messages[{i}].role", code="invalid_value")
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, f"messages[{i}] has tool_calls but role {short_repr(m.role)}; only assistant "
                                    "messages carry tool_calls", param=f"messages[{i}].tool_calls",
                               code="invalid_value")
            d["tool_calls"] = [c.plain() for c in m.tool_calls]
            if not d["content"]:
                d["content"] = None        # R1's own template renders the calls only of a message whose content is null
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def plan_tools(req: ChatCompletionRequest, caps: TemplateTools, template: str) -> ToolPlan:
    """What the template is given and how the output is read, for this request's tools and tool_choice. `template`
    names the chat template in error messages."""
    messages = template_messages(req.messages)
    check_history(messages, caps, template)
    fns = _functions(req)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if fns else "none")
    if choice == "none":
        return ToolPlan(messages)
    if not fns:
        raise APIError(400, "tool_choice needs tools; send tools or omit tool_choice", param="tool_choice",
                       code="invalid_value")
    fmt = caps.call_format
    if choice != "auto":
        other = "response_format" if req.response_format is not None and req.response_format.get("type") not in (
            None, "text") else "structured_outputs" if req.structured_outputs else None
        if other:
            raise APIError(400, f"send {other} or a forced tool_choice, not both (both are grammars for the output)",
                           param=other, code="invalid_value")
    if choice == "auto":
        if fmt is None:
            raise APIError(400, f"tool_choice auto needs a chat template that writes tool calls in DeepSeek-V3's "
                                f"markup, the format this server parses; {template} does not; send tool_choice "
                                "required or a named function", param="tool_choice", code="unsupported_value")
        return _with_tools(messages, req, caps, ToolMode("auto", True))
    if choice == "required":
        most = 1 if req.parallel_tool_calls is False else MAX_PARALLEL_TOOL_CALLS
        if fmt is not None:
            spec = {"format": fmt, "tools": [[n, p] for n, p in fns.items()], "min": 1, "max": most}
            return _with_tools(messages, req, caps, ToolMode("required", True), ("tool_calls", json.dumps(spec)))
        calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                            "required": ["name", "parameters"], "additionalProperties": False}
                           for n, p in fns.items()]}
        schema = {"type": "array", "items": calls, "minItems": 1, "maxItems": most}
        return _with_tools(messages, req, caps, ToolMode("required", False), ("json_schema", json.dumps(schema)))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in fns:
        raise APIError(400, f"tool_choice must be none, auto, required or {{type: function, function: {{name}}}} "
                            f"naming one of the tools ({', '.join(fns)}), got {short_repr(choice)}",
                       param="tool_choice", code="invalid_value")
    if fmt is not None:
        spec = {"format": fmt, "tools": [[name, fns[name]]], "min": 1, "max": 1}
        return _with_tools(messages, req, caps, ToolMode("named", True, name), ("tool_calls", json.dumps(spec)))
    return _with_tools(messages, req, caps, ToolMode("named", False, name), ("json_schema", json.dumps(fns[name])))


def tools_text(tools: list[dict]) -> str:
    """The tool list as system text, for a DeepSeek template that does not render `tools` itself."""
    return "## Tools\n" + TOOLS_INSTRUCTIONS + "".join(
        "\n" + json.dumps(t["function"], ensure_ascii=False) for t in tools)


def with_tools(messages: list[dict], tools: list[dict], caps: TemplateTools) -> tuple[list[dict], Optional[list]]:
    """(messages, the template's `tools`) that put the tool list in the prompt: the template's own rendering, or the
    system text for a DeepSeek template without one; a template with neither gets no list."""
    if caps.renders_definitions:
        return messages, tools
    if caps.call_format is None:
        return messages, None
    text = tools_text(tools)                 # the template writes the markup but not the list: add it as system text
    last = max((i for i, m in enumerate(messages) if m["role"] == "system"), default=None)
    if last is None:
        return [{"role": "system", "content": text}] + messages, None
    messages = [dict(m) for m in messages]
    messages[last]["content"] = (messages[last]["content"] + "\n\n" + text).lstrip("\n")
    return messages, None


def _with_tools(messages: list[dict], req: ChatCompletionRequest, caps: TemplateTools, mode: ToolMode,
                guided: Optional[tuple[str, str]] = None) -> ToolPlan:
    messages, tools = with_tools(messages, list(req.tools or []), caps)
    return ToolPlan(messages, tools, mode, guided)


def check_history(messages: list[dict], caps: TemplateTools, template: str) -> None:
    """A 400 for an assistant's tool_calls or a tool message the template would not render."""
    for i, m in enumerate(messages):
        if m.get("tool_calls") and not caps.renders_calls:
            raise APIError(400, f"messages[{i}] has tool_calls, which {template} does not render (the model would not "
                                "see the calls it made); send them as text in content",
                           param=f"messages[{i}].tool_calls", code="unsupported_value")
        if m["role"] == "tool" and not caps.renders_results:
            raise APIError(400, f"messages[{i}] has role tool, which {template} does not render; send the tool's "
                                "result as a user message", param=f"messages[{i}].role", code="unsupported_value")


def _functions(req: ChatCompletionRequest) -> dict[str, dict]:
    """name -> parameters schema of every tool, checked."""
    fns: dict[str, dict] = {}
    for i, t in enumerate(req.tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(name, str) \
                or not _NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}] must be {{type: function, function: {{name, parameters}}}} with a name of "
                                "1-64 letters, digits, _ . -", param=f"tools[{i}]", code="invalid_value")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object",
                           param=f"tools[{i}].function.parameters", code="invalid_value")
        if name in fns:
            raise APIError(400, f"tools[{i}] repeats the name {name!r}; give each function its own name",
                           param=f"tools[{i}].function.name", code="invalid_value")
        fns[name] = params
    return fns

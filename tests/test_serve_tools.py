"""Tool calling through `mtp serve` (mtp_core/serve/tools.py, tool_parser.py): what each kind of chat template gets,
the agent round trip on the shipped model with the `openai` client and LangChain (MTP K=3 and no MTP give the same
text and calls), the bound on `required` calls, templates without DeepSeek markup or without a tool list, and the
tokenizer routes (/tokenize, /detokenize, /tokenizer_info) as lm-evaluation-harness uses them.

The shipped model was not trained to call tools, so where a test needs the model to write markup under
tool_choice auto, a regex grammar (structured_outputs) makes it write it: the model still picks every token the
grammar allows (the city, the order), and the real parser reads the real stream.
"""
from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from cli.common import DEFAULT_MODEL_DIR
from conftest import llm_config
from mtp_core.chat_format import TOOLS_INSTRUCTIONS, tool_call_text
from mtp_core.llm import LLM
from mtp_core.serve.app import build_app
from mtp_core.serve.protocol import APIError, ChatCompletionRequest
from mtp_core.serve.server import server_in_thread
from mtp_core.serve.tools import MAX_PARALLEL_TOOL_CALLS, TemplateTools, plan_tools
from mtp_core.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]


def _rx(text: str) -> str:
    return re.sub(r"([.{}()\[\]|*+?^$\\])", r"\\\1", text)


# tool_choice auto, the model made to write: a sentence, then two calls in DeepSeek-V3's markup, choosing the city
# and the zone itself
MARKUP = ("(Checking|Looking it up)\\.<｜tool▁calls▁begin｜>"
          + _rx(tool_call_text("get_weather", '{"city": "@"}')).replace("@", "(Paris|Oslo|Lima)") + "\n"
          + _rx(tool_call_text("get_time", '{"zone": "@"}')).replace("@", "(UTC|CET)") + "<｜tool▁calls▁end｜>")

# templates written for these tests: one without tools, DeepSeek-V3-like (calls and results in the markup, no tool
# list, the reply after tool results without an Assistant tag) and DeepSeek-V3.1-like (NAME<sep>ARGS)
NO_TOOLS = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
            "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}{{ eos_token }}"
            "{% elif m['role'] == 'system' %}{{ m['content'] }}"
            "{% else %}{{ raise_exception('unsupported chat role ' + m['role']) }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")


def _deepseek_like(call: str, sep: str) -> str:
    return ("{{ bos_token }}{% set ns = namespace(out=false) %}{% for m in messages %}"
            "{% if m['role'] == 'system' %}{{ m['content'] }}"
            "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
            "{% elif m['role'] == 'assistant' %}"
            "{% if ns.out %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.out = false %}{% else %}{{ '<｜Assistant｜>' }}"
            "{% endif %}{{ m['content'] or '' }}{% if m['tool_calls'] %}{{ '<｜tool▁calls▁begin｜>' }}"
            "{% for c in m['tool_calls'] %}{{ ('' if loop.first else '" + sep + "') + " + call + " }}{% endfor %}"
            "{{ '<｜tool▁calls▁end｜>' }}{% endif %}{{ eos_token }}"
            "{% elif m['role'] == 'tool' %}{{ ('' if ns.out else '<｜tool▁outputs▁begin｜>') + '<｜tool▁output▁begin｜>'"
            " + m['content'] + '<｜tool▁output▁end｜>' }}{% set ns.out = true %}{% endif %}{% endfor %}"
            "{% if ns.out %}{{ '<｜tool▁outputs▁end｜>' }}{% elif add_generation_prompt %}{{ '<｜Assistant｜>' }}"
            "{% endif %}")


V3_LIKE = _deepseek_like("'<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + c['function']['name'] + '\\\\n```json\\\\n' + "
                         "c['function']['arguments'] + '\\\\n```<｜tool▁call▁end｜>'", "\\\\n")
V31_LIKE = _deepseek_like("'<｜tool▁call▁begin｜>' + c['function']['name'] + '<｜tool▁sep｜>' + "
                          "c['function']['arguments'] + '<｜tool▁call▁end｜>'", "")
JSON_DUMP = "{% for m in messages %}{{ m | tojson }}{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"


def _with_template(src: Path, dst: Path, template: str) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False), encoding="utf-8")
    return dst


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


# ---- what a template does with tools, and what each tool_choice becomes ----------------------------------

@pytest.fixture(scope="module")
def templates(tiny1_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    return {"shipped": DEFAULT_MODEL_DIR, "none": _with_template(tiny1_dir, root / "none", NO_TOOLS),
            "v3": _with_template(tiny1_dir, root / "v3", V3_LIKE), "v31": _with_template(tiny1_dir, root / "v31", V31_LIKE),
            "json": _with_template(tiny1_dir, root / "json", JSON_DUMP)}


def test_template_probe(templates) -> None:
    got = {k: TemplateTools.probe(Tokenizer.from_dir(d)) for k, d in templates.items()}
    assert got == {"shipped": TemplateTools(True, True, True, "deepseek-v3"),
                   "none": TemplateTools(False, False, False, None),
                   "v3": TemplateTools(False, True, True, "deepseek-v3"),
                   "v31": TemplateTools(False, True, True, "deepseek-v3.1"),
                   "json": TemplateTools(True, True, True, None)}


def _plan(caps: TemplateTools, **body):
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "system", "content": "S"}] + QUESTION,
                                                **body})
    return plan_tools(req, caps, "T")


SHIPPED = TemplateTools(True, True, True, "deepseek-v3")
V3 = TemplateTools(False, True, True, "deepseek-v3")
NONE = TemplateTools()
JSON = TemplateTools(True, True, True, None)
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("caps,body,mode,grammar,tools_passed,injected", [
    (SHIPPED, {}, None, None, False, False),
    (SHIPPED, {"tools": TOOLS, "tool_choice": "none"}, None, None, False, False),
    (SHIPPED, {"tools": TOOLS}, ("auto", True, None), None, True, False),
    (SHIPPED, {"tools": TOOLS, "tool_choice": "required"}, ("required", True, None),
     ("tool_calls", {"format": "deepseek-v3", "tools": [["get_weather", WEATHER["function"]["parameters"]],
                                                        ["get_time", TIME["function"]["parameters"]]],
                     "min": 1, "max": MAX_PARALLEL_TOOL_CALLS}), True, False),
    (SHIPPED, {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, ("required", True, None),
     ("tool_calls", {"format": "deepseek-v3", "tools": [["get_weather", WEATHER["function"]["parameters"]],
                                                        ["get_time", TIME["function"]["parameters"]]],
                     "min": 1, "max": 1}), True, False),
    (SHIPPED, {"tools": TOOLS, "tool_choice": NAMED}, ("named", True, "get_time"),
     ("tool_calls", {"format": "deepseek-v3", "tools": [["get_time", TIME["function"]["parameters"]]], "min": 1,
                     "max": 1}), True, False),
    (V3, {"tools": TOOLS}, ("auto", True, None), None, False, True),
    (V3, {"tools": TOOLS, "tool_choice": NAMED}, ("named", True, "get_time"),
     ("tool_calls", {"format": "deepseek-v3", "tools": [["get_time", TIME["function"]["parameters"]]], "min": 1,
                     "max": 1}), False, True),
    (NONE, {"tools": TOOLS, "tool_choice": NAMED}, ("named", False, "get_time"),
     ("json_schema", TIME["function"]["parameters"]), False, False),
    (NONE, {"tools": [TIME], "tool_choice": "required"}, ("required", False, None),
     ("json_schema", {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {
         "name": {"const": "get_time"}, "parameters": TIME["function"]["parameters"]},
         "required": ["name", "parameters"], "additionalProperties": False}]}, "minItems": 1,
         "maxItems": MAX_PARALLEL_TOOL_CALLS}), False, False),
    (JSON, {"tools": [TIME], "tool_choice": NAMED}, ("named", False, "get_time"),
     ("json_schema", TIME["function"]["parameters"]), True, False),
], ids=["no tools", "none", "auto", "required", "required, not parallel", "named", "v3: auto", "v3: named",
        "no markup: named", "no markup: required", "json template: named"])
def test_plan_per_template_and_tool_choice(caps, body, mode, grammar, tools_passed, injected) -> None:
    plan = _plan(caps, **body)
    assert (None if plan.mode is None else (plan.mode.choice, plan.mode.markup, plan.mode.name)) == mode
    assert (None if plan.guided is None else (plan.guided[0], json.loads(plan.guided[1]))) == grammar
    assert plan.tools == (body["tools"] if tools_passed else None)
    system = plan.messages[0]["content"]
    if injected:       # the list as system text after the request's own, in the markup the parser reads
        assert system == "S\n\n## Tools\n" + TOOLS_INSTRUCTIONS + "".join(
            "\n" + json.dumps(t["function"]) for t in body["tools"])
    else:
        assert system == "S"


@pytest.mark.parametrize("caps,body,param,needle", [
    (NONE, {"tools": TOOLS}, "tool_choice", "tool_choice auto needs a chat template that writes tool calls in "
                                            "DeepSeek-V3's markup"),
    (JSON, {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "T does not"),
    (SHIPPED, {"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    (SHIPPED, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "naming one of the tools (get_weather, get_time)"),
    (SHIPPED, {"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "repeats the name"),
    (SHIPPED, {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "not both"),
    (SHIPPED, {"tools": TOOLS, "tool_choice": NAMED, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
])
def test_plan_errors(caps, body, param, needle) -> None:
    with pytest.raises(APIError) as e:
        _plan(caps, **body)
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message, e.value.message


def test_history_a_template_would_drop_is_refused() -> None:
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}
    for messages, param in (([*QUESTION, call], "messages[1].tool_calls"),
                            ([*QUESTION, {"role": "tool", "tool_call_id": "c1", "content": "12:00"}], "messages[1].role")):
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
        with pytest.raises(APIError) as e:
            plan_tools(req, NONE, "the chat template of m")
        assert e.value.param == param and "the chat template of m does not render" in e.value.message
        plan_tools(req, SHIPPED, "-")                 # the shipped template renders both


# ---- the agent round trip on the shipped model ----------------------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    kw = dict(max_seq_len=1024, max_batch_size=4, max_tokens_kv=16384, tokens_per_block=16)
    apps = {"plain": build_app(LLM(llm_config(DEFAULT_MODEL_DIR, 0, **kw)), "tiny-r1"),
            "mtp": build_app(LLM(llm_config(DEFAULT_MODEL_DIR, 3, **kw)), "tiny-r1")}
    with server_in_thread(apps["plain"]) as a, server_in_thread(apps["mtp"]) as b:
        yield {"plain": a, "mtp": b}


def _streamed(c: openai.OpenAI, **kw) -> tuple[str, list[tuple[str, str]], list[str], str]:
    """(content, [(name, arguments)], ids, finish reason) assembled from a stream's deltas."""
    content, calls, reasons = "", {}, []
    for ev in c.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            content += ch.delta.content or ""
            reasons += [ch.finish_reason] if ch.finish_reason else []
            for tc in ch.delta.tool_calls or []:
                if tc.id:
                    assert tc.index not in calls and tc.function.name, "a call's first delta has its id and name"
                    calls[tc.index] = [tc.function.name, "", tc.id]
                calls[tc.index][1] += tc.function.arguments or ""
    assert len(reasons) == 1
    return content, [(calls[i][0], calls[i][1]) for i in sorted(calls)], [calls[i][2] for i in sorted(calls)], reasons[0]


def _round_trip(url: str) -> list:
    c = _client(url)
    out = []
    kw = dict(model="tiny-r1", messages=QUESTION, tools=TOOLS, max_tokens=400, temperature=0,
              extra_body={"structured_outputs": {"regex": MARKUP}})
    r = c.chat.completions.create(**kw)                 # tool_choice unset with tools: auto
    msg, ch = r.choices[0].message, r.choices[0]
    assert ch.finish_reason == "tool_calls" and msg.content in ("Checking.", "Looking it up."), ch
    calls = [(t.function.name, t.function.arguments) for t in msg.tool_calls]
    assert [n for n, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1])["city"] in ("Paris", "Oslo", "Lima") and json.loads(calls[1][1])["zone"] in ("UTC", "CET")
    assert len({t.id for t in msg.tool_calls}) == 2
    content, scalls, ids, reason = _streamed(c, **kw)
    assert (content, scalls, reason) == (msg.content, calls, "tool_calls") and len(set(ids)) == 2
    out += [msg.content, calls]
    # the results go back with the assistant's message: the template renders both, and the model answers
    results = [{"role": "tool", "tool_call_id": t.id, "content": f"result {i}"} for i, t in enumerate(msg.tool_calls)]
    history = [*QUESTION, msg.model_dump(exclude_none=True), *results]
    ids_ = httpx.post(url + "/tokenize", json={"messages": history, "tools": TOOLS}, timeout=60).json()["tokens"]
    prompt = httpx.post(url + "/detokenize", json={"tokens": ids_}, timeout=60).json()["prompt"]
    assert "<｜Assistant｜>" + msg.content + "<｜tool▁calls▁begin｜>" + tool_call_text(*calls[0]) + "\n" \
        + tool_call_text(*calls[1]) + "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜>" \
        "<｜tool▁output▁begin｜>result 0<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>result 1<｜tool▁output▁end｜>" \
        "<｜tool▁outputs▁end｜><｜Assistant｜><think>\n" in prompt
    r2 = c.chat.completions.create(model="tiny-r1", messages=history, tools=TOOLS, max_tokens=60, temperature=0)
    assert r2.usage.prompt_tokens == len(ids_)
    out += [r2.choices[0].message.content, r2.choices[0].message.tool_calls, r2.choices[0].finish_reason]
    # required: the grammar writes the calls in the markup, at most MAX_PARALLEL_TOOL_CALLS, then the turn ends
    r3 = c.chat.completions.create(model="tiny-r1", messages=QUESTION, tools=TOOLS, tool_choice="required",
                                   max_tokens=570, temperature=0)
    calls3 = [(t.function.name, json.loads(t.function.arguments)) for t in r3.choices[0].message.tool_calls]
    assert r3.choices[0].finish_reason == "tool_calls" and 1 <= len(calls3) <= MAX_PARALLEL_TOOL_CALLS
    assert r3.choices[0].message.content is None
    out.append(calls3)
    return out


def test_agent_round_trip_identical_with_and_without_mtp(shipped) -> None:
    got = {k: _round_trip(url) for k, url in shipped.items()}
    assert got["plain"] == got["mtp"]
    assert float(re.search(r"^mtp_spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$",
                           httpx.get(shipped["mtp"] + "/metrics").text, re.M).group(1)) > 0


def test_langchain_bind_tools_round_trip(shipped) -> None:
    """LangChain's bind_tools (tool_choice unset: auto) and tool_choice any (required), a ToolMessage with the result,
    the answer: the same messages with MTP as without."""
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    got = {}
    for which, url in shipped.items():
        llm = lc.ChatOpenAI(base_url=url + "/v1", api_key="unused", model="tiny-r1", temperature=0, max_tokens=300,
                            max_retries=0, timeout=120)
        history = [HumanMessage("What is the weather in Paris?")]
        auto = llm.bind_tools([get_weather]).invoke(history)        # the model answers in text (or calls)
        forced = llm.bind_tools([get_weather], tool_choice="any").invoke(history)
        assert forced.tool_calls and forced.tool_calls[0]["name"] == "get_weather"
        history += [forced, *[ToolMessage(get_weather.invoke(c["args"]), tool_call_id=c["id"])
                              for c in forced.tool_calls]]
        answer = llm.bind_tools([get_weather]).invoke(history)
        got[which] = [(m.content, [(c["name"], c["args"]) for c in m.tool_calls]) for m in (auto, forced, answer)]
    assert got["plain"] == got["mtp"]


# ---- other templates -----------------------------------------------------------------------------------

def test_templates_without_markup_or_without_a_tool_list(templates) -> None:
    """No tool support: auto, tool messages and an assistant's calls are 400s that name the template; a forced call
    still works (the JSON grammar). DeepSeek-like templates without a tool list: the list goes in as system text,
    and forced calls come out in their markup (V3 or V3.1) and parse."""
    with server_in_thread(build_app(LLM(llm_config(templates["none"], 0, max_seq_len=1024)), "tiny")) as url:
        c = _client(url)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, max_tokens=4)
        err = e.value.body
        assert (err["param"], err["code"]) == ("tool_choice", "unsupported_value")
        assert "the chat template of tiny does not" in err["message"]
        with pytest.raises(openai.BadRequestError, match="does not render"):
            c.chat.completions.create(model="tiny", max_tokens=4, messages=[
                *QUESTION, {"role": "tool", "tool_call_id": "c", "content": "r"}])
        r = c.chat.completions.create(model="tiny", messages=QUESTION, tools=[TIME], max_tokens=60, temperature=0,
                                      tool_choice="required", parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].function.name == "get_time"
    for kind in ("v3", "v31"):
        with server_in_thread(build_app(LLM(llm_config(templates[kind], 0, max_seq_len=1024)), "tiny")) as url:
            c = _client(url)
            ids = httpx.post(url + "/tokenize", json={"messages": QUESTION, "tools": TOOLS}).json()["tokens"]
            text = httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]
            assert "## Tools\n" + TOOLS_INSTRUCTIONS + "\n" + json.dumps(WEATHER["function"]) in text
            r = c.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, max_tokens=200, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
            call = r.choices[0].message.tool_calls[0]
            assert r.choices[0].finish_reason == "stop" and call.function.name == "get_weather"
            assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo", "Lima")
            auto = c.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS, max_tokens=8, temperature=0)
            assert auto.choices[0].finish_reason in ("stop", "length")


# ---- the tokenizer over HTTP -------------------------------------------------------------------------

def test_tokenize_detokenize_tokenizer_info(shipped) -> None:
    url = shipped["mtp"]
    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    assert r["token_strs"] == [tok._tok.id_to_token(i) for i in r["tokens"]]
    r = httpx.post(url + "/tokenize", json={"model": "tiny-r1", "prompt": "Hello", "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode("Hello", add_special_tokens=False) and r["token_strs"] is None
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "developer", "content": "S"}, *QUESTION]}).json()
    assert chat["tokens"] == tok.encode(tok.apply_chat_template([{"role": "system", "content": "S"}, *QUESTION]),
                                        add_special_tokens=False)
    cont = httpx.post(url + "/tokenize", json={"messages": [*QUESTION, {"role": "assistant", "content": "It is"}],
                                               "add_generation_prompt": False, "continue_final_message": True}).json()
    assert tok.decode(cont["tokens"], skip_special_tokens=False).endswith("<｜Assistant｜>It is")
    back = httpx.post(url + "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert back == tok.apply_chat_template([{"role": "system", "content": "S"}, *QUESTION])
    info = httpx.get(url + "/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["chat_template"]) == (tok.eos_token, tok.bos_token,
                                                                             tok.chat_template)
    for path, body, status, param in (("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
                                      ("/tokenize", {"prompt": 3}, 400, "prompt"),
                                      ("/tokenize", {"messages": QUESTION, "continue_final_message": True}, 400,
                                       "continue_final_message"),
                                      ("/detokenize", {"tokens": [1, 10 ** 6]}, 400, "tokens")):
        r = httpx.post(url + path, json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_lm_eval_harness_remote_tokenizer_probe(shipped) -> None:
    """What lm-evaluation-harness's `local-completions` does with tokenizer_backend=auto (0.4.13,
    check_remote_tokenizer_support and RemoteTokenizer): GET /tokenizer_info must hold eos_token, POST /tokenize
    {"prompt": "test", "add_special_tokens": false} a token list; the EOS and BOS ids come from tokenizing their
    text; decoding goes through /detokenize. All of it against the server's own tokenizer, nothing from a hub."""
    base = shipped["plain"] + "/v1/completions".replace("/v1/completions", "")
    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    info = httpx.get(base + "/tokenizer_info").json()
    assert isinstance(info, dict) and "eos_token" in info

    def encode(text: str) -> list[int]:
        r = httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        return r.json()["tokens"]

    assert isinstance(encode("test"), list)
    assert encode(info["eos_token"])[0] == tok.eos_token_ids[0] and encode(info["bos_token"])[0] == tok.bos_token_id
    ids = encode("Paris is in France")
    assert httpx.post(base + "/detokenize", json={"tokens": ids}).json()["prompt"] == "Paris is in France"


def test_structured_output_is_installed_with_the_package() -> None:
    """`pip install .` brings xgrammar (json_schema, structured_outputs and forced tool calls need it)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    requires = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "install_requires"))
    names = {re.split(r"[<>=!~\[;]", r)[0].strip().lower() for r in requires}
    assert {"xgrammar", "transformers"} <= names

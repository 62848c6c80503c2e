"""The project's chat format (DeepSeek-R1-like), fixed project-wide.

A prompt rendered for generation, and the assistant completion that follows it::

    <｜begin▁of▁sentence｜><｜User｜>{question}<｜Assistant｜><think>\\n
    {reasoning}\\n</think>\\n\\n{answer}<｜end▁of▁sentence｜>

`CHAT_TEMPLATE` is the same format as a Hugging Face-style Jinja template (variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, function `raise_exception`). System messages are
gathered and placed right after BOS, as DeepSeek-R1's template does; an assistant message renders as
`<｜Assistant｜>` + its content + EOS.

Tools, in DeepSeek-V3's markup (the markers are plain text to this project's tokenizers, which do not have them
as tokens; DeepSeek-V3's tokenizer has each one as a single token). Given `tools`, the template lists them after
the system text under `## Tools` (TOOLS_INSTRUCTIONS, then one JSON object per function). An assistant message
with `tool_calls` renders its calls; a run of `tool` messages renders their results::

    <｜Assistant｜>{content}<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```<｜tool▁call▁end｜>
    \n<｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>
    <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{result}<｜tool▁output▁end｜>\n<｜tool▁output▁begin｜>...<｜tool▁output▁end｜><｜tool▁outputs▁end｜>

A conversation without tools renders exactly as before tools were added.
"""
from __future__ import annotations

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
PAD = "<｜pad｜>"

# Order = token id in tokenizers built by `mtp_core.tokenizer_build` (PAD is id 0, BOS 1, ...).
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END)

# What the generation prompt appends after the last message.
GENERATION_PROMPT = ASSISTANT + THINK_START + "\n"

# DeepSeek-V3's tool-call markup (the same in R1's template).
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
TOOL_MARKUP: tuple[str, ...] = (TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP,
                                TOOL_OUTPUTS_BEGIN, TOOL_OUTPUTS_END, TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END)


def tool_call_text(name: str, arguments: str) -> str:
    """One call in DeepSeek-V3's markup (what the template renders and the parser reads)."""
    return f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{name}\n```json\n{arguments}\n```{TOOL_CALL_END}"


# The text that introduces the tool list (then one JSON object per function, one per line).
TOOLS_INSTRUCTIONS = (
    "You can call these functions. To call them, write " + TOOL_CALLS_BEGIN + ", then each call as "
    + tool_call_text("NAME", "ARGUMENTS") + " (a newline between two calls), then " + TOOL_CALLS_END
    + ". Their results come back between " + TOOL_OUTPUTS_BEGIN + " and " + TOOL_OUTPUTS_END + ". The functions:"
)


def _literal(text: str) -> str:
    """A Jinja string literal of `text`."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='', in_outputs=false) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token + ns.system -}}"
    "{%- if tools -%}"
    "{{- ('\\n\\n' if ns.system else '') + '## Tools\\n' + " + _literal(TOOLS_INSTRUCTIONS) + " -}}"
    "{%- for tool in tools -%}"
    "{{- '\\n' + ((tool['function'] if tool['function'] is defined else tool) | tojson) -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if ns.in_outputs and message['role'] != 'tool' -%}"
    "{{- " + _literal(TOOL_OUTPUTS_END) + " -}}"
    "{%- set ns.in_outputs = false -%}"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '" + USER + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT + "' + (message['content'] or '') -}}"
    "{%- if message['tool_calls'] -%}"
    "{{- " + _literal(TOOL_CALLS_BEGIN) + " -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set args = call['function']['arguments'] -%}"
    "{{- ('' if loop.first else '\\n') + " + _literal(TOOL_CALL_BEGIN + "function" + TOOL_SEP)
    + " + call['function']['name'] + '\\n```json\\n' + (args if args is string else args | tojson) + "
    + _literal("\n```" + TOOL_CALL_END) + " -}}"
    "{%- endfor -%}"
    "{{- " + _literal(TOOL_CALLS_END) + " -}}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- (" + _literal(TOOL_OUTPUTS_BEGIN) + " if not ns.in_outputs else '\\n') + " + _literal(TOOL_OUTPUT_BEGIN)
    + " + (message['content'] or '') + " + _literal(TOOL_OUTPUT_END) + " -}}"
    "{%- set ns.in_outputs = true -%}"
    "{%- elif message['role'] != 'system' -%}"
    "{{- raise_exception('unsupported chat role ' + message['role'] + '; use system, user, assistant or tool') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.in_outputs -%}"
    "{{- " + _literal(TOOL_OUTPUTS_END) + " -}}"
    "{%- endif -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '" + ASSISTANT + THINK_START + "\\n' -}}"
    "{%- endif -%}"
)


def render_prompt(question: str) -> str:
    """The generation prompt for one user question: BOS, User, question, Assistant, `<think>\\n`."""
    return BOS + USER + question + GENERATION_PROMPT


def render_completion(reasoning: str, answer: str) -> str:
    """The assistant text that follows `render_prompt`: reasoning, `\\n</think>\\n\\n`, answer, EOS."""
    return reasoning + "\n" + THINK_END + "\n\n" + answer + EOS

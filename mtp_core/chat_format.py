"""The project's chat format (DeepSeek-R1-like), fixed project-wide.

A prompt rendered for generation, and the assistant completion that follows it::

    <｜begin▁of▁sentence｜><｜User｜>{question}<｜Assistant｜><think>\\n
    {reasoning}\\n</think>\\n\\n{answer}<｜end▁of▁sentence｜>

`CHAT_TEMPLATE` is the same format as a Hugging Face-style Jinja template (variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, function `raise_exception`). System messages are
gathered and placed right after BOS, as DeepSeek-R1's template does; an assistant message renders as
`<｜Assistant｜>` + its content + EOS.
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

CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token + ns.system -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '" + USER + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT + "' + message['content'] + eos_token -}}"
    "{%- elif message['role'] != 'system' -%}"
    "{{- raise_exception('unsupported chat role ' + message['role'] + '; use system, user or assistant') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
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

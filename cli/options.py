"""The engine commands' Typer options, generated from the flags the config schema declares (mtp_core/config).

A command lists flag keys; each key's option (names and aliases, type, default, help, choices) comes from the
field that declares it, or from COMMAND_FLAGS (options of every engine command that set no field), or from
the command's own options (a `Flag`, or an `(annotation, typer.Option)` pair for what a Flag cannot say: an
`--x/--no_x` pair, an environment variable). quickstart and serve show every flag in full; bench and sweep
show theirs `brief`ly (a shorter help, choices as plain text that the config checks instead of the option
parser). `section_keys` and `help_order` read the flag lists off the schema, so a new field's flag reaches
every command that lists its section (or, for quickstart and serve, every flag) with no edit here.
"""
from __future__ import annotations

import inspect
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import typer

from mtp_core.config.compat import flag_aliases
from mtp_core.config.flags import engine_flags
from mtp_core.config.schema import FIELD, Flag

LOG_LEVELS = ("debug", "info", "warning", "error")
COMMAND_FLAGS = {flag.key: flag for flag in (
    Flag("--trust_remote_code", "Accepted and ignored: no code from the model directory is ever run.", type=bool,
         default=False),
    Flag("--extra_llm_api_options", "TensorRT-LLM LLM-API YAML file; its values win over flags.",
         "TensorRT-LLM LLM-API YAML file.", type=Optional[Path], default=None),
    Flag("--log_level", "Logging on stderr.", "debug | info | warning | error.", type=str, default="warning",
         choices=LOG_LEVELS),
)}


def _flags(own: Mapping[str, Flag]) -> dict[str, Flag]:
    return {**{key: b.flag for key, b in engine_flags().items()}, **COMMAND_FLAGS, **own}


def _choice_type(flag: Flag) -> type[Enum]:
    """The Enum Typer makes a case-insensitive choice of (named like the flag: --mtp_mode -> MtpMode)."""
    name = "".join(part.capitalize() for part in flag.key.split("_"))
    return Enum(name, [(c, c) for c in flag.choices], type=str)     # type: ignore[return-value]


CHOICES = {key: _choice_type(flag) for key, flag in _flags({}).items() if flag.choices}


def option(flag: Flag, brief: bool = False) -> tuple[Any, Any]:
    """(annotation, typer.Option) of a flag; brief: bench / sweep's form."""
    bound = engine_flags().get(flag.key)
    hint = bound.entry.hint if flag.type is FIELD else flag.type
    default = bound.entry.default if flag.default is FIELD else flag.default
    text = (flag.brief if brief else "") or flag.help or bound.entry.spec.help
    names = (flag.name, *flag_aliases(flag.name))
    if flag.choices and not brief:
        choice = CHOICES[flag.key]
        return choice, typer.Option(choice(default), *names, case_sensitive=False, help=text)
    return hint, typer.Option(default, *names, help=text)


# --log_level of the commands that run no engine (prepare-dataset, train-mtp): COMMAND_FLAGS' in its brief form
LOG_LEVEL = option(COMMAND_FLAGS["log_level"], brief=True)[1]


Own = Union[Flag, tuple[Any, Any]]   # a command's own option: a Flag, or (annotation, typer.Option)


def section_keys(section: str) -> tuple[str, ...]:
    """The keys of the flags that set an LLMConfig section (its switch included), in declaration order."""
    return tuple(key for key, b in engine_flags().items() if section in (b.section, b.entry.name))


def help_order(placed: Mapping[str, tuple[str, ...]], keys: Optional[tuple[str, ...]] = None) -> tuple[str, ...]:
    """`keys` (default: every engine flag in the schema's declaration order, then COMMAND_FLAGS) with each run of
    keys in `placed` put right after the key it is filed under (a command's own flags, or flags it shows elsewhere)."""
    moved = {key for run in placed.values() for key in run}
    out: list[str] = []

    def put(key: str) -> None:
        out.append(key)
        for after in placed.get(key, ()):
            put(after)

    for key in keys if keys is not None else (*engine_flags(), *COMMAND_FLAGS):
        if key not in moved:
            put(key)
    return tuple(out)


def parameters(keys: tuple[str, ...], own: Mapping[str, Own] = {}, brief: bool = False) -> list[inspect.Parameter]:
    """The options of these flag keys, in this order; own: the command's own options; brief: bench / sweep's form
    of the engine flags."""
    flags = _flags({key: o for key, o in own.items() if isinstance(o, Flag)})
    out = []
    for key in keys:
        mine = own.get(key)
        hint, info = mine if isinstance(mine, tuple) else option(flags[key], brief)
        out.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=hint))
    return out


def set_parameters(command: Callable[..., None], params: list[inspect.Parameter]) -> None:
    """Give `command(ctx, **flags)` the signature Typer reads its options from (at import)."""
    ctx = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
    command.__signature__ = inspect.Signature([ctx, *params], return_annotation=None)   # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in (ctx, *params)} | {"return": None}


def plain(value: Any) -> Any:
    """A parsed option's value with choices as their strings."""
    return value.value if isinstance(value, Enum) else value


def explicit_params(ctx: typer.Context) -> dict[str, Any]:
    """The options typed on the command line, by key, with their values (plain), in the command's order."""
    return {p.name: plain(ctx.params[p.name]) for p in ctx.command.params
            if getattr(ctx.get_parameter_source(p.name), "name", None) == "COMMANDLINE"}

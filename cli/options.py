"""The engine commands' Typer options, generated from the flags the config schema declares (mtp_core/config).

A command lists flag keys; each key's option (names and aliases, type, default, help, choices) comes from the
field that declares it, or from COMMAND_FLAGS (options of every engine command that set no field), or from
the command's own flags. quickstart and serve show every flag in full; bench and sweep show some `brief`ly
(a shorter help, choices as plain text that the config checks instead of the option parser).
"""
from __future__ import annotations

import inspect
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

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


def brief_option(key: str) -> Any:
    """The typer.Option of an engine flag as bench and sweep list it (the annotation: `option(...)[0]`)."""
    return option(_flags({})[key], brief=True)[1]


def parameters(keys: tuple[str, ...], own: Mapping[str, Flag] = {}) -> list[inspect.Parameter]:
    """The full options of these flag keys, in this order; own: the command's own flags."""
    flags = _flags(own)
    out = []
    for key in keys:
        hint, info = option(flags[key])
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

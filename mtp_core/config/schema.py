"""The configuration schema: each engine field's type, default, range, help, YAML key and CLI flags.

A field of an engine config (engine.py) is declared with `opt(default, help, ...)`, or with `section(...)`
for a nested config object (a YAML mapping). The annotation is the field's type; `opt` keeps a `Spec`
(range, help, flags) in the dataclass field's metadata. Everything else is read off these specs:

- mtp_core/yaml_config.py: the YAML keys (the field names, TensorRT-LLM's) and the checks of their values;
- mtp_core/config/flags.py: CLI flag values -> LLMConfig; cli/options.py: the Typer options;
- `validate` below: a finished config object (every field's range, then the class's `RULES` across fields).

`Spec.ok` is a field's one range test. The YAML loader and the CLI apply it to each value as they read it
(the error names the key or the flag), `validate` to the fields of a finished object (the error names the
key path). Settings kept only for compatibility (aliases, pre-1.0 spellings, ignored flags): compat.py.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import MISSING, dataclass
from functools import cache
from typing import Any, Callable, Optional


class ConfigError(ValueError):
    """A bad setting: a one-line message; `path` is the key path or the flag it names."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


def _same(value: Any) -> Any:
    return value


MESSAGE = "{who} must be {allowed}, got {value!r}"   # an out-of-range value, unless a field words it otherwise


class _FieldsOwn:
    def __repr__(self) -> str:
        return "FIELD"


FIELD: Any = _FieldsOwn()   # a Flag's type or default that is its field's


@dataclass(frozen=True)
class Flag:
    """A CLI option: one that sets a field (listed in the field's `flags`), or a command's own option."""
    name: str                                   # "--relaxed_topk"; its aliases are rows of compat.COMPAT
    help: str = ""                              # "" = the field's help
    brief: str = ""                             # bench / sweep's shorter help ("" = help); choices as text there
    type: Any = FIELD                           # the option's type (FIELD = the field's annotation)
    default: Any = FIELD                        # its default (FIELD = the field's default)
    choices: tuple[str, ...] = ()               # a case-insensitive choice, checked by the option parser
    to_field: Callable[[Any], Any] = _same      # option value (not None) -> field value; None: set nothing
    message: str = ""                           # out-of-range wording ("" = MESSAGE; {raw} = the value typed)

    @property
    def key(self) -> str:
        """The name without dashes: the command's parameter name."""
        return self.name[2:]


@dataclass(frozen=True)
class Spec:
    """What a field declares besides its type and default (the dataclass field's metadata["spec"])."""
    help: str
    allowed: str = ""                           # the allowed values in words (error messages, docs)
    ok: Optional[Callable[[Any], bool]] = None  # the range test of a value of the field's type
    norm: Callable[[Any], Any] = _same          # a YAML value -> the field's spelling (case folding)
    parse: Optional[Callable[[Any, str], Any]] = None   # a value that may be text: (value, who) -> value
    message: str = ""                           # the Python API's wording of a bad value ("" = MESSAGE)
    yaml: bool = True                           # a YAML key (named as the field)
    flags: tuple[Flag, ...] = ()                # the CLI options that set it, the first one wins
    section: Optional[type] = None              # the config class of a nested object (a YAML mapping)
    switch: str = ""                            # (nullable section) the flag whose value turns it on


@dataclass(frozen=True)
class Rule:
    """A check across fields of one config object."""
    path: str                                             # the field the error names
    broken: Callable[[Any], Optional[dict[str, Any]]]     # None when it holds, else the facts for the message
    message: str                                          # {at}: the object's key path, then the facts
    flag_message: str = ""                                # the same in flag words ({flag[field]})


def opt(default: Any, help: str, *, ge: Optional[float] = None, gt: Optional[float] = None,
        le: Optional[float] = None, lt: Optional[float] = None, choices: tuple[str, ...] = (), allowed: str = "",
        ok: Optional[Callable[[Any], bool]] = None, norm: Callable[[Any], Any] = _same,
        parse: Optional[Callable[[Any, str], Any]] = None, message: str = "", yaml: bool = True,
        flags: tuple[Flag, ...] = ()) -> Any:
    """A config field: `relaxed_topk: int = opt(1, "help", ge=1, flags=(Flag("--relaxed_topk"),))`."""
    if choices:
        ok = ok or (lambda v: v in choices)
        allowed = allowed or "one of " + ", ".join(choices)
    elif ok is None and (ge, gt, le, lt) != (None, None, None, None):
        ok = _bounds(ge, gt, le, lt)
        allowed = allowed or _bounds_text(ge, gt, le, lt)
    spec = Spec(help, allowed, ok, norm, parse, message, yaml, flags)
    return dataclasses.field(default=default, metadata={"spec": spec})


def section(cls: type, help: str, *, nullable: bool = False, switch: str = "", flags: tuple[Flag, ...] = ()) -> Any:
    """A nested config object; nullable: None switches it off (YAML null), `switch` turns it on from the CLI."""
    spec = Spec(help, flags=flags, section=cls, switch=switch)
    if nullable:
        return dataclasses.field(default=None, metadata={"spec": spec})
    return dataclasses.field(default_factory=cls, metadata={"spec": spec})


def _bounds(ge: Optional[float], gt: Optional[float], le: Optional[float],
            lt: Optional[float]) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        if le is None and lt is None:
            # a lower bound alone fails only below it: NaN passes here and the type test (finite numbers)
            # refuses it, with the field's own message (as the flags' `if v < lo` checks always did)
            return not (v < ge if ge is not None else v <= gt)
        return ((ge is None or ge <= v) and (gt is None or gt < v) and (le is None or v <= le)
                and (lt is None or v < lt))
    return ok


def _bounds_text(ge: Optional[float], gt: Optional[float], le: Optional[float], lt: Optional[float]) -> str:
    if le is None and lt is None:
        return f">= {ge}" if ge is not None else f"> {gt}"
    low = f"[{ge}" if ge is not None else f"({gt}"
    return f"in {low}, {le}]" if le is not None else f"in {low}, {lt})"


@dataclass(frozen=True)
class Entry:
    """A declared field, resolved: name, annotation, kind, default and spec."""
    name: str
    hint: Any                   # the annotation
    kind: str                   # bool | int | float | str | ints | intmap | section | other
    nullable: bool              # Optional[...]: None is a value
    default: Any
    spec: Spec

    @property
    def allowed(self) -> str:
        return self.spec.allowed


_KINDS = {bool: "bool", int: "int", float: "float", str: "str", list: "ints", dict: "intmap"}


def _kind(hint: Any) -> tuple[str, bool]:
    args = typing.get_args(hint)
    nullable = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    inner = next(a for a in args if a is not type(None)) if nullable else hint
    if dataclasses.is_dataclass(inner):
        return "section", nullable
    return _KINDS.get(typing.get_origin(inner) or inner, "other"), nullable


@cache
def entries(cls: type) -> tuple[Entry, ...]:
    """The declared fields of a config class, in declaration order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "spec" in f.metadata:
            kind, nullable = _kind(hints[f.name])
            default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            out.append(Entry(f.name, hints[f.name], kind, nullable, default, f.metadata["spec"]))
    return tuple(out)


def is_kind(kind: str, v: Any) -> bool:
    """v has the type of a field of this kind (numbers finite; ints not booleans; lists non-empty)."""
    is_int = isinstance(v, int) and not isinstance(v, bool)
    if kind == "float":
        return is_int or (isinstance(v, float) and math.isfinite(v))
    if kind == "ints":
        return isinstance(v, list) and bool(v) and all(is_kind("int", x) for x in v)
    return {"bool": isinstance(v, bool), "int": is_int, "str": isinstance(v, str),
            "intmap": isinstance(v, dict)}.get(kind, True)


def check(entry: Entry, value: Any, who: str, message: str = "", typed: bool = False, raw: Any = FIELD) -> Any:
    """`value` if the field allows it (parsed, for a field that parses text), else a ConfigError naming `who`.

    message: the wording (default: the field's, then MESSAGE), formatted with who, allowed, value and raw (the
    value as typed, before a flag's conversion). typed: the value already has the field's type (a parsed CLI
    option): only its range is tested."""
    if value is None and entry.nullable:
        return None
    if entry.spec.parse is not None:
        try:
            return entry.spec.parse(value, who)
        except ValueError as e:
            raise ConfigError(str(e), who) from None
    if (typed or is_kind(entry.kind, value)) and (entry.spec.ok is None or entry.spec.ok(value)):
        return value
    text = message or entry.spec.message or MESSAGE
    raise ConfigError(text.format(who=who, allowed=entry.allowed, value=value,
                                  raw=value if raw is FIELD else raw), who)


def flag_names(cls: type) -> dict[str, str]:
    """Field name -> its (first) CLI flag, for the fields of `cls` that have one."""
    return {e.name: e.spec.flags[0].name for e in entries(cls) if e.spec.flags}


def validate(obj: Any, at: str = "", flag_words: bool = False) -> None:
    """Check a config object: every field's range in declaration order (into sections), then the class's RULES.

    The one walk of the schema. Raises ConfigError naming the key path (`at` is this object's prefix, e.g.
    "speculative_config."). A field that parses text (the draft-length schedule) is stored parsed. flag_words:
    the rules that have a CLI wording use it (a config built from flags alone)."""
    for e in entries(type(obj)):
        value = getattr(obj, e.name)
        if e.kind == "section":
            if value is not None:
                validate(value, f"{at}{e.name}.", flag_words)
        elif value == [] and e.nullable:     # the Python API's empty list is unset (YAML refuses it when read)
            setattr(obj, e.name, None)
        elif e.spec.ok is not None or e.spec.parse is not None:
            if isinstance(value, str) and e.spec.norm is not _same:   # the spelling YAML would give it ('vanilla')
                value = e.spec.norm(value)
                setattr(obj, e.name, value)
            checked = check(e, value, at + e.name)
            if e.spec.parse is not None:
                setattr(obj, e.name, checked)
    for rule in getattr(obj, "RULES", ()):
        facts = rule.broken(obj)
        if facts is not None:
            text = rule.flag_message if flag_words and rule.flag_message else rule.message
            raise ConfigError(text.format(at=at, flag=flag_names(type(obj)), **facts), at + rule.path)

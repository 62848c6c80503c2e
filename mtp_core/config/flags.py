"""CLI flag values -> LLMConfig, read off the flags each field declares (engine.py).

A flag's value is checked as it is read (the error names the flag), whether or not its section ends up on:
a bad `--relaxed_topk` is an error without `--spec_decode_algo` too. A flag with choices is checked by the
option parser instead (quickstart, serve), or by the config's own check (bench and sweep list the choices
as text). A nullable section (speculation, CUDA graphs) exists when its switch flag is given; its fields
then take their flags' values, every other field its default.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from .compat import flag_aliases
from .engine import LLMConfig
from .schema import MESSAGE, Entry, Flag, check, entries


@dataclass(frozen=True)
class Bound:
    """A flag and the field it sets."""
    flag: Flag
    section: str          # the LLMConfig field that holds the field ("" = LLMConfig's own)
    entry: Entry          # the field (for a section's own flag: the section)


@cache
def engine_flags() -> dict[str, Bound]:
    """Every flag that sets a field, by key, in declaration order (a section's own flag before its fields')."""
    out: dict[str, Bound] = {}
    for e in entries(LLMConfig):
        for flag in e.spec.flags:
            out[flag.key] = Bound(flag, "", e)
        if e.kind == "section":
            for sub in entries(e.spec.section):
                for flag in sub.spec.flags:
                    out[flag.key] = Bound(flag, e.name, sub)
    return out


def flag_keys(entry: Entry) -> tuple[str, ...]:
    """The keys of the flags that set a field (aliases included): the flags a YAML key overrides."""
    return tuple(name[2:] for flag in entry.spec.flags for name in (flag.name, *flag_aliases(flag.name)))


def section_flags(section: str) -> list[str]:
    """The keys of the flags that set the fields of an LLMConfig section (its switch not included)."""
    switch = next(e.spec.switch for e in entries(LLMConfig) if e.name == section)
    return [key for key, b in engine_flags().items() if b.section == section and key != switch]


def config_from_flags(values: dict[str, Any]) -> LLMConfig:
    """values: flag key -> the value as parsed (choices as plain strings); a flag missing or None leaves its
    field at the default. Raises ConfigError naming the first flag (in declaration order) out of range."""
    fields: dict[str, dict[str, Any]] = {}
    for key, b in engine_flags().items():
        raw = values.get(key)
        if raw is None or b.entry.kind == "section":
            continue
        value = b.flag.to_field(raw)
        if value is not None and not b.flag.choices:
            value = check(b.entry, value, b.flag.name, b.flag.message or MESSAGE, typed=True, raw=raw)
        if value is not None:                       # of a field's flags, the first that says something wins
            fields.setdefault(b.section, {}).setdefault(b.entry.name, value)
    top = fields.pop("", {})
    for e in entries(LLMConfig):
        if e.kind == "section":
            on = not e.nullable or values.get(e.spec.switch) not in (None, False)
            top[e.name] = e.spec.section(**fields.get(e.name, {})) if on else None
    return LLMConfig(**top)

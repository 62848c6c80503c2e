"""`--extra_llm_api_options FILE` (alias `--config`): TensorRT-LLM's LLM-API YAML keys -> LLMConfig.

The keys are the engine config's fields, declared with their types, ranges and the flags they override in
mtp_core/config/engine.py; aliases, pre-1.0 spellings and keys accepted without effect are rows of
mtp_core/config/compat.py. `load_yaml_options` reads the file (yaml.safe_load; the top level must be a
mapping). `apply_yaml_options` checks every key before touching anything, then returns an updated copy of the
LLMConfig. As in TensorRT-LLM a YAML value wins over the command-line flag of the same meaning; we merge
field by field (a flag whose key the YAML does not name keeps its value) and log each override of a flag
the user typed. The pre-1.0 spellings (`pytorch_backend_config:` and the same keys flattened to the top
level, TensorRT-LLM 0.19-0.21) are accepted with a deprecation warning and mapped onto the new objects.
"""
from __future__ import annotations

import copy
import difflib
import math
from pathlib import Path
from typing import Any, Callable

import yaml

from .config import LLMConfig
from .config.compat import OLD_SECTION, rows, warning_text
from .config.flags import flag_keys
from .config.schema import ConfigError, Entry, Spec, entries, is_kind, validate


def _section_keys(section: Entry) -> dict[str, Entry]:
    """A section's YAML keys: its fields, each alias right after the field it stands for."""
    keys: dict[str, Entry] = {}
    for sub in entries(section.spec.section):
        keys[sub.name] = sub
        keys.update({alias.key: sub for alias in rows("alias") if alias.target == (section.name, sub.name)})
    return keys


TOP = {e.name: e for e in entries(LLMConfig) if e.spec.yaml}                      # key -> field
KEYS = {name: _section_keys(e) for name, e in TOP.items() if e.kind == "section"}  # section -> key -> field
OLD = {c.key: c for c in rows("old")}
OLD_FLAT = tuple(k for k in OLD if k not in TOP)  # also accepted at the top level (0.20/0.21)
IGNORED = {c.name: c for c in rows("ignored") if not c.name.startswith("--")}   # booleans, all of them
_BOOL = Entry("", bool, "bool", False, False, Spec(""))

_KIND_TEXT = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
              "ints": "a list of integers", "intmap": "a mapping"}

Assign = tuple[str, Any, Any]   # (key path as written, raw YAML value, normalized value)


# ---- reading --------------------------------------------------------------------------------

def load_yaml_options(path: str | Path) -> dict:
    """Read FILE with yaml.safe_load; empty file -> {}; anything but a mapping is an error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the YAML file ({e.__class__.__name__}: "
                          f"{getattr(e, 'strerror', None) or e}); pass an existing file", str(path)) from None
    try:
        data = yaml.safe_load(text)
        _check_duplicates(yaml.compose(text, Loader=yaml.SafeLoader), path)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: YAML syntax error{where}: {what}", str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys (e.g. speculative_config: ...), "
                          f"got {_describe(data)}", str(path))
    return data


def _check_duplicates(node: Any, path: Path, seen: set[int] | None = None) -> None:
    """safe_load keeps the last of two equal keys silently; we refuse (walks the composed node tree)."""
    seen = set() if seen is None else seen
    if node is None or id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        keys: set[str] = set()
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.value != "<<":
                if key_node.value in keys:
                    raise ConfigError(f"{path}: duplicate key {key_node.value!r} at line "
                                      f"{key_node.start_mark.line + 1}; keep only one", str(path))
                keys.add(key_node.value)
            _check_duplicates(value_node, path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_duplicates(item, path, seen)


# ---- checking ------------------------------------------------------------------------------

def _show(v: Any) -> str:
    """A value the way it reads in YAML (true, null, [1, 2], {})."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, list):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_show(x)}" for k, x in v.items()) + "}"
    return str(v)


def _describe(v: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}
    kind = "null" if v is None else names.get(type(v), type(v).__name__)
    return kind if isinstance(v, (list, dict)) or v is None else f"{kind} {_show(v)}"


def _allowed(entry: Entry) -> str:
    return entry.allowed + (" or null" if entry.nullable and entry.kind == "int" else "")


def _check_leaf(entry: Entry, raw: Any, path: str) -> Any:
    allowed = f" ({_allowed(entry)})" if entry.allowed else ""
    if raw is None and entry.nullable:
        return None
    if not is_kind(entry.kind, raw):
        hint = ""
        if isinstance(raw, bool) and entry.kind == "str":
            hint = "; YAML reads yes/no/on/off as booleans, quote the value"
        elif isinstance(raw, str) and entry.kind == "float" and _parses_as_float(raw):
            hint = "; PyYAML reads exponents without a dot (6e-1) as strings, write 0.6 or 6.0e-1"
        elif isinstance(raw, float):
            hint = "; it must be finite"
        raise ConfigError(f"{path}: expected {_KIND_TEXT[entry.kind]}{allowed}, got {_describe(raw)}{hint}",
                          path)
    if entry.spec.parse is not None:
        try:
            return entry.spec.parse(raw, path)
        except ValueError as e:
            raise ConfigError(str(e), path) from None
    value = [int(x) for x in raw] if entry.kind == "ints" else entry.spec.norm(raw)
    value = float(value) if entry.kind == "float" else value
    if entry.spec.ok is not None and not entry.spec.ok(value):
        raise ConfigError(f"{path}: must be {_allowed(entry)}, got {_show(raw)}", path)
    return value


def _parses_as_float(s: str) -> bool:
    try:
        return math.isfinite(float(s))
    except ValueError:
        return False


def _unknown(path: str, key: Any, valid: list[str]) -> ConfigError:
    match = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f"did you mean {match[0]}?" if match else "valid keys here: " + ", ".join(sorted(valid))
    return ConfigError(f"unknown key {path}; {hint}", path)


def _put(out: dict[tuple, Assign], canon: tuple, assign: Assign) -> None:
    if canon in out and out[canon][2] != assign[2]:
        first = out[canon]
        raise ConfigError(f"{assign[0]}={_show(assign[1])} conflicts with {first[0]}={_show(first[1])}; "
                          "both set the same option, keep one", assign[0])
    out.setdefault(canon, assign)


def _entry_at(canon: tuple) -> Entry:
    return TOP[canon[0]] if len(canon) == 1 else KEYS[canon[0]][canon[1]]


def _collect(options: Any) -> tuple[dict[tuple, Assign], list[str]]:
    """Validate every key; returns new-path -> assignment, and the notes: deprecated spellings, then keys that
    have no effect here (checked, never applied)."""
    if not isinstance(options, dict):
        raise ConfigError(f"top level: expected a mapping of keys, got {_describe(options)}")
    out: dict[tuple, Assign] = {}
    warnings: list[str] = []
    ignored: list[str] = []
    for key, raw in options.items():
        if key == OLD_SECTION:
            if not isinstance(raw, dict):
                raise ConfigError(f"{key}: expected a mapping (deprecated section), got {_describe(raw)}", key)
            for old, old_raw in raw.items():
                if old not in OLD:
                    raise _unknown(f"{key}.{old}", old, list(OLD))
                _collect_old(f"{key}.{old}", old, old_raw, out, warnings)
        elif key in OLD_FLAT:
            _collect_old(key, key, raw, out, warnings)
        elif key in IGNORED:
            _check_leaf(_BOOL, raw, key)
            ignored.append(warning_text(IGNORED[key], path=key, value=_show(raw)))
        elif key not in TOP:
            raise _unknown(str(key), key, [*TOP, *IGNORED, OLD_SECTION])
        elif TOP[key].kind != "section":
            _put(out, (key,), (key, raw, _check_leaf(TOP[key], raw, key)))
        else:
            _collect_section(key, TOP[key], raw, out)
    return out, warnings + ignored


def _collect_section(key: str, section: Entry, raw: Any, out: dict[tuple, Assign]) -> None:
    keys = KEYS[key]
    if raw is None and section.nullable:
        _put(out, (key,), (key, raw, None))
        return
    if not isinstance(raw, dict):
        off = " or null" if section.nullable else ""
        raise ConfigError(f"{key}: expected a mapping{off} (keys: {', '.join(keys)}), "
                          f"got {_describe(raw)}", key)
    if section.nullable:
        _put(out, (key,), (key, raw, {}))
    for sub, sub_raw in raw.items():
        path = f"{key}.{sub}"
        if sub not in keys:
            raise _unknown(path, sub, list(keys))
        canon = (key, keys[sub].name)            # an alias names its field's key
        _put(out, canon, (path, sub_raw, _check_leaf(keys[sub], sub_raw, path)))


def _collect_old(path: str, old: str, raw: Any, out: dict[tuple, Assign], warnings: list[str]) -> None:
    row = OLD[old]
    value = _check_leaf(_BOOL if row.transform is not None else _entry_at(row.target), raw, path)
    _put(out, row.target, (path, raw, row.transform(value) if row.transform is not None else value))
    warnings.append(warning_text(row, path=path))


# ---- applying -------------------------------------------------------------------------------

def apply_yaml_options(cfg: LLMConfig, options: dict, explicit_flags: dict[str, object],
                       log: Callable[[str], None]) -> LLMConfig:
    """Validate `options` fully, then return an updated copy of `cfg` (cfg itself is never changed).

    explicit_flags: CLI flag name -> the value the user typed; only used to log overrides."""
    out, lines = _collect(options)
    new = copy.deepcopy(cfg)
    switched = [name for name, e in TOP.items() if e.kind == "section" and e.nullable]
    for name in switched:                       # switch optional objects on/off before their fields
        if (name,) in out:
            value = out[(name,)][2]
            setattr(new, name, None if value is None else getattr(new, name) or TOP[name].spec.section())
    for canon, (path, raw, value) in out.items():
        if len(canon) == 1 and canon[0] in switched:
            continue
        obj = new if len(canon) == 1 else getattr(new, canon[0])
        if obj is None:             # only the pre-1.0 graph keys reach a section that is off
            raise ConfigError(f"{path} has no effect while CUDA graphs are off; also set use_cuda_graph: true "
                              "(or write cuda_graph_config instead)", path)
        setattr(obj, canon[-1], copy.copy(value))
    validate(new)                   # the rules across keys (possibly one from the YAML and one from a flag)
    lines += _override_lines(out, explicit_flags)
    for line in lines:
        log(line)
    return new


def _flag_text(flag: str, v: object) -> str:
    if v is True:
        return f"--{flag}"
    if isinstance(v, (list, tuple)):
        return f"--{flag} " + " ".join(str(x) for x in v)
    return f"--{flag} {_show(v)}"


def _override_lines(out: dict[tuple, Assign], explicit: dict[str, object]) -> list[str]:
    lines = []
    for canon, (path, raw, value) in out.items():
        entry = _entry_at(canon)
        groups = [flag_keys(entry)]
        if entry.kind == "section" and value is None:   # null wipes every flag of the section
            groups += [flag_keys(sub) for sub in entries(entry.spec.section)]
        for group in dict.fromkeys(groups):
            flag = next((f for f in group if f in explicit), None)
            if flag is not None:
                lines.append(f"YAML {path}={_show(raw)} overrides {_flag_text(flag, explicit[flag])}")
    return lines


def valid_yaml_keys() -> dict:
    """The accepted key tree: key -> description, or key -> nested dict for sections."""
    def describe(entry: Entry) -> str:
        return " ".join(x for x in (_KIND_TEXT[entry.kind], _allowed(entry)) if x)

    tree: dict[str, Any] = {}
    for key, e in TOP.items():
        tree[key] = {k: describe(v) for k, v in KEYS[key].items()} if e.kind == "section" else describe(e)
    tree.update({key: describe(_BOOL) for key in IGNORED})
    tree[OLD_SECTION] = {old: f"deprecated: write {row.maps_to}" for old, row in OLD.items()}
    for old in OLD_FLAT:
        tree[old] = tree[OLD_SECTION][old]
    return tree

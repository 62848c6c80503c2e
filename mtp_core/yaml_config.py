"""`--extra_llm_api_options FILE` (alias `--config`): TensorRT-LLM's LLM-API YAML keys -> LLMConfig.

`load_yaml_options` reads the file (yaml.safe_load; the top level must be a mapping). `apply_yaml_options`
checks every key against the schema below before touching anything, then returns an updated copy of the
LLMConfig. As in TensorRT-LLM a YAML value wins over the command-line flag of the same meaning; we merge
field by field (a flag whose key the YAML does not name keeps its value) and log each override of a flag
the user typed. The pre-1.0 spellings (`pytorch_backend_config:` and the same keys flattened to the top
level, TensorRT-LLM 0.19-0.21) are accepted with a deprecation warning and mapped onto the new objects.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from .config import MTP_MODES, CudaGraphConfig, LLMConfig, SpeculativeConfig


class ConfigError(ValueError):
    """A bad option: a one-line message that starts with the key path (or the file name)."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class Leaf:
    kind: str                                     # bool | int | float | str | ints (list of int) | intmap
    allowed: str = ""                             # what is allowed, for messages and docs
    ok: Callable[[Any], bool] = lambda v: True    # range check on the normalized value
    nullable: bool = False
    flags: tuple[str, ...] = ()                   # CLI flag (and its aliases) this key overrides
    norm: Callable[[Any], Any] = lambda v: v      # e.g. case folding


@dataclass(frozen=True)
class Section:
    keys: dict[str, Leaf]
    nullable: bool = False                        # null switches the object off (graphs, speculation)
    flags: tuple[str, ...] = ()                   # flags overridden whenever the section is present


def _int(lo: int, *flags: str, nullable: bool = False) -> Leaf:
    return Leaf("int", f">= {lo}" + (" or null" if nullable else ""), lambda v: v >= lo, nullable, flags)


def _bool(*flags: str) -> Leaf:
    return Leaf("bool", flags=flags)


def _choice(choices: tuple[str, ...], norm: Callable[[str], str], *flags: str) -> Leaf:
    return Leaf("str", "one of " + ", ".join(choices), lambda v: v in choices, flags=flags, norm=norm)


_MOE_BACKENDS = ("auto", "CUTLASS", "TRTLLM", "WIDEEP", "CUTEDSL", "DEEPGEMM", "VANILLA", "TRITON")
_NUM_DRAFT = _int(1, "spec_decode_max_draft_len", "spec_decode_nextn")

SCHEMA: dict[str, Leaf | Section] = {
    "cuda_graph_config": Section({
        "batch_sizes": Leaf("ints", "non-empty, each >= 1; or null", nullable=True,
                            flags=("cuda_graph_batch_sizes",)),
        "max_batch_size": _int(0, "cuda_graph_max_batch_size"),
        "enable_padding": _bool("cuda_graph_padding_enabled"),
    }, nullable=True, flags=("use_cuda_graph",)),
    "disable_overlap_scheduler": _bool("disable_overlap_scheduler"),
    "kv_cache_config": Section({
        "free_gpu_memory_fraction": Leaf("float", "in (0, 1]", lambda v: 0 < v <= 1,
                                         flags=("kv_cache_fraction",)),
        "tokens_per_block": _int(1, "tokens_per_block"),
        "max_tokens": _int(1, nullable=True),
        "dtype": _choice(("auto", "fp8", "float32", "bfloat16", "float16"), str.lower, "kv_cache_dtype"),
        "enable_block_reuse": _bool("disable_kv_cache_reuse"),
    }),
    "moe_config": Section({
        "backend": _choice(_MOE_BACKENDS, lambda s: "auto" if s.lower() == "auto" else s.upper(),
                           "moe_backend"),
    }),
    "speculative_config": Section({
        "decoding_type": Leaf("str", "MTP (case-insensitive)", lambda v: v == "MTP",
                              flags=("spec_decode_algo",), norm=str.upper),
        "num_nextn_predict_layers": _NUM_DRAFT,
        "max_draft_len": _NUM_DRAFT,
        "use_relaxed_acceptance_for_thinking": _bool("use_relaxed_acceptance_for_thinking"),
        "relaxed_topk": _int(1, "relaxed_topk"),
        "relaxed_delta": Leaf("float", ">= 0", lambda v: v >= 0, flags=("relaxed_delta",)),
        "use_mtp_vanilla": _bool("use_mtp_vanilla"),
        "mtp_mode": _choice(MTP_MODES, str.lower, "mtp_mode"),
        # draft length: the policy (mtp_core/speculative/policy.py) and the explicit rules that bound it
        "draft_len_policy": _choice(("cost", "fixed"), str.lower, "spec_decode_draft_len_policy"),
        "draft_confidence_threshold": Leaf("float", "in [0, 1); 0 = off", lambda v: 0 <= v < 1,
                                           flags=("spec_decode_draft_confidence",)),
        "draft_len_schedule": Leaf("intmap", "a mapping of batch size >= 1 to max drafts >= 0, e.g. {1: 4, 4: 2, 16: 0}",
                                   nullable=True, flags=("spec_decode_draft_len_schedule",)),
        "acceptance_window": _int(0, "spec_decode_acceptance_window"),
        "acceptance_length_threshold": Leaf("float", ">= 0", lambda v: v >= 0,
                                            flags=("spec_decode_acceptance_length_threshold",)),
    }, nullable=True),
    "enable_chunked_prefill": _bool("enable_chunked_prefill"),
    "max_batch_size": _int(1, "max_batch_size"),
    "max_num_tokens": _int(1, "max_num_tokens"),
    "max_seq_len": _int(2, "max_seq_len", nullable=True),
    "tensor_parallel_size": _int(1, "tp_size", "tensor_parallel_size"),
    "moe_expert_parallel_size": _int(1, "moe_ep_size", "moe_expert_parallel_size"),
    "print_iter_log": _bool("print_iter_log"),
    "enable_attention_dp": _bool("enable_attention_dp"),
    "dtype": _choice(("auto", "float32", "bfloat16", "float16"), str.lower, "dtype"),
}

_ALIASES = {("speculative_config", "max_draft_len"): ("speculative_config", "num_nextn_predict_layers")}
_OPTIONAL = {"cuda_graph_config": CudaGraphConfig, "speculative_config": SpeculativeConfig}
_NO_EFFECT = {("enable_attention_dp",): "one device; attention data parallelism is not implemented"}

# Pre-1.0 key -> (new path, how to write it now, value transform or None for "same value").
_OLD: dict[str, tuple[tuple[str, ...], str, Callable[[Any], Any] | None]] = {
    "use_cuda_graph": (("cuda_graph_config",), "cuda_graph_config: {} (null = off)",
                       lambda v: {} if v else None),
    "cuda_graph_batch_sizes": (("cuda_graph_config", "batch_sizes"), "cuda_graph_config.batch_sizes", None),
    "cuda_graph_max_batch_size": (("cuda_graph_config", "max_batch_size"),
                                  "cuda_graph_config.max_batch_size", None),
    "cuda_graph_padding_enabled": (("cuda_graph_config", "enable_padding"),
                                   "cuda_graph_config.enable_padding", None),
    "enable_overlap_scheduler": (("disable_overlap_scheduler",), "disable_overlap_scheduler (inverted)",
                                 lambda v: not v),
    "disable_overlap_scheduler": (("disable_overlap_scheduler",), "top-level disable_overlap_scheduler", None),
    "kv_cache_dtype": (("kv_cache_config", "dtype"), "kv_cache_config.dtype", None),
    "moe_backend": (("moe_config", "backend"), "moe_config.backend", None),
    "print_iter_log": (("print_iter_log",), "top-level print_iter_log", None),
}
_OLD_FLAT = tuple(k for k in _OLD if k not in SCHEMA)  # also accepted at the top level (0.20/0.21)

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


def _is_kind(kind: str, v: Any) -> bool:
    is_int = isinstance(v, int) and not isinstance(v, bool)
    return {"bool": isinstance(v, bool), "int": is_int, "str": isinstance(v, str),
            "float": is_int or (isinstance(v, float) and math.isfinite(v)),
            "ints": isinstance(v, list) and bool(v) and all(_is_kind("int", x) for x in v),
            "intmap": isinstance(v, dict)}[kind]


def _check_leaf(leaf: Leaf, raw: Any, path: str) -> Any:
    allowed = f" ({leaf.allowed})" if leaf.allowed else ""
    if raw is None and leaf.nullable:
        return None
    if not _is_kind(leaf.kind, raw):
        hint = ""
        if isinstance(raw, bool) and leaf.kind == "str":
            hint = "; YAML reads yes/no/on/off as booleans, quote the value"
        elif isinstance(raw, str) and leaf.kind == "float" and _parses_as_float(raw):
            hint = "; PyYAML reads exponents without a dot (6e-1) as strings, write 0.6 or 6.0e-1"
        elif isinstance(raw, float):
            hint = "; it must be finite"
        raise ConfigError(f"{path}: expected {_KIND_TEXT[leaf.kind]}{allowed}, got {_describe(raw)}{hint}",
                          path)
    if leaf.kind == "intmap":
        from .speculative.adaptive import parse_schedule
        try:
            return parse_schedule(raw, path)
        except ValueError as e:
            raise ConfigError(str(e), path) from None
    value = [int(x) for x in raw] if leaf.kind == "ints" else leaf.norm(raw)
    value = float(value) if leaf.kind == "float" else value
    if leaf.kind == "ints" and min(value) < 1 or leaf.kind != "ints" and not leaf.ok(value):
        raise ConfigError(f"{path}: must be {leaf.allowed}, got {_show(raw)}", path)
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


def _leaf_at(canon: tuple) -> Leaf | Section:
    node: Any = SCHEMA[canon[0]]
    return node.keys[canon[1]] if len(canon) == 2 else node


def _collect(options: Any) -> tuple[dict[tuple, Assign], list[str]]:
    """Validate every key; returns new-path -> assignment, and deprecation warnings."""
    if not isinstance(options, dict):
        raise ConfigError(f"top level: expected a mapping of keys, got {_describe(options)}")
    out: dict[tuple, Assign] = {}
    warnings: list[str] = []
    for key, raw in options.items():
        if key == "pytorch_backend_config":
            if not isinstance(raw, dict):
                raise ConfigError(f"{key}: expected a mapping (deprecated section), got {_describe(raw)}", key)
            for old, old_raw in raw.items():
                if old not in _OLD:
                    raise _unknown(f"{key}.{old}", old, list(_OLD))
                _collect_old(f"{key}.{old}", old, old_raw, out, warnings)
        elif key in _OLD_FLAT:
            _collect_old(key, key, raw, out, warnings)
        elif key not in SCHEMA:
            raise _unknown(str(key), key, list(SCHEMA) + ["pytorch_backend_config"])
        elif isinstance(SCHEMA[key], Leaf):
            _put(out, (key,), (key, raw, _check_leaf(SCHEMA[key], raw, key)))
        else:
            _collect_section(key, SCHEMA[key], raw, out)
    return out, warnings


def _collect_section(key: str, sec: Section, raw: Any, out: dict[tuple, Assign]) -> None:
    if raw is None and sec.nullable:
        _put(out, (key,), (key, raw, None))
        return
    if not isinstance(raw, dict):
        off = " or null" if sec.nullable else ""
        raise ConfigError(f"{key}: expected a mapping{off} (keys: {', '.join(sec.keys)}), "
                          f"got {_describe(raw)}", key)
    if sec.nullable:
        _put(out, (key,), (key, raw, {}))
    for sub, sub_raw in raw.items():
        path = f"{key}.{sub}"
        if sub not in sec.keys:
            raise _unknown(path, sub, list(sec.keys))
        canon = _ALIASES.get((key, sub), (key, sub))
        _put(out, canon, (path, sub_raw, _check_leaf(sec.keys[sub], sub_raw, path)))


def _collect_old(path: str, old: str, raw: Any, out: dict[tuple, Assign], warnings: list[str]) -> None:
    canon, now, transform = _OLD[old]
    leaf = _bool() if transform is not None else _leaf_at(canon)
    value = _check_leaf(leaf, raw, path)  # type: ignore[arg-type]
    _put(out, canon, (path, raw, transform(value) if transform else value))
    warnings.append(f"warning: {path} is deprecated (TensorRT-LLM < 1.0 spelling); write {now}")


# ---- applying -------------------------------------------------------------------------------

def apply_yaml_options(cfg: LLMConfig, options: dict, explicit_flags: dict[str, object],
                       log: Callable[[str], None]) -> LLMConfig:
    """Validate `options` fully, then return an updated copy of `cfg` (cfg itself is never changed).

    explicit_flags: CLI flag name -> the value the user typed; only used to log overrides."""
    out, lines = _collect(options)
    new = copy.deepcopy(cfg)
    for name, make in _OPTIONAL.items():       # switch optional objects on/off before their fields
        if (name,) in out:
            value = out[(name,)][2]
            setattr(new, name, None if value is None else getattr(new, name) or make())
    for canon, (path, raw, value) in out.items():
        name = canon[-1]
        if len(canon) == 1 and name in _OPTIONAL:
            continue
        obj = new if len(canon) == 1 else getattr(new, canon[0])
        if obj is None:
            raise ConfigError(f"{path} has no effect while CUDA graphs are off; also set use_cuda_graph: true "
                              "(or write cuda_graph_config instead)", path)
        if name in {f.name for f in dataclasses.fields(obj)}:
            setattr(obj, name, copy.copy(value))
        else:
            lines.append(f"{path}={_show(raw)} is accepted but has no effect here ({_NO_EFFECT[canon]})")
    _check_combined(new)
    lines += _override_lines(out, explicit_flags)
    for line in lines:
        log(line)
    return new


def _check_combined(cfg: LLMConfig) -> None:
    """Rules that span keys (possibly one from the YAML and one from a flag)."""
    cg = cfg.cuda_graph_config
    if cg is not None and cg.batch_sizes and cg.max_batch_size not in (0, max(cg.batch_sizes)):
        raise ConfigError(f"cuda_graph_config.max_batch_size={cg.max_batch_size} must be 0 or the largest of "
                          f"batch_sizes ({max(cg.batch_sizes)})", "cuda_graph_config.max_batch_size")
    sc = cfg.speculative_config
    if sc is not None and sc.use_mtp_vanilla and sc.mtp_mode == "eagle":
        raise ConfigError("speculative_config.use_mtp_vanilla=true contradicts mtp_mode=eagle; set one of them",
                          "speculative_config.use_mtp_vanilla")
    try:
        cfg.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _flag_text(flag: str, v: object) -> str:
    if v is True:
        return f"--{flag}"
    if isinstance(v, (list, tuple)):
        return f"--{flag} " + " ".join(str(x) for x in v)
    return f"--{flag} {_show(v)}"


def _override_lines(out: dict[tuple, Assign], explicit: dict[str, object]) -> list[str]:
    lines = []
    for canon, (path, raw, value) in out.items():
        node = _leaf_at(canon)
        groups = [node.flags]
        if isinstance(node, Section) and value is None:   # null wipes every flag of the section
            groups += [leaf.flags for leaf in node.keys.values()]
        for group in dict.fromkeys(groups):
            flag = next((f for f in group if f in explicit), None)
            if flag is not None:
                lines.append(f"YAML {path}={_show(raw)} overrides {_flag_text(flag, explicit[flag])}")
    return lines


def valid_yaml_keys() -> dict:
    """The accepted key tree: key -> description, or key -> nested dict for sections."""
    def describe(leaf: Leaf) -> str:
        return " ".join(x for x in (_KIND_TEXT[leaf.kind], leaf.allowed) if x)

    tree: dict[str, Any] = {}
    for key, node in SCHEMA.items():
        tree[key] = describe(node) if isinstance(node, Leaf) else {k: describe(v) for k, v in node.keys.items()}
    tree["pytorch_backend_config"] = {old: f"deprecated: write {now}" for old, (_, now, _) in _OLD.items()}
    for old in _OLD_FLAT:
        tree[old] = tree["pytorch_backend_config"][old]
    return tree

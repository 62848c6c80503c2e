"""Settings kept only for compatibility with TensorRT-LLM's spellings: one table, `COMPAT`.

A row says what the user writes, what it stands for (nothing, when it is ignored), why it is kept, and what
is logged when it is used. The YAML loader reads its aliases, pre-1.0 keys and ignored keys from here; the
CLI its flag aliases, ignored flags and the MoE backends that fall back; `markdown()` renders it for the docs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

OLD_SECTION = "pytorch_backend_config"           # TensorRT-LLM 0.19-0.21's section of the keys below
GPU_MOE_BACKENDS = ("CUTLASS", "TRTLLM", "WIDEEP", "CUTEDSL", "DEEPGEMM", "TRITON")


@dataclass(frozen=True)
class Compat:
    """One setting kept only for compatibility."""
    name: str                                    # what is written: a flag, a YAML key path (" / ": both)
    kind: str                                    # alias | old (pre-1.0 YAML key) | ignored | fallback
    maps_to: str                                 # what it stands for ("" = nothing)
    why: str                                     # why it is kept
    warning: str = ""                            # logged when used ("" = silent); {path} {value} {why} {reason}
    target: tuple[str, ...] = ()                 # (YAML alias, old key) the key path it sets
    transform: Optional[Callable[[bool], Any]] = None   # (old key) its boolean -> the value of `target`
    values: tuple[str, ...] = ()                 # (fallback) the values concerned

    @property
    def key(self) -> str:
        """The name's last key: an old key's name inside pytorch_backend_config, an alias's in its section."""
        return self.name.rpartition(".")[2]


_OLD_WHY = "TensorRT-LLM 0.19-0.21's spelling"
_OLD_WARNING = "warning: {path} is deprecated (TensorRT-LLM < 1.0 spelling); write {maps_to}"


def _old(key: str, target: tuple[str, ...], maps_to: str, transform: Optional[Callable[[bool], Any]] = None) -> Compat:
    return Compat(f"{OLD_SECTION}.{key}", "old", maps_to, _OLD_WHY, _OLD_WARNING, target, transform)


MOE_FALLBACK = Compat(
    "--moe_backend / moe_config.backend", "fallback", "the PyTorch MoE (VANILLA)",
    "TensorRT-LLM's GPU MoE kernels; this engine has one MoE (the warning is logged on a CPU; on a GPU none)",
    "MoE backend {value} needs an NVIDIA GPU and {reason}; using the PyTorch MoE", values=GPU_MOE_BACKENDS)

COMPAT: tuple[Compat, ...] = (
    Compat("--spec_decode_nextn", "alias", "--spec_decode_max_draft_len",
           "the older name of the flag in TensorRT-LLM's quickstart_advanced.py"),
    Compat("--config", "alias", "--extra_llm_api_options", "trtllm-serve's name of the YAML file"),
    Compat("speculative_config.max_draft_len", "alias", "speculative_config.num_nextn_predict_layers",
           "TensorRT-LLM's other name of K; give one of the two (two different values are an error)",
           target=("speculative_config", "num_nextn_predict_layers")),
    Compat("--trust_remote_code", "ignored", "", "no code from the model directory is ever run",
           "--trust_remote_code is ignored: mtp never runs code from the model directory"),
    Compat("enable_attention_dp", "ignored", "", "one device; attention data parallelism is not implemented",
           "{path}={value} is accepted but has no effect here ({why})"),
    MOE_FALLBACK,
    _old("use_cuda_graph", ("cuda_graph_config",), "cuda_graph_config: {} (null = off)", lambda on: {} if on else None),
    _old("cuda_graph_batch_sizes", ("cuda_graph_config", "batch_sizes"), "cuda_graph_config.batch_sizes"),
    _old("cuda_graph_max_batch_size", ("cuda_graph_config", "max_batch_size"), "cuda_graph_config.max_batch_size"),
    _old("cuda_graph_padding_enabled", ("cuda_graph_config", "enable_padding"), "cuda_graph_config.enable_padding"),
    _old("enable_overlap_scheduler", ("disable_overlap_scheduler",), "disable_overlap_scheduler (inverted)",
         lambda on: not on),
    _old("disable_overlap_scheduler", ("disable_overlap_scheduler",), "top-level disable_overlap_scheduler"),
    _old("kv_cache_dtype", ("kv_cache_config", "dtype"), "kv_cache_config.dtype"),
    _old("moe_backend", ("moe_config", "backend"), "moe_config.backend"),
    _old("print_iter_log", ("print_iter_log",), "top-level print_iter_log"),
)


def rows(kind: str) -> tuple[Compat, ...]:
    return tuple(c for c in COMPAT if c.kind == kind)


def flag_aliases(flag: str) -> tuple[str, ...]:
    """The other names of a CLI flag ("--spec_decode_max_draft_len" -> ("--spec_decode_nextn",))."""
    return tuple(c.name for c in rows("alias") if c.maps_to == flag)


def warning_text(row: Compat, **facts: Any) -> str:
    """A row's warning with its facts filled in (path, value, reason); the old keys' starts with "warning: "."""
    return row.warning.format(maps_to=row.maps_to, why=row.why, **facts)


def markdown(current: set[str]) -> str:
    """The table for the docs (an old key is accepted at the top level too where that is not a current key:
    `current`, the schema's YAML keys, which the caller reads from LLMConfig; this table sits below it)."""
    out = ["| Setting | Stands for | Why it is kept | Logged when used |", "|---|---|---|---|"]
    for c in COMPAT:
        names = [f"`{name}`" for name in c.name.split(" / ")]
        if c.kind == "old" and c.key not in current:
            names.append(f"`{c.key}`")
        written = " / ".join(names) + (": " + ", ".join(c.values) if c.values else "")
        logged = c.warning.removeprefix("warning: ").replace("{maps_to}", c.maps_to).replace("{why}", c.why)
        out.append(f"| {written} | {c.maps_to or 'nothing (ignored)'} | {c.why} | {logged or 'nothing'} |")
    return "\n".join(out) + "\n"

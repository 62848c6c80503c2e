"""`draft_len_schedule` (TensorRT-LLM's map from batch size to the most drafts per step), from YAML or a flag."""
from __future__ import annotations

from typing import Any, Optional


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_schedule(value: Any, what: str = "speculative_config.draft_len_schedule") -> Optional[dict[int, int]]:
    """{batch size >= 1: max drafts >= 0} from a mapping, or from text like '1:4,4:2,16:0'; None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        out: dict[Any, Any] = {}
        for part in value.replace(" ", "").split(","):
            if not part:
                continue
            k, sep, v = part.partition(":")
            if not sep:
                raise ValueError(f"{what}: expected BATCH:K pairs like 1:4,4:2,16:0, got {part!r}")
            try:
                out[int(k)] = int(v)
            except ValueError:
                raise ValueError(f"{what}: {part!r} is not two integers BATCH:K (e.g. 4:2)") from None
        value = out
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{what}: expected a non-empty mapping of batch size to max drafts, e.g. "
                         "{1: 4, 4: 2, 16: 0}")
    for k, v in value.items():
        if not _is_int(k) or k < 1:
            raise ValueError(f"{what}: batch size {k!r} must be an integer >= 1")
        if not _is_int(v) or v < 0:
            raise ValueError(f"{what}: the entry for batch size {k} must be an integer >= 0 drafts, got {v!r}")
    return {int(k): int(v) for k, v in sorted(value.items())}

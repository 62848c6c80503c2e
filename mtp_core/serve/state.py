"""What the HTTP side of `mtp serve` holds for its lifetime: the server's options, the engine handle, the
tokenizer threads, the output thread, and the sampling defaults read from the checkpoint."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from mtp_core.serve.engine_core import SHUTDOWN_MESSAGE
from mtp_core.serve.metrics import ErrorCounts
from mtp_core.serve.outputs import OutputProcessor
from mtp_core.serve.prompts import PromptEncoder
from mtp_core.serve.text import OutputText

REASONING_PARSERS = ("deepseek-r1",)
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024


@dataclass
class ServeOptions:
    """The server's own settings (the engine's come with the engine)."""
    api_key: Optional[str] = None
    allowed_origins: Sequence[str] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def validate(self) -> None:
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api_key (or MTP_API_KEY) is empty; give a key or leave it unset")
        for o in self.allowed_origins:
            if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
                raise ValueError(f"--allowed_origins entry {o!r} is not an origin; use scheme://host[:port] "
                                 "(no path), or *")


@dataclass
class ServerState:
    engine: Any                                  # EngineProcess | InProcessEngine
    tokenizer: Any
    prompts: PromptEncoder
    outputs: OutputProcessor
    model_name: str
    reasoning_parser: Optional[str]
    defaults: dict[str, Any]
    created: int
    options: ServeOptions
    info: dict = field(default_factory=dict)
    accepting: bool = True
    output_text: Callable[..., OutputText] = OutputText     # tests may wrap it to inject a per-request fault
    errors: ErrorCounts = field(default_factory=ErrorCounts)  # error answers by status and reason (/metrics)

    @property
    def max_seq_len(self) -> int:
        return self.engine.ready.max_seq_len

    @property
    def up(self) -> bool:
        """Taking requests: not shutting down, and the engine and the output thread alive."""
        return self.accepting and self.engine.alive and not self.outputs.gone

    def cut(self) -> int:
        """Shutdown past --shutdown_timeout: every unfinished request gets its 503 now."""
        self.accepting = False
        return self.outputs.cut_all(503, SHUTDOWN_MESSAGE)


def generation_defaults(model_dir: str) -> dict[str, Any]:
    """Sampling defaults from generation_config.json (as vLLM does): do_sample false -> greedy."""
    try:
        gen = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        gen = {}
    out: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0
    for k in ("temperature", "top_p", "top_k"):
        v = gen.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and gen.get("do_sample") is not False:
            out[k] = v
    return out

"""What the API process and the engine process say to each other (msgspec structs, MessagePack on the wire).

API -> engine: `Add` (a tokenized request), `Abort` (requests to drop), `Shutdown`.
engine -> API: `Ready` (once, after the model loaded: what the API side needs to validate requests and
what GET /server_info shows), `Failed` (instead of Ready: loading failed), then one `Outputs` per engine
loop iteration that changed anything: each request's new token ids (a final one carries its finish reason
and statistics, or an error) and a snapshot of the engine's gauges and counters for /metrics.

The same structs travel unencoded between the threads of `InProcessEngine`, so both layouts run the same
protocol; only `EngineProcess` encodes them.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from mtp_core.sampling import SamplingParams
from mtp_core.request.stats import SpecStats


class Add(msgspec.Struct, tag="add", array_like=True):
    rid: int
    prompt_ids: list[int]
    params: SamplingParams
    after: int = 0           # another choice of the same prompt: admitted once that request's prefill is done,
                             # so that it maps the prompt's blocks from the prefix cache (0: at once)


class Abort(msgspec.Struct, tag="abort", array_like=True):
    rids: list[int]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


Command = Union[Add, Abort, Shutdown]


class Output(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one loop iteration."""
    rid: int
    token_ids: list[int]
    finish_reason: Optional[str] = None          # set on the final output: "stop" | "length" | "abort"
    stats: Optional[SpecStats] = None            # final output: the request's speculative-decoding counters
    queue_s: Optional[float] = None              # set once: arrival at the engine -> first scheduled step
    error_status: int = 0                        # final output of a failed request: the HTTP status ...
    error: str = ""                              # ... and the one-line message
    # params.logprobs set: (id, logprob, [(id, logprob)] top) per token of token_ids
    logprobs: Optional[list[tuple[int, float, list[tuple[int, float]]]]] = None
    # params.prompt_logprobs set, once (with the first tokens): None for the first prompt token, then per token
    prompt_logprobs: Optional[list[Optional[tuple[int, float, list[tuple[int, float]]]]]] = None


class EngineStats(msgspec.Struct, array_like=True):
    """The engine's gauges and monotonic counters, as of the end of a loop iteration."""
    num_running: int = 0
    num_waiting: int = 0
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    num_preemptions: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    step_buckets: list[int] = []                 # cumulative counts per STEP_BUCKETS_S bound
    step_failures: int = 0
    requests_rejected: int = 0
    prompt_tokens: int = 0                       # of admitted requests
    generation_tokens: int = 0
    prefix_cache: Optional[list[float]] = None   # see PREFIX_FIELDS; None without block reuse
    spec: SpecStats = msgspec.field(default_factory=SpecStats)


PREFIX_FIELDS = ("queries_tokens_total", "hits_tokens_total", "queries_blocks_total", "hits_blocks_total",
                 "token_hit_rate", "evicted_blocks_total")


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[Output]
    stats: EngineStats


class Ready(msgspec.Struct, tag="ready", array_like=True):
    max_seq_len: int
    pool_tokens: int                             # KV slots of the whole pool (a longer request can never run)
    vocab_size: int
    num_draft_tokens: int                        # K
    server_info: dict[str, Any]                  # GET /server_info


class Failed(msgspec.Struct, tag="failed", array_like=True):
    message: str
    usage_error: bool                            # a ValueError (bad checkpoint or setting): exit 2, else 1


EngineMessage = Union[Ready, Failed, Outputs]

command_encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
message_encoder = msgspec.msgpack.Encoder()
message_decoder = msgspec.msgpack.Decoder(EngineMessage)

"""The forward path an engine serves its model with: chosen once per engine, logged, then used by every
serving forward the engine runs (target, MTP modules, LM head).

  native  `NativeDecoder` (native_decode.py): one native op per forward over the paged cache, batch-invariant;
          built once per model where the model allows it (a CPU, the native ops loaded, weights it can read, one
          process); runtime.native_decode: false (env MTP_CORE_NATIVE_DECODE=0) keeps it off.
  torch   `TorchForward`: the model's own modules, on every device and for every model; the reference the native
          path is tested against.

Both offer the same three calls, so the runner, the drafters and the benches never ask which one they hold.
The static (CUDA-graph) step is the third way a step can run: `GraphRunner` runs the torch modules over
device-only metadata (`AttentionMetadata.uniform`, every MoE dense) and the engine's LM head.
"""
from __future__ import annotations

import logging
from typing import Protocol

import torch

from mtp_core.model.attention_metadata import AttentionMetadata
from mtp_core.model.deepseek_v3 import DeepseekV3ForCausalLM

log = logging.getLogger("mtp.model")


class ForwardPath(Protocol):
    name: str

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor]) -> torch.Tensor:
        """The target model: ids [T] -> hidden [T, H] after the final norm."""

    def mtp_forward(self, k: int, ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                    caches: list[torch.Tensor]) -> torch.Tensor:
        """MTP module k: (ids [T], hidden [T, H]) -> h_out [T, H]."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., V]."""


class TorchForward:
    """The model's torch modules."""

    name = "torch"

    def __init__(self, model: DeepseekV3ForCausalLM) -> None:
        self.model = model

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor]) -> torch.Tensor:
        return self.model(ids, meta, caches)

    def mtp_forward(self, k: int, ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                    caches: list[torch.Tensor]) -> torch.Tensor:
        return self.model.mtp_forward(k, ids, hidden, meta, caches)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def serving_forward(model: DeepseekV3ForCausalLM) -> ForwardPath:
    """The path an engine over `model` takes: the model's native decoder where it has one (prepared once per
    model by ensure_decode_fused, which logs why not otherwise), else its torch modules."""
    model.ensure_decode_fused()
    path: ForwardPath = model.native if model.native is not None else TorchForward(model)
    log.info("engine forward path: %s", path.name)
    return path

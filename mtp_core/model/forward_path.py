"""The interface of a forward path, the object an engine serves its model with (target, MTP modules, LM
head), and the model's own torch path:

  torch   `TorchForward`: the model's own modules, on every device and for every model; the reference the native
          path is tested against.
  native  `NativeDecoder` (mtp_core/native/native_decode.py): one native op per forward over the paged cache,
          batch-invariant, where the model allows it. Which of the two an engine takes is chosen once per engine
          and logged by mtp_core/native/forward_path.py (`serving_forward`), above both.

Both offer the same three calls, so the runner, the drafters and the benches never ask which one they hold.
The static (CUDA-graph) step is the third way a step can run: `GraphRunner` runs the torch modules over
device-only metadata (`AttentionMetadata.uniform`, every MoE dense) and the engine's LM head.
"""
from __future__ import annotations

from typing import Protocol

import torch

from mtp_core.model.attention_metadata import AttentionMetadata
from mtp_core.model.deepseek_v3 import DeepseekV3ForCausalLM


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


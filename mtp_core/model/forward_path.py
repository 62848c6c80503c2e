"""The interface of a forward path, the object an engine serves its model with (target, MTP modules, LM
head), and the model's own torch path:

  torch   `TorchForward`: the model's own modules, on every device and for every model; the reference the native
          path is tested against.
  native  `NativeDecoder` (mtp_core/native/native_decode.py): one native op per forward over the paged cache,
          batch-invariant, where the model allows it. Which of the two an engine takes is chosen once per engine
          and logged by mtp_core/native/forward_path.py (`serving_forward`), above both.

Both offer the same calls, so the runner, the drafters and the benches never ask which one they hold. An engine
given a draft vocabulary (speculative_config.draft_token_map: speculative/draft_vocab.py) scores its MTP drafts
with `draft_logits`, the LM head's rows of those ids only; `draft_tokens` maps the columns back to token ids.
The static (CUDA-graph) step is the third way a step can run: `GraphRunner` runs the torch modules over
device-only metadata (`AttentionMetadata.uniform`, every MoE dense) and the engine's LM head.
"""
from __future__ import annotations

from typing import Literal, Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from mtp_core.model.attention_metadata import AttentionMetadata
from mtp_core.model.deepseek_v3 import DeepseekV3ForCausalLM


# The rows a forward returns: every position's, each row's last position's ([B, H]: the one a draft starts from,
# or a prompt's whose other hidden states nobody keeps), or none (None: the forward only fills the caches). The
# native path skips, at the positions it leaves out, everything of the last layer after its KV write
# (decode_forward.h: Outputs).
RowOutputs = Literal["all", "last", "none"]


def row_ends(meta: AttentionMetadata) -> list[int]:
    """The index of each row's last token in the flattened batch."""
    return [e - 1 for e in meta.query_start[1:]]


def _rows_of(out: torch.Tensor, meta: AttentionMetadata, outputs: RowOutputs) -> Optional[torch.Tensor]:
    """A forward's every output -> the rows `outputs` says (the torch path computes them all)."""
    return out if outputs == "all" else out[row_ends(meta)] if outputs == "last" else None


class ForwardPath(Protocol):
    name: str

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor],
                outputs: RowOutputs = "all") -> Optional[torch.Tensor]:
        """The target model: ids [T] -> hidden [T, H] after the final norm, of the rows `outputs` says."""

    def forward_split(self, ids: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target model, its last layer run past the KV write only at each row's last position: (the residual
        stream entering the last layer [T, H], hidden [B, H] after the final norm at each row's last position).
        `forward_last_layer` over the residual later gives the other positions' hidden states, the same numbers
        `forward` gives (a deferred prompt's, for its MTP forward: speculative/backlog.py)."""

    def forward_last_layer(self, x: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor]
                           ) -> torch.Tensor:
        """The target's last layer and final norm from its input residual stream x [T, H] (forward_split's),
        at the same positions -> hidden [T, H] (the layer's KV entries are written again, with the same values)."""

    def mtp_forward(self, k: int, ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                    caches: list[torch.Tensor], outputs: RowOutputs = "all") -> Optional[torch.Tensor]:
        """MTP module k: (ids [T], hidden [T, H]) -> h_out [T, H], of the rows `outputs` says."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., V]."""

    # the token id of each column of draft_logits (ascending), None when drafts are scored over every id
    draft_ids: Optional[torch.Tensor]

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> float32 logits of the drafts' head [R, len(draft_ids)] (logits() without a draft
        vocabulary)."""


def draft_tokens(path: ForwardPath, columns: torch.Tensor) -> torch.Tensor:
    """Columns of draft_logits (its argmax: the greedy drafts) as token ids."""
    return columns if path.draft_ids is None else path.draft_ids[columns]


def draft_head_rows(model: DeepseekV3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The LM head's rows of `ids` [n, H], in their order: a copy of n rows (the target keeps the whole head)."""
    head = model.lm_head
    if type(head) is not nn.Linear or head.weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"speculative_config.draft_token_map needs the LM head as one bf16/fp32 matrix, but this "
                         f"model's is a {type(head).__name__} ({head.weight.dtype}); drop the token map")
    return head.weight.detach()[ids.to(head.weight.device)].contiguous()


class TorchForward:
    """The model's torch modules."""

    name = "torch"

    def __init__(self, model: DeepseekV3ForCausalLM, draft_vocab: Optional[torch.Tensor] = None) -> None:
        self.model = model
        dev = model.lm_head.weight.device
        self.draft_ids = None if draft_vocab is None else draft_vocab.to(dev)
        self.draft_head = None if draft_vocab is None else draft_head_rows(model, draft_vocab)

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor],
                outputs: RowOutputs = "all") -> Optional[torch.Tensor]:
        return _rows_of(self.model(ids, meta, caches), meta, outputs)

    def forward_split(self, ids: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        x = m.layers_from(0, m.num_main_layers - 1, m.model.embed_tokens(ids), meta, caches)
        return x, self.forward_last_layer(x, meta, caches)[row_ends(meta)]

    def forward_last_layer(self, x: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor]
                           ) -> torch.Tensor:
        m = self.model
        return m.model.norm(m.layers_from(m.num_main_layers - 1, 1, x, meta, caches))

    def mtp_forward(self, k: int, ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                    caches: list[torch.Tensor], outputs: RowOutputs = "all") -> Optional[torch.Tensor]:
        return _rows_of(self.model.mtp_forward(k, ids, hidden, meta, caches), meta, outputs)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.draft_head is None:
            return self.logits(hidden)
        return F.linear(hidden.to(self.draft_head.dtype), self.draft_head).float()


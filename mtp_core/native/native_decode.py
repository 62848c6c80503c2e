"""The native CPU decode forward of a DeepseekV3ForCausalLM: one call of mtp_core::decode_forward per
target forward (all main layers, final norm included) and one per MTP module forward, plus the
batch-invariant LM head mtp_core::decode_logits.

Built once per model by `NativeDecoder.build` (the weights as a `DecodeWeights`, native_weights.py: read
in place, or repacked for small models), or not at all, with one log line saying why: not a CPU, no native
ops (runtime.kernels: reference), runtime.native_decode: false, weights it cannot read, or a distributed
model. An engine that takes it (forward_path.py) serves every forward through it: decode, verification and
draft rows, and prefill chunks too (absorbed attention over the paged cache, causal within each row), so
that every token of a request is computed by the same batch-invariant code whatever shares its step and
however its prompt was chunked. References: the model's torch path and kernels/native_ref.py.
"""
from __future__ import annotations

import array
import copy
import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from mtp_core import kernels
from mtp_core.config import runtime
from mtp_core.loader.quant.linear import Fp8BlockLinear, Nvfp4Linear
from mtp_core.model.attention_metadata import AttentionMetadata
from mtp_core.model.forward_path import RowOutputs
from mtp_core.model.layers import MLP
from mtp_core.model.moe import MoE
from mtp_core.native.native_weights import NativeWeights, build_native_weights, choose_layout, draft_head

log = logging.getLogger("mtp.model")

MAX_TOKENS = 16384    # tokens per op call (bounds its work buffers); a larger batch runs as several calls
_LINEARS = (nn.Linear, Fp8BlockLinear, Nvfp4Linear)
_OUTPUTS = {"all": 0, "last": 1, "none": 2}    # RowOutputs as decode_forward's `outputs`


def direct_op(packet: Any) -> Callable:
    """The C++ entry of an op that takes the DecodeWeights script object. torch's Python wrapper of such an op
    scans every argument (each cache tensor too) for fake script objects on every call, which only tracing
    needs: ~10-20 us per call, a few percent of a shipped-model decode step. Falls back to the wrapper."""
    return getattr(packet.default, "_op", packet)


class NativeDecoder:
    name = "native"
    draft_ids: Optional[torch.Tensor] = None    # the draft vocabulary (with_draft_vocab), None = every id

    def __init__(self, model: nn.Module, weights: NativeWeights, max_tokens: int = MAX_TOKENS) -> None:
        self.rope = model.rope
        self.weights = weights
        self.handle = torch.classes.mtp_core.DecodeWeights(*weights.dictionaries())
        ops = torch.ops.mtp_core
        self.forward_op, self.logits_op, self.step_op = (direct_op(ops.decode_forward),
                                                         direct_op(ops.decode_logits), direct_op(ops.mtp_step))
        self.draft_op = direct_op(ops.eagle_draft)
        self.num_main = model.num_main_layers
        self.vocab = weights.dims["vocab"]
        self.max_tokens = max_tokens
        self.rope_len = 0
        self.grow_rope(int(model.config.max_position_embeddings) + 64)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def why_not(cls, model: nn.Module) -> Optional[str]:
        """None when the native decode forward can serve this model, else the reason."""
        if not runtime.native_decode():
            return runtime.source("native_decode")
        if not kernels.native_ops().cpu:
            return kernels.native_ops().summary
        p = model.model.embed_tokens.weight
        if p.device.type != "cpu":
            return f"weights on {p.device}"
        if p.dtype not in (torch.float32, torch.bfloat16):
            return f"weights in {p.dtype}"
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            return "distributed (TP/EP) model"
        for layer in model.model.layers:
            mlp = layer.mlp
            if type(mlp) is MoE:
                mlps = [*mlp.experts, *([mlp.shared_experts] if mlp.shared_experts is not None else [])]
            elif type(mlp) is MLP:
                mlps = [mlp]
            else:
                return f"feed-forward {type(mlp).__name__} is not a plain MLP / MoE"
            attn = layer.self_attn
            linears = [attn.kv_a_proj_with_mqa, attn.kv_b_proj, attn.o_proj,
                       *([attn.q_a_proj, attn.q_b_proj] if attn.q_lora_rank is not None else [attn.q_proj])]
            linears += [l for m in mlps for l in (m.gate_proj, m.up_proj, m.down_proj)]
            if attn.indexer is not None:
                linears += [attn.indexer.wq_b, attn.indexer.wk, attn.indexer.weights_proj]
            for lin in linears:
                if not isinstance(lin, _LINEARS) or (type(lin) is nn.Linear and lin.weight.dtype not in
                                                     (torch.float32, torch.bfloat16)):
                    return f"a {type(lin).__name__} the native kernels cannot read"
        return None

    @classmethod
    def build(cls, model: nn.Module, layout: str = "") -> Optional["NativeDecoder"]:
        why = cls.why_not(model)
        if why is not None:
            log.info("native CPU decode forward off: %s", why)
            return None
        layout = choose_layout(model, layout)
        dec = cls(model, build_native_weights(model, layout))
        log.info("native CPU decode forward on (%s kernels, %d threads): %s; reads %s", kernels.cpu_isa(),
                 torch.get_num_threads(), dec.handle.summary(), dec.weights.formats())
        return dec

    def with_draft_vocab(self, model: nn.Module, ids: torch.Tensor) -> "NativeDecoder":
        """A decoder for one engine whose MTP drafts are scored over the draft vocabulary `ids` (int64, ascending):
        the same weights, read in place, plus a copy of the LM head's rows of `ids` that the native chains and
        draft_logits read instead of the whole head (speculative/draft_vocab.py)."""
        dec = copy.copy(self)
        tensors, ints, floats = self.weights.dictionaries()
        draft_head(model, ids, self.weights.layout).entries("draft_head", tensors, ints, floats)
        tensors["draft_ids"] = dec.draft_ids = ids.to(torch.long).contiguous()
        dec.handle = torch.classes.mtp_core.DecodeWeights(tensors, ints, floats)
        return dec

    def grow_rope(self, n: int) -> None:
        cos, sin = self.rope.cos_sin(torch.arange(n))
        self.rope_cos, self.rope_sin, self.rope_len = cos.float().contiguous(), sin.float().contiguous(), n

    # ---- serving -------------------------------------------------------------------------
    def _call(self, first: int, num: int, ids: torch.Tensor, hidden: Optional[torch.Tensor],
              caches: list[torch.Tensor], meta: AttentionMetadata, final_norm: bool,
              outputs: RowOutputs = "all") -> Optional[torch.Tensor]:
        """Layers first..first+num-1 over the batch (host metadata: AttentionMetadata.build), float32 out whatever
        the weights: MTP inputs and logits see the unrounded hidden state. outputs: forward_path.RowOutputs."""
        if meta.query_start_i32 is None:
            raise ValueError("the native forward needs host metadata (AttentionMetadata.build), not uniform()")
        if meta.query_start[-1] > self.max_tokens:
            parts = [(self._call(first, num, ids[a:b], None if hidden is None else hidden[a:b], caches, part,
                                 final_norm, outputs), cut) for a, b, part, cut in _pieces(meta, self.max_tokens)]
            if outputs == "none":
                return None
            # "last": a row cut in two ends in the later piece; the earlier piece's last row is its first part
            return torch.cat([out[:-1] if cut and outputs == "last" else out for out, cut in parts])
        if max(meta.context_lens) > self.rope_len:
            self.grow_rope(max(meta.context_lens) + 256)
        out = self.forward_op(self.handle, first, num, ids, hidden, caches, self.rope_cos, self.rope_sin,
                              meta.positions, meta.slot_mapping, meta.query_start_i32, meta.block_tables_i32,
                              meta.seqlens_i32, final_norm, _OUTPUTS[outputs])
        return None if outputs == "none" else out

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor],
                outputs: RowOutputs = "all") -> Optional[torch.Tensor]:
        """The target model over a batch: ids [T] -> hidden [T, H] float32 after the final norm, of the rows
        `outputs` says (forward_path.RowOutputs)."""
        return self._call(0, self.num_main, ids, None, caches[:self.num_main], meta, True, outputs)

    def forward_split(self, ids: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_path.ForwardPath.forward_split: two calls, the layers before the last (every position's residual
        stream out), then the last layer from it with each row's last output (decode_forward.h: Outputs)."""
        last = self.num_main - 1
        x = self._call(0, last, ids, None, caches[:last], meta, False)
        return x, self._call(last, 1, ids, x, caches[last:self.num_main], meta, True, "last")

    def forward_last_layer(self, x: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor]
                           ) -> torch.Tensor:
        last = self.num_main - 1
        ids = torch.zeros(len(x), dtype=torch.long)     # unread: the layer starts from x
        return self._call(last, 1, ids, x.contiguous(), caches[last:self.num_main], meta, True)

    def mtp_forward(self, k: int, ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                    caches: list[torch.Tensor], outputs: RowOutputs = "all") -> Optional[torch.Tensor]:
        """MTP module k: (ids [T], hidden [T, H]) -> h_out [T, H] after its shared-head norm, of the rows
        `outputs` says (forward_path.RowOutputs)."""
        layer = self.num_main + k
        return self._call(layer, 1, ids, hidden.contiguous(), [caches[layer]], meta, False, outputs)

    def eagle_drafts(self, next_tokens: list[list[int]], hidden: torch.Tensor, start: list[int],
                     tables: list[list[int]], num_drafts: list[int], caches: list[torch.Tensor]) -> list[list[int]]:
        """MTP Eagle's forward 1 over each row's new positions (next_tokens[b]: x_{q+1} from start[b]; hidden
        [T, H] their main hidden states, rows one after another) and its chain, in one call
        (mtp_core::eagle_draft) -> num_drafts[b] drafts per row."""
        end = max(s + len(t) + k for s, t, k in zip(start, next_tokens, num_drafts))
        if end > self.rope_len:
            self.grow_rope(end + 256)
        qs = [0]
        for t in next_tokens:
            qs.append(qs[-1] + len(t))
        out = self.draft_op(self.handle, torch.tensor([x for t in next_tokens for x in t], dtype=torch.long),
                            hidden.float().contiguous(), torch.tensor(qs, dtype=torch.int32),
                            torch.tensor(start, dtype=torch.long), padded_tables(tables),
                            torch.tensor(num_drafts, dtype=torch.int32), caches, self.rope_cos, self.rope_sin,
                            self.num_main).tolist()
        return [row[:k] for row, k in zip(out, num_drafts)]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return self.logits_op(self.handle, flat, False).view(*hidden.shape[:-1], self.vocab)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_op(self.handle, hidden.reshape(-1, hidden.shape[-1]), True)


def padded_tables(tables: list[list[int]]) -> torch.Tensor:
    """The rows' block tables as the native ops take them: int32 [B, longest], -1 past a row's last block."""
    width = max(len(t) for t in tables)
    flat = array.array("i", [b for t in tables for b in t + [-1] * (width - len(t))])
    return torch.frombuffer(flat, dtype=torch.int32).view(len(tables), width)


def _pieces(meta: AttentionMetadata, max_tokens: int) -> list[tuple[int, int, AttentionMetadata, bool]]:
    """A batch of more than max_tokens tokens as consecutive calls of at most max_tokens each: (first token, end
    token, metadata, whether its last row goes on in the next call) per call. A row may be cut in two; its second
    part then attends to the first part's cache entries, as the next chunk of a chunked prefill does (the same
    values: the kernels are chunk- and batch-invariant)."""
    pieces: list[tuple[int, int, AttentionMetadata, bool]] = []
    rows: list[list[int]] = []
    tables: list[list[int]] = []
    start = used = 0
    for positions, table in zip(meta.row_positions, meta.block_tables):
        while positions:
            take = positions[:max_tokens - used]
            positions = positions[len(take):]
            rows.append(take)
            tables.append(table)
            used += len(take)
            if used == max_tokens:
                pieces.append((start, start + used, AttentionMetadata.build(
                    rows, tables, meta.tokens_per_block, meta.use_absorbed, device=meta.positions.device),
                    bool(positions)))
                start, used, rows, tables = start + used, 0, [], []
    if rows:
        pieces.append((start, start + used, AttentionMetadata.build(
            rows, tables, meta.tokens_per_block, meta.use_absorbed, device=meta.positions.device), False))
    return pieces

"""The native CPU decode forward of a DeepseekV3ForCausalLM: one call of mtp_core::decode_forward per
target forward (all main layers, final norm included) and one per MTP module forward, plus the
batch-invariant LM head mtp_core::linear_bi.

Built once per model by `NativeDecoder.build` after `fuse_for_decode` (it reads the fused weights:
W_a = [q_a | kv_a], absorbed W_q / W_o, stacked experts), or not at all, with one log line saying why:
not a CPU, no native ops (`MTP_CORE_KERNELS=reference`), `MTP_CORE_NATIVE_DECODE=0`, weights that are
not plain fp32/bf16 (quantized), unfused attention, or a distributed model. It serves every serving
forward with host metadata: decode, verification and draft rows, and prefill chunks too (absorbed
attention over the paged cache, causal within each row, at most MAX_TOKENS tokens per call), so that every
token of a request is computed by the same batch-invariant code whatever shares its step and however its
prompt was chunked. The contract and the torch reference are in mtp_core/kernels/decode_ref.py.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch
from torch import nn

from mtp_core import kernels
from mtp_core.kernels.decode_ref import DIMS, WEIGHT_SLOTS, pack_weight
from mtp_core.model.attention_metadata import AttentionMetadata
from mtp_core.model.layers import MLP
from mtp_core.model.moe import MoE

log = logging.getLogger("mtp.model")

MAX_TOKENS = 16384


def _none() -> torch.Tensor:
    return torch.empty(0)


def _c(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous()


class NativeDecoder:
    def __init__(self, model: nn.Module, layer_weights: list[list[torch.Tensor]], dims: list[int],
                 fparams: list[float]) -> None:
        self.rope = model.rope
        self.layer_weights = layer_weights          # per model.layers index: WEIGHT_SLOTS tensors
        self.dims, self.fparams = dims, fparams
        self.num_main = model.num_main_layers
        self.main_weights = [w for ws in layer_weights[:self.num_main] for w in ws]
        self.final_norm = _c(model.model.norm.weight)
        self.embed = _c(model.model.embed_tokens.weight)
        self.lm_head = pack_weight(model.lm_head.weight.detach())
        self.vocab = model.lm_head.weight.shape[0]
        self._rope_len = 0
        self._grow_rope(int(model.config.max_position_embeddings) + 64)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def why_not(cls, model: nn.Module) -> Optional[str]:
        """None when the native decode forward can serve this (fused) model, else the reason."""
        if os.environ.get("MTP_CORE_NATIVE_DECODE", "1") == "0":
            return "MTP_CORE_NATIVE_DECODE=0"
        if not kernels.NATIVE.cpu:
            return kernels.NATIVE.summary
        p = next(model.parameters())
        if p.device.type != "cpu":
            return f"weights on {p.device}"
        if p.dtype not in (torch.float32, torch.bfloat16):
            return f"weights in {p.dtype}"
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            return "distributed (TP/EP) model"
        for layer in model.model.layers:
            if layer.self_attn.decode_weights is None:
                return "attention weights not fused for decode (quantized or too large to absorb)"
            mlp = layer.mlp
            if type(mlp) is MoE:
                mlps = [*mlp.experts, *([mlp.shared_experts] if mlp.shared_experts is not None else [])]
            elif type(mlp) is MLP:
                mlps = [mlp]
            else:
                return f"feed-forward {type(mlp).__name__} is not a plain MLP / MoE"
            for m in mlps:
                if any(type(l) is not nn.Linear or l.bias is not None or l.weight.dtype != p.dtype
                       for l in (m.gate_proj, m.up_proj, m.down_proj)):
                    return "feed-forward weights are not plain fp32/bf16 linears"
        return None

    @classmethod
    def build(cls, model: nn.Module) -> Optional["NativeDecoder"]:
        why = cls.why_not(model)
        if why is not None:
            log.info("native CPU decode forward off: %s", why)
            return None
        cfg = model.config
        attn0 = model.model.layers[0].self_attn
        dims = dict(hidden=cfg.hidden_size, q_lora=cfg.q_lora_rank or 0, kv_lora=cfg.kv_lora_rank,
                    rope=cfg.qk_rope_head_dim, heads=attn0.num_heads, experts=int(cfg.n_routed_experts or 0),
                    top_k=int(cfg.num_experts_per_tok or 0), groups=int(cfg.n_group or 1),
                    topk_groups=int(cfg.topk_group or 1), norm_topk=int(bool(cfg.norm_topk_prob)),
                    interleave=int(bool(cfg.rope_interleave)))
        fparams = [float(cfg.rms_norm_eps), float(attn0.softmax_scale), float(cfg.routed_scaling_factor or 1.0)]
        weights = [cls._layer_weights(layer) for layer in model.model.layers]
        dec = cls(model, weights, [int(dims[k]) for k in DIMS], fparams)
        log.info("native CPU decode forward on (%s kernels, %d threads)", kernels.cpu_isa(), torch.get_num_threads())
        return dec

    @staticmethod
    def _layer_weights(layer: nn.Module) -> list[torch.Tensor]:
        """The layer's decode weights in WEIGHT_SLOTS order; projections packed (a copy: decode reads only
        these, prefill the model's own)."""
        w = {k: _none() for k in WEIGHT_SLOTS}
        P = lambda t: pack_weight(t.detach())  # noqa: E731
        attn = layer.self_attn
        w_a, b_a, w_q, w_o = attn.decode_weights
        w.update(in_norm=_c(layer.input_layernorm.weight), w_a=P(w_a), w_o=P(w_o),
                 kv_norm=_c(attn.kv_a_layernorm.weight), post_norm=_c(layer.post_attention_layernorm.weight))
        if b_a is not None:
            w["b_a"] = _c(b_a.float())
        if attn.q_lora_rank is not None:
            w.update(q_a_norm=_c(attn.q_a_layernorm.weight), w_q=P(w_q))
        mlp = layer.mlp
        gate_up = lambda m: torch.cat([m.gate_proj.weight, m.up_proj.weight])  # noqa: E731
        if type(mlp) is MLP:
            w.update(mlp_w13=P(gate_up(mlp)), mlp_w2=P(mlp.down_proj.weight))
        else:
            w.update(gate=P(mlp.gate.weight.float()), gate_bias=_c(mlp.gate.e_score_correction_bias.float()),
                     exp_w13=P(torch.stack([gate_up(e) for e in mlp.experts])),
                     exp_w2=P(torch.stack([e.down_proj.weight for e in mlp.experts])))
            if mlp.shared_experts is not None:
                w.update(sh_w13=P(gate_up(mlp.shared_experts)), sh_w2=P(mlp.shared_experts.down_proj.weight))
        if hasattr(layer, "eh_proj"):
            w.update(enorm=_c(layer.enorm.weight), hnorm=_c(layer.hnorm.weight), eh_proj=P(layer.eh_proj.weight),
                     head_norm=_c(layer.shared_head.norm.weight))
        return [w[k] for k in WEIGHT_SLOTS]

    def _grow_rope(self, n: int) -> None:
        cos, sin = self.rope.cos_sin(torch.arange(n))
        self.rope_cos, self.rope_sin, self._rope_len = cos.contiguous(), sin.contiguous(), n

    # ---- serving -------------------------------------------------------------------------
    def accepts(self, meta: AttentionMetadata) -> bool:
        """Serving forwards with host metadata (AttentionMetadata.build, not the device-only uniform() of the
        graph step), no autograd, at most MAX_TOKENS tokens."""
        if meta.query_start_i32 is None or torch.is_grad_enabled() or meta.query_start[-1] > MAX_TOKENS:
            return False
        if max(meta.context_lens) > self._rope_len:
            self._grow_rope(max(meta.context_lens) + 256)
        return True

    def _call(self, ids: torch.Tensor, hidden: Optional[torch.Tensor], weights: list[torch.Tensor],
              caches: list[torch.Tensor], meta: AttentionMetadata, final_norm: Optional[torch.Tensor]) -> torch.Tensor:
        return kernels.decode_forward(ids, self.embed, hidden, weights, self.dims, self.fparams, caches,
                                      self.rope_cos, self.rope_sin, meta.positions, meta.slot_mapping,
                                      meta.query_start_i32,
                                      meta.block_tables_i32, meta.seqlens_i32, final_norm)

    def forward(self, ids: torch.Tensor, meta: AttentionMetadata, caches: list[torch.Tensor]) -> torch.Tensor:
        """The target model over a decode batch: ids [T] -> hidden [T, H] after the final norm."""
        return self._call(ids, None, self.main_weights, caches[:self.num_main], meta, self.final_norm)

    def mtp_forward(self, k: int, ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                    caches: list[torch.Tensor]) -> torch.Tensor:
        """MTP module k: (ids [T], hidden [T, H]) -> h_out [T, H] after its shared-head norm."""
        layer = self.num_main + k
        return self._call(ids, hidden.contiguous(), self.layer_weights[layer], [caches[layer]], meta, None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return kernels.linear_bi(flat, self.lm_head, self.vocab).view(*hidden.shape[:-1], self.vocab)

"""DeepSeek-V3 causal LM with its MTP modules, laid out exactly as the Hugging Face checkpoint.

`model.layers[0 .. L-1]` are the main decoder layers; `model.layers[L + k]` is MTP module k (0-based),
so `state_dict()` names equal the checkpoint names. The MTP modules share `model.embed_tokens` and
`lm_head` (one copy in memory). KV caches are indexed the same way: cache[i] belongs to model.layers[i].
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from mtp_core.config import ModelConfig
from mtp_core.model.attention_metadata import AttentionMetadata
from mtp_core.model.decoder_layer import DecoderLayer
from mtp_core.model.layers import RMSNorm
from mtp_core.model.mtp import MTPModule
from mtp_core.model.rope import RotaryEmbedding


log = logging.getLogger("mtp.model")


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        L = cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers: list[nn.Module] = [DecoderLayer(cfg, i) for i in range(L)]
        layers += [MTPModule(cfg, L + k) for k in range(cfg.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DeepseekV3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg)
        self.num_main_layers = cfg.num_hidden_layers
        # the native CPU decode forward (a NativeDecoder), set once by mtp_core.native.forward_path.prepare_decode;
        # the model itself never calls it
        self.native = None

    def __getstate__(self) -> dict:
        """Copies (copy.deepcopy, pickle) drop the decode-time fusion and the native decoder: both are
        snapshots of the weights (absorbed attention, packed panels), so a copy whose weights are then changed
        fuses and packs its own when an engine first uses it."""
        state = self.__dict__.copy()
        state["native"] = None
        state["decode_fused"] = False
        return state

    @property
    def num_mtp_modules(self) -> int:
        return len(self.model.layers) - self.num_main_layers

    def mtp_module(self, k: int) -> MTPModule:
        return self.model.layers[self.num_main_layers + k]  # type: ignore[return-value]

    def draft_read_share(self, draft_vocab: int = 0) -> float:
        """One draft's forward (the first MTP module and the LM head, over draft_vocab rows where a token map cuts
        it) / one decode step's (every main layer and the LM head), in weight bytes read per token: routed experts
        count at top-k of their number, the embedding (a row) not at all. The draft-length policy's prior cost
        of a draft, before it measures one (speculative/costs.CostPrior); 0 without MTP modules."""
        if not self.num_mtp_modules:
            return 0.0
        cfg = self.config
        routed = cfg.num_experts_per_tok / cfg.n_routed_experts if cfg.n_routed_experts else 1.0
        head = _matrix_bytes(self.lm_head)
        layers = [_matrix_bytes(layer, routed) for layer in self.model.layers]
        main = sum(layers[:self.num_main_layers]) + head
        draft = layers[self.num_main_layers] + head * (draft_vocab / cfg.vocab_size if draft_vocab else 1.0)
        return draft / max(main, 1)

    # ---- serving (paged cache) -----------------------------------------------------------
    def ensure_decode_fused(self) -> None:
        """Once per model: the torch path's decode-time weight fusion (each fusion skips itself where it would grow
        the weights), logged. Engines prepare a model through mtp_core.native.forward_path.prepare_decode, which
        calls this and then builds the native CPU decode forward from the fused weights."""
        if not getattr(self, "decode_fused", False):
            log.info("decode weight fusion: %s", self.fuse_for_decode())
            self.decode_fused = True

    def fuse_for_decode(self) -> dict[str, int]:
        """Serving-time weight fusion of every layer (MLA absorption, stacked experts); each module skips
        itself when its weights do not allow it. Returns how many modules were fused."""
        fused = {"attention": 0, "moe": 0}
        for layer in self.model.layers:
            fused["attention"] += layer.self_attn.fuse_for_decode()
            if hasattr(layer.mlp, "fuse_for_decode"):
                fused["moe"] += layer.mlp.fuse_for_decode()
        return fused

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids [T] -> hidden [T, hidden] after the final norm: the torch path (an engine may serve its
        forwards natively instead: forward_path.py)."""
        x = self.layers_from(0, self.num_main_layers, self.model.embed_tokens(input_ids), meta, kv_caches)
        return self.model.norm(x)

    def layers_from(self, first: int, num: int, x: torch.Tensor, meta: AttentionMetadata,
                    kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Main layers first..first+num-1 over the residual stream x [T, hidden] (kv_caches: every main layer's)."""
        cos, sin = self.rope.cos_sin(meta.positions)
        for i in range(first, first + num):
            x = self.model.layers[i].block(x, self.rope, cos, sin, meta, kv_caches[i])
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(hidden).float()

    def mtp_forward(self, k: int, input_ids: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                    kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """MTP module k: input_ids [T], hidden [T, hidden] -> h_out [T, hidden]."""
        cos, sin = self.rope.cos_sin(meta.positions)
        layer = self.num_main_layers + k
        return self.mtp_module(k)(self.model.embed_tokens(input_ids), hidden, self.rope, cos, sin, meta,
                                  kv_caches[layer])

    # ---- training / reference (no cache) -------------------------------------------------
    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] -> hidden [B, S, hidden] after the final norm (causal, positions 0..S-1)."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rope.cos_sin(pos)
        x = self.model.embed_tokens(input_ids)
        for i in range(self.num_main_layers):
            x = self.model.layers[i].block(x, self.rope, cos, sin, None, None)
        return self.model.norm(x)

    def mtp_forward_dense(self, k: int, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """MTP module k without a cache: input_ids [B, S], hidden [B, S, hidden] -> [B, S, hidden]."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rope.cos_sin(pos)
        return self.mtp_module(k)(self.model.embed_tokens(input_ids), hidden, self.rope, cos, sin, None, None)


def _matrix_bytes(module: nn.Module, routed: float = 1.0) -> float:
    """Bytes of the module's matrices as stored (weights, packed codes and their scales), the routed experts'
    (`experts.<i>.`; not `shared_experts.`) times `routed`: what one token's forward reads."""
    total = 0.0
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.dim() >= 2:
            b = t.numel() * t.element_size()
            total += b * routed if ".experts." in f".{name}" else b
    return total

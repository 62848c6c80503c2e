"""The weights of a DeepseekV3ForCausalLM as the native CPU forward reads them: one typed structure per
model, turned once into the named dictionaries of `torch.classes.mtp_core.DecodeWeights`
(csrc/cpu/decode_weights.h), which checks them once.

Two layouts, chosen once per model (`choose_layout`, logged by NativeDecoder):

  direct  every matrix is read where the model keeps it: nn.Linear weights row-major in their own dtype
          (fp32 / bf16), FP8-block weights as e4m3 + the checkpoint's block scales, NVFP4 as packed codes
          + group scales (chunk-interleaved in place once, mtp_core/kernels/nvfp4_layout.py). No copy of the
          weights is made. MLA is absorbed at run time: per head, q_nope x W_UK and latent x W_UV read
          kv_b_proj's rows in place, so attention reads exactly the checkpoint's attention bytes.
  packed  small models: each matrix repacked into 64-row panels (a copy; tiny next to the KV cache) and
          MLA pre-absorbed (W_UK folded into the query projection, W_UV into o_proj), which is faster when
          the matrices are too narrow for row-wise dot products and the absorbed weights do not grow.

Where the CPU has AMX (`kernels.cpu_amx()`), the direct layout's bf16 row-wise matrices run on AMX tiles
(docs/native_cpu.md); everything else stays on the fp32 kernels, the exact reference.

`Matrix.dense()` gives every matrix's real values in fp32: the reference (mtp_core/kernels/native_ref.py)
and the tests read the same structure.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from mtp_core import kernels
from mtp_core.config import runtime
from mtp_core.kernels import nvfp4_layout
from mtp_core.kernels.mat import BF16, COLS, F32, FP8, NVFP4, PAIRS, PANEL, ROWS
from mtp_core.loader.quant.fp8 import dequantize_fp8_block
from mtp_core.loader.quant.linear import Fp8BlockLinear, Nvfp4Linear
from mtp_core.loader.quant.nvfp4 import dequantize_nvfp4
from mtp_core.model.forward_path import draft_head_rows
from mtp_core.model.layers import MLP
from mtp_core.model.moe import MoE

log = logging.getLogger("mtp.model")

FMT_NAMES = {F32: "fp32", BF16: "bf16", FP8: "fp8", NVFP4: "nvfp4"}
PACKED_MAX_BYTES = 64 << 20    # packed layout (repacked copies, pre-absorbed MLA) up to this many weight bytes
LAYOUTS = ("auto", "direct", "packed")


@dataclass
class Matrix:
    """W [n outputs, k inputs] as the kernels read it (csrc/cpu/decode_kernels.h: Mat; the codes of its format and
    layout: kernels/mat.py)."""
    layout: int
    fmt: int
    n: int
    k: int
    data: torch.Tensor                       # ROWS [n, k] (NVFP4 [n, k/2] uint8), COLS [k, n], PANEL [P, k, 64],
                                             # PAIRS [ceil(n/16), ceil(k/2), 32] bf16
    scale: Optional[torch.Tensor] = None     # FP8: the source's block scales x 256, [rows/128, cols/128]
    scale_r0: int = 0                        # FP8: first source row within its 128-row block
    gscale: Optional[torch.Tensor] = None    # NVFP4: e4m3 bytes [n, k/16]
    gscale2: float = 1.0                     # NVFP4: global scale
    bias: Optional[torch.Tensor] = None      # [n] fp32

    def entries(self, name: str, tensors: dict, ints: dict, floats: dict) -> None:
        tensors[f"{name}.data"] = self.data
        ints.update({f"{name}.layout": self.layout, f"{name}.fmt": self.fmt, f"{name}.n": self.n,
                     f"{name}.k": self.k, f"{name}.scale_r0": self.scale_r0})
        if self.scale is not None:
            tensors[f"{name}.scale"] = self.scale
        if self.gscale is not None:
            tensors[f"{name}.gscale"] = self.gscale
            floats[f"{name}.gscale2"] = float(self.gscale2)
        if self.bias is not None:
            tensors[f"{name}.bias"] = self.bias

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.gscale) if t is not None)

    def dense(self) -> torch.Tensor:
        """The real values, float32 [n, k]."""
        if self.layout == PANEL:
            return self.data.float().transpose(-1, -2).reshape(-1, self.k)[:self.n]
        if self.layout == PAIRS:   # [blocks, pairs, 16 rows, 2 inputs] -> [rows, inputs]
            b, p = self.data.shape[:2]
            w = self.data.float().view(b, p, 16, 2).permute(0, 2, 1, 3).reshape(b * 16, 2 * p)
            return w[:self.n, :self.k].contiguous()
        if self.fmt in (F32, BF16):
            w = self.data.float()
        elif self.fmt == FP8:
            rows, cols = (self.n, self.k) if self.layout == ROWS else (self.k, self.n)
            src = torch.zeros(self.scale_r0 + rows, cols, dtype=torch.float8_e4m3fn)
            src[self.scale_r0:] = self.data[:rows, :cols].view(torch.float8_e4m3fn)
            w = dequantize_fp8_block(src, self.scale / 256.0)[self.scale_r0:]
        else:
            codes = nvfp4_layout.deinterleave(self.data[:, : self.k // 2])
            w = dequantize_nvfp4(codes, self.gscale[:, : self.k // 16].view(torch.float8_e4m3fn),
                                 torch.tensor(self.gscale2, dtype=torch.float32))
        w = w[: self.k, : self.n].t() if self.layout == COLS else w[: self.n, : self.k]
        return w.contiguous()


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [ceil(N/64), K, 64]: 64 output rows per panel, k-major inside it (rows past N zero)."""
    n, k = w.shape
    padded = torch.zeros(-(-n // 64) * 64, k, dtype=w.dtype)
    padded[:n] = w
    return padded.view(-1, 64, k).transpose(-1, -2).contiguous()


def pack_pairs(w: torch.Tensor) -> torch.Tensor:
    """bf16 W [N, K] -> [ceil(N/16), ceil(K/2), 32]: 16-row blocks, each input pair's 16 rows x 2 inputs side by
    side (zeros past N and K): what the bf16 dot products multiply a broadcast pair of activations with."""
    n, k = w.shape
    padded = torch.zeros(-(-n // 16) * 16, -(-k // 2) * 2, dtype=torch.bfloat16)
    padded[:n, :k] = w
    return padded.view(-1, 16, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).reshape(-1, padded.shape[1] // 2, 32) \
        .contiguous()


def _fmt_of(t: torch.Tensor) -> int:
    if t.dtype == torch.float32:
        return F32
    if t.dtype == torch.bfloat16:
        return BF16
    raise ValueError(f"native decode: weights must be float32 or bfloat16, got {t.dtype}")


def panel(w: torch.Tensor, pairs: bool = False) -> Matrix:
    """A packed copy: 64-row panels, or for bf16 weights on a CPU with bf16 dot products (pairs) input pairs."""
    if pairs and w.dtype == torch.bfloat16:
        return Matrix(PAIRS, BF16, w.shape[0], w.shape[1], pack_pairs(w.detach()))
    return Matrix(PANEL, _fmt_of(w), w.shape[0], w.shape[1], pack_panels(w.detach()))


def _fp8_scale(scale_inv: torch.Tensor) -> torch.Tensor:   # the kernels decode e4m3 as value / 256 (exact)
    return (scale_inv.float() * 256.0).contiguous()


def rows_of(module: nn.Module) -> Matrix:
    """A linear module's weight read in place (no copy): nn.Linear, FP8-block or NVFP4."""
    if type(module) is nn.Linear:
        w = module.weight.detach()
        bias = module.bias.detach().float().contiguous() if module.bias is not None else None
        return Matrix(ROWS, _fmt_of(w), w.shape[0], w.shape[1], w, bias=bias)
    if isinstance(module, Fp8BlockLinear) and tuple(module.block_size) == (128, 128):
        return Matrix(ROWS, FP8, module.out_features, module.in_features, module.weight_bits,
                      scale=_fp8_scale(module.weight_scale_inv))
    if isinstance(module, Nvfp4Linear) and module.in_features % 16 == 0:
        nvfp4_layout.make_interleaved(module)
        return Matrix(ROWS, NVFP4, module.out_features, module.in_features, module.weight_packed,
                      gscale=module.weight_scale_bits, gscale2=float(module.weight_scale_2))
    # anything else (another FP8 block size): its dequantized weight, a float32 copy
    w = module.weight.detach().float().contiguous()
    return Matrix(ROWS, F32, w.shape[0], w.shape[1], w)


def _kv_b_heads(attn: nn.Module) -> tuple[list[Matrix], list[Matrix]]:
    """Run-time absorption: per head, W_UK^T (q_nope -> latent, read as columns) and W_UV (latent -> v) as
    row ranges of kv_b_proj, in place."""
    nh, dn, dv = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    r = attn.kv_lora_rank
    m = attn.kv_b_proj
    whole = rows_of(m) if not isinstance(m, Nvfp4Linear) else None
    if whole is None:   # NVFP4 codes cannot be read column-wise: kv_b_proj's values as float32 (a copy)
        whole = Matrix(ROWS, F32, m.out_features, m.in_features, m.weight.detach().float().contiguous())
    uk, uv = [], []
    for h in range(nh):
        k0, v0 = h * (dn + dv), h * (dn + dv) + dn
        common = dict(fmt=whole.fmt, bias=None)
        if whole.fmt == FP8:
            uk.append(Matrix(COLS, n=r, k=dn, data=whole.data[k0:k0 + dn], scale=whole.scale[k0 // 128:],
                             scale_r0=k0 % 128, **common))
            uv.append(Matrix(ROWS, n=dv, k=r, data=whole.data[v0:v0 + dv], scale=whole.scale[v0 // 128:],
                             scale_r0=v0 % 128, **common))
        else:
            uk.append(Matrix(COLS, n=r, k=dn, data=whole.data[k0:k0 + dn], **common))
            uv.append(Matrix(ROWS, n=dv, k=r, data=whole.data[v0:v0 + dv], **common))
    return uk, uv


@dataclass
class FFN:
    gate: Matrix
    up: Matrix
    down: Matrix

    def entries(self, name: str, *dicts) -> None:
        self.gate.entries(f"{name}.gate", *dicts)
        self.up.entries(f"{name}.up", *dicts)
        self.down.entries(f"{name}.down", *dicts)


@dataclass
class LayerWeights:
    in_norm: torch.Tensor
    kv_norm: torch.Tensor
    post_norm: torch.Tensor
    q_in: Matrix                    # q_a_proj (q_lora) or q_proj (pre-absorbed: per head [latent | rope])
    kv_a: Matrix
    o: Matrix
    q_a_norm: Optional[torch.Tensor] = None
    q_b: Optional[Matrix] = None    # q_b_proj (pre-absorbed: per head [latent | rope])
    uk: list[Matrix] = field(default_factory=list)   # run-time absorption, per head
    uv: list[Matrix] = field(default_factory=list)
    mlp: Optional[FFN] = None
    router: Optional[Matrix] = None
    router_bias: Optional[torch.Tensor] = None
    experts: list[FFN] = field(default_factory=list)
    shared: Optional[FFN] = None
    enorm: Optional[torch.Tensor] = None
    hnorm: Optional[torch.Tensor] = None
    eh_proj: Optional[Matrix] = None
    head_norm: Optional[torch.Tensor] = None
    # DeepSeek-V3.2's indexer (model/dsa.py): wq_b, wk, weights_proj; k_norm's LayerNorm weight and bias
    idx_q: Optional[Matrix] = None
    idx_k: Optional[Matrix] = None
    idx_w: Optional[Matrix] = None
    idx_norm: Optional[torch.Tensor] = None
    idx_bias: Optional[torch.Tensor] = None

    def matrices(self) -> list[Matrix]:
        out = [self.q_in, self.kv_a, self.o, *self.uk, *self.uv]
        out += [m for m in (self.q_b, self.router, self.eh_proj, self.idx_q, self.idx_k, self.idx_w) if m is not None]
        for f in [self.mlp, self.shared, *self.experts]:
            if f is not None:
                out += [f.gate, f.up, f.down]
        return out

    def entries(self, p: str, tensors: dict, ints: dict, floats: dict) -> None:
        for name in ("in_norm", "kv_norm", "post_norm", "q_a_norm", "enorm", "hnorm", "head_norm", "router_bias",
                     "idx_norm", "idx_bias"):
            t = getattr(self, name)
            if t is not None:
                tensors[p + name] = t
        for name in ("q_in", "kv_a", "o", "q_b", "router", "eh_proj", "idx_q", "idx_k", "idx_w"):
            m = getattr(self, name)
            if m is not None:
                m.entries(p + name, tensors, ints, floats)
        ints[p + "num_uk"] = len(self.uk)
        for h, (uk, uv) in enumerate(zip(self.uk, self.uv)):
            uk.entries(f"{p}uk.{h}", tensors, ints, floats)
            uv.entries(f"{p}uv.{h}", tensors, ints, floats)
        if self.mlp is not None:
            self.mlp.entries(p + "mlp", tensors, ints, floats)
        ints[p + "num_experts"] = len(self.experts)
        for e, f in enumerate(self.experts):
            f.entries(f"{p}experts.{e}", tensors, ints, floats)
        if self.shared is not None:
            self.shared.entries(p + "shared", tensors, ints, floats)


@dataclass
class NativeWeights:
    layout: str                     # "direct" | "packed"
    dims: dict[str, int]            # dims["amx"] / ["bf16_dot"]: row-wise matrices on AMX tiles / bf16 dot products
    params: dict[str, float]
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: Matrix
    layers: list[LayerWeights]

    def dictionaries(self) -> tuple[dict, dict, dict]:
        tensors: dict[str, torch.Tensor] = {"embed": self.embed, "final_norm": self.final_norm}
        ints = {f"dims.{k}": int(v) for k, v in self.dims.items()}
        ints["num_layers"] = len(self.layers)
        floats = {f"params.{k}": float(v) for k, v in self.params.items()}
        self.lm_head.entries("lm_head", tensors, ints, floats)
        for i, layer in enumerate(self.layers):
            layer.entries(f"layers.{i}.", tensors, ints, floats)
        return tensors, ints, floats

    def formats(self) -> str:
        """'bf16 (1,234 MiB) + fp8 (...)': the bytes the forward reads, by format."""
        by: dict[int, int] = {}
        for layer in self.layers:
            for m in layer.matrices():
                by[m.fmt] = by.get(m.fmt, 0) + m.nbytes
        return " + ".join(f"{FMT_NAMES[f]} {b / 2**20:,.0f} MiB" for f, b in sorted(by.items()))


def _c(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous()


def linear_bytes(model: nn.Module) -> int:
    """Bytes of every linear weight in the model (as stored)."""
    return sum(b.numel() * b.element_size() for mod in model.modules()
               for b in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)] if b.dim() >= 2)


def choose_layout(model: nn.Module, want: str = "") -> str:
    """direct or packed (see the module docstring). auto: packed for plain fp32/bf16 models of at most
    PACKED_MAX_BYTES whose attention pre-absorbs without more than doubling; direct otherwise. want "" reads
    runtime.native_layout (auto / direct / packed; env MTP_CORE_NATIVE_LAYOUT overrides)."""
    want = want or runtime.native_layout()
    if want not in LAYOUTS:
        raise ValueError(f"native layout {want!r}: use one of {', '.join(LAYOUTS)}")
    if getattr(model.config, "is_dsa", False):
        if want == "packed":
            log.info("native layout: DeepSeek-V3.2 sparse attention runs in the direct layout only; "
                     "the packed layout asked for is ignored")
        return "direct"
    if want != "auto":
        return want
    plain = all(type(m) is nn.Linear for m in model.modules() if isinstance(m, (nn.Linear, Fp8BlockLinear, Nvfp4Linear)))
    if not plain or linear_bytes(model) > PACKED_MAX_BYTES:
        return "direct"
    return "packed" if all(layer.self_attn.fuse_for_decode() for layer in model.model.layers) else "direct"


def _ffn(m: MLP, pack: bool, pairs: bool = False) -> FFN:
    if pack:
        return FFN(panel(m.gate_proj.weight, pairs), panel(m.up_proj.weight, pairs), panel(m.down_proj.weight, pairs))
    return FFN(rows_of(m.gate_proj), rows_of(m.up_proj), rows_of(m.down_proj))


def _layer(layer: nn.Module, pack: bool, pairs: bool = False) -> LayerWeights:
    attn = layer.self_attn
    r_dr = attn.kv_lora_rank + attn.qk_rope_head_dim
    lw: dict = dict(in_norm=_c(layer.input_layernorm.weight), kv_norm=_c(attn.kv_a_layernorm.weight),
                    post_norm=_c(layer.post_attention_layernorm.weight))
    if pack:   # pre-absorbed (MLAttention.fuse_for_decode): w_a = [q_a | kv_a] or [absorbed q | kv_a]
        w_a, b_a, w_q, w_o = attn.decode_weights
        q_rows = w_a.shape[0] - r_dr
        lw.update(q_in=panel(w_a[:q_rows], pairs), kv_a=panel(w_a[q_rows:], pairs), o=panel(w_o, pairs))
        if b_a is not None:
            lw["q_in"].bias, lw["kv_a"].bias = _c(b_a[:q_rows].float()), _c(b_a[q_rows:].float())
        if attn.q_lora_rank is not None:
            lw.update(q_a_norm=_c(attn.q_a_layernorm.weight), q_b=panel(w_q, pairs))
    else:
        q_in = attn.q_a_proj if attn.q_lora_rank is not None else attn.q_proj
        uk, uv = _kv_b_heads(attn)
        lw.update(q_in=rows_of(q_in), kv_a=rows_of(attn.kv_a_proj_with_mqa), o=rows_of(attn.o_proj), uk=uk, uv=uv)
        if attn.q_lora_rank is not None:
            lw.update(q_a_norm=_c(attn.q_a_layernorm.weight), q_b=rows_of(attn.q_b_proj))
    mlp = layer.mlp
    if type(mlp) is MoE:
        gate = mlp.gate
        lw.update(router=Matrix(ROWS, F32, gate.weight.shape[0], gate.weight.shape[1], _c(gate.weight.float())),
                  router_bias=_c(gate.e_score_correction_bias.float()),
                  experts=[_ffn(e, pack, pairs) for e in mlp.experts])
        if mlp.shared_experts is not None:
            lw["shared"] = _ffn(mlp.shared_experts, pack, pairs)
    else:
        lw["mlp"] = _ffn(mlp, pack, pairs)
    idx = getattr(attn, "indexer", None)
    if idx is not None:   # read in place like the other row-wise matrices (direct layout only: choose_layout)
        lw.update(idx_q=rows_of(idx.wq_b), idx_k=rows_of(idx.wk), idx_w=rows_of(idx.weights_proj),
                  idx_norm=_c(idx.k_norm.weight), idx_bias=_c(idx.k_norm.bias))
    if hasattr(layer, "eh_proj"):
        lw.update(enorm=_c(layer.enorm.weight), hnorm=_c(layer.hnorm.weight), head_norm=_c(layer.shared_head.norm.weight),
                  eh_proj=panel(layer.eh_proj.weight, pairs) if pack else rows_of(layer.eh_proj))
    return LayerWeights(**lw)


def build_native_weights(model: nn.Module, layout: str) -> NativeWeights:
    """The structure for this model in `layout` (direct / packed, see choose_layout)."""
    cfg = model.config
    attn0 = model.model.layers[0].self_attn
    dims = dict(hidden=cfg.hidden_size, q_lora=cfg.q_lora_rank or 0, kv_lora=cfg.kv_lora_rank,
                rope=cfg.qk_rope_head_dim, nope=cfg.qk_nope_head_dim, v_head=cfg.v_head_dim,
                heads=attn0.num_heads, experts=int(cfg.n_routed_experts or 0),
                top_k=int(cfg.num_experts_per_tok or 0), groups=int(cfg.n_group or 1),
                topk_groups=int(cfg.topk_group or 1), norm_topk=int(bool(cfg.norm_topk_prob)),
                interleave=int(bool(cfg.rope_interleave)), vocab=int(model.lm_head.weight.shape[0]),
                num_main=model.num_main_layers)
    params = dict(eps=float(cfg.rms_norm_eps), softmax_scale=float(attn0.softmax_scale),
                  routed_scale=float(cfg.routed_scaling_factor or 1.0))
    if attn0.indexer is not None:
        dims.update(index_heads=attn0.indexer.n_heads, index_dim=attn0.indexer.head_dim,
                    index_topk=attn0.indexer.topk)
        params["index_eps"] = float(attn0.indexer.k_norm.eps)
    pack = layout == "packed"
    dims["amx"] = int(not pack and kernels.cpu_amx())
    dims["bf16_dot"] = int(not pack and kernels.cpu_bf16_dot())
    pairs = pack and kernels.cpu_bf16_dot()      # packed bf16 matrices in input pairs, for the bf16 dot products
    if pack and not all(layer.self_attn.decode_weights is not None or layer.self_attn.fuse_for_decode()
                        for layer in model.model.layers):
        raise ValueError("the packed native layout needs plain fp32/bf16 attention whose absorbed weights at most "
                         "double; use the direct layout (MTP_CORE_NATIVE_LAYOUT=direct)")
    head = model.lm_head
    lm_head = panel(head.weight, pairs) if pack else rows_of(head)
    return NativeWeights(layout, dims, params, _c(model.model.embed_tokens.weight), _c(model.model.norm.weight),
                         lm_head, [_layer(layer, pack, pairs) for layer in model.model.layers])


def draft_head(model: nn.Module, ids: torch.Tensor, layout: str) -> Matrix:
    """The drafts' LM head over a draft vocabulary (the lm_head rows of `ids`, a copy) in the model's layout."""
    w = draft_head_rows(model, ids)
    if layout == "packed":
        return panel(w, kernels.cpu_bf16_dot())
    return Matrix(ROWS, _fmt_of(w), w.shape[0], w.shape[1], w)

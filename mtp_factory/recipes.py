"""Training recipes: model shape, data schedule and optimisation settings, fixed so that a run is reproducible.

`tiny-r1` is the shipped model's (its recipe.json is this one, setting for setting); `smoke` runs in seconds
for the tests. Earlier models' recipes live in git history (mtp_core/assets/tiny-r1/HISTORY.md).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mtp_factory.data.tasks import FAMILY_SPECS


@dataclass
class Recipe:
    name: str
    vocab_size: int = 1024
    hidden_size: int = 192
    num_layers: int = 8
    num_heads: int = 4
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    intermediate_size: int = 512
    moe_intermediate_size: int = 128
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    first_k_dense_replace: int = 1
    num_mtp_modules: int = 3
    eagle_depth: int = 3             # module 1 also trained recursively to this depth
    max_position_embeddings: int = 1024
    seq_len: int = 384
    batch_size: int = 12
    # later batch shapes, as (start_step, rows, tokens per row, mtp_batch_fraction); the last one that has
    # started decides
    row_shapes: tuple = ()
    steps: int = 1820
    # The learning-rate schedule as (end_step, kind, *args) segments, evaluated at the global step (see
    # trainer.lr_at): (end, "constant", peak), (end, "linear", from, to), (end, "cosine", planned_total) or
    # a warm restart (end, "restart", length, peak, warmup[, floor]).
    lr_segments: tuple = ((1820, "cosine", 1820),)
    # Task-family shares from a step on, as (start_step, ((family, weight), ...)); the last one that has
    # started decides, the families' default shares (data.tasks) before the first and for families it leaves out.
    mix_segments: tuple = ()
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.05
    mtp_lambda: float = 0.3          # weight of the mean Vanilla-chain loss (and of the Eagle-chain loss)
    # the MTP losses (both chains) on the first rows of each batch only: on a CPU they cost ~2.3x the main
    # model's forward+backward, so 0.5 about doubles the main model's tokens per second
    mtp_batch_fraction: float = 1.0
    autocast_bf16: bool = False      # matmuls in bfloat16 under torch.autocast (master weights float32)
    bias_update_speed: float = 1e-3  # aux-loss-free expert balancing (DeepSeek-V3)
    general_fraction: float = 0.08
    drill_fraction: float = 0.0      # share of examples that are a single-digit fact drill (data.arithmetic)
    spell_drill_fraction: float = 0.0  # share of examples that are a spelling drill (data.words) ...
    spell_drill_from: int = 0          # ... from this step on
    # from this step on the examples use trace style `late_trace_style` instead of style 2 (data.tasks.render);
    # -1: never (the name is the shipped recipe.json's)
    v3_traces_from: int = -1
    late_trace_style: int = 4
    # later switches of the trace style, as (start_step, style); the last one that has started decides
    trace_styles: tuple = ()
    # the shipped asset whose tokenizer a run starts from ("" = the recipe's own name; trained if absent)
    tokenizer_from: str = ""
    # start from these trained weights instead of the random init (a shipped asset's name or a checkpoint dir)
    init_from: str = ""
    tokenizer_examples: int = 6000
    save_every: int = 100
    num_threads: int = 2
    seed: int = 0
    ship_dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict)

    def model_config(self, vocab_size: int, bos: int, eos: int) -> dict:
        return {
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "vocab_size": vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_layers, "num_nextn_predict_layers": self.num_mtp_modules,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_heads,
            "n_shared_experts": self.n_shared_experts, "n_routed_experts": self.n_routed_experts,
            "routed_scaling_factor": 1.0, "kv_lora_rank": self.kv_lora_rank, "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim, "topk_method": "noaux_tc", "n_group": self.n_group,
            "topk_group": self.topk_group, "num_experts_per_tok": self.num_experts_per_tok, "moe_layer_freq": 1,
            "first_k_dense_replace": self.first_k_dense_replace, "norm_topk_prob": True, "scoring_func": "sigmoid",
            "hidden_act": "silu", "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": 0.02, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_interleave": True,
            "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
            "use_cache": True, "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": self.ship_dtype,
        }

    def to_dict(self) -> dict:
        return asdict(self)


def _shares(*weights: float) -> tuple:
    """A mix_segments entry's ((family, weight), ...), the weights in the families' order (data.tasks)."""
    assert len(weights) == len(FAMILY_SPECS)
    return tuple(zip(FAMILY_SPECS, weights))


# The shipped model: 4 main layers (1 dense + 3 MoE) x d256, 26,100 steps from scratch in one schedule.
#   0-13,099      learning rate 2e-3, then 4e-3 from step 2,460, constant; style-2 traces; arithmetic-heavy
#                 for the first 150 steps, then the wider mix
#   13,100-16,599 linear decay 4e-3 -> 1e-4 on the style-4 traces
#   16,600-26,099 five warm restarts (50 steps up, a cosine down to 1e-4; to 1.5e-3 over 1,500 steps, then to
#                 1e-3 over 2,000 each), each with the families below their goals weighted up and the next
#                 trace style (5 from 16,600, 7 from 20,100, 8 from 22,100, 9 from 24,100); a spelling drill
#                 as 5% of the examples from 18,100; 3 rows of 768 tokens (the MTP losses on one) from 22,100,
#                 where sort's style-8 traces outgrow 512 tokens
# Throughout: 4% single-digit fact drills, 3% standard-library text, MTP losses on half the rows, bf16
# autocast, the shipped tokenizer.
TINY_R1 = Recipe(
    name="tiny-r1", tokenizer_from="tiny-r1", num_layers=4, hidden_size=256, q_lora_rank=128,
    qk_nope_head_dim=48, v_head_dim=48, intermediate_size=640, moe_intermediate_size=160,
    seq_len=512, batch_size=4, row_shapes=((22100, 3, 768, 1 / 3),), steps=26100, lr=2e-3, warmup_steps=30,
    lr_segments=((2460, "constant", 2e-3), (13100, "constant", 4e-3), (16600, "linear", 4e-3, 1e-4),
                 (18100, "restart", 1500, 1.5e-3, 50, 1e-4), (20100, "restart", 2000, 1e-3, 50, 1e-4),
                 (22100, "restart", 2000, 1e-3, 50, 1e-4), (24100, "restart", 2000, 1e-3, 50, 1e-4),
                 (26100, "restart", 2000, 1e-3, 50, 1e-4)),
    mix_segments=((0, _shares(0.24, 0.18, 0.20, 0.08, 0.08, 0.06, 0.05, 0.08, 0.03)),
                  (150, _shares(0.17, 0.15, 0.18, 0.16, 0.09, 0.07, 0.06, 0.09, 0.03)),
                  (16600, _shares(0.10, 0.15, 0.16, 0.14, 0.14, 0.14, 0.05, 0.10, 0.02)),
                  (18100, _shares(0.10, 0.16, 0.14, 0.15, 0.15, 0.12, 0.05, 0.11, 0.02)),
                  (20100, _shares(0.10, 0.15, 0.12, 0.22, 0.13, 0.11, 0.04, 0.11, 0.02)),
                  (22100, _shares(0.10, 0.17, 0.12, 0.20, 0.12, 0.12, 0.03, 0.12, 0.02))),
    general_fraction=0.03, drill_fraction=0.04, spell_drill_fraction=0.05, spell_drill_from=18100,
    v3_traces_from=13100, late_trace_style=4, trace_styles=((16600, 5), (20100, 7), (22100, 8), (24100, 9)),
    mtp_batch_fraction=0.5, autocast_bf16=True, save_every=20, num_threads=2, seed=0)

# A seconds-long run for the tests (never the shipped model): a 2-layer d32 model, 4 steps of 2 x 64 tokens,
# its own tokenizer trained on 200 examples.
SMOKE = Recipe(name="smoke", vocab_size=300, hidden_size=32, num_layers=2, num_heads=2, q_lora_rank=16,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, intermediate_size=64,
               moe_intermediate_size=16, seq_len=64, batch_size=2, steps=4, warmup_steps=1, save_every=2,
               tokenizer_examples=200, num_threads=1, max_position_embeddings=256, lr_segments=((4, "cosine", 4),))

RECIPES = {"tiny-r1": TINY_R1, "smoke": SMOKE}

"""The engine's settings: TensorRT-LLM's LLM-API objects (LLMConfig and its sections), declared once.

Each field: its annotation (the type) and `opt(default, help, range, flags=...)` (schema.py). The field names
are the YAML keys, a `section` is a YAML mapping, `flags` are the CLI options that set the field; the YAML
loader, the CLI and `validate()` all read these declarations. Cross-field rules are each class's RULES.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

from .compat import GPU_MOE_BACKENDS
from .schedule import parse_schedule
from .schema import Flag, Rule, opt, section, validate

MTP_MODES = ("auto", "eagle", "vanilla")
DRAFT_LEN_POLICIES = ("cost", "fixed")       # speculative/policy.py: what each one does
# `mtp sweep`'s relaxed-acceptance row: its K, top-k and delta (top-10, delta 0.6: NVIDIA's write-up); the
# defaults of the command's flags and of mtp_core/bench/sweep.py: sweep_settings
SWEEP_RELAXED_K, SWEEP_RELAXED_TOPK, SWEEP_RELAXED_DELTA = 3, 10, 0.6
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "float32", "bfloat16", "float16")
# TensorRT-LLM's MoE backends (its order); the flag lists the PyTorch one (VANILLA) first
MOE_BACKENDS = ("auto", "CUTLASS", "TRTLLM", "WIDEEP", "CUTEDSL", "DEEPGEMM", "VANILLA", "TRITON")
# the runtime section's choices (config/runtime.py resolves them, environment overrides included)
KERNEL_MODES = ("auto", "reference")
CPU_ISAS = ("auto", "amx", "avx512", "avx512f", "avx2", "generic")
NATIVE_LAYOUTS = ("auto", "direct", "packed")


def is_device(name: Any) -> bool:
    """auto, cpu, cuda or cuda:N."""
    return name in ("auto", "cpu", "cuda") or (str(name).startswith("cuda:") and str(name)[5:].isdigit())


def _moe_backend(name: str) -> str:
    return "auto" if name.lower() == "auto" else name.upper()


def _schedule_over_k(s: "SpeculativeConfig") -> Optional[dict[str, Any]]:
    K = s.num_nextn_predict_layers
    over = next(((b, k) for b, k in (s.draft_len_schedule or {}).items() if k > K), None)
    return None if over is None else {"batch": over[0], "drafts": over[1], "K": K}


@dataclass
class SpeculativeConfig:
    """MTP speculative decoding: K drafts per step, how they are accepted, how many a step verifies."""
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("use_mtp_vanilla", lambda s: {} if s.use_mtp_vanilla and s.mtp_mode == "eagle" else None,
             "{at}use_mtp_vanilla=true contradicts mtp_mode=eagle; set one of them",
             "{flag[use_mtp_vanilla]} contradicts {flag[mtp_mode]} eagle; give one of them"),
        Rule("draft_len_schedule", _schedule_over_k,
             "{at}draft_len_schedule: {drafts} drafts at batch size {batch} exceed max_draft_len {K}; lower the entry "
             "or raise max_draft_len",
             "{flag[draft_len_schedule]}: {drafts} drafts at batch size {batch} exceed "
             "{flag[num_nextn_predict_layers]} {K}; lower the entry or raise the draft length"),
        Rule("acceptance_window", lambda s: {} if s.acceptance_window and not s.acceptance_length_threshold else None,
             "{at}acceptance_window is set but acceptance_length_threshold is 0, so it would never pause a request; "
             "set acceptance_length_threshold (e.g. 1.5)"),
        Rule("acceptance_length_threshold",
             lambda s: {} if s.acceptance_length_threshold and not s.acceptance_window else None,
             "{at}acceptance_length_threshold needs acceptance_window >= 1 (the number of steps it averages over)"),
    )

    decoding_type: str = opt(
        "MTP", "The speculative decoding algorithm: MTP (case-insensitive).", allowed="MTP (case-insensitive)",
        ok=lambda v: str(v).upper() == "MTP", norm=str.upper, message="{who} {value!r} is not supported; use MTP",
        flags=(Flag("--spec_decode_algo", "Speculative decoding: MTP, case-insensitive (absent = none).",
                    "MTP (absent = no speculation).", type=Optional[str], default=None, to_field=str.upper,
                    message="{who} {raw!r} is not supported; use MTP (or omit it for no speculation)"),))
    num_nextn_predict_layers: int = opt(         # K = max_draft_len
        1, "Draft tokens per step, K (nextn).", ge=1,
        message="{who} must be >= 1 (got {value!r}); omit speculation for nextn=0",
        flags=(Flag("--spec_decode_max_draft_len"),))
    use_relaxed_acceptance_for_thinking: bool = opt(
        False, "Relaxed acceptance inside <think>...</think>.", flags=(Flag("--use_relaxed_acceptance_for_thinking"),))
    relaxed_topk: int = opt(1, "Relaxed acceptance: candidates from the top-k.", ge=1, flags=(Flag("--relaxed_topk"),))
    relaxed_delta: float = opt(0.0, "Relaxed acceptance: probability margin to top-1.", ge=0,
                               flags=(Flag("--relaxed_delta", brief="Relaxed acceptance: probability margin."),))
    use_mtp_vanilla: bool = opt(False, "MTP Vanilla (K distinct modules).", flags=(Flag("--use_mtp_vanilla"),))
    mtp_mode: str = opt("auto", "auto: eagle (on this engine it measures faster than vanilla; docs/adaptive.md); "
                                "vanilla: one distinct module per draft (TensorRT-LLM's choice for several modules).",
                        choices=MTP_MODES, norm=str.lower,
                        flags=(Flag("--mtp_mode", brief="auto | eagle | vanilla.", choices=MTP_MODES,
                                    to_field=str.lower),))
    # how many drafts a step verifies (mtp_core/speculative/policy.py)
    draft_len_policy: str = opt(
        "cost", "cost: each step verifies the 0..K drafts with the most expected tokens/s, from measured step costs "
                "and each request's acceptance (0 where MTP loses); fixed: K every step.",
        choices=DRAFT_LEN_POLICIES, norm=str.lower,
        message="{who} must be one of cost, fixed (cost: choose 0..K drafts per step from measured costs; fixed: K "
                "every step), got {value!r}",
        flags=(Flag("--spec_decode_draft_len_policy",
                    brief="cost: 0..K drafts per step from measured step costs (default); fixed: K every step.",
                    to_field=str.lower, message="{who} must be cost (0..K drafts per step from measured costs) or "
                                                "fixed (K every step), got {value!r}"),))
    # explicit adaptive rules (mtp_core/speculative/adaptive.py); they bound the policy's choice
    draft_confidence_threshold: float = opt(
        0.0, "Adaptive drafting: stop a step's drafts when the product of their probabilities falls below this, in "
             "[0, 1) (0 = off).", ge=0, lt=1, allowed="in [0, 1); 0 = off",
        message="{who} must be in [0, 1) (0 = off), got {value!r}",
        flags=(Flag("--spec_decode_draft_confidence",
                    brief="Stop drafting below this draft-probability product (0 = off).",
                    message="{who} must be in [0, 1) (0 = off), got {value!r}"),))
    draft_len_schedule: Optional[dict[int, int]] = opt(
        None, "Max drafts per batch size, BATCH:K pairs, e.g. 1:4,4:2,16:0 (from that many requests in flight on).",
        parse=parse_schedule, allowed="a mapping of batch size >= 1 to max drafts >= 0, e.g. {1: 4, 4: 2, 16: 0}",
        flags=(Flag("--spec_decode_draft_len_schedule", brief="Max drafts per batch size, e.g. 1:4,4:2,16:0.",
                    type=Optional[str], to_field=lambda text: text or None),))
    acceptance_window: int = opt(
        0, "A request whose AL over its last N drafting steps is below the threshold pauses drafting for N steps "
           "(0 = off).", ge=0, message="{who} must be an integer >= 0 (0 = off), got {value!r}",
        flags=(Flag("--spec_decode_acceptance_window", brief="Per-request acceptance window in steps (0 = off).",
                    message="{who} must be >= 0 (0 = off), got {value!r}"),))
    acceptance_length_threshold: float = opt(
        0.0, "Window AL below this pauses the request's drafting (needs acceptance_window).", ge=0,
        message="{who} must be a number >= 0, got {value!r}",
        flags=(Flag("--spec_decode_acceptance_length_threshold",
                    "The AL threshold of --spec_decode_acceptance_window.",
                    "AL threshold of the acceptance window."),))

    draft_token_map: Optional[str] = opt(
        None, "A JSON list of token ids (`mtp token-map` writes one): MTP drafts are scored over these ids only, so "
              "a draft's LM head reads their rows instead of the whole vocabulary's; verification still scores "
              "every id, so output is unchanged and only acceptance can drop (docs/adaptive.md).",
        ok=lambda v: v is None or (isinstance(v, str) and bool(v)), allowed="a path to a JSON file of token ids",
        message="{who} must be a path to a JSON list of token ids (from `mtp token-map`), got {value!r}",
        flags=(Flag("--spec_decode_token_map", brief="JSON list of the token ids MTP drafts are scored over.",
                    type=Optional[str], to_field=lambda text: text or None),))

    @property
    def max_draft_len(self) -> int:
        return self.num_nextn_predict_layers

    def resolved_mode(self, num_modules: int) -> str:
        """auto: eagle, whatever the module count. TensorRT-LLM's rule takes vanilla for checkpoints with several
        modules; here a vanilla step runs every module over the accepted positions plus its chain (K forwards
        over ~K + k tokens each) where eagle runs one module over them and single-token chain forwards, so at
        equal acceptance eagle costs less per draft (measured on the shipped model, 1 thread: a K=3 step 1.5x
        cheaper, at a higher acceptance length: docs/adaptive.md). vanilla stays one flag away."""
        del num_modules   # the choice does not depend on it (kept for the callers' signature)
        if self.use_mtp_vanilla:
            return "vanilla"
        return "eagle" if self.mtp_mode == "auto" else self.mtp_mode

    def validate(self) -> None:
        validate(self, "speculative_config.")

    @property
    def adaptive(self) -> bool:
        """Any adaptive draft-length option on (the number of drafts may then differ per row and step)."""
        return bool(self.draft_confidence_threshold or self.draft_len_schedule or self.acceptance_window)


@dataclass
class KvCacheConfig:
    """The paged KV cache."""
    free_gpu_memory_fraction: float = opt(
        0.9, "Share of free memory for the KV cache, in (0, 1].", gt=0, le=1,
        flags=(Flag("--kv_cache_fraction", brief="Share of free memory for the KV cache."),))
    tokens_per_block: int = opt(64, "Tokens per KV block (page).", ge=1)
    max_tokens: Optional[int] = opt(None, "An exact KV pool size in tokens (wins over the fraction).", ge=1)
    dtype: str = opt(
        "auto", "auto = the model dtype; fp8 = e4m3 latents (half of bf16), on every device.",
        choices=KV_CACHE_DTYPES, norm=str.lower, message="{who} must be auto or fp8, got {value!r}",
        flags=(Flag("--kv_cache_dtype", choices=("auto", "fp8"), to_field=str.lower),))
    enable_block_reuse: bool = opt(
        True, "Prefix caching: full KV blocks outlive their request.",
        flags=(Flag("--disable_kv_cache_reuse", "Turn prefix caching (KV block reuse across requests) off.",
                    "Turn prefix caching (KV block reuse) off.", type=bool, default=False,
                    to_field=lambda off: not off),))

    def validate(self) -> None:
        validate(self, "kv_cache_config.")


@dataclass
class CudaGraphConfig:
    """CUDA graphs for decode steps (GPU)."""
    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule("max_batch_size", lambda g: None if not g.batch_sizes or g.max_batch_size in (0, max(g.batch_sizes))
             else {"size": g.max_batch_size, "largest": max(g.batch_sizes)},
             "{at}max_batch_size={size} must be 0 or the largest of batch_sizes ({largest})"),
    )

    batch_sizes: Optional[list[int]] = opt(
        None, "Batch sizes to capture (repeat the flag).", ok=lambda sizes: min(sizes) >= 1,
        allowed="non-empty, each >= 1; or null",
        flags=(Flag("--cuda_graph_batch_sizes", to_field=lambda sizes: list(sizes) or None),))
    max_batch_size: int = opt(0, "The largest batch captured: 0 or the largest of batch_sizes.", ge=0)
    enable_padding: bool = opt(False, "Pad a batch up to the next captured size.",
                               flags=(Flag("--cuda_graph_padding_enabled"),))

    def validate(self) -> None:
        validate(self, "cuda_graph_config.")


@dataclass
class MoeConfig:
    """Mixture-of-experts kernels (one implementation here; see compat.COMPAT)."""
    backend: str = opt("auto", "MoE kernels; GPU backends fall back to PyTorch on a CPU.", choices=MOE_BACKENDS,
                       norm=_moe_backend,
                       flags=(Flag("--moe_backend", choices=("auto", "VANILLA", *GPU_MOE_BACKENDS)),))


@dataclass
class RuntimeConfig:
    """Process-wide switches: the kernels, the CPU instruction set, the native CPU forward, the device. Each may be
    overridden by its environment variable (config/runtime.py, the one place that reads them)."""
    kernels: str = opt(
        "auto", "auto: the native kernels where they were built (mtp_core._C), else the torch references; "
                "reference: the torch references only. Env MTP_CORE_KERNELS overrides.",
        choices=KERNEL_MODES, norm=str.lower)
    cpu_isa: str = opt(
        "auto", "Caps the native CPU kernels' instruction set: auto (the best the CPU has), amx, avx512 (no AMX "
                "tiles), avx512f (no AMX, no bf16 dot products: the fp32 reference kernels), avx2, generic. Env "
                "MTP_CORE_CPU_ISA overrides.",
        choices=CPU_ISAS, norm=str.lower)
    native_decode: bool = opt(
        True, "The native CPU decode forward where the model allows it; false keeps every forward on the torch "
              "path. Env MTP_CORE_NATIVE_DECODE=0|1 overrides.")
    native_layout: str = opt(
        "auto", "The native forward's weight layout: auto (packed for small plain fp32/bf16 models, else direct), "
                "direct (read in place) or packed (repacked). Env MTP_CORE_NATIVE_LAYOUT overrides.",
        choices=NATIVE_LAYOUTS, norm=str.lower)
    device: str = opt(
        "auto", "The CLI's device: auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N. Env "
                "MTP_CORE_DEVICE overrides.", ok=is_device, allowed="one of auto, cpu, cuda, cuda:N", norm=str.lower)

    def validate(self) -> None:
        validate(self, "runtime.")


@dataclass
class LLMConfig:
    """Everything the engine needs besides the checkpoint."""
    model_dir: str = opt("", "Checkpoint directory.", yaml=False,
                         flags=(Flag("--model_dir", "Checkpoint directory (default: the shipped model).",
                                     type=Optional[Path], default=None, to_field=str),))
    dtype: str = opt(
        "auto", "auto = the checkpoint's dtype on CPU (fp32 without the native kernels), bf16 on GPUs.",
        choices=DTYPES, norm=str.lower, message="{who} must be auto, float32 or bfloat16, got {value!r}",
        flags=(Flag("--dtype", brief="auto | float32 | bfloat16 (auto = float32 on CPU).", choices=DTYPES),))
    max_batch_size: int = opt(
        8, "Most requests in one engine step (TensorRT-LLM: 2048; the CPU KV pool is capped at max_batch_size x "
           "max_seq_len).", ge=1, flags=(Flag("--max_batch_size"),))
    max_num_tokens: int = opt(8192, "Most tokens in one engine step.", ge=1, flags=(Flag("--max_num_tokens"),))
    max_seq_len: Optional[int] = opt(None, "Longest prompt + output (default: the model's).", ge=2,
                                     flags=(Flag("--max_seq_len"),))
    speculative_config: Optional[SpeculativeConfig] = section(
        SpeculativeConfig, "MTP speculative decoding (None = off).", nullable=True, switch="spec_decode_algo")
    kv_cache_config: KvCacheConfig = section(KvCacheConfig, "The paged KV cache.")
    cuda_graph_config: Optional[CudaGraphConfig] = section(
        CudaGraphConfig, "CUDA graphs for decode steps (None = eager).", nullable=True, switch="use_cuda_graph",
        flags=(Flag("--use_cuda_graph", "CUDA graphs for decode steps (GPU; eager with a warning on CPU).",
                    type=bool, default=False),))
    moe_config: MoeConfig = section(MoeConfig, "Mixture-of-experts kernels.")
    runtime: RuntimeConfig = section(RuntimeConfig, "Process-wide switches (kernels, CPU ISA, native forward, device).")
    disable_overlap_scheduler: bool = opt(
        False, "Turn the overlap scheduler off (it prepares the next step while MTP drafts; GPU only, off on CPU).",
        flags=(Flag("--disable_overlap_scheduler"),))
    overlap_scheduler_on_cpu: bool = opt(
        False, "Run the overlap scheduler on a CPU too (there host work and compute share the cores and it measured "
               "slower, BENCHMARKS.md; the tests set it).", yaml=False)
    native_step: bool = opt(
        True, "On a CPU with the native forward, a greedy decode step (plain, or MTP Eagle with strict acceptance) "
              "runs as one native call (engine/native_step.py); False runs every step through the general path (the "
              "reference the native step is tested against; env MTP_CORE_NATIVE_STEP=0 does the same: "
              "config/runtime.py).", yaml=False)
    enable_chunked_prefill: bool = opt(False, "Split long prompts over steps.",
                                       flags=(Flag("--enable_chunked_prefill"),))
    print_iter_log: bool = opt(False, "One stderr line per engine step.", flags=(Flag("--print_iter_log"),))
    tensor_parallel_size: int = opt(1, "Tensor-parallel size (launch with torchrun --nproc_per_node N).", ge=1,
                                    flags=(Flag("--tp_size"),))
    moe_expert_parallel_size: int = opt(
        1, "Expert-parallel size.", ge=1,
        flags=(Flag("--moe_ep_size", "Expert-parallel size; -1 = auto (1 here).", default=-1,
                    to_field=lambda size: 1 if size == -1 else size,
                    message="{who} must be >= 1 or -1 (auto), got {value!r}"),))
    device: str = opt("cpu", "cpu, cuda or cuda:N.", yaml=False)
    keep_quantized: Optional[bool] = opt(
        None, "FP8/NVFP4 weights stay packed (True) or are dequantized at load (False); None: packed on a CPU with "
              "the native kernels and on a GPU where a GPU GEMM serves the weight.", yaml=False,
        flags=(Flag("--keep_quantized", "Keep FP8/NVFP4 weights packed on every device (default: packed on a CPU "
                    "with the native kernels, which dequantize them in registers, and on a GPU where a GPU GEMM "
                    "serves the weight).", type=bool, default=False, to_field=lambda on: True if on else None),
               Flag("--dequantize", "Dequantize FP8/NVFP4 weights at load to --dtype (more memory).", type=bool,
                    default=False, to_field=lambda on: False if on else None)))
    num_threads: Optional[int] = opt(None, "CPU threads (default: torch's choice).", ge=1, yaml=False,
                                     flags=(Flag("--num_threads", brief="CPU threads for torch (default: torch's "
                                                                        "choice)."),))

    def validate(self) -> None:
        validate(self)

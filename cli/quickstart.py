"""`mtp quickstart`: TensorRT-LLM's quickstart_advanced.py, flag for flag.

stdout carries only the result lines `[i] Prompt: '...', Generated text: '...'`; logs, progress and the
speculative statistics go to stderr. Exit codes: 0 ok, 2 usage/config error, 1 runtime error, 130 Ctrl-C
(the results finished before it are printed first), 141 stdout closed early.
"""
from __future__ import annotations

import logging
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from cli.common import (EXIT_INTERRUPT, Progress, build_llm_config, install_one_line_usage_errors, run_or_exit,
                        setup_logging, write_lines)

install_one_line_usage_errors()
log = logging.getLogger("mtp.cli")

SHIPPED_MAX_TOKENS = 768   # --max_tokens when the shipped model runs with no --max_tokens given
# Three held-out questions (eval/ beside the shipped model) that the shipped model answers correctly with greedy
# decoding (so with MTP, which is lossless), worded as it was trained; tests/test_shipped_model.py checks them.
DEFAULT_PROMPTS = [
    "Calculate the sum of 376 and 279.",
    "What is 24 * 58?",
    "Sort these numbers in ascending order: 63, 64, 94, 5, 29.",
]


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class MtpMode(str, Enum):
    auto = "auto"
    eagle = "eagle"
    vanilla = "vanilla"


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class KvCacheDtype(str, Enum):
    auto = "auto"
    fp8 = "fp8"


class MoeBackend(str, Enum):
    auto = "auto"
    VANILLA = "VANILLA"
    CUTLASS = "CUTLASS"
    TRTLLM = "TRTLLM"
    WIDEEP = "WIDEEP"
    CUTEDSL = "CUTEDSL"
    DEEPGEMM = "DEEPGEMM"
    TRITON = "TRITON"


def read_prompts(prompt: Optional[list[str]]) -> list[str]:
    """--prompt values; `-` (or no --prompt with piped stdin) reads one prompt per line, skipping blank ones."""
    if prompt and prompt != ["-"]:
        if "-" in prompt:
            raise ValueError("--prompt - (stdin) cannot be mixed with literal prompts")
        return list(prompt)
    if prompt == ["-"] or not sys.stdin.isatty():
        lines = [line.rstrip("\n").rstrip("\r") for line in sys.stdin] if sys.stdin else []
        lines = [line for line in lines if line.strip()]
        if lines:
            return lines
        if prompt == ["-"]:
            raise ValueError("--prompt - was given but stdin held no non-empty line")
    return list(DEFAULT_PROMPTS)


def result_line(i: int, prompt: str, text: str) -> str:
    return f"[{i}] Prompt: {prompt!r}, Generated text: {text!r}"


def _plain(v: Any) -> Any:
    return v.value if isinstance(v, Enum) else v


def quickstart_command(
    ctx: typer.Context,
    model_dir: Optional[Path] = typer.Option(None, "--model_dir",
                                             help="Checkpoint directory (default: the shipped model)."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="Prompt(s); `-` reads one per line from stdin."),
    max_tokens: int = typer.Option(64, "--max_tokens",
                                   help="Tokens to generate per prompt (768 for the shipped model without --model_dir)."),
    max_batch_size: int = typer.Option(8, "--max_batch_size",
                                       help="Most requests in one engine step (TensorRT-LLM: 2048; the CPU KV "
                                            "pool is capped at max_batch_size x max_seq_len)."),
    max_num_tokens: int = typer.Option(8192, "--max_num_tokens", help="Most tokens in one engine step."),
    max_seq_len: Optional[int] = typer.Option(None, "--max_seq_len",
                                              help="Longest prompt + output (default: the model's)."),
    spec_decode_algo: Optional[str] = typer.Option(None, "--spec_decode_algo",
                                                   help="Speculative decoding: MTP, case-insensitive (absent = none)."),
    spec_decode_max_draft_len: int = typer.Option(1, "--spec_decode_max_draft_len", "--spec_decode_nextn",
                                                  help="Draft tokens per step, K (nextn)."),
    use_relaxed_acceptance_for_thinking: bool = typer.Option(False, "--use_relaxed_acceptance_for_thinking",
                                                             help="Relaxed acceptance inside <think>...</think>."),
    relaxed_topk: int = typer.Option(1, "--relaxed_topk", help="Relaxed acceptance: candidates from the top-k."),
    relaxed_delta: float = typer.Option(0.0, "--relaxed_delta",
                                        help="Relaxed acceptance: probability margin to top-1."),
    use_mtp_vanilla: bool = typer.Option(False, "--use_mtp_vanilla", help="MTP Vanilla (K distinct modules)."),
    mtp_mode: MtpMode = typer.Option(MtpMode.auto, "--mtp_mode", case_sensitive=False,
                                     help="auto: one MTP module -> eagle, more -> vanilla."),
    spec_decode_draft_len_policy: str = typer.Option(
        "cost", "--spec_decode_draft_len_policy",
        help="cost: each step verifies the 0..K drafts with the most expected tokens/s, from measured step costs "
             "and each request's acceptance (0 where MTP loses); fixed: K every step."),
    spec_decode_draft_confidence: float = typer.Option(
        0.0, "--spec_decode_draft_confidence",
        help="Adaptive drafting: stop a step's drafts when the product of their probabilities falls below this, in [0, 1) (0 = off)."),
    spec_decode_draft_len_schedule: Optional[str] = typer.Option(
        None, "--spec_decode_draft_len_schedule",
        help="Max drafts per batch size, BATCH:K pairs, e.g. 1:4,4:2,16:0 (from that many requests in flight on)."),
    spec_decode_acceptance_window: int = typer.Option(
        0, "--spec_decode_acceptance_window",
        help="A request whose AL over its last N drafting steps is below the threshold pauses drafting for N steps (0 = off)."),
    spec_decode_acceptance_length_threshold: float = typer.Option(
        0.0, "--spec_decode_acceptance_length_threshold", help="The AL threshold of --spec_decode_acceptance_window."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy (TensorRT-LLM: unset = greedy)."),
    top_k: int = typer.Option(0, "--top_k", help="Sample from the top-k tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top_p", help="Nucleus sampling mass (1 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    dtype: Dtype = typer.Option(Dtype.auto, "--dtype", case_sensitive=False, help="auto = the checkpoint's dtype on CPU (fp32 without the native kernels), bf16 on GPUs."),
    num_threads: Optional[int] = typer.Option(None, "--num_threads", help="CPU threads (default: torch's choice)."),
    tp_size: int = typer.Option(1, "--tp_size", help="Tensor-parallel size (launch with torchrun --nproc_per_node N)."),
    moe_ep_size: int = typer.Option(-1, "--moe_ep_size", help="Expert-parallel size; -1 = auto (1 here)."),
    moe_backend: MoeBackend = typer.Option(MoeBackend.auto, "--moe_backend", case_sensitive=False,
                                           help="MoE kernels; GPU backends fall back to PyTorch on a CPU."),
    kv_cache_fraction: float = typer.Option(0.9, "--kv_cache_fraction",
                                            help="Share of free memory for the KV cache, in (0, 1]."),
    kv_cache_dtype: KvCacheDtype = typer.Option(KvCacheDtype.auto, "--kv_cache_dtype", case_sensitive=False,
                                                help="auto = the model dtype; fp8 = e4m3 latents (half of bf16), on every device."),
    disable_kv_cache_reuse: bool = typer.Option(False, "--disable_kv_cache_reuse",
                                                help="Turn prefix caching (KV block reuse across requests) off."),
    use_cuda_graph: bool = typer.Option(False, "--use_cuda_graph", help="CUDA graphs for decode steps (GPU; "
                                                                        "eager with a warning on CPU)."),
    cuda_graph_batch_sizes: Optional[list[int]] = typer.Option(None, "--cuda_graph_batch_sizes",
                                                               help="Batch sizes to capture (repeat the flag)."),
    cuda_graph_padding_enabled: bool = typer.Option(False, "--cuda_graph_padding_enabled",
                                                    help="Pad a batch up to the next captured size."),
    disable_overlap_scheduler: bool = typer.Option(
        False, "--disable_overlap_scheduler",
        help="Turn the overlap scheduler off (it prepares the next step while MTP drafts; GPU only, off on CPU)."),
    enable_chunked_prefill: bool = typer.Option(False, "--enable_chunked_prefill",
                                                help="Split long prompts over steps."),
    print_iter_log: bool = typer.Option(False, "--print_iter_log", help="One stderr line per engine step."),
    keep_quantized: bool = typer.Option(
        False, "--keep_quantized",
        help="Keep FP8/NVFP4 weights packed on every device (default: packed on a CPU with the native kernels, "
             "which dequantize them in registers, and on a GPU where a GPU GEMM serves the weight)."),
    dequantize: bool = typer.Option(False, "--dequantize",
                                    help="Dequantize FP8/NVFP4 weights at load to --dtype (more memory)."),
    apply_chat_template: bool = typer.Option(False, "--apply_chat_template", help="Wrap prompts in the chat template."),
    trust_remote_code: bool = typer.Option(False, "--trust_remote_code",
                                           help="Accepted and ignored: no code from the model directory is ever run."),
    extra_llm_api_options: Optional[Path] = typer.Option(
        None, "--extra_llm_api_options", "--config", help="TensorRT-LLM LLM-API YAML file; its values win over flags."),
    log_level: LogLevel = typer.Option(LogLevel.warning, "--log_level", case_sensitive=False,
                                       help="Logging on stderr."),
) -> None:
    setup_logging(log_level.value)
    params = {k: _plain(v) for k, v in ctx.params.items()}
    explicit = {name: params[name] for name in params
                if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"}
    run_or_exit(lambda: _run(params, explicit))


def _run(p: dict[str, Any], explicit: dict[str, Any]) -> None:
    from mtp_core import SamplingParams
    from mtp_core.distributed.launch import is_output_rank, make_llm

    if p["trust_remote_code"]:
        log.warning("--trust_remote_code is ignored: mtp never runs code from the model directory")
    cfg = build_llm_config(p, explicit)
    if p["max_tokens"] < 1:
        raise ValueError(f"--max_tokens must be >= 1, got {p['max_tokens']}")
    # the shipped model's answers come after ~100-300 tokens of reasoning: without --model_dir and without
    # --max_tokens, generate enough to finish them (TensorRT-LLM's 64 stays the default for a --model_dir)
    max_tokens = SHIPPED_MAX_TOKENS if p["model_dir"] is None and "max_tokens" not in explicit else p["max_tokens"]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=p["temperature"], top_k=p["top_k"],
                              top_p=p["top_p"], seed=p["seed"])
    try:
        sampling.validate()
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    prompts = read_prompts(p["prompt"])
    for i, text in enumerate(prompts):
        if not text.strip():
            raise ValueError(f"prompt [{i}] is empty; give non-empty text")
    chat = p["apply_chat_template"] or p["model_dir"] is None
    finished: dict[int, str] = {}
    with Progress(enabled=None if os.environ.get("RANK", "0") == "0" else False) as bar:
        def on_finish(i: int, out: Any) -> None:
            finished[i] = out.text
            bar.update("generating", len(finished), len(prompts))

        iter_log = (lambda s: print(s, file=sys.stderr)) if cfg.print_iter_log else None
        llm = make_llm(cfg, load_progress=bar.load, iter_log=iter_log)
        bar.update("generating", 0, len(prompts))
        try:
            outputs = llm.generate(prompts, sampling, apply_chat_template=chat, on_finish=on_finish)
        except KeyboardInterrupt:
            bar.stop()
            if not is_output_rank(llm):
                raise typer.Exit(EXIT_INTERRUPT) from None
            write_lines(result_line(i, prompts[i], finished[i]) for i in sorted(finished))
            print(f"interrupted: {len(finished)} of {len(prompts)} prompts had finished (printed above)",
                  file=sys.stderr)
            raise typer.Exit(EXIT_INTERRUPT) from None
    if not is_output_rank(llm):
        return
    write_lines(result_line(i, text, out.text) for i, (text, out) in enumerate(zip(prompts, outputs)))
    if cfg.speculative_config is not None:
        for line in llm.engine.stats.summary_lines():
            print(line, file=sys.stderr)
    if cfg.kv_cache_config.enable_block_reuse:
        print(llm.engine.blocks.stats.summary_line(), file=sys.stderr)

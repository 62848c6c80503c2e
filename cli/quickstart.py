"""`mtp quickstart`: TensorRT-LLM's quickstart_advanced.py, flag for flag.

stdout carries only the result lines `[i] Prompt: '...', Generated text: '...'`; logs, progress and the
speculative statistics go to stderr. Exit codes: 0 ok, 2 usage/config error, 1 runtime error, 130 Ctrl-C.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import click
import typer

from cli.common import DEFAULT_MODEL_DIR, fail, setup_logging

DEFAULT_PROMPTS = [
    "What is 347 + 285?",
    "Sort these numbers: 42, 7, 19, 88, 3",
    "How many times does the letter r appear in strawberry?",
]


def read_prompts(prompt: Optional[list[str]]) -> list[str]:
    """--prompt values; `-` (or no --prompt with piped stdin) reads one prompt per line."""
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


def quickstart_command(
    ctx: typer.Context,
    model_dir: Optional[Path] = typer.Option(None, "--model_dir", help="Checkpoint directory (default: the shipped model)."),
    prompt: Optional[list[str]] = typer.Option(None, "--prompt", help="Prompt(s); `-` reads one per line from stdin."),
    max_tokens: int = typer.Option(64, "--max_tokens", help="Tokens to generate per prompt."),
    max_batch_size: int = typer.Option(8, "--max_batch_size", help="Most requests in one engine step."),
    max_num_tokens: int = typer.Option(8192, "--max_num_tokens", help="Most tokens in one engine step."),
    max_seq_len: Optional[int] = typer.Option(None, "--max_seq_len", help="Longest prompt + output (default: the model's)."),
    spec_decode_algo: Optional[str] = typer.Option(None, "--spec_decode_algo", help="Speculative decoding: MTP (absent = none)."),
    spec_decode_max_draft_len: int = typer.Option(1, "--spec_decode_max_draft_len", "--spec_decode_nextn",
                                                  help="Draft tokens per step, K (nextn)."),
    use_relaxed_acceptance_for_thinking: bool = typer.Option(False, "--use_relaxed_acceptance_for_thinking",
                                                             help="Relaxed acceptance inside <think>...</think>."),
    relaxed_topk: int = typer.Option(1, "--relaxed_topk", help="Relaxed acceptance: candidates from the top-k."),
    relaxed_delta: float = typer.Option(0.0, "--relaxed_delta", help="Relaxed acceptance: probability margin to top-1."),
    use_mtp_vanilla: bool = typer.Option(False, "--use_mtp_vanilla", help="MTP Vanilla (K distinct modules)."),
    mtp_mode: str = typer.Option("auto", "--mtp_mode", help="auto | eagle | vanilla."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_k: int = typer.Option(0, "--top_k", help="Sample from the top-k tokens (0 = off)."),
    top_p: float = typer.Option(1.0, "--top_p", help="Nucleus sampling mass."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    dtype: str = typer.Option("auto", "--dtype", help="auto | float32 | bfloat16 (auto = float32 on CPU)."),
    tp_size: int = typer.Option(1, "--tp_size", help="Tensor-parallel size (torchrun)."),
    moe_ep_size: int = typer.Option(1, "--moe_ep_size", help="Expert-parallel size (torchrun)."),
    kv_cache_fraction: float = typer.Option(0.9, "--kv_cache_fraction", help="Share of free memory for the KV cache."),
    kv_cache_dtype: str = typer.Option("auto", "--kv_cache_dtype", help="auto | fp8 (fp8 needs a GPU)."),
    use_cuda_graph: bool = typer.Option(False, "--use_cuda_graph", help="Capture decode steps in CUDA graphs (GPU)."),
    disable_overlap_scheduler: bool = typer.Option(False, "--disable_overlap_scheduler", help="Turn the overlap scheduler off."),
    enable_chunked_prefill: bool = typer.Option(False, "--enable_chunked_prefill", help="Split long prompts over steps."),
    print_iter_log: bool = typer.Option(False, "--print_iter_log", help="One stderr line per engine step."),
    keep_quantized: bool = typer.Option(False, "--keep_quantized",
                                        help="Keep FP8/NVFP4 weights packed and dequantize per layer (less memory)."),
    apply_chat_template: bool = typer.Option(False, "--apply_chat_template", help="Wrap prompts in the chat template."),
    extra_llm_api_options: Optional[Path] = typer.Option(None, "--extra_llm_api_options", "--config",
                                                         help="TensorRT-LLM LLM-API YAML file."),
    log_level: str = typer.Option("warning", "--log_level", help="debug | info | warning | error."),
) -> None:
    setup_logging(log_level)
    from cli.common import build_llm_config, run_or_exit

    def run() -> None:
        from mtp_core import LLM, SamplingParams

        explicit = {p.name: v for p, v in ((p, ctx.params[p.name]) for p in ctx.command.params)
                    if ctx.get_parameter_source(p.name) == click.core.ParameterSource.COMMANDLINE}
        cfg = build_llm_config(ctx.params, explicit)
        prompts = read_prompts(prompt)
        if max_tokens < 1:
            raise ValueError(f"--max_tokens must be >= 1, got {max_tokens}")
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        params.validate()
        llm = LLM(cfg, iter_log=(lambda s: print(s, file=sys.stderr)) if cfg.print_iter_log else None)
        for p in prompts:
            if not p.strip():
                raise ValueError("a prompt is empty; give non-empty text")
        chat = apply_chat_template or model_dir is None
        outputs = llm.generate(prompts, params, apply_chat_template=chat)
        for i, out in enumerate(outputs):
            print(f"[{i}] Prompt: {prompts[i]!r}, Generated text: {out.text!r}", flush=True)
        if cfg.speculative_config is not None:
            for line in llm.engine.stats.summary_lines():
                print(line, file=sys.stderr)

    run_or_exit(run)

"""`mtp quickstart`: TensorRT-LLM's quickstart_advanced.py, flag for flag.

stdout carries only the result lines `[i] Prompt: '...', Generated text: '...'`; logs, progress and the
speculative statistics go to stderr. Exit codes: 0 ok, 2 usage/config error, 1 runtime error, 130 Ctrl-C
(the results finished before it are printed first), 141 stdout closed early.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional

import typer

from cli.common import (EXIT_INTERRUPT, Progress, build_llm_config, install_one_line_usage_errors, run_or_exit,
                        setup_logging, warn_ignored_flags, write_lines)
from cli.options import explicit_params, help_order, parameters, plain, set_parameters
from mtp_core.config.schema import Flag

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


# the flags of one request (serve takes them from each request instead)
REQUEST_FLAGS = {flag.key: flag for flag in (
    Flag("--prompt", "Prompt(s); `-` reads one per line from stdin.", type=Optional[list[str]], default=None),
    Flag("--max_tokens", "Tokens to generate per prompt (768 for the shipped model without --model_dir).", type=int,
         default=64),
    Flag("--temperature", "0 = greedy (TensorRT-LLM: unset = greedy).", type=float, default=0.0),
    Flag("--top_k", "Sample from the top-k tokens (0 = off).", type=int, default=0),
    Flag("--top_p", "Nucleus sampling mass (1 = off).", type=float, default=1.0),
    Flag("--seed", "Random seed for sampling.", type=Optional[int], default=None),
    Flag("--apply_chat_template", "Wrap prompts in the chat template.", type=bool, default=False),
)}
# the options in --help order: the schema's engine flags in declaration order (mtp_core/config/engine.py), then
# the commands' own (cli/options.py), with these runs filed right after the flag named: the request's flags, and
# the engine flags --help shows among them (dtype, threads, parallelism, MoE)
PLACED = {
    "model_dir": ("prompt", "max_tokens"),
    "spec_decode_acceptance_length_threshold": ("temperature", "top_k", "top_p", "seed", "dtype", "num_threads",
                                                "tp_size", "moe_ep_size", "moe_backend"),
    "dequantize": ("apply_chat_template",),
}
FLAGS = help_order(PLACED)


def quickstart_command(ctx: typer.Context, **flags: Any) -> None:
    setup_logging(plain(flags["log_level"]))
    params = {k: plain(v) for k, v in ctx.params.items()}
    run_or_exit(lambda: _run(params, explicit_params(ctx)))


assert set(REQUEST_FLAGS) <= set(FLAGS), "a request flag is missing from quickstart's PLACED"
set_parameters(quickstart_command, parameters(FLAGS, REQUEST_FLAGS))


def _run(p: dict[str, Any], explicit: dict[str, Any]) -> None:
    from mtp_core import SamplingParams
    from mtp_core.distributed.launch import is_output_rank, make_llm

    warn_ignored_flags(p)
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

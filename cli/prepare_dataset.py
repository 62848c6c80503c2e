"""`mtp prepare-dataset`: write a benchmark dataset (JSON lines: task_id, prompt | input_ids, output_tokens).

Default: the shipped model's held-out task prompts (chat-rendered, BOS included; the 50 per family of its
eval directory), all families round-robin. `--task_set general` takes standard-library text instead;
`--synthetic --input_tokens N` writes random token ids (the vocabulary comes from --model_dir).
`--shared_prefix N` puts the same N tokens in front of every request (written as input_ids; text, or random
ids with --synthetic), for prefix-caching benchmarks.
With a tokenizer at hand the input lengths are counted and summarised on stderr.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from cli.common import DEFAULT_MODEL_DIR, run_or_exit, setup_logging
from cli.options import LOG_LEVEL


def prepare_dataset_command(
    output: Path = typer.Option(..., "--output", help="Dataset file to write (`-` = stdout)."),
    num_requests: int = typer.Option(..., "--num_requests", help="Requests to write."),
    output_tokens: int = typer.Option(..., "--output_tokens", help="output_tokens of every request."),
    task_set: str = typer.Option("all", "--task_set", help="A task family, `all`, or `general` (stdlib text)."),
    model_dir: Optional[Path] = typer.Option(None, "--model_dir", help="Tokenizer for counting input tokens "
                                             "(and the vocabulary of --synthetic); default: the shipped model."),
    synthetic: bool = typer.Option(False, "--synthetic", help="Random token ids instead of text prompts."),
    input_tokens: Optional[int] = typer.Option(None, "--input_tokens", help="Input length of --synthetic requests."),
    seed: int = typer.Option(1234, "--seed", help="Seed of the general-text sample / random ids (the held-out "
                             "task prompts ship drawn with 1234)."),
    shared_prefix: int = typer.Option(0, "--shared_prefix", help="The same N tokens before every request "
                                      "(prefix-caching benchmarks; 0 = none)."),
    log_level: str = LOG_LEVEL,
) -> None:
    setup_logging(log_level)

    def run() -> None:
        from mtp_core.bench.dataset import shared_prefix_ids, task_requests, with_shared_prefix
        from mtp_core.tokenizer import Tokenizer

        mdir = model_dir if model_dir is not None else DEFAULT_MODEL_DIR
        tok = Tokenizer.from_dir(mdir) if (Path(mdir) / "tokenizer.json").is_file() else None
        if model_dir is not None and tok is None:
            raise ValueError(f"--model_dir {model_dir} has no tokenizer.json; point it at a checkpoint")
        if synthetic:
            requests, allowed = _synthetic(tok, Path(mdir), num_requests, input_tokens, output_tokens, seed)
        else:
            if input_tokens is not None:
                raise ValueError("--input_tokens applies to --synthetic only; text prompts have their own length")
            requests, allowed = task_requests(task_set, num_requests, output_tokens, seed), None
        if shared_prefix < 0:
            raise ValueError(f"--shared_prefix must be >= 0, got {shared_prefix}")
        if shared_prefix:
            if tok is None:
                raise ValueError("--shared_prefix needs a tokenizer (--model_dir); the shipped model is not installed")
            requests = with_shared_prefix(requests, shared_prefix_ids(shared_prefix, tok, allowed, seed), tok)
        _write(output, requests, tok, output_tokens)

    run_or_exit(run)


def _synthetic(tok: Any, mdir: Path, num_requests: int, input_tokens: Optional[int], output_tokens: int,
               seed: int) -> tuple[list, list[int]]:
    """--synthetic: random ids of the vocabulary without its special tokens; (requests, the ids they draw from)."""
    from mtp_core.bench.dataset import synthetic_requests
    from mtp_core.chat_format import SPECIAL_TOKENS

    if input_tokens is None:
        raise ValueError("--synthetic needs --input_tokens N")
    if tok is None:
        raise ValueError("--synthetic needs --model_dir (its vocabulary size); the shipped model is not installed")
    cfg = json.loads((mdir / "config.json").read_text())
    named = [tok.token_id(s) for s in SPECIAL_TOKENS]
    special = frozenset(t for t in (tok.bos_token_id, tok.pad_token_id, *tok.eos_token_ids, *named) if t is not None)
    requests = synthetic_requests(num_requests, input_tokens, output_tokens, int(cfg["vocab_size"]), special, seed)
    return requests, [t for t in range(int(cfg["vocab_size"])) if t not in special]


def _write(output: Path, requests: list, tok: Any, output_tokens: int) -> None:
    """The dataset to --output (or stdout), then a summary line on stderr (input lengths, with a tokenizer)."""
    from mtp_core.bench.dataset import encode_request, write_dataset

    if str(output) == "-":
        for r in requests:
            sys.stdout.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
    else:
        write_dataset(output, requests)
    if tok is not None:
        lens = [len(encode_request(tok, r)) for r in requests]
        print(f"{len(requests)} requests -> {output}: input tokens avg {sum(lens) / len(lens):.1f} "
              f"(min {min(lens)}, max {max(lens)}), output tokens {output_tokens}", file=sys.stderr)
    else:
        print(f"{len(requests)} requests -> {output} (no tokenizer: input tokens not counted)", file=sys.stderr)

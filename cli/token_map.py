"""`mtp token-map`: write a draft vocabulary (speculative_config.draft_token_map, `--spec_decode_token_map`).

Counts the token ids of a dataset's prompts (`mtp prepare-dataset`'s JSON lines: text tokenized with the model's
tokenizer, or input_ids) and, with --generate, of the model's own greedy continuations of them (each request's
output_tokens, no MTP), then writes the --size most frequent ids; ids never seen fill the rest in ascending order.
The file is JSON: {"token_ids": [...], "vocab_size", "counted_tokens", "sources"}. Build it from text like the
traffic it will serve, and not from the prompts a benchmark then measures (the map would fit them too well).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Optional

import typer

from cli.common import DEFAULT_MODEL_DIR, run_or_exit, setup_logging
from cli.options import LOG_LEVEL


def token_map_command(
    output: Path = typer.Option(..., "--output", help="The map to write (JSON)."),
    size: int = typer.Option(..., "--size", help="Token ids in the map (e.g. a fifth of the vocabulary)."),
    dataset: Path = typer.Option(..., "--dataset", help="Dataset whose prompts are counted (mtp prepare-dataset)."),
    model_dir: Optional[Path] = typer.Option(None, "--model_dir", help="The checkpoint (vocabulary, tokenizer; "
                                             "default: the shipped model)."),
    generate: bool = typer.Option(False, "--generate", help="Also count the model's greedy continuations of the "
                                  "prompts (each request's output_tokens)."),
    num_threads: Optional[int] = typer.Option(None, "--num_threads", help="CPU threads for --generate."),
    log_level: str = LOG_LEVEL,
) -> None:
    setup_logging(log_level)

    def run() -> None:
        from mtp_core.bench.dataset import encode_request, load_dataset
        from mtp_core.config.model import ModelConfig
        from mtp_core.speculative.draft_vocab import frequent_ids
        from mtp_core.tokenizer import Tokenizer

        mdir = model_dir if model_dir is not None else DEFAULT_MODEL_DIR
        if not (Path(mdir) / "config.json").is_file():
            raise ValueError(f"--model_dir {mdir} has no config.json; point it at a checkpoint")
        vocab = int(ModelConfig.from_file(Path(mdir) / "config.json").vocab_size)
        if not 1 <= size <= vocab:
            raise ValueError(f"--size must be in [1, {vocab}] (the model's vocabulary), got {size}")
        requests = load_dataset(dataset)
        tok = Tokenizer.from_dir(mdir) if (Path(mdir) / "tokenizer.json").is_file() else None
        if tok is None and any(r.input_ids is None for r in requests):
            raise ValueError(f"{dataset} has text prompts but --model_dir {mdir} has no tokenizer.json; give a "
                             "checkpoint with one, or a dataset of input_ids")
        prompts = [encode_request(tok, r) for r in requests]
        sequences, sources = list(prompts), [f"prompts of {dataset} ({len(prompts)})"]
        if generate:
            sequences += _generate(mdir, prompts, [r.output_tokens for r in requests], num_threads)
            sources.append("the model's greedy continuations (nextn=0)")
        counts = Counter(t for s in sequences for t in s)
        ids = frequent_ids(counts, size, vocab)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps({"token_ids": ids, "vocab_size": vocab,
                                      "counted_tokens": sum(counts.values()), "sources": sources}) + "\n")
        seen = sum(1 for i in ids if counts.get(i, 0) > 0)
        covered = sum(counts.get(i, 0) for i in ids) / max(1, sum(counts.values()))
        typer.echo(f"wrote {output}: {size} of {vocab} ids ({seen} seen in the counted text, which they cover "
                   f"{100 * covered:.1f}% of)")

    run_or_exit(run)


def _generate(mdir: Path, prompts: list[list[int]], output_tokens: list[int],
              num_threads: Optional[int]) -> list[list[int]]:
    from cli.bench import set_threads
    from mtp_core.config import LLMConfig
    from mtp_core.llm import LLM
    from mtp_core.sampling import SamplingParams

    set_threads(num_threads)
    llm = LLM(LLMConfig(model_dir=str(mdir)))
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in output_tokens]
    return [o.token_ids for o in llm.generate(prompts, params)]

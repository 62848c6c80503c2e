"""`mtp make-tiny OUT_DIR`: a tiny random DeepSeek-V3 (or V3.2) checkpoint, made offline in about a second."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def make_tiny_command(
    out_dir: Path = typer.Argument(..., help="Directory to create (must not exist or be empty)."),
    num_layers: int = typer.Option(2, "--num_layers", help="Main decoder layers."),
    num_mtp_modules: int = typer.Option(1, "--num_mtp_modules", help="MTP modules (num_nextn_predict_layers)."),
    q_lora_rank: Optional[int] = typer.Option(32, "--q_lora_rank", help="Query low-rank size; 0 for a plain q_proj."),
    yarn: bool = typer.Option(False, "--yarn", help="Use YaRN rope scaling."),
    num_shards: int = typer.Option(1, "--num_shards", help="Split the weights over this many safetensors files."),
    vocab_size: int = typer.Option(512, "--vocab_size", help="Byte-level BPE vocabulary size (>= 263)."),
    hidden_size: int = typer.Option(64, "--hidden_size", help="Model width."),
    seed: int = typer.Option(0, "--seed", help="Random seed for the weights."),
    arch: str = typer.Option("v3", "--arch", help="v3 (DeepSeek-V3) or v32 (DeepSeek-V3.2: + sparse attention, 4 "
                             "indexer heads of 16 per layer)."),
    index_topk: int = typer.Option(8, "--index_topk", help="v32: keys each query attends to (small, so that short "
                                   "prompts exercise the selection)."),
) -> None:
    from mtp_core.tiny import make_tiny_checkpoint

    try:
        path = make_tiny_checkpoint(out_dir, seed=seed, num_layers=num_layers, num_mtp=num_mtp_modules,
                                    q_lora_rank=q_lora_rank or None, yarn=yarn, num_shards=num_shards,
                                    vocab_size=vocab_size, hidden_size=hidden_size, arch=arch.lower(),
                                    index_topk=index_topk)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote a tiny DeepSeek-{'V3.2' if arch.lower() == 'v32' else 'V3'} checkpoint to {path}", err=True)

"""`mtp make-scale OUT_DIR`: a random checkpoint with real DeepSeek-V3-architecture widths, tensor by tensor."""
from __future__ import annotations

from pathlib import Path

import typer


def make_scale_command(
    out_dir: Path = typer.Argument(..., help="Directory to create (must not exist or be empty)."),
    shape: str = typer.Option("", "--shape", help="Widths: moonlight (Moonlight-16B-A3B) or deepseek-v3 (default: "
                              "moonlight for --arch v3, deepseek-v3 for v32)."),
    arch: str = typer.Option("v3", "--arch", help="v3 (DeepSeek-V3) or v32 (DeepSeek-V3.2: + sparse attention, 64 "
                             "indexer heads of 128, top-2048, 160k context)."),
    n_routed_experts: int = typer.Option(0, "--n_routed_experts", help="Routed experts per MoE layer (0: the "
                                         "shape's); fewer keep a full-width checkpoint small."),
    num_layers: int = typer.Option(4, "--num_layers", help="Main decoder layers (the first is dense)."),
    num_mtp_modules: int = typer.Option(1, "--num_mtp_modules", help="MTP modules (num_nextn_predict_layers)."),
    vocab_size: int = typer.Option(32768, "--vocab_size", help="Vocabulary of the embedding and lm_head."),
    width_divisor: int = typer.Option(1, "--width_divisor", help="Divide every width by this (small test twins)."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 or float32."),
    seed: int = typer.Option(0, "--seed", help="Random seed for the weights."),
) -> None:
    import torch

    from mtp_core.scale_model import write_scale_checkpoint

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    try:
        if dtype not in dtypes:
            raise ValueError(f"--dtype must be bfloat16 or float32, got {dtype!r}")
        shape = shape.lower() or ("deepseek-v3" if arch == "v32" else "moonlight")
        path = write_scale_checkpoint(out_dir, shape, num_layers, num_mtp_modules, width_divisor,
                                      vocab_size, seed, dtypes[dtype], n_routed_experts=n_routed_experts or None,
                                      arch=arch.lower())
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote a {shape} ({arch}) checkpoint ({num_layers} layers + {num_mtp_modules} MTP) to {path}", err=True)

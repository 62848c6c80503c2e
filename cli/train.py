"""`mtp train --recipe tiny-r1 --out DIR`: reproduces the shipped model (resumable)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def train_command(
    recipe: str = typer.Option("tiny-r1", "--recipe", help="Recipe name (tiny-r1 = the shipped model; smoke = seconds)."),
    out: Path = typer.Option(..., "--out", help="Output directory (state/, tokenizer/, model/); resumes if present."),
    max_steps: Optional[int] = typer.Option(None, "--max_steps", help="Stop after this many steps (resume later)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Override the recipe's total steps."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
) -> None:
    from dataclasses import replace

    from mtp_factory.recipes import RECIPES
    from mtp_factory.trainer import train

    if recipe not in RECIPES:
        typer.echo(f"error: unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}", err=True)
        raise typer.Exit(2)
    r = RECIPES[recipe] if steps is None else replace(RECIPES[recipe], steps=steps)
    train(r, out, max_steps=max_steps, device=device, echo=lambda s: typer.echo(s, err=True))

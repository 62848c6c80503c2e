"""`mtp quantize`: write a DeepSeek FP8 or ModelOpt NVFP4 copy of a bf16/fp32 checkpoint.

Register on the app with `app.command("quantize")(quantize_command)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from mtp_core.quantize import quantize_checkpoint


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def quantize_command(
    model_dir: Annotated[Path, typer.Option(
        "--model_dir", help="Source checkpoint directory: config.json, model.safetensors (or shards "
                            "with model.safetensors.index.json) and tokenizer files, in bf16/fp32.")],
    output_dir: Annotated[Path, typer.Option(
        "--output_dir", help="Where to write the quantized checkpoint; must not exist or be empty.")],
    format: Annotated[str, typer.Option(
        "--format", help="fp8: DeepSeek FP8 with 128x128 block scales (weight_scale_inv). "
                         "nvfp4: ModelOpt NVFP4 (e2m1 + per-16 e4m3 scales + per-tensor scale).")
    ] = "fp8",
    quantize_mtp: Annotated[bool, typer.Option(
        "--quantize_mtp/--no_quantize_mtp",
        help="Quantize the MTP layers (model.layers.{num_hidden_layers}+) like the main layers, "
             "or keep them in the source precision.")] = True,
    exclude: Annotated[Optional[list[str]], typer.Option(
        "--exclude", help="Extra module-name pattern (fnmatch, e.g. 'model.layers.0.*') to keep "
                          "unquantized; repeat for several.")] = None,
    quantize_attention: Annotated[bool, typer.Option(
        "--quantize_attention/--no_quantize_attention",
        help="nvfp4: quantize the attention projections too (q, kv_a, o_proj; kv_b_proj and the DSA indexer "
             "stay in the source precision). Off: ModelOpt's default, attention unquantized.")] = False,
) -> None:
    """Quantize a checkpoint to FP8 (block-scaled) or NVFP4 for smaller, faster loading."""
    try:
        summary = quantize_checkpoint(model_dir, output_dir, format, quantize_mtp=quantize_mtp,
                                      exclude=list(exclude or []), quantize_attention=quantize_attention)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    line = (f"wrote {summary['format']} checkpoint to {summary['out_dir']}: "
            f"{summary['num_quantized']} weights quantized, {summary['num_kept']} kept in source "
            f"precision, {_megabytes(summary['bytes_before'])} -> {_megabytes(summary['bytes_after'])}")
    typer.echo(line)
    if summary["num_uncalibrated_input_scales"]:
        typer.echo(f"note: {summary['num_uncalibrated_input_scales']} NVFP4 input_scale values are "
                   f"uncalibrated (1.0); weights are exact to the format, activation scales are not")

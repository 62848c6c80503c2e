"""`mtp train-mtp`: fine-tune (or add with --add_mtp N) a checkpoint's MTP modules by self-distillation from
its frozen main model; main tensors are written byte for byte (see mtp_core/train_mtp/)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cli.common import run_or_exit, setup_logging
from cli.options import LOG_LEVEL


def train_mtp_command(
    model_dir: Path = typer.Option(..., "--model_dir", help="Source checkpoint (bf16/fp32, FP8 or NVFP4)."),
    out: Path = typer.Option(..., "--out", help="Output checkpoint directory (new, or --overwrite)."),
    prompts: Path = typer.Option(..., "--prompts", help="Training prompts: JSONL (prompt/text/input_ids) or text, one per line."),
    eval_prompts: Optional[Path] = typer.Option(None, "--eval_prompts", help="Held-out prompts (default: a split of --prompts)."),
    heldout: float = typer.Option(0.1, "--heldout", help="Share of --prompts held out without --eval_prompts."),
    max_eval_prompts: int = typer.Option(32, "--max_eval_prompts", help="Most held-out prompts evaluated."),
    max_steps: int = typer.Option(300, "--max_steps", help="Training steps."),
    lr: float = typer.Option(5e-4, "--lr", help="Peak learning rate (warmup, then cosine to 0.1x)."),
    mtp_mode: str = typer.Option("both", "--mtp_mode", help="eagle: module 1 recursively; vanilla: module k at depth k; both."),
    eagle_depth: int = typer.Option(3, "--eagle_depth", help="Depths module 1 is trained at (Eagle recursion)."),
    add_mtp: int = typer.Option(0, "--add_mtp", help="Create N new MTP modules (checkpoint without any)."),
    gen_tokens: int = typer.Option(128, "--gen_tokens", help="Tokens the main model generates per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy continuations, else sampled."),
    topk: int = typer.Option(8, "--topk", help="Main-model logits kept per position (for --kl_weight)."),
    kl_weight: float = typer.Option(0.0, "--kl_weight", help="Weight of the KL term to the main model's top-k distribution."),
    batch_size: int = typer.Option(8, "--batch_size", help="Sequences per step."),
    seq_len: int = typer.Option(256, "--seq_len", help="Tokens per training window."),
    save_every: int = typer.Option(100, "--save_every", help="Save the training state every N steps."),
    log_every: int = typer.Option(10, "--log_every", help="Progress line every N steps."),
    eval_tokens: int = typer.Option(128, "--eval_tokens", help="Tokens per held-out prompt in the AL report."),
    eval_k: int = typer.Option(3, "--eval_k", help="Draft length K of the AL report."),
    gen_batch: int = typer.Option(64, "--gen_batch", help="Prompts per cache chunk (the unit of resuming generation)."),
    max_batch_size: int = typer.Option(16, "--max_batch_size", help="Engine batch while generating and evaluating."),
    seed: int = typer.Option(0, "--seed", help="Seed of the split, batches and sampling."),
    num_threads: Optional[int] = typer.Option(None, "--num_threads", help="CPU threads."),
    work_dir: Optional[Path] = typer.Option(None, "--work_dir", help="Cache + training state (default: OUT.train-mtp-work); a rerun resumes."),
    keep_work: bool = typer.Option(False, "--keep_work", help="Keep the work directory after success."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty --out (at the end, atomically)."),
    no_chat_template: bool = typer.Option(False, "--no_chat_template", help="Do not wrap text prompts in the chat template."),
    copy: bool = typer.Option(False, "--copy", help="Copy untouched shards instead of hard-linking them."),
    log_level: str = LOG_LEVEL,
) -> None:
    setup_logging(log_level)

    def body() -> None:
        from mtp_core.train_mtp import FinetuneOptions, run

        run(FinetuneOptions(model_dir=model_dir, out=out, prompts=prompts, eval_prompts=eval_prompts, heldout=heldout,
                            max_eval_prompts=max_eval_prompts, max_steps=max_steps, lr=lr, mtp_mode=mtp_mode.lower(),
                            eagle_depth=eagle_depth, add_mtp=add_mtp, gen_tokens=gen_tokens, temperature=temperature,
                            topk=topk, kl_weight=kl_weight, batch_size=batch_size, seq_len=seq_len,
                            save_every=save_every, log_every=log_every, eval_tokens=eval_tokens, eval_k=eval_k,
                            gen_batch=gen_batch, max_batch_size=max_batch_size, seed=seed, num_threads=num_threads, work_dir=work_dir, keep_work=keep_work,
                            overwrite=overwrite, chat_template=not no_chat_template, link=not copy),
            echo=lambda s: typer.echo(s, err=True))

    run_or_exit(body)

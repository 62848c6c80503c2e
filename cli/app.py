"""The `mtp` command: one Typer app, one file per subcommand."""
from __future__ import annotations

import sys

import typer

from cli.make_scale import make_scale_command
from cli.make_tiny import make_tiny_command
from cli.quickstart import quickstart_command

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="DeepSeek-V3/R1 inference with MTP speculative decoding.")
app.command("quickstart", help="Generate text for prompts (mirror of TensorRT-LLM's quickstart_advanced.py).",
            context_settings={"help_option_names": ["-h", "--help"]})(quickstart_command)
app.command("make-tiny", help="Write a tiny random DeepSeek-V3 checkpoint (for tests and offline trials).")(
    make_tiny_command)
app.command("make-scale", help="Write a random checkpoint with real DeepSeek-V3-architecture widths (Moonlight, "
            "DeepSeek-V3), tensor by tensor.")(make_scale_command)

from cli.train import train_command  # noqa: E402

app.command("train", help="Train the shipped model's recipe (DeepSeek-V3 architecture + MTP), resumable.")(
    train_command)

from cli.train_mtp import train_mtp_command  # noqa: E402

app.command("train-mtp", help="Fine-tune (or --add_mtp N) a checkpoint's MTP modules by self-distillation; "
            "main weights untouched.")(train_mtp_command)

try:  # commands added by later issues register themselves only when their module is present
    from cli.quantize import quantize_command
    app.command("quantize", help="Write FP8-block or NVFP4 checkpoints from a bf16/fp32 one.")(quantize_command)
    from cli.bench import bench_command
    from cli.prepare_dataset import prepare_dataset_command
    from cli.sweep import sweep_command
    app.command("bench", help="Benchmark with a dataset (mirror of trtllm-bench; --concurrency 1 = min latency).")(
        bench_command)
    app.command("prepare-dataset", help="Write a benchmark dataset (held-out task prompts, text or synthetic).")(
        prepare_dataset_command)
    app.command("sweep", help="nextn 0..5 x Eagle/Vanilla + relaxed acceptance in one process; table and plot.")(
        sweep_command)
    from cli.token_map import token_map_command
    app.command("token-map", help="Write a draft vocabulary (--spec_decode_token_map) from token frequencies.")(
        token_map_command)
except ImportError:  # pragma: no cover
    pass

try:  # the HTTP server needs fastapi + uvicorn (install_requires); without them the other commands still work
    from cli.serve import serve_command
    app.command("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics).",
                context_settings={"help_option_names": ["-h", "--help"]})(serve_command)
except ImportError:  # pragma: no cover
    pass

NARGS_PLUS = {"--prompt", "--cuda_graph_batch_sizes"}  # TensorRT-LLM takes `--prompt a b c`; click wants `--prompt a --prompt b`


def expand_nargs(argv: list[str]) -> list[str]:
    """`--prompt a b` -> `--prompt a --prompt b` (values run until the next option)."""
    out: list[str] = []
    flag, taken = None, 0
    for a in argv:
        if a in NARGS_PLUS:
            if flag and not taken:
                out.append(flag)
            flag, taken = a, 0
            continue
        if flag and (a == "-" or not a.startswith("-")):
            out += [flag, a]
            taken += 1
            continue
        if flag and not taken:
            out.append(flag)
        flag = None
        out.append(a)
    if flag and not taken:
        out.append(flag)
    return out


def main(argv: list[str] | None = None) -> None:
    args = expand_nargs(list(sys.argv[1:] if argv is None else argv))
    app(args=args, prog_name="mtp")


if __name__ == "__main__":
    main()

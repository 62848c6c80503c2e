"""Shared CLI plumbing: logging, one-line errors and exit codes, flags + YAML -> LLMConfig, progress.

Exit codes: 0 success; 2 a usage or configuration error (bad flag, YAML, prompt or checkpoint: the one
`error:` line says what to change); 1 a runtime error; 130 Ctrl-C; 141 stdout closed early (`| head`).
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import typer

import mtp_core
from cli.options import LOG_LEVELS
from mtp_core.config import LLMConfig
from mtp_core.config.compat import GPU_MOE_BACKENDS, MOE_FALLBACK, rows, warning_text

DEFAULT_MODEL_DIR = Path(mtp_core.__file__).parent / "assets" / "tiny-r1"
log = logging.getLogger("mtp.cli")

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPT, EXIT_PIPE = 0, 1, 2, 130, 141


# ---- errors and logging ---------------------------------------------------------------------

def fail(message: str, code: int) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _one_line_click_error(e: Exception) -> None:
    """Replaces typer's boxed usage-error panel: one `error:` line naming the help command."""
    if type(e).__name__ == "NoArgsIsHelpError":      # bare `mtp`: click already printed the help
        return
    ctx = getattr(e, "ctx", None)
    where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    typer.echo(f"error: {' '.join(e.format_message().split())}{where}", err=True)


def install_one_line_usage_errors() -> None:
    """Make typer's usage errors (unknown flag, bad int, bad choice) one line on stderr; they exit 2.

    typer renders them through `typer.rich_utils.rich_format_error` (a boxed panel); we swap in a
    one-line printer. (With TYPER_USE_RICH=0 typer prints click's plain three-line form instead.)"""
    import typer.rich_utils

    typer.rich_utils.rich_format_error = _one_line_click_error


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is now (rich's live progress swaps it to print above the bar)."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass


def setup_logging(level: str) -> None:
    lvl = getattr(logging, str(level).upper(), None) if str(level).lower() in LOG_LEVELS else None
    if not isinstance(lvl, int):
        fail(f"--log_level must be {', '.join(LOG_LEVELS)}; got {level!r}", EXIT_USAGE)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(name)s: %(message)s"))
    logging.basicConfig(level=lvl, handlers=[handler], force=True)


def run_or_exit(fn: Callable[[], None]) -> None:
    """Runs the command body; every failure becomes one `error:` line and an exit code, never a traceback."""
    try:
        fn()
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPT)
    except BrokenPipeError:
        quiet_stdout()
        raise typer.Exit(EXIT_PIPE)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__, EXIT_USAGE)
    except MemoryError as e:
        fail(f"out of memory ({e}); lower --max_batch_size, --max_seq_len or --kv_cache_fraction", EXIT_RUNTIME)
    except Exception as e:  # noqa: BLE001 - the CLI never shows a traceback (--log_level debug logs it)
        log.debug("traceback", exc_info=True)
        first = str(e).splitlines()[0] if str(e) else ""
        if "OutOfMemoryError" in type(e).__name__:
            fail(f"out of memory ({first}); lower --max_batch_size, --max_seq_len or --kv_cache_fraction",
                 EXIT_RUNTIME)
        fail(f"{type(e).__name__}: {first}", EXIT_RUNTIME)


def quiet_stdout() -> None:
    """After a broken pipe: point fd 1 at /dev/null so the interpreter's final flush stays silent."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def write_lines(lines: Iterable[str]) -> None:
    """Result lines to stdout, flushed one by one (a pipeline sees each as soon as it is printed)."""
    for line in lines:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


# ---- flags + YAML -> LLMConfig --------------------------------------------------------------

def _note(line: str) -> None:
    """YAML notes (overrides of typed flags, deprecated spellings, keys without effect) as warnings."""
    log.warning("%s", line[len("warning: "):] if line.startswith("warning: ") else line)


def build_llm_config(p: dict[str, Any], explicit: dict[str, Any], note: Callable[[str], None] = _note) -> LLMConfig:
    """p: every flag's value (plain Python values); explicit: the flags typed on the command line.

    The flags are checked and mapped by the schema (mtp_core/config/flags.py). The YAML file
    (--extra_llm_api_options / --config) is applied last: its values win, each override of a typed flag is
    reported through `note`."""
    from mtp_core.config.flags import config_from_flags, section_flags
    from mtp_core.config.schema import validate

    cfg = config_from_flags({**p, "model_dir": _model_dir(p.get("model_dir"))})
    path = p.get("extra_llm_api_options")
    if path is not None:
        from mtp_core.yaml_config import apply_yaml_options, load_yaml_options

        opts = load_yaml_options(path)
        try:
            cfg = apply_yaml_options(cfg, opts, explicit, note)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    else:
        validate(cfg, flag_words=True)       # the rules across fields, worded with the flags that set them
    cfg.device = default_device(cfg)         # after the YAML: its runtime.device counts
    if cfg.speculative_config is None:
        typed = [f"--{f}" for f in section_flags("speculative_config") if f in explicit]
        if typed:
            log.warning("%s %s no effect without --spec_decode_algo MTP", ", ".join(typed),
                        "has" if len(typed) == 1 else "have")
    check_device_features(cfg)
    return cfg


def _model_dir(model_dir: Optional[Path]) -> Path:
    if model_dir is not None:
        return model_dir
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise ValueError(f"no --model_dir given and the shipped model is not installed at {DEFAULT_MODEL_DIR}; "
                         "pass --model_dir (e.g. one written by `mtp make-tiny DIR`)")
    return DEFAULT_MODEL_DIR


def warn_ignored_flags(p: dict[str, Any]) -> None:
    """The flags accepted only for compatibility and ignored (compat.COMPAT): one warning each that is set."""
    for row in rows("ignored"):
        if row.name.startswith("--") and p.get(row.name[2:]):
            log.warning("%s", warning_text(row))


def default_device(cfg: Optional[LLMConfig] = None) -> str:
    """runtime.device (auto: cuda when torch sees a GPU, else cpu); MTP_CORE_DEVICE (cpu | cuda | cuda:N)
    overrides it (mtp_core/config/runtime.py)."""
    import torch

    from mtp_core.config import runtime

    return runtime.device(torch.cuda.is_available, cfg.runtime if cfg is not None else None)


def check_device_features(cfg: LLMConfig) -> None:
    """GPU-only settings are accepted everywhere; on a CPU each either runs without them (with a warning)
    or is refused with the reason."""
    from mtp_core.loader import resolve_dtype

    if cfg.device == "cpu":
        import torch

        why = "this run is on the CPU" if torch.cuda.is_available() else "this machine has none"
        if cfg.cuda_graph_config is not None:
            log.warning("CUDA graphs need an NVIDIA GPU and %s; running eagerly", why)
            cfg.cuda_graph_config = None
        if cfg.moe_config.backend in GPU_MOE_BACKENDS:       # compat.COMPAT: one MoE, the PyTorch one
            log.warning("%s", warning_text(MOE_FALLBACK, value=cfg.moe_config.backend, reason=why))
    kv = cfg.kv_cache_config.dtype
    if kv in ("auto", "fp8"):
        return
    from mtp_core.loader.checkpoint import open_checkpoint
    from mtp_core.loader.weights import checkpoint_dtype
    model = str(resolve_dtype(cfg.dtype, cfg.device, checkpoint_dtype(open_checkpoint(cfg.model_dir))))
    model = model.replace("torch.", "")
    if kv != model:
        raise ValueError(f"kv_cache_config.dtype {kv} differs from the model dtype {model}; the KV cache is kept "
                         "in the model dtype, use auto (or change --dtype)")


# ---- progress (stderr, only on a terminal) --------------------------------------------------

class Progress:
    """Weight-loading and finished-request bars on stderr; does nothing when stderr is not a terminal."""

    def __init__(self, enabled: Optional[bool] = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar = None
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> "Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                                     redirect_stdout=False)
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def update(self, name: str, done: int, total: int) -> None:
        if self._bar is None:
            return
        if name not in self._tasks:
            self._tasks[name] = self._bar.add_task(name, total=total)
        self._bar.update(self._tasks[name], completed=done, total=total)

    def load(self, done: int, total: int) -> None:
        """LLM(load_progress=...) callback: tensors read so far / tensors to read."""
        self.update("loading weights", done, total)

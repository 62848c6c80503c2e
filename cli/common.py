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

DEFAULT_MODEL_DIR = Path(mtp_core.__file__).parent / "assets" / "tiny-r1"
log = logging.getLogger("mtp.cli")

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPT, EXIT_PIPE = 0, 1, 2, 130, 141
SPEC_FLAGS = ("spec_decode_max_draft_len", "use_relaxed_acceptance_for_thinking", "relaxed_topk",
              "relaxed_delta", "use_mtp_vanilla", "mtp_mode", "spec_decode_draft_confidence",
              "spec_decode_draft_len_schedule", "spec_decode_acceptance_window",
              "spec_decode_acceptance_length_threshold", "spec_decode_draft_len_policy")
LOG_LEVELS = ("debug", "info", "warning", "error")
GPU_MOE_BACKENDS = ("CUTLASS", "TRTLLM", "WIDEEP", "CUTEDSL", "DEEPGEMM", "TRITON")


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


def build_llm_config(p: dict[str, Any], explicit: dict[str, Any], note: Callable[[str], None] = _note):
    """p: every flag's value (plain Python values); explicit: the flags typed on the command line.

    The YAML file (--extra_llm_api_options / --config) is applied last: its values win, each override of
    a typed flag is reported through `note`."""
    from mtp_core.config import CudaGraphConfig, KvCacheConfig, LLMConfig, MoeConfig, SpeculativeConfig

    model_dir = p["model_dir"]
    if model_dir is None:
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            raise ValueError(f"no --model_dir given and the shipped model is not installed at {DEFAULT_MODEL_DIR}; "
                             "pass --model_dir (e.g. one written by `mtp make-tiny DIR`)")
        model_dir = DEFAULT_MODEL_DIR
    for flag in ("max_batch_size", "max_num_tokens", "tp_size", "spec_decode_max_draft_len", "relaxed_topk"):
        if p[flag] < 1:
            raise ValueError(f"--{flag} must be >= 1, got {p[flag]}")
    if p.get("num_threads") is not None and p["num_threads"] < 1:
        raise ValueError(f"--num_threads must be >= 1, got {p['num_threads']}")
    if p["max_seq_len"] is not None and p["max_seq_len"] < 2:
        raise ValueError(f"--max_seq_len must be >= 2, got {p['max_seq_len']}")
    if p["moe_ep_size"] == 0 or p["moe_ep_size"] < -1:
        raise ValueError(f"--moe_ep_size must be >= 1 or -1 (auto), got {p['moe_ep_size']}")
    if not 0 < p["kv_cache_fraction"] <= 1:
        raise ValueError(f"--kv_cache_fraction must be in (0, 1], got {p['kv_cache_fraction']}")
    if p["relaxed_delta"] < 0:
        raise ValueError(f"--relaxed_delta must be >= 0, got {p['relaxed_delta']}")
    spec = None
    algo = p["spec_decode_algo"]
    if algo is not None:
        if algo.upper() != "MTP":
            raise ValueError(f"--spec_decode_algo {algo!r} is not supported; use MTP (or omit it for no speculation)")
        spec = SpeculativeConfig(num_nextn_predict_layers=p["spec_decode_max_draft_len"],
                                 use_relaxed_acceptance_for_thinking=p["use_relaxed_acceptance_for_thinking"],
                                 relaxed_topk=p["relaxed_topk"], relaxed_delta=p["relaxed_delta"],
                                 use_mtp_vanilla=p["use_mtp_vanilla"], mtp_mode=p["mtp_mode"].lower(),
                                 **adaptive_options(p))
    graphs = None
    if p.get("use_cuda_graph"):
        graphs = CudaGraphConfig(batch_sizes=list(p.get("cuda_graph_batch_sizes") or []) or None,
                                 enable_padding=bool(p.get("cuda_graph_padding_enabled")))
    cfg = LLMConfig(
        model_dir=str(model_dir), dtype=p["dtype"], max_batch_size=p["max_batch_size"],
        max_num_tokens=p["max_num_tokens"], max_seq_len=p["max_seq_len"], speculative_config=spec,
        kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=p["kv_cache_fraction"],
                                      dtype=p["kv_cache_dtype"].lower(),
                                      enable_block_reuse=not p.get("disable_kv_cache_reuse", False)),
        cuda_graph_config=graphs, moe_config=MoeConfig(backend=p.get("moe_backend", "auto")),
        disable_overlap_scheduler=p["disable_overlap_scheduler"],
        enable_chunked_prefill=p["enable_chunked_prefill"], print_iter_log=p["print_iter_log"],
        tensor_parallel_size=p["tp_size"], keep_quantized=(True if p.get("keep_quantized") else False if p.get("dequantize") else None),
        moe_expert_parallel_size=1 if p["moe_ep_size"] == -1 else p["moe_ep_size"],
        num_threads=p.get("num_threads"), device=default_device(),
    )
    if p.get("extra_llm_api_options") is not None:
        from mtp_core.yaml_config import apply_yaml_options, load_yaml_options

        path = p["extra_llm_api_options"]
        opts = load_yaml_options(path)
        try:
            cfg = apply_yaml_options(cfg, opts, explicit, note)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    cfg.validate()
    if cfg.speculative_config is None:
        typed = [f"--{f}" for f in SPEC_FLAGS if f in explicit]
        if typed:
            log.warning("%s %s no effect without --spec_decode_algo MTP", ", ".join(typed),
                        "has" if len(typed) == 1 else "have")
    check_device_features(cfg)
    return cfg


def adaptive_options(p: dict[str, Any]) -> dict[str, Any]:
    """The adaptive draft-length flags -> SpeculativeConfig fields, with one-line errors naming the flag."""
    from mtp_core.speculative.adaptive import parse_schedule

    c = p.get("spec_decode_draft_confidence", 0.0)
    if c is not None and not 0 <= c < 1:
        raise ValueError(f"--spec_decode_draft_confidence must be in [0, 1) (0 = off), got {c}")
    w = p.get("spec_decode_acceptance_window", 0) or 0
    if w < 0:
        raise ValueError(f"--spec_decode_acceptance_window must be >= 0 (0 = off), got {w}")
    t = p.get("spec_decode_acceptance_length_threshold", 0.0) or 0.0
    if t < 0:
        raise ValueError(f"--spec_decode_acceptance_length_threshold must be >= 0, got {t}")
    sched = p.get("spec_decode_draft_len_schedule")
    sched = parse_schedule(sched, "--spec_decode_draft_len_schedule") if sched else None
    K = p.get("spec_decode_max_draft_len", 1)
    over = next(((b, k) for b, k in (sched or {}).items() if k > K), None)
    if over is not None and p.get("extra_llm_api_options") is None:     # (a YAML file may set K itself)
        raise ValueError(f"--spec_decode_draft_len_schedule: {over[1]} drafts at batch size {over[0]} exceed "
                         f"--spec_decode_max_draft_len {K}; lower the entry or raise the draft length")
    policy = str(p.get("spec_decode_draft_len_policy") or "cost").lower()
    if policy not in ("cost", "fixed"):
        raise ValueError(f"--spec_decode_draft_len_policy must be cost (0..K drafts per step from measured costs) or "
                         f"fixed (K every step), got {policy!r}")
    return dict(draft_confidence_threshold=float(c or 0.0), draft_len_schedule=sched, acceptance_window=w,
                acceptance_length_threshold=float(t), draft_len_policy=policy)


def default_device() -> str:
    """cuda when torch sees a GPU, else cpu; MTP_CORE_DEVICE (cpu | cuda | cuda:N) overrides."""
    import torch

    chosen = os.environ.get("MTP_CORE_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    if not (chosen == "cpu" or chosen.startswith("cuda")):
        raise ValueError(f"MTP_CORE_DEVICE={chosen!r} is not a device; use cpu, cuda or cuda:N")
    if chosen.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"MTP_CORE_DEVICE={chosen} but torch sees no CUDA device; unset it or use cpu")
    return chosen


def check_device_features(cfg) -> None:
    """GPU-only settings are accepted everywhere; on a CPU each either runs without them (with a warning)
    or is refused with the reason."""
    from mtp_core.loader import resolve_dtype

    if cfg.device == "cpu":
        import torch

        why = "this run is on the CPU" if torch.cuda.is_available() else "this machine has none"
        if cfg.cuda_graph_config is not None:
            log.warning("CUDA graphs need an NVIDIA GPU and %s; running eagerly", why)
            cfg.cuda_graph_config = None
        if cfg.moe_config.backend in GPU_MOE_BACKENDS:
            log.warning("MoE backend %s needs an NVIDIA GPU and %s; using the PyTorch MoE",
                        cfg.moe_config.backend, why)
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

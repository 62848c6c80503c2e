"""`mtp serve`: an OpenAI-compatible HTTP server over the batched MTP engine.

Takes every engine flag of `mtp quickstart` (and its YAML, `--extra_llm_api_options`), minus the
per-prompt ones (prompts, max_tokens, sampling: those come with each request), plus the server's own.
The engine runs in its own process (`--engine_in_thread` keeps it in this one); chunked prefill is on
unless `--disable_chunked_prefill`. stderr carries the logs and one `serving <model> on http://HOST:PORT`
line once the socket accepts connections. Exit codes: 0 after SIGTERM / Ctrl-C (graceful, or during
loading), 128 + the signal's number after a second signal (forced), 2 a usage or configuration error (bad
flag, YAML, checkpoint, port in use), 1 a runtime error.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import typer

from cli.common import build_llm_config, run_or_exit, setup_logging, warn_ignored_flags
from cli.options import explicit_params, plain
from cli.quickstart import REQUEST_FLAGS, quickstart_command

log = logging.getLogger("mtp.cli")

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024   # = mtp_core.serve.state.DEFAULT_MAX_REQUEST_BYTES (not imported:
SERVE_PREFILL_CHUNK = 256                      # `mtp --help` must stay light); see docs/serving.md for 256


def _serve_options() -> list[inspect.Parameter]:
    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter("host", kw, annotation=str, default=typer.Option(
            "127.0.0.1", "--host", help="Address to listen on (0.0.0.0 = every interface).")),
        inspect.Parameter("port", kw, annotation=int, default=typer.Option(
            8000, "--port", help="TCP port (0 = any free port; the chosen one is logged).")),
        inspect.Parameter("served_model_name", kw, annotation=Optional[str], default=typer.Option(
            None, "--served_model_name", help="The model id clients send (default: the model directory's name).")),
        inspect.Parameter("reasoning_parser", kw, annotation=Optional[str], default=typer.Option(
            None, "--reasoning_parser", help="deepseek-r1: chat text inside <think>...</think> goes to "
                                             "reasoning_content.")),
        inspect.Parameter("shutdown_timeout", kw, annotation=float, default=typer.Option(
            10.0, "--shutdown_timeout", help="Seconds in-flight requests get to finish after SIGTERM / Ctrl-C; "
                                             "the rest get a 503.")),
        inspect.Parameter("api_key", kw, annotation=Optional[str], default=typer.Option(
            None, "--api_key", envvar="MTP_API_KEY", show_envvar=True,
            help="Require 'Authorization: Bearer KEY' on /v1/* (default: $MTP_API_KEY; unset = no key).")),
        inspect.Parameter("allowed_origins", kw, annotation=Optional[str], default=typer.Option(
            None, "--allowed_origins", help="CORS: comma-separated origins browsers may call from "
                                            "(e.g. http://localhost:3000), or * (default: none).")),
        inspect.Parameter("max_request_bytes", kw, annotation=int, default=typer.Option(
            DEFAULT_MAX_REQUEST_BYTES, "--max_request_bytes", help="Largest request body; larger ones get 413.")),
        inspect.Parameter("engine_in_thread", kw, annotation=bool, default=typer.Option(
            False, "--engine_in_thread", help="Run the engine loop in a thread of the HTTP process instead of its "
                                              "own process (debugging; HTTP work then takes the engine's time).")),
    ]


def serve_command(ctx: typer.Context, **flags: Any) -> None:
    setup_logging(plain(flags["log_level"]))
    params = {k: plain(v) for k, v in ctx.params.items()}
    run_or_exit(lambda: _run(params, explicit_params(ctx)))


def _build_signature() -> None:
    """quickstart's options minus the request's (prompts, max_tokens, sampling: each request brings them)."""
    base = inspect.signature(quickstart_command, eval_str=True)
    ps = [p for name, p in base.parameters.items() if name not in REQUEST_FLAGS]
    # serving interleaves long prompts with the running streams: chunked prefill is on by default here
    ps = [p.replace(default=typer.Option(True, "--enable_chunked_prefill/--disable_chunked_prefill",
                                         help="Prefill long prompts in chunks between decode steps (on in serve; "
                                              f"without --max_num_tokens a step holds max_batch_size x (K+1) + "
                                              f"{SERVE_PREFILL_CHUNK} tokens)."))
          if p.name == "enable_chunked_prefill" else p for p in ps]
    # the engine shares the machine with the API process: by default it leaves that process a core
    ps = [p.replace(default=typer.Option(None, "--num_threads", help="CPU threads of the engine (default: torch's "
                                                                     "choice, at most the usable CPUs minus one, which "
                                                                     "is left to the API process)."))
          if p.name == "num_threads" else p for p in ps]
    ps = ps[:1] + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in ps[1:]] + _serve_options()
    serve_command.__signature__ = base.replace(parameters=ps)          # type: ignore[attr-defined]
    serve_command.__annotations__ = {p.name: p.annotation for p in ps} | {"return": None}


_build_signature()


def engine_threads(torch_default: Optional[int] = None, usable_cpus: Optional[int] = None) -> int:
    """The engine's CPU threads without --num_threads: torch's default, but at most the usable CPUs minus one, so
    that the API process (HTTP, JSON, tokenizing, detokenizing) has a core of its own, as vLLM's CPU backend
    reserves one. On a machine with more cores than torch takes (torch uses the physical cores) nothing changes."""
    if torch_default is None:
        import torch

        torch_default = torch.get_num_threads()
    if usable_cpus is None:
        usable_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(torch_default, usable_cpus - 1))


class _Interrupted(Exception):
    def __init__(self, sig: int) -> None:
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """While the model loads: SIGINT / SIGTERM raise _Interrupted (one line, exit 0; no traceback)."""
    def handler(sig: int, frame: Any) -> None:
        raise _Interrupted(sig)
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _run(p: dict[str, Any], explicit: dict[str, Any]) -> None:
    from mtp_core.serve.server import bind, serve

    warn_ignored_flags(p)
    options = _serve_options_checked(p)
    cfg = _engine_config(p, explicit)
    sock = bind(p["host"], p["port"])          # before loading: a busy port fails fast
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    name = p["served_model_name"] or Path(cfg.model_dir).name
    level = str(p["log_level"])
    try:
        with _signals_raise():
            app = _load_app(cfg, name, p, options, level)
    except _Interrupted as e:
        sock.close()
        print(f"stopped: {e} arrived while the model was loading", file=sys.stderr, flush=True)
        raise typer.Exit(0) from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host

    def ready() -> None:
        print(f"serving {name} on http://{shown}:{port} (OpenAI API under /v1; Ctrl-C to stop)", file=sys.stderr,
              flush=True)

    serve(app, sock, p["shutdown_timeout"], "debug" if level == "debug" else "warning", on_ready=ready)
    print("server stopped", file=sys.stderr, flush=True)


def _serve_options_checked(p: dict[str, Any]) -> Any:
    """The server's own options, checked (before anything loads), as the app's ServeOptions."""
    from mtp_core.serve.app import REASONING_PARSERS, ServeOptions

    if p["reasoning_parser"] is not None and p["reasoning_parser"] not in REASONING_PARSERS:
        raise ValueError(f"--reasoning_parser {p['reasoning_parser']!r} is unknown; use "
                         f"{', '.join(REASONING_PARSERS)}")
    if not 0 <= p["port"] <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {p['port']}")
    if p["shutdown_timeout"] < 0:
        raise ValueError(f"--shutdown_timeout must be >= 0, got {p['shutdown_timeout']}")
    if p["tp_size"] != 1 or p["moe_ep_size"] not in (-1, 1):
        raise ValueError("mtp serve runs one process; drop --tp_size / --moe_ep_size (tensor and expert "
                         "parallel serving is not supported yet)")
    origins = [o.strip() for o in (p["allowed_origins"] or "").split(",") if o.strip()]
    options = ServeOptions(api_key=p["api_key"], allowed_origins=origins, max_request_bytes=p["max_request_bytes"])
    options.validate()
    return options


def _engine_config(p: dict[str, Any], explicit: dict[str, Any]) -> Any:
    """quickstart's LLMConfig with serve's defaults: a core left to the API process, chunked prefill's step size."""
    cfg = build_llm_config(p, explicit)
    if cfg.num_threads is None and cfg.device == "cpu":
        cfg.num_threads = engine_threads()
        log.info("engine threads: %d (--num_threads to change)", cfg.num_threads)
    if cfg.enable_chunked_prefill and "max_num_tokens" not in explicit:
        k = cfg.speculative_config.max_draft_len if cfg.speculative_config else 0
        cfg.max_num_tokens = cfg.max_batch_size * (k + 1) + SERVE_PREFILL_CHUNK
    return cfg


def _load_app(cfg: Any, name: str, p: dict[str, Any], options: Any, level: str) -> Any:
    """The app over the engine: in its own process (the tokenizer loads here meanwhile), or with
    --engine_in_thread an LLM in this one."""
    from mtp_core.serve.app import build_app

    if p["engine_in_thread"]:
        from mtp_core.llm import LLM
        from mtp_core.serve.engine_proc import server_info

        iter_log = (lambda s: print(s, file=sys.stderr)) if cfg.print_iter_log else None
        llm = LLM(cfg, iter_log=iter_log)
        return build_app(llm, name, p["reasoning_parser"], info=server_info(cfg, llm), options=options)
    from mtp_core.serve.engine_client import EngineProcess
    from mtp_core.tokenizer import Tokenizer

    engine = EngineProcess(cfg, level)
    print(f"loading {cfg.model_dir} in the engine process (pid {engine.proc.pid})", file=sys.stderr, flush=True)
    try:
        tokenizer = Tokenizer.from_dir(cfg.model_dir)      # while the engine loads the model
        engine.wait_ready()
        return build_app(engine, name, p["reasoning_parser"], tokenizer=tokenizer, model_dir=cfg.model_dir,
                         options=options)
    except BaseException:
        engine.kill()
        raise

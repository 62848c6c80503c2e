"""`mtp serve`: an OpenAI-compatible HTTP server over the batched MTP engine.

Takes every engine flag of `mtp quickstart` (and its YAML, `--extra_llm_api_options`), minus the
per-prompt ones (prompts, max_tokens, sampling: those come with each request), plus the server's own.
stderr carries the logs and one `serving <model> on http://HOST:PORT` line once the socket accepts
connections. Exit codes: 0 after SIGTERM / Ctrl-C (graceful), 2 a usage or configuration error (bad flag,
YAML, checkpoint, port in use), 1 a runtime error.
"""
from __future__ import annotations

import inspect
import logging
import sys
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from cli.common import build_llm_config, run_or_exit, setup_logging
from cli.quickstart import quickstart_command

log = logging.getLogger("mtp.cli")

# quickstart flags that belong to a request, not to the server
PER_REQUEST = ("prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "apply_chat_template")


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
            10.0, "--shutdown_timeout", help="Seconds in-flight requests get to finish after SIGTERM / Ctrl-C.")),
    ]


def _plain(v: Any) -> Any:
    return v.value if isinstance(v, Enum) else v


def serve_command(ctx: typer.Context, **flags: Any) -> None:
    setup_logging(_plain(flags["log_level"]))
    params = {k: _plain(v) for k, v in ctx.params.items()}
    explicit = {name: params[name] for name in params
                if getattr(ctx.get_parameter_source(name), "name", None) == "COMMANDLINE"}
    run_or_exit(lambda: _run(params, explicit))


def _build_signature() -> None:
    base = inspect.signature(quickstart_command, eval_str=True)
    ps = [p for name, p in base.parameters.items() if name not in PER_REQUEST]
    ps = ps[:1] + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in ps[1:]] + _serve_options()
    serve_command.__signature__ = base.replace(parameters=ps)          # type: ignore[attr-defined]
    serve_command.__annotations__ = {p.name: p.annotation for p in ps} | {"return": None}


_build_signature()


def _run(p: dict[str, Any], explicit: dict[str, Any]) -> None:
    from mtp_core.bench.report import engine_info, machine_info, mode_name, world_info
    from mtp_core.llm import LLM
    from mtp_core.serve.app import REASONING_PARSERS, build_app
    from mtp_core.serve.server import bind, serve

    if p["trust_remote_code"]:
        log.warning("--trust_remote_code is ignored: mtp never runs code from the model directory")
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
    full = dict(p)
    full.update({k: None for k in ("prompt", "seed")}, max_tokens=1, temperature=0.0, top_k=0, top_p=1.0,
                apply_chat_template=False)
    cfg = build_llm_config(full, explicit)
    sock = bind(p["host"], p["port"])          # before loading: a busy port fails fast
    iter_log = (lambda s: print(s, file=sys.stderr)) if cfg.print_iter_log else None
    llm = LLM(cfg, iter_log=iter_log)
    name = p["served_model_name"] or Path(cfg.model_dir).name
    info = {"engine": engine_info(cfg, llm.model), "machine": machine_info(cfg.device),
            "world_info": world_info(cfg, 0), "mode": mode_name(cfg, llm.model.num_mtp_modules),
            "max_draft_len": cfg.speculative_config.max_draft_len if cfg.speculative_config else 0,
            "max_seq_len": llm.engine.max_seq_len}
    app = build_app(llm, name, p["reasoning_parser"], info=info)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host

    def ready() -> None:
        print(f"serving {name} on http://{shown}:{port} (OpenAI API under /v1; Ctrl-C to stop)", file=sys.stderr,
              flush=True)

    serve(app, sock, p["shutdown_timeout"], "debug" if p["log_level"] == "debug" else "warning", on_ready=ready)
    print("server stopped", file=sys.stderr, flush=True)

"""The engine process of `mtp serve`: `python -m mtp_core.serve.engine_proc FD` (started by EngineProcess).

FD is this end of the socket pair to the API process. The first frame is the MessagePack (LLMConfig, log
level); then the model loads and the process answers Ready (or Failed) and serves the engine loop until a
Shutdown command or the end of the socket (the API process is gone). SIGINT and SIGTERM are ignored: the
API process owns the shutdown.
"""
from __future__ import annotations

import json
import logging
import signal
import sys
from typing import Any

import msgspec


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the API process dies, even while the model is still loading."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)            # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - elsewhere the socket's EOF stops the loop once it runs
        pass


def server_info(cfg: Any, llm: Any) -> dict:
    """GET /server_info: the engine settings `mtp bench --base_url` puts in its report."""
    from mtp_core.bench.report import engine_info, machine_info, mode_name, world_info

    info = {"engine": engine_info(cfg, llm.model), "machine": machine_info(cfg.device),
            "world_info": world_info(cfg, 0), "mode": mode_name(cfg, llm.model.num_mtp_modules),
            "max_draft_len": cfg.speculative_config.max_draft_len if cfg.speculative_config else 0,
            "max_seq_len": llm.engine.stops.max_seq_len}
    return json.loads(json.dumps(info, default=str))        # plain JSON values (torch.__version__ is a str subclass)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    from multiprocessing.connection import Connection

    from mtp_core.config import LLMConfig

    conn = Connection(int(argv[0]))
    cfg, log_level = msgspec.msgpack.decode(conn.recv_bytes(), type=tuple[LLMConfig, str])
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING), handlers=[handler], force=True)

    from mtp_core.serve.messages import Failed, command_decoder, message_encoder

    try:
        from mtp_core.llm import LLM

        iter_log = (lambda s: print(s, file=sys.stderr, flush=True)) if cfg.print_iter_log else None
        llm = LLM(cfg, iter_log=iter_log)
        info = server_info(cfg, llm)
    except (ValueError, FileNotFoundError) as e:
        conn.send_bytes(message_encoder.encode(Failed(str(e).splitlines()[0] if str(e) else type(e).__name__, True)))
        return 2
    except Exception as e:  # noqa: BLE001 - one line to the API process, which prints it
        logging.getLogger("mtp.serve").debug("traceback", exc_info=True)
        first = str(e).splitlines()[0] if str(e) else ""
        conn.send_bytes(message_encoder.encode(Failed(f"{type(e).__name__}: {first}".rstrip(": "), False)))
        return 1

    from mtp_core.serve.engine_core import EngineCore, run_engine_loop

    core = EngineCore(llm)
    conn.send_bytes(message_encoder.encode(core.ready(info)))

    def recv(block: bool) -> list:
        out = []
        if block:
            conn.poll(None)
        while len(out) < 4096 and conn.poll(0):
            out.append(command_decoder.decode(conn.recv_bytes()))   # EOFError: the API process is gone
        return out

    def send(msg: Any) -> None:
        try:
            conn.send_bytes(message_encoder.encode(msg))
        except OSError:
            raise EOFError() from None

    run_engine_loop(core, recv, send)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

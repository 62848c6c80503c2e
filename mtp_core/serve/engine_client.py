"""The API process's handle on the engine: `EngineProcess` (the default) or `InProcessEngine`.

Both offer the same four calls: `send(command)` (thread-safe and never blocking: the event loop and the
output thread both send), `recv()` (blocking, for the one output thread; EOFError once the engine is gone), `close()` and
`kill()`; `ready` holds what the engine reported once it had loaded (context length, pool size, vocab).

`EngineProcess` runs the engine loop in a child process (`python -m mtp_core.serve.engine_proc`) over one
Unix socket pair: each message is a length-prefixed MessagePack frame (multiprocessing.connection framing,
msgspec encoding). Measured against ZeroMQ and multiprocessing queues in `scripts/ipc_bench.py` and
docs/serving.md. The child ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole process group;
the API process decides how to stop), dies with its parent (PR_SET_PDEATHSIG on Linux, and EOF on the socket
otherwise) and is stopped with a Shutdown command, or SIGKILL when it does not answer.
"""
from __future__ import annotations

import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Optional

import msgspec

import mtp_core
from mtp_core.serve.engine_core import EngineCore, run_engine_loop
from mtp_core.serve.messages import (Command, EngineMessage, Failed, Ready, Shutdown, command_encoder,
                                     message_decoder)

log = logging.getLogger("mtp.serve")


class EngineGone(EOFError):
    pass


class InProcessEngine:
    """The engine loop in a thread of this process (tests, notebooks, `mtp serve --engine_in_thread`).
    Messages are the same structs, passed without encoding. The HTTP work then shares this process's GIL
    with the engine loop: the separate process is the layout for serving."""

    def __init__(self, llm: Any, server_info: Optional[dict] = None) -> None:
        self.llm = llm
        self.core = EngineCore(llm)
        self.ready: Ready = self.core.ready(server_info or {})
        self._cmds: queue.Queue = queue.Queue()
        self._outs: queue.Queue = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mtp-engine-loop", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        def recv(block: bool) -> list[Command]:
            out = [self._cmds.get()] if block else []
            while True:
                try:
                    out.append(self._cmds.get_nowait())
                except queue.Empty:
                    return out
        try:
            run_engine_loop(self.core, recv, self._outs.put)
        except BaseException as e:  # noqa: BLE001 - the loop must never die silently
            self.error = e
            log.error("engine loop stopped: %s: %s", type(e).__name__, e, exc_info=True)
        finally:
            self._outs.put(None)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def send(self, cmd: Command) -> None:
        self._cmds.put(cmd)

    def recv(self) -> EngineMessage:
        m = self._outs.get()
        if m is None:
            raise EngineGone()
        return m

    def close(self, timeout: float = 30.0) -> None:
        self.send(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout)

    def kill(self) -> None:
        self.close(0.0)


class EngineProcess:
    """The engine loop in its own process. Construct, then `wait_ready()` (the model loads meanwhile)."""

    def __init__(self, cfg: Any, log_level: str = "warning") -> None:
        parent, child = socket.socketpair()
        self._conn = Connection(os.dup(parent.fileno()))
        parent.close()
        env = dict(os.environ)
        root = str(Path(mtp_core.__file__).resolve().parent.parent)      # import the same mtp_core as we do
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        fd = child.fileno()
        self.proc = subprocess.Popen([sys.executable, "-m", "mtp_core.serve.engine_proc", str(fd)],
                                     pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self._conn.send_bytes(msgspec.msgpack.encode((cfg, log_level)))   # data only: no pickle
        self.ready: Optional[Ready] = None
        self._eof = False
        # commands are written by one sender thread: neither the event loop nor the output thread ever
        # blocks on a full socket (the engine reads between steps), and their order is kept
        self._outbox: queue.Queue[Optional[bytes]] = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="mtp-engine-send", daemon=True)
        self._sender.start()

    def _send_loop(self) -> None:
        while True:
            data = self._outbox.get()
            if data is None:
                return
            try:
                self._conn.send_bytes(data)
            except OSError:      # the engine is gone: recv() reports it to the output thread
                return

    def wait_ready(self, check: Callable[[], None] = lambda: None) -> Ready:
        """Blocks until the engine reports Ready; raises ValueError / RuntimeError with the engine's one-line
        message when loading fails. `check` runs every 0.1 s (the CLI raises from it on a signal)."""
        while True:
            check()
            if self._conn.poll(0.1):
                try:
                    m = message_decoder.decode(self._conn.recv_bytes())
                except (EOFError, OSError):
                    m = None
                if isinstance(m, Ready):
                    self.ready = m
                    return m
                self.kill()
                if isinstance(m, Failed):
                    raise (ValueError if m.usage_error else RuntimeError)(m.message)
                raise RuntimeError(f"the engine process exited while loading (exit code {self.proc.wait()}); "
                                   "see the log above")
            if self.proc.poll() is not None and not self._conn.poll(0):
                raise RuntimeError(f"the engine process exited while loading (exit code {self.proc.returncode}); "
                                   "see the log above")

    def start(self) -> None:
        if self.ready is None:
            self.wait_ready()

    @property
    def alive(self) -> bool:
        return not self._eof and self.proc.poll() is None

    def send(self, cmd: Command) -> None:
        self._outbox.put(command_encoder.encode(cmd))

    def recv(self) -> EngineMessage:
        try:
            data = self._conn.recv_bytes()
        except (EOFError, OSError):
            self._eof = True
            raise EngineGone() from None
        return message_decoder.decode(data)

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.send(Shutdown())
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not stop within %.0f s; killing it", timeout)
                self.kill()
        self._outbox.put(None)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __del__(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


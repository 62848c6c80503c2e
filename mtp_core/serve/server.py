"""Runs the app under uvicorn on a socket we bind ourselves (so `--port 0` works and the port is known).

SIGTERM and SIGINT (Ctrl-C) stop the server gracefully: the listening socket closes (no new connections;
a request on a kept-alive connection gets a 503), in-flight requests get up to `shutdown_timeout` seconds to
finish, then every request still running is cut: a non-streaming one gets a JSON 503 error object, a
stream an `error` event (503) and `data: [DONE]`; the engine aborts them and stops. The process then exits
0, without uvicorn re-raising the signal and without a traceback. A second signal exits at once (the engine
process killed, exit code 128 + the signal's number), also without a traceback.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import socket
import threading
from typing import Any, Callable, Iterator, Optional

import uvicorn

log = logging.getLogger("mtp.serve")


class _Server(uvicorn.Server):
    """uvicorn.Server whose signal handling does not re-raise the signal after the graceful shutdown, cuts
    the requests still running at `shutdown_timeout` with a 503, and exits at once on a second signal."""

    cut_after: float = 10.0
    on_cut: Optional[Callable[[], int]] = None       # answers every unfinished request with a 503
    on_force_exit: Optional[Callable[[], None]] = None
    on_begin: Optional[Callable[[], None]] = None     # the shutdown starts: new requests get 503

    async def shutdown(self, sockets: Optional[list] = None) -> None:
        async def cut() -> None:
            await asyncio.sleep(self.cut_after)
            if self.on_cut is not None:
                n = self.on_cut()
                if n:
                    log.warning("%d request(s) still running after %.0f s: answered with 503", n, self.cut_after)
        if self.on_begin is not None:
            self.on_begin()
        task = asyncio.create_task(cut())
        try:
            await super().shutdown(sockets)
        finally:
            task.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def handle_exit(self, sig: int, frame: Any) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            log.warning("second %s: exiting now", name)
            if self.on_force_exit is not None:
                self.on_force_exit()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(128 + sig)
        log.warning("%s received: finishing in-flight requests (up to %.0f s), then exiting", name, self.cut_after)
        self.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(app: Any, shutdown_timeout: float, log_level: str = "warning") -> _Server:
    # uvicorn's own cancellation is only the fallback: our cut at shutdown_timeout answers every request first
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug", lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + 5, timeout_keep_alive=5, log_config=None)
    server = _Server(config)
    server.cut_after = shutdown_timeout
    state = getattr(getattr(app, "state", None), "mtp", None)
    if state is not None:
        server.on_cut = state.cut
        server.on_force_exit = state.engine.kill
        server.on_begin = lambda: setattr(state, "accepting", False)
    return server


def serve(app: Any, sock: socket.socket, shutdown_timeout: float = 10.0, log_level: str = "warning",
          on_ready: Optional[Callable[[], None]] = None) -> bool:
    """Blocks until a signal (or `server.should_exit`); returns whether the engine loop was healthy."""
    server = make_server(app, shutdown_timeout, log_level)
    # what start-up built (modules, the app, the tokenizer) lives as long as the server: keep the cyclic
    # collector from re-scanning it in every full collection while requests stream
    gc.collect()
    gc.freeze()

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started and on_ready is not None:
            on_ready()
        await task

    asyncio.run(main())
    return server.started


@contextlib.contextmanager
def server_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0,
                     start_timeout: float = 60.0) -> Iterator[str]:
    """Serves `app` from a background thread of this process (tests, notebooks); yields the base URL."""
    import time

    sock = bind(host, port)
    server = make_server(app, shutdown_timeout)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), name="mtp-uvicorn",
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    h, p = sock.getsockname()[:2]
    try:
        yield f"http://{h}:{p}"
    finally:
        server.should_exit = True
        thread.join(shutdown_timeout + 30)

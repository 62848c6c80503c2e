"""The ASGI middlewares around every route, outermost first: the error guard (an unexpected exception is a
500 error object, never a traceback), CORS (`allowed_origins`; browser preflights answered before the key
check), X-Request-Id (taken from the request or generated, echoed on every response, named in the log),
the API key (Bearer token on /v1/*), the request-body limit (413). Plain ASGI: they see every request,
streamed responses included, without buffering a body.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid
from typing import Any, Optional, Sequence

from fastapi import FastAPI

from mtp_core.serve.metrics import ErrorCounts
from mtp_core.serve.protocol import APIError
from mtp_core.serve.state import ServeOptions

log = logging.getLogger("mtp.serve")

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")
KEYED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")   # besides /v1/*: the API key guards them too


def add_middlewares(app: FastAPI, options: ServeOptions, errors: Optional[ErrorCounts] = None) -> None:
    # added innermost first: guard -> CORS -> request id -> API key -> body limit -> routes
    errors = errors if errors is not None else ErrorCounts()
    app.add_middleware(BodyLimit, limit=options.max_request_bytes, errors=errors)
    app.add_middleware(ApiKey, key=options.api_key, errors=errors)
    app.add_middleware(RequestId, errors=errors)
    if options.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id"], max_age=600)
    app.add_middleware(QuietCancel, errors=errors)


async def _send_error(send: Any, e: APIError, errors: ErrorCounts, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    errors.add(e.status, e.code)
    body = json.dumps(e.body()).encode()
    await send({"type": "http.response.start", "status": e.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class QuietCancel:
    """Outermost guard of every HTTP request. An unexpected exception becomes a 500 error object (one log
    line; the traceback only at debug level). A request cancelled by the server's shutdown ends quietly: its
    handler's cleanup has aborted its engine request already."""

    def __init__(self, app: Any, errors: ErrorCounts) -> None:
        self.app, self.errors = app, errors

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            log.warning("%s %s cancelled by the shutdown", scope.get("method"), scope.get("path"))
        except Exception as e:  # noqa: BLE001 - never a traceback in the server log for one request
            first = str(e).splitlines()[0] if str(e) else ""
            rid = scope.get("state", {}).get("request_id", "-")
            log.error("unexpected error on %s (request %s): %s: %s", scope.get("path"), rid, type(e).__name__, first)
            log.debug("traceback", exc_info=True)
            if not started:
                await _send_error(send, APIError(500, f"internal error: {type(e).__name__}: {first}".rstrip(": ")),
                                  self.errors, [(b"x-request-id", rid.encode())])


class RequestId:
    """X-Request-Id: the client's (1-256 visible ASCII characters) or a new one; echoed on every response."""

    def __init__(self, app: Any, errors: ErrorCounts) -> None:
        self.app, self.errors = app, errors

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        rid = given.decode("latin-1") if given is not None else uuid.uuid4().hex
        if given is not None and not _REQUEST_ID.fullmatch(rid):
            new = uuid.uuid4().hex
            return await _send_error(send, APIError(400, "X-Request-Id must be 1-256 visible ASCII characters; send "
                                                         "another or leave it out", code="invalid_request_id"),
                                     self.errors, [(b"x-request-id", new.encode())])
        scope.setdefault("state", {})["request_id"] = rid
        raw = rid.encode("latin-1")

        async def with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", raw)]
            await send(message)

        await self.app(scope, receive, with_id)


class ApiKey:
    """With a key set: /v1/* and the tokenizer's routes need `Authorization: Bearer <key>` (401 otherwise); /health,
    /metrics and /server_info stay open."""

    def __init__(self, app: Any, key: Optional[str], errors: ErrorCounts) -> None:
        self.app, self.errors = app, errors
        self.key = key.encode() if key else None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if self.key is None or scope.get("type") != "http" or not (path.startswith("/v1/") or path in KEYED_PATHS):
            return await self.app(scope, receive, send)
        auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
            rid = scope.get("state", {}).get("request_id", "-")
            log.warning("request %s: %s %s refused: %s API key", rid, scope.get("method"), scope.get("path"),
                        "wrong" if auth else "no")
            return await _send_error(send, APIError(401, "invalid or missing API key; send the header "
                                                         "'Authorization: Bearer <key>'", code="invalid_api_key"),
                                     self.errors, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class _TooLarge(Exception):
    pass


class BodyLimit:
    """Request bodies over `limit` bytes get a 413 error object. A declared Content-Length over it is
    refused before anything is buffered (the body is read and dropped, up to DRAIN_FACTOR x the limit, so
    that the client, still sending, sees the answer); a chunked body is counted as it arrives."""

    DRAIN_FACTOR = 8

    def __init__(self, app: Any, limit: int, errors: ErrorCounts) -> None:
        self.app, self.limit, self.errors = app, limit, errors

    def _error(self, size: Optional[int]) -> APIError:
        what = f"is {size} bytes" if size is not None else "is longer than that"
        return APIError(413, f"the request body {what}, over the limit of {self.limit} bytes (--max_request_bytes); "
                             "send a shorter prompt or raise the limit", code="request_too_large")

    async def _drain(self, receive: Any) -> None:
        seen = 0
        while seen <= self.DRAIN_FACTOR * self.limit:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            seen += len(msg.get("body", b""))
            if not msg.get("more_body", False):
                return

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        size = int(declared) if declared is not None and declared.isdigit() else None
        if size is not None and size > self.limit:
            await self._drain(receive)
            return await _send_error(send, self._error(size), self.errors)
        seen = 0
        started = False

        async def counted() -> dict:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge()
            return msg

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except _TooLarge:
            if not started:
                await self._drain(receive)
                await _send_error(send, self._error(None), self.errors)

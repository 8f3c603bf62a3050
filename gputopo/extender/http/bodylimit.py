"""The outermost layer of the extender's HTTP stack: a request body limit and a last-resort error answer.

- A body larger than `--max-request-bytes` is answered 413 before anything parses it: a declared
  Content-Length over the limit is refused without reading the body, and a chunked body is counted as it
  streams in and refused the moment it passes the limit. The 413 closes the connection (the rest of the
  body is never read, so the connection cannot be reused).
- Anything a route did not catch is answered as a JSON 500 naming the error instead of Starlette's plain
  one. The exception is not re-raised: a re-raised exception after the response started makes uvicorn
  close the connection, and kube-scheduler's next request on it would fail.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic_core import to_json

from gputopo.extender.settings import DEFAULT_MAX_REQUEST_BYTES

log = logging.getLogger("gputopo.extender.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def _answer(send: Send, status: int, body: dict[str, Any], *, close: bool = False) -> None:
    payload = to_json(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def too_large_body(limit: int) -> str:
    return f"request body is larger than {limit} bytes (--max-request-bytes)"


def _too_large(limit: int) -> dict[str, Any]:
    return {"Error": too_large_body(limit)}


class RequestGuard:
    """ASGI middleware: body limit (413) and a JSON answer for unexpected errors (see the module doc)."""

    def __init__(self, app: ASGIApp, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Read the whole body here, under the limit, then replay it: the routes parse it in one piece anyway,
        # and the limit then holds for chunked bodies without relying on how each route reads.
        whole = await read_body(scope, receive, send, self.max_request_bytes)
        if whole is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the server would

        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, replay, tracked)
        except Exception as e:
            log.exception("unhandled error", extra={"path": scope.get("path", "")})
            if not started:
                await _answer(send, 500, {"Error": f"internal: {type(e).__name__}: {e}"})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value) if len(value) <= 20 else -1
            except ValueError:
                return -1  # unreadable: refused like an oversized one
    return None


async def read_body(scope: Scope, receive: Receive, send: Send, limit: int) -> bytes | None:
    """The request's whole body, or None once a 413 is answered (or the client left): a declared
    Content-Length over `limit` is refused unread, a chunked body the moment it passes it."""
    declared = _content_length(scope)
    if declared is not None and (declared < 0 or declared > limit):
        await _answer(send, 413, _too_large(limit), close=True)
        return None
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            await _answer(send, 413, _too_large(limit), close=True)
            return None
        chunks.append(body)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)

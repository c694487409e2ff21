"""Run one HTTP request through an in-process ASGI app and stream the response out as it is sent.

An engine replica holds the ordinary `kvpager serve` app; the ingress hands it the request's method,
path, headers and body, and gets back the status and headers, then the body chunks as the app sends
them (SSE streams stay streams). Closing the generator early (the client left) tells the app the
client disconnected, so the app aborts the engine requests exactly as behind uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True)
class HttpRequest:
    """A plain-data HTTP request (what travels from the ingress to a replica)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


async def stream_asgi(app: ASGIApp, request: HttpRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Yield the response start, then each non-empty body chunk, until the app finishes the response."""
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    outbox: asyncio.Queue[Message | BaseException | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await outbox.put(message)

    async def run() -> None:
        try:
            await app(scope, receive, send)
            await outbox.put(None)
        except BaseException as exc:  # noqa: BLE001  # handed to the consumer, which re-raises it
            await outbox.put(exc)

    task = asyncio.create_task(run())
    try:
        while True:
            item = await outbox.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            if item["type"] == "http.response.start":
                yield ResponseStart(int(item["status"]), [(bytes(k), bytes(v)) for k, v in item.get("headers", [])])
            elif item["type"] == "http.response.body":
                chunk = bytes(item.get("body", b""))
                if chunk:
                    yield chunk
                if not item.get("more_body", False):
                    return
    finally:
        disconnected.set()  # NOTE: the app sees http.disconnect and aborts what it still runs
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            if not task.done():
                task.cancel()

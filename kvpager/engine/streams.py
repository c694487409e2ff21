"""Per-request output streams: the hand-off from the engine's loop thread to an asyncio consumer.

The loop thread (`kvpager.engine.async_engine`) never touches an event loop's objects directly: it
posts each item with `loop.call_soon_threadsafe` (`post`), and the consumer's loop queues it. A
stream holds at most one undelivered output (newer ones merge into it, `merge_outputs`), so a reader
that never reads costs one output's memory, not one copy per step. Leaving a stream early (a closed
generator, a cancelled task, a client disconnect) calls its `on_abort`, so the request's blocks go
back to the pool at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvpager.core.outputs import RequestOutput
from kvpager.engine.output_processor import merge_outputs


def post(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    """Run `fn` on `loop` soon (from any thread); dropped when the loop is closed (nobody listens)."""
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:
        pass


def resolve_soon(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: Any, error: BaseException | None
) -> None:
    """Resolve `future` (which belongs to `loop`) from any thread; a no-op once it is done (cancelled)."""

    def resolve() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    post(loop, resolve)


class RequestStream:
    """The outputs of one request, as an async iterator; `abort()` (or leaving early) cancels it.

    `added` resolves once the engine accepted the request (or fails with the reason it did not).
    `on_abort(request_id)` is called once, on the consumer's loop, when the consumer stops first.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, on_abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.finished = False
        self._on_abort = on_abort
        self._loop = loop
        self._pending: deque[RequestOutput | BaseException] = deque()  # at most one output, then an error
        self._ready = asyncio.Event()
        self.added: asyncio.Future[None] = loop.create_future()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                while not self._pending:
                    self._ready.clear()
                    await self._ready.wait()
                item = self._pending.popleft()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            # NOTE: a consumer that stops early (closed generator, cancelled task) aborts at once,
            # so the request's blocks go back to the pool without waiting for max_tokens.
            self.abort()

    def abort(self) -> None:
        """Stop the request if it is still running (idempotent, callable from the event loop)."""
        if not self.finished:
            self.finished = True
            self._on_abort(self.request_id)

    def put(self, item: RequestOutput | BaseException) -> None:
        """From the loop thread: hand an output (or the error that ends the stream) to the consumer."""
        post(self._loop, lambda: self._offer(item))

    def resolve_added(self, error: BaseException | None) -> None:
        """From the loop thread: the engine accepted the request (`error` None) or refused it."""
        resolve_soon(self._loop, self.added, None, error)

    def _offer(self, item: RequestOutput | BaseException) -> None:
        """On the consumer's loop: queue `item`, merged into an output the reader has not taken yet."""
        last = self._pending[-1] if self._pending else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            self._pending[-1] = merge_outputs(last, item)
        else:
            self._pending.append(item)
        self._ready.set()

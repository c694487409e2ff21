"""AsyncEngine: the engine's step loop on one background thread, streamed per request to asyncio.

The `Engine` is not thread-safe, so exactly one thread (the loop thread) ever touches it. Callers on
any asyncio event loop hand it work through an inbox (adds and aborts) guarded by a condition
variable; the loop thread drains the inbox before each step, runs `engine.step()` while there is
work and sleeps on the condition otherwise (no busy loop). Outputs go back to per-request
streams (`kvpager.engine.streams`, each bounded to one undelivered output) through
`loop.call_soon_threadsafe`, so model compute never blocks an event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvpager.core.outputs import RequestOutput
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.openmp_pool import release_thread_pool
from kvpager.engine.streams import RequestStream, resolve_soon

__all__ = ["AsyncEngine", "EngineDeadError", "QueueFullError", "RequestStream"]

logger = logging.getLogger("kvpager.engine.async_engine")

T = TypeVar("T")


class QueueFullError(RuntimeError):
    """The waiting queue already holds `max_waiting` requests; retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error or a shutdown; no request can be served."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float | None
    stream: RequestStream


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    """Run `fn(engine)` on the loop thread between steps; its result or error resolves `future`."""

    fn: Callable[[Any], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


@dataclass
class _Inbox:
    commands: list[_Add | _Abort | _Call] = field(default_factory=list)
    num_pending_adds: int = 0


class AsyncEngine:
    """Runs `engine.step()` on a background thread and streams each request's outputs.

    `max_waiting` bounds the waiting queue: when it already holds that many requests (counting
    those not yet handed to the engine), `add_request` raises `QueueFullError`.
    """

    def __init__(self, engine: Any, max_waiting: int | None = None) -> None:
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._inbox = _Inbox()
        self._streams: dict[str, RequestStream] = {}  # guarded by _cond
        self._stats = engine.stats()
        self._error: BaseException | None = None
        self._stopped = False
        self._engine_shut_down = False
        self._thread: threading.Thread | None = None
        # NOTE: only a shared store answers slower than a step; without one a hint would only hash the prompt
        config = getattr(engine, "config", None)
        self._hint_lookups = getattr(config, "kv_cache_remote", None) is not None and hasattr(engine, "kv_manager")

    # -- pass-throughs the server reads ---------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def model_name(self) -> str:
        return str(self.engine.model_name)

    @property
    def pool(self) -> Any:
        return self.engine.pool

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    def stats(self) -> Any:
        """The engine's stats as of the end of the last step (a snapshot; safe from any thread)."""
        return self._stats

    @property
    def is_running(self) -> bool:
        """True while the loop thread is alive and has not failed (nor lost a tensor-parallel worker)."""
        alive = self._thread is not None and self._thread.is_alive() and self._error is None
        return alive and self._dead_reason() is None

    def _dead_reason(self) -> str | None:
        return getattr(self.engine, "dead_reason", None)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop thread (idempotent). The calling thread (the one that built the engine, as a
        rule) first hands back its OpenMP workers, so that only the loop thread's are counted while it
        steps (kvpager.engine.openmp_pool)."""
        if self._thread is None:
            release_thread_pool()
            self._thread = threading.Thread(target=self._run, name="kvpager-engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread after its current step; pending requests fail with EngineDeadError.

        On its way out the loop thread aborts what is still running and calls `engine.shutdown()`
        (when the engine has one), which persists the prefix cache to the KV tiers (host → disk).
        Idempotent.
        """
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        elif not self._engine_shut_down:  # never started: nobody else will flush the tiers
            self._shutdown_engine()
        self._fail_all(EngineDeadError("the engine was shut down"))

    # -- requests -------------------------------------------------------------------------------
    async def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, arrival_time: float | None = None
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it.

        Raises the engine's `ValueError` for bad input, `QueueFullError` when the waiting queue is
        full and `EngineDeadError` when the loop is not running.
        """
        stream = RequestStream(request_id, asyncio.get_running_loop(), self._abort)
        if isinstance(prompt, list) and self._hint_lookups:
            # the shared store's answer for this prompt is usually back before the step that schedules it
            self.engine.kv_manager.hint_lookup(prompt)
        with self._cond:
            self._check_accepting(request_id)
            self._streams[request_id] = stream
            self._inbox.commands.append(_Add(request_id, prompt, params, arrival_time, stream))
            self._inbox.num_pending_adds += 1
            self._cond.notify()
        try:
            await stream.added
        except BaseException:
            stream.abort()  # rejected (no-op on the engine) or the caller was cancelled while waiting
            raise
        return stream

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; closing the iterator aborts it."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            # NOTE: closing this generator does not close the inner iterator; abort explicitly.
            stream.abort()

    async def run_in_engine(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(engine)` on the loop thread between two steps and return its result (or raise its error).

        The engine is not thread-safe; this is the only way for other code to touch it while the loop
        runs (KV export/import, tier stats). `fn` blocks the step loop while it runs, so keep it
        short. Raises `EngineDeadError` when the loop is not running.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._cond:
            if self._error is not None or self._stopped or self._thread is None:
                raise EngineDeadError(f"the engine loop is not running ({self._error or 'stopped'})")
            self._inbox.commands.append(_Call(fn, future, loop))
            self._cond.notify()
        return await future

    async def import_kv(self, payload: bytes, max_bytes: int | None = None) -> int:
        """Import a KV payload: checked and decoded on a worker thread, inserted on the loop thread
        between steps. Returns the blocks imported; ValueError naming the problem (nothing imported)."""
        pack = await asyncio.to_thread(self.engine.decode_kv, payload, max_bytes)
        return int(await self.run_in_engine(lambda e: e.insert_kv(pack, len(payload))))

    def abort(self, request_id: str) -> None:
        """Abort a request by id (no-op when it is unknown or finished)."""
        with self._cond:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()

    def _check_accepting(self, request_id: str) -> None:
        if self._dead_reason() is not None:
            raise EngineDeadError(f"the engine is dead: {self._dead_reason()}")
        if self._error is not None or self._stopped or self._thread is None:
            raise EngineDeadError(f"the engine loop is not running ({self._error or 'stopped'})")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running; use a unique id")
        if self.max_waiting is not None:
            num_waiting = self._stats.num_waiting + self._inbox.num_pending_adds
            if num_waiting >= self.max_waiting:
                raise QueueFullError(
                    f"the server has {num_waiting} requests waiting (limit {self.max_waiting}); retry later"
                )

    def _abort(self, request_id: str) -> None:
        with self._cond:
            if self._streams.pop(request_id, None) is None:
                return
            self._inbox.commands.append(_Abort(request_id))
            self._cond.notify()

    # -- the loop thread ------------------------------------------------------------------------
    def _run(self) -> None:
        has_work = False
        while True:
            with self._cond:
                while not self._inbox.commands and not has_work and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    break
                commands, self._inbox.commands = self._inbox.commands, []
            try:
                self._apply(commands)
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                has_work = self.engine.has_unfinished_requests()
                # NOTE: the snapshot is taken before delivery, so a consumer never sees stats older
                # than the outputs it holds.
                self._stats = self.engine.stats()
                self._deliver(outputs)
            except Exception as exc:  # a failed step poisons the engine; fail every request loudly
                logger.exception("engine step failed; the engine loop stops")
                self._error = exc
                self._fail_all(EngineDeadError(f"the engine failed: {exc!r}"))
                return
        self._shutdown_engine()

    def _shutdown_engine(self) -> None:
        """Abort what still runs (its full blocks stay cached) and let the engine persist its KV."""
        self._engine_shut_down = True
        try:
            with self._cond:
                running = list(self._streams)
            for request_id in running:
                self.engine.abort_request(request_id)
            shutdown = getattr(self.engine, "shutdown", None)
            if shutdown is not None:
                shutdown()
        except Exception:  # a failed flush must not hide the shutdown itself
            logger.exception("engine shutdown failed; the KV tiers may not have been flushed")

    def _apply(self, commands: list[_Add | _Abort | _Call]) -> None:
        results: list[tuple[RequestStream, Exception | None]] = []
        for cmd in commands:
            if isinstance(cmd, _Abort):
                self.engine.abort_request(cmd.request_id)
                continue
            if isinstance(cmd, _Call):
                _run_call(self.engine, cmd)
                continue
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time)
            except Exception as exc:  # ValueError: bad input; anything else fails only this request
                with self._cond:
                    self._streams.pop(cmd.request_id, None)
                cmd.stream.finished = True
                results.append((cmd.stream, exc))
                continue
            results.append((cmd.stream, None))
        # NOTE: refreshed (and the pending count dropped) before the callers hear back, so the waiting
        # count that bounds the queue holds these requests exactly once while the next step runs.
        self._stats = self.engine.stats()
        with self._cond:
            self._inbox.num_pending_adds -= sum(isinstance(c, _Add) for c in commands)
        for stream, error in results:
            stream.resolve_added(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._cond:
                stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            streams = list(self._streams.values())
            self._streams.clear()
            pending = [c for c in self._inbox.commands if isinstance(c, _Add | _Call)]
            self._inbox = _Inbox()
        for stream in streams:
            stream.resolve_added(error)
            stream.put(error)
        for cmd in pending:
            if isinstance(cmd, _Call):
                resolve_soon(cmd.loop, cmd.future, None, error)
            else:
                cmd.stream.resolve_added(error)


def _run_call(engine: Any, call: _Call) -> None:
    """Run one `_Call` on the loop thread; an exception goes to the caller, not the loop."""
    try:
        result = call.fn(engine)
    except Exception as exc:
        resolve_soon(call.loop, call.future, None, exc)
        return
    resolve_soon(call.loop, call.future, result, None)

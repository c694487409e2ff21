"""The live KV memory view: `GET /kv` (the page), `GET /v1/kv/map` (JSON), `GET /v1/kv/stream` (SSE).

A snapshot is copied on the engine thread between two steps (`run_in_engine`, O(blocks)) and turned
into JSON off it; `KVMapSampler` shares one snapshot between every watcher for `MIN_INTERVAL_S` (longer
when a snapshot costs more than `COST_FRACTION` of that), so the engine pays at most a few copies per
second, and nothing at all while nobody watches.
With an API key the JSON and the stream need it: `Authorization: Bearer KEY`, or the HttpOnly cookie
that the page's login form (`POST /kv/login`, key in the body, never in a URL) sets. The cookie
holds an HMAC of the key, not the key, and opens only these two GET routes.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from kvpager.api.server.errors import ApiError
from kvpager.core.kv_snapshot import KVCapture, KVMapper, TierView
from kvpager.engine.async_engine import AsyncEngine, EngineDeadError
from kvpager.engine.kv_map import capture_engine, planner_prediction

MAP_PATH = "/v1/kv/map"
STREAM_PATH = "/v1/kv/stream"
PAGE_PATH = "/kv"
LOGIN_PATH = "/kv/login"
LOGOUT_PATH = "/kv/logout"
ASSETS = {"/kv/kv.js": ("kv.js", "text/javascript"), "/kv/kv.css": ("kv.css", "text/css")}
# Reachable without the key: they hold no engine data (the page asks for the key itself).
OPEN_VIEW_PATHS = frozenset({"/", PAGE_PATH, LOGIN_PATH, LOGOUT_PATH, *ASSETS})
COOKIE_PATHS = frozenset({MAP_PATH, STREAM_PATH})
COOKIE_NAME = "kvpager_kv"
MIN_INTERVAL_S = 0.25  # one shared snapshot at most this often, whatever the number of watchers
# A snapshot (copy on the engine thread + JSON off it, which still holds the GIL) may take at most this
# fraction of the time between two snapshots.
COST_FRACTION = 0.01
DEFAULT_STREAM_INTERVAL_S = 1.0
MAX_STREAM_INTERVAL_S = 10.0
SNAPSHOT_TIMEOUT_S = 5.0
NO_STORE = {"Cache-Control": "no-store"}


def cookie_token(api_key: str) -> str:
    """What the login cookie holds: an HMAC of the key (the key itself never leaves the login body)."""
    return hmac.new(api_key.encode(), b"kvpager-kv-view-v1", hashlib.sha256).hexdigest()


class KVMapSampler:
    """Snapshots shared by all watchers, at most one per `min_interval_s`; keeps the history the charts need."""

    def __init__(
        self,
        engine: AsyncEngine,
        remote_stats: Callable[[], dict[str, float]] | None = None,
        min_interval_s: float = MIN_INTERVAL_S,
        model_name: str | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name or engine.model_name
        self.remote_stats = remote_stats
        self.min_interval_s = min_interval_s
        self._mapper: KVMapper | None = None
        self._lock = asyncio.Lock()
        self._last: dict[str, Any] | None = None
        self._last_at = 0.0
        self.num_captures = 0
        self.last_cost_s = 0.0
        self.interval_s = min_interval_s  # what the last snapshot's cost allows (see COST_FRACTION)

    async def snapshot(self) -> dict[str, Any]:
        """The latest snapshot document (a fresh one if the last is older than `min_interval_s`)."""
        async with self._lock:
            if self._last is not None and time.monotonic() - self._last_at < self.interval_s:
                return self._last
            if self._mapper is None:
                self._mapper = await asyncio.to_thread(self._new_mapper)
            cap, capture_s = await asyncio.wait_for(self.engine.run_in_engine(_timed_capture), SNAPSHOT_TIMEOUT_S)
            self.num_captures += 1
            if self.remote_stats is not None:
                cap.tiers.append(_remote_view(self.remote_stats()))
            doc, render_s = await asyncio.to_thread(_timed_render, self._mapper, cap)
            # NOTE: the next snapshot waits until this one's cost is at most COST_FRACTION of the time
            # between them, so a huge pool is refreshed less often instead of slowing the engine.
            self.last_cost_s = capture_s + render_s
            self.interval_s = max(self.min_interval_s, self.last_cost_s / COST_FRACTION)
            doc["model"] = self.model_name
            doc["interval_s"] = self.interval_s
            self._last, self._last_at = doc, time.monotonic()
            return doc

    def history(self) -> list[dict[str, Any]]:
        return list(self._mapper.history) if self._mapper is not None else []

    def _new_mapper(self) -> KVMapper:
        engine = self.engine.engine
        tokenizer = engine.tokenizer

        def decode(token_ids: Any) -> str:
            return str(tokenizer.decode(list(token_ids), skip_special_tokens=False))

        return KVMapper(decode=decode, planner=planner_prediction(engine))


def _timed_capture(engine: Any) -> tuple[KVCapture, float]:
    """The capture and the CPU seconds it took the engine thread (thread time: waits for the GIL excluded)."""
    start = time.thread_time()
    cap = capture_engine(engine)
    return cap, time.thread_time() - start


def _timed_render(mapper: KVMapper, cap: KVCapture) -> tuple[dict[str, Any], float]:
    start = time.thread_time()
    doc = mapper.render(cap)
    return doc, time.thread_time() - start


def _remote_view(stats: dict[str, float]) -> TierView:
    """The prefill server a decode server fetches prompt KV from: fetches as hits/misses, bytes in."""
    return TierView(
        name="remote",
        unit="fetches",
        num_blocks=int(stats.get("fetch_blocks", 0)),
        bytes_held=0,
        capacity_bytes=None,
        hits=int(stats.get("fetches_ok", 0)),
        misses=int(stats.get("fetches_failed", 0)),
        bytes_in=int(stats.get("fetch_bytes", 0)),
        bytes_out=0,
        evictions=0,
    )


def _asset(name: str) -> str:
    return resources.files("kvpager.api.server").joinpath("static", name).read_text(encoding="utf-8")


def add_kv_view_routes(app: FastAPI, sampler: KVMapSampler, api_key: str | None) -> None:
    """Register the page, its assets, the login, the JSON map and the stream on `app`."""
    page = _asset("kv.html")
    assets = {path: (_asset(name), media) for path, (name, media) in ASSETS.items()}

    @app.get("/")
    async def root() -> HTMLResponse:
        return HTMLResponse(_asset("index.html"))

    @app.get(PAGE_PATH)
    async def kv_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    for path, (body, media) in assets.items():
        app.add_api_route(path, _static(body, media), methods=["GET"])

    @app.post(LOGIN_PATH)
    async def login(request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", errors="replace"))
        key = (form.get("key") or [""])[0]
        if api_key is None:
            return Response(status_code=204)
        if not hmac.compare_digest(key.encode(), api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        response = Response(status_code=204)
        secure = request.url.scheme == "https"
        response.set_cookie(COOKIE_NAME, cookie_token(api_key), httponly=True, samesite="strict", secure=secure)
        return response

    @app.post(LOGOUT_PATH)
    async def logout() -> Response:
        response = Response(status_code=204)
        response.delete_cookie(COOKIE_NAME, httponly=True, samesite="strict")
        return response

    @app.get(MAP_PATH)
    async def kv_map(history: bool = False) -> JSONResponse:
        doc = await _snapshot(sampler)
        if history:
            doc = {**doc, "history": sampler.history()}
        return JSONResponse(doc, headers=NO_STORE)

    @app.get(STREAM_PATH)
    async def kv_stream(interval: float = DEFAULT_STREAM_INTERVAL_S) -> StreamingResponse:
        if not MIN_INTERVAL_S <= interval <= MAX_STREAM_INTERVAL_S:
            raise ApiError(
                400, f"interval must be in [{MIN_INTERVAL_S}, {MAX_STREAM_INTERVAL_S}] seconds", param="interval"
            )
        first = await _snapshot(sampler)
        return StreamingResponse(
            _events(sampler, first, interval),
            media_type="text/event-stream",
            headers={**NO_STORE, "X-Accel-Buffering": "no"},
        )


def _static(body: str, media: str) -> Callable[[], Any]:
    async def serve() -> Response:
        return Response(body, media_type=media, headers={"Cache-Control": "no-cache"})

    return serve


async def _snapshot(sampler: KVMapSampler) -> dict[str, Any]:
    try:
        return await sampler.snapshot()
    except (EngineDeadError, TimeoutError) as exc:
        raise ApiError(
            503, f"no KV snapshot: {exc or 'the engine did not answer in time'}", code="engine_dead"
        ) from exc


async def _events(sampler: KVMapSampler, first: dict[str, Any], interval: float) -> AsyncIterator[str]:
    """SSE: the first event carries the history, the next ones the latest snapshot (one per interval)."""
    yield _sse({**first, "history": sampler.history()})
    last_time = first["time"]
    while True:
        await asyncio.sleep(max(interval, sampler.interval_s))
        try:
            doc = await sampler.snapshot()
        except (EngineDeadError, TimeoutError):
            yield "event: error\ndata: {}\n\n"
            return
        if doc["time"] != last_time:  # a snapshot shared with another watcher is sent once
            last_time = doc["time"]
            yield _sse(doc)


def _sse(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"

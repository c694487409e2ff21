"""The Ray Serve application of `kvpager serve --replicas N`: one ingress, N engine replicas.

`EngineReplica` is one engine with the ordinary `kvpager serve` HTTP app in-process: every OpenAI
route, error, stream and abort behaves as on a single server. It reports its prefix-cache state (KV
events) and queue length to the router through `record_routing_stats`.

With a shared KV store (`--kv-cache-remote`) and the store-aware router a replica also reports
`kv_store_blocks`: the hashes it knows the store holds or is writing there (`store_blocks_of`), so that
the router does not favour a replica for a prefix every replica can restore from the store.

`Ingress` takes the HTTP requests: it tokenizes the prompt as the engine will (same tokenizer and
chat template), hashes its full blocks with the replicas' fingerprint-seeded chain, and hands the
request to the engine deployment with the chain as the routing hint (`KVAwareRequestRouter`). The
response is streamed back chunk by chunk; a client that disconnects cancels the replica's stream,
which the replica's app sees as a disconnect (the engine request is aborted). `/metrics` merges
every replica's page with a `replica` label.

With a prefill pool (`--prefill-replicas M`, `prefill_pool.py`) the application holds two engine
deployments: the decode replicas (behind the ingress) fetch each prompt's KV from the prefill
deployment through a Ray Serve handle, routed by the prompt's chain like a completion; the ingress
also sends `POST /v1/kv/export` there, and `/metrics` adds a `role` label to every sample.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

from kvpager.api.replicas.asgi import HttpRequest, ResponseStart, stream_asgi
from kvpager.api.replicas.metrics_merge import merge_pages
from kvpager.api.replicas.policy import hex_chain
from kvpager.api.server.app import ServerSettings, build_app
from kvpager.core.config import EngineConfig
from kvpager.core.hashing import hash_prompt_blocks
from kvpager.core.kv_events import KVEventLog

logger = logging.getLogger("ray.serve")  # NOTE: Ray Serve writes this logger to the replica logs

REPLICA_HEADER = b"x-kvpager-replica"
STORE_REPORT_LIMIT = 4096  # hashes of the shared store one report carries (the newest this replica knows)
SNAPSHOT_TIMEOUT_S = 5.0
METRICS_TIMEOUT_S = 10.0


class EngineReplica:
    """One engine and its HTTP app (a Ray Serve replica)."""

    def __init__(
        self,
        config: EngineConfig,
        settings: ServerSettings,
        max_waiting: int | None = None,
        prefill_handle: Any = None,
        report_store_blocks: bool = False,
    ) -> None:
        from kvpager.api.replicas.prefill_pool import ServeHandleTransport
        from kvpager.engine.async_engine import AsyncEngine
        from kvpager.engine.engine import Engine

        engine = Engine(config)
        # NOTE: only the store-aware router reads the store's hashes; the others skip building them
        self.report_store_blocks = report_store_blocks
        self.kv_log = KVEventLog(max_pending=0)  # NOTE: only the held set is read (a full snapshot per report)
        engine.kv_manager.block_pool.add_listener(self.kv_log)
        self.engine = AsyncEngine(engine, max_waiting=max_waiting)
        self.fingerprint = engine.loaded.fingerprint
        self.block_size = config.block_size
        transport = None
        if prefill_handle is not None:  # NOTE: a decode replica of an application with a prefill pool
            transport = ServeHandleTransport(prefill_handle, self.fingerprint, self.block_size)
        self.app = build_app(self.engine, settings, prefill_transport=transport)
        self.engine.start()
        self._seq = 0
        self._num_requests = 0  # HTTP requests handled, reported so that every router spreads new prompts
        self.replica_id = _replica_id()

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to hash prompts like this engine does."""
        return {"fingerprint": self.fingerprint.hex(), "block_size": self.block_size, "replica": self.replica_id}

    async def handle(self, request: HttpRequest, kv_chain: list[str] | None = None) -> AsyncIterator[Any]:
        """Serve one HTTP request through the app: yields the `ResponseStart`, then body chunks."""
        self._num_requests += 1
        try:
            async for item in stream_asgi(self.app, request):
                if isinstance(item, ResponseStart):
                    item = ResponseStart(item.status, [*item.headers, (REPLICA_HEADER, self.replica_id.encode())])
                yield item
        finally:
            logger.debug("kvpager replica %s: request %s %s ended", self.replica_id, request.method, request.path)

    async def metrics_page(self, metrics_slot: int) -> tuple[str, str]:
        """(replica id, this replica's Prometheus page)."""
        request = HttpRequest("GET", "/metrics", b"", [], b"")

        async def render() -> bytes:
            return b"".join([item async for item in stream_asgi(self.app, request) if isinstance(item, bytes)])

        return self.replica_id, (await asyncio.wait_for(render(), METRICS_TIMEOUT_S)).decode("utf-8")

    async def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve polls this: the held block hashes (short hex) and the queue length."""
        log = self.kv_log

        def snapshot(engine: Any) -> tuple[list[str], list[str] | None]:
            return [h[:8].hex() for h in log.held], store_blocks_of(engine) if self.report_store_blocks else None

        held, stored = await asyncio.wait_for(self.engine.run_in_engine(snapshot), SNAPSHOT_TIMEOUT_S)
        stats = self.engine.stats()
        self._seq += 1
        report: dict[str, Any] = {
            "seq": self._seq,
            "kv_blocks": held,
            "queue_len": int(stats.num_running + stats.num_waiting),
            "num_requests": self._num_requests,
        }
        if stored is not None:
            report["kv_store_blocks"] = stored
        return report

    def check_health(self) -> None:
        """Ray Serve's health check: a dead engine loop restarts the replica."""
        if not self.engine.is_running:
            raise RuntimeError("the engine loop is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def store_blocks_of(engine: Any, limit: int = STORE_REPORT_LIMIT) -> list[str] | None:
    """The short hex hashes of at most `limit` blocks `engine` knows the shared store holds, newest
    first, or None when it has no store.

    First the blocks its publisher has announced or queued and not yet written (they are on their
    way), then the newest of those it wrote to or found in the store (`RemoteTier.recent_known`).
    Empty while the store is marked down. A hash the server has evicted since stays listed until this
    engine misses it or it ages out: the router then sends the prompt by queue length and the prefix
    is recomputed, never answered wrongly (every load is checked against its record).
    """
    store = getattr(engine, "kv_store", None)
    remote = getattr(getattr(store, "tiers", None), "remote", None)
    if remote is None:
        return None
    if not remote.available:
        return []
    publisher = getattr(engine, "kv_publisher", None)
    pending = publisher.pending() if publisher is not None else []
    hashes = dict.fromkeys(h[:8].hex() for h in pending[:limit])
    for block_hash in remote.recent_known(limit):
        if len(hashes) >= limit:
            break
        hashes.setdefault(block_hash[:8].hex(), None)
    return list(hashes)


class Ingress:
    """The HTTP entry point: hashes each prompt, routes by it, streams the replica's response back."""

    def __init__(
        self,
        engine_handle: Any,
        num_replicas: int,
        tokenizer_dir: str,
        chat_template: str | None,
        prefill_handle: Any = None,
        num_prefill_replicas: int = 0,
    ) -> None:
        from kvpager.text.tokenizer import Tokenizer

        self.engine = engine_handle
        self.num_replicas = num_replicas
        self.prefill = prefill_handle
        self.num_prefill_replicas = num_prefill_replicas if prefill_handle is not None else 0
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        self.chat_template = chat_template
        self._model: dict[str, Any] | None = None

    async def _describe(self) -> dict[str, Any]:
        if self._model is None:
            self._model = await self.engine.describe.remote()
        return self._model

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response, StreamingResponse

        body = await request.body()
        if request.url.path == "/metrics":
            return Response(await self._metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")
        model = await self._describe()
        chain = self.chain_for(request.url.path, body, bytes.fromhex(model["fingerprint"]), int(model["block_size"]))
        http = HttpRequest(
            request.method, request.url.path, request.url.query.encode(), list(request.headers.raw), body
        )
        target = self.engine
        if self.prefill is not None and request.url.path.endswith("/kv/export"):
            target = self.prefill  # NOTE: a decode server outside this application fetching from the pool
        stream = target.options(stream=True).handle.remote(http, kv_chain=chain)
        try:
            start = await stream.__anext__()
        except StopAsyncIteration:
            return Response(status_code=502)
        headers = {k.decode(): v.decode() for k, v in start.headers if k.lower() != b"content-length"}

        async def body_chunks() -> AsyncIterator[bytes]:
            # NOTE: no explicit `stream.cancel()` here (it blocks on the handle's router loop): when
            # the client leaves, Ray Serve cancels this request and, with it, the replica's stream.
            async for chunk in stream:
                yield chunk

        return StreamingResponse(body_chunks(), status_code=start.status, headers=headers)

    def chain_for(self, path: str, body: bytes, fingerprint: bytes, block_size: int) -> list[str]:
        """The prompt's block-hash chain (short hex), or [] when it cannot be read (then no preference)."""
        try:
            payload = json.loads(body) if body else {}
            token_ids = self._prompt_ids(path, payload)
        except (ValueError, TypeError, KeyError):
            return []
        if not token_ids:
            return []
        return hex_chain(hash_prompt_blocks(fingerprint, token_ids, block_size))

    def _prompt_ids(self, path: str, payload: dict[str, Any]) -> list[int]:
        if path.endswith("/kv/export"):  # NOTE: a decode server's fetch goes where the prefix is
            return [int(t) for t in payload["prompt_token_ids"]]
        if path.endswith("/chat/completions"):
            messages = [{"role": m["role"], "content": _text(m.get("content"))} for m in payload["messages"]]
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=payload.get("add_generation_prompt", True),
                chat_template=self.chat_template,
            )
            return list(self.tokenizer.encode(str(text), add_special_tokens=False))
        if path.endswith("/completions"):
            prompt = payload["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
                prompt = prompt[0]  # NOTE: a batch is routed by its first prompt
            if isinstance(prompt, str):
                return list(self.tokenizer.encode(prompt, add_special_tokens=True))
            return [int(t) for t in prompt]
        return []

    async def _metrics(self) -> str:
        """Every replica's page, merged; a replica that does not answer in time is left out (and logged).

        NOTE: one call at a time: concurrent handle calls made while serving one HTTP request can share
        the request's routing identity in Ray Serve, and then only one of them is routed.
        """
        pools = [("decode", self.engine, self.num_replicas)]
        if self.prefill is not None:
            pools.append(("prefill", self.prefill, self.num_prefill_replicas))
        pages: set[tuple[str, str]] = set()
        roles: dict[str, str] = {}
        for role, handle, count in pools:
            for slot in range(count):
                try:
                    page = await asyncio.wait_for(
                        _result(handle.metrics_page.remote(metrics_slot=slot)), METRICS_TIMEOUT_S
                    )
                except Exception as error:  # noqa: BLE001  # a slow or dead replica must not break /metrics
                    logger.warning("/metrics: %s replica slot %d did not answer: %r", role, slot, error)
                    continue
                pages.add(page)
                roles[page[0]] = role
        return merge_pages(sorted(pages), roles if self.prefill is not None else None)


async def _result(response: Any) -> Any:
    return await response


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def _replica_id() -> str:
    serve = sys.modules.get("ray.serve")  # NOTE: loaded in every Ray Serve replica; never imported here
    if serve is None:
        return "local"
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Ray Serve replica (unit tests)
        return "local"

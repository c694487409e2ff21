"""A decode replica's KV fetches, sent to the prefill deployment of the same Ray Serve application.

`kvpager serve --replicas N --prefill-replicas M` deploys M prefill replicas next to the N decode
replicas. A decode replica's `PrefillClient` (`api/server/disagg.py`) talks HTTP as it does to a
prefill server; here its httpx transport is a Ray Serve handle to the prefill deployment instead of a
socket. Each `POST /v1/kv/export` travels as a plain `HttpRequest` with the prompt's block-hash chain
as the routing hint, so the prefill deployment's `KVAwareRequestRouter` sends it to the prefill
replica that holds the longest prefix of the prompt. Everything else is the HTTP path's: the export is
signed with `--kv-transfer-key` and verified by the client, the body is read under
`--max-kv-import-bytes`, and any failure falls back to a local prefill with the reason logged.

Failures become httpx errors, which the client already turns into a fallback: a call Ray refuses
(no prefill replica alive, a replica that died mid-call) is a `ConnectError` / `ReadError`, and no
answer within `--prefill-timeout` (Ray Serve queues a call while no replica is up) a `ReadTimeout`,
after which the call is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx

from kvpager.api.replicas.asgi import HttpRequest, ResponseStart
from kvpager.api.replicas.policy import hex_chain
from kvpager.api.server.app import ServerSettings
from kvpager.api.server.disagg import DEFAULT_PREFILL_TIMEOUT_S, PrefillSettings
from kvpager.core.hashing import hash_prompt_blocks

logger = logging.getLogger("kvpager")

PREFILL_DEPLOYMENT = "KVPagerPrefill"
# NOTE: the client's base URL; no socket is opened (the transport is the handle). It names the pool in logs.
PREFILL_POOL_URL = "http://kvpagerprefill.serve"
CANCEL_TIMEOUT_S = 2.0


def pool_settings(
    settings: ServerSettings, timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S
) -> tuple[ServerSettings, ServerSettings]:
    """(prefill replicas' settings, decode replicas' settings) from one server's settings.

    Both pools keep the server's `--api-key`; the decode replicas send it with their KV fetches (the
    export route is behind it).

    ValueError when `settings` already names another prefill server or asks for a role, or when no
    `--kv-transfer-key` is set (the decode side would refuse every export).
    """
    if settings.prefill is not None:
        raise ValueError("--prefill-replicas deploys its own prefill pool; drop --prefill-url")
    if settings.role != "both":
        raise ValueError(
            f"--prefill-replicas deploys both roles (--replicas decode replicas, --prefill-replicas prefill "
            f"replicas); drop --role {settings.role}"
        )
    if not settings.kv_transfer_key:
        raise ValueError(
            "--prefill-replicas needs --kv-transfer-key KEY: the prefill replicas sign every export with it and "
            "the decode replicas import only what verifies (see docs/security.md)"
        )
    prefill = replace(settings, role="prefill", prefill=None)
    decode = replace(
        settings,
        role="decode",
        prefill=PrefillSettings(PREFILL_POOL_URL, api_key=settings.api_key, timeout_s=timeout_s),
    )
    return prefill, decode


def export_chain(body: bytes, fingerprint: bytes, block_size: int) -> list[str]:
    """The routing chain (short hex) of an export request's `prompt_token_ids`; [] when unreadable."""
    try:
        token_ids = [int(t) for t in json.loads(body)["prompt_token_ids"]]
    except (ValueError, TypeError, KeyError, RecursionError):
        return []
    return hex_chain(hash_prompt_blocks(fingerprint, token_ids, block_size))


class ServeHandleTransport(httpx.AsyncBaseTransport):
    """httpx transport over a Ray Serve handle to a deployment of `EngineReplica`s."""

    def __init__(self, handle: Any, fingerprint: bytes, block_size: int) -> None:
        self.handle = handle
        self.fingerprint = fingerprint
        self.block_size = block_size

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        chain = export_chain(body, self.fingerprint, self.block_size)
        headers = [(name.lower(), value) for name, value in request.headers.raw]  # NOTE: ASGI wants lower case
        http = HttpRequest(request.method, request.url.path, request.url.query, headers, body)
        timeout = _read_timeout(request)
        try:
            stream = self.handle.options(stream=True).handle.remote(http, kv_chain=chain)
        except Exception as error:  # noqa: BLE001  # any refusal by Ray is an unreachable pool
            raise httpx.ConnectError(f"the prefill deployment refused the call: {error!r}", request=request) from error
        try:
            start = await asyncio.wait_for(stream.__anext__(), timeout)
        except TimeoutError as error:
            await _cancel(stream)
            raise httpx.ReadTimeout(f"no prefill replica answered within {timeout:g} s", request=request) from error
        except StopAsyncIteration as error:
            raise httpx.RemoteProtocolError("the prefill replica sent no response", request=request) from error
        except Exception as error:  # noqa: BLE001  # e.g. the replica died: the pool is unreachable
            raise httpx.ConnectError(f"the prefill deployment is unreachable: {error!r}", request=request) from error
        if not isinstance(start, ResponseStart):
            await _cancel(stream)
            raise httpx.RemoteProtocolError("the prefill replica's response did not start", request=request)
        return httpx.Response(start.status, headers=start.headers, stream=_Chunks(stream, timeout, request))


class _Chunks(httpx.AsyncByteStream):
    """The rest of a replica's response: body chunks, each within the read timeout."""

    def __init__(self, stream: Any, timeout: float | None, request: httpx.Request) -> None:
        self.stream = stream
        self.timeout = timeout
        self.request = request
        self.done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            try:
                chunk = await asyncio.wait_for(self.stream.__anext__(), self.timeout)
            except StopAsyncIteration:
                self.done = True
                return
            except TimeoutError as error:
                raise httpx.ReadTimeout("the prefill replica stopped sending", request=self.request) from error
            except Exception as error:  # noqa: BLE001  # the replica died mid-response
                self.done = True
                raise httpx.ReadError(
                    f"the prefill replica failed mid-response: {error!r}", request=self.request
                ) from error
            yield bytes(chunk)

    async def aclose(self) -> None:
        if not self.done:  # NOTE: the client stopped reading (e.g. over --max-kv-import-bytes)
            self.done = True
            await _cancel(self.stream)


def _read_timeout(request: httpx.Request) -> float | None:
    timeouts = request.extensions.get("timeout") or {}
    value = timeouts.get("read")
    return float(value) if value is not None else None


async def _cancel(stream: Any) -> None:
    """Best-effort cancel of a handle call (off the event loop: Ray's cancel may wait on its router)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(asyncio.to_thread(stream.cancel), CANCEL_TIMEOUT_S)

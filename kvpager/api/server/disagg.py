"""Disaggregated serving: a decode server fetches each prompt's KV from a prefill server.

`kvpager serve --role decode --prefill-url URL` gives `Serving` a `PrefillClient`. Before a new
request is added to the local engine, the client asks the prefill server for the KV of the
prompt's full blocks (`POST /v1/kv/export` with the exact `prompt_token_ids`, so tokenization
cannot differ) and imports the payload on the engine thread. The request is then added as usual:
its full blocks are prefix-cache hits, so only the partial last block (at most `block_size - 1`
tokens, plus the last one) is computed here, and decoding runs locally.

With a shared store (both servers started with the same `--kv-cache-remote redis://HOST:PORT`), the
client first asks the store — one pipelined EXISTS, off the engine thread — whether it holds every
full block of the prompt that a prefix-cache lookup can reuse; then nothing goes over HTTP: the engine
pulls the blocks from the store when it schedules the request (`kvpager:kv_fetches_from_store`).
Otherwise (a block missing, or the store down) the prefill server is asked as below. The prefill
server writes every block it computes into the store, so the store fills as it serves.

Both servers share `--kv-transfer-key`: the prefill server signs every export with it and the
client refuses a payload whose signature does not verify (docs/security.md), so only KV the prefill
server computed can enter this server's prefix cache. The response is read in chunks and dropped
once it passes `--max-kv-import-bytes`, never buffered whole first.

Any failure — the prefill server is unreachable, times out, answers non-200, or sends a payload the
local engine refuses (unsigned or forged, another model's fingerprint, corrupted, oversize) — falls back to a local
prefill: the request is served exactly as by a `--role both` server, and the reason is logged as a
WARNING on the `kvpager` logger and counted in `/metrics` (`kvpager:kv_fetches_failed`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from kvpager.core.hashing import hash_prompt_blocks
from kvpager.engine.async_engine import AsyncEngine
from kvpager.kvstore.signing import SIGNATURE_HEADER, verify_payload

logger = logging.getLogger("kvpager")

ROLES = ("both", "prefill", "decode")
DEFAULT_PREFILL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PrefillSettings:
    """Where the prefill server is and how to talk to it (codec: how the KV travels; lossless by default)."""

    url: str
    api_key: str | None = None
    timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S
    codec: str = "lossless"

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--prefill-url must start with http:// or https://, got {self.url!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"--prefill-timeout must be > 0 seconds, got {self.timeout_s}")

    @property
    def base_url(self) -> str:
        """The server root: a trailing `/` or `/v1` (as given to OpenAI clients) is dropped."""
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class DisaggStats:
    """Counters of KV fetches from the prefill server (exposed as `kvpager:kv_fetch*`)."""

    fetches_ok: int = 0
    fetches_from_store: int = 0  # prompts whose reusable blocks were all in the shared store (no HTTP)
    fetches_failed: int = 0  # each one fell back to a local prefill
    fetch_seconds: float = 0.0  # request to the prefill server + import, successful fetches only
    fetch_bytes: int = 0  # payload bytes received (successful fetches)
    fetch_blocks: int = 0  # blocks imported from them

    def as_dict(self) -> dict[str, float]:
        return {key: float(value) for key, value in asdict(self).items()}


class PrefillError(Exception):
    """The prefill server did not give us a usable payload; the message is the fallback reason."""


class PrefillClient:
    """Fetches prompt KV from the prefill server and imports it into the local engine."""

    def __init__(
        self,
        settings: PrefillSettings,
        block_size: int,
        max_import_bytes: int | None = None,
        transfer_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.transfer_key = transfer_key
        self.block_size = block_size
        self.max_import_bytes = max_import_bytes
        self.stats = DisaggStats()
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=settings.base_url, timeout=settings.timeout_s, headers=headers, transport=transport
        )

    async def fetch_into(self, engine: AsyncEngine, token_ids: list[int]) -> int | None:
        """Import the KV of `token_ids`' full blocks from the prefill server.

        Returns the number of blocks imported, or None when nothing was fetched: the prompt is
        shorter than one block (not counted), or the fetch failed (counted, reason logged).
        """
        if len(token_ids) < self.block_size:
            return None
        if await self._in_store(engine, token_ids):
            self.stats.fetches_from_store += 1
            return 0
        start = time.perf_counter()
        try:
            payload = await self._fetch(token_ids)
            num_blocks = await engine.import_kv(payload, self.max_import_bytes)
        except (PrefillError, ValueError, httpx.HTTPError) as exc:
            self.stats.fetches_failed += 1
            logger.warning(
                "KV fetch from the prefill server %s failed, prefilling locally instead: %s",
                self.settings.base_url,
                _reason(exc, self.settings.timeout_s),
            )
            return None
        self.stats.fetches_ok += 1
        self.stats.fetch_seconds += time.perf_counter() - start
        self.stats.fetch_bytes += len(payload)
        self.stats.fetch_blocks += int(num_blocks)
        return int(num_blocks)

    async def _in_store(self, engine: AsyncEngine, token_ids: list[int]) -> bool:
        """Whether the shared store holds every full block of `token_ids` a prefix lookup reuses."""
        store = engine.engine.kv_store
        remote = store.tiers.remote if store is not None else None
        if remote is None:
            return False
        # NOTE: a lookup stops before the last prompt token, whose logits are computed here anyway.
        num_reusable = (len(token_ids) - 1) // self.block_size
        hashes = hash_prompt_blocks(engine.engine.kv_manager.hash_seed, token_ids, self.block_size)[:num_reusable]
        return bool(hashes) and await asyncio.to_thread(remote.lookup, hashes) == len(hashes)

    async def _fetch(self, token_ids: list[int]) -> bytes:
        if not self.transfer_key:
            raise PrefillError("no --kv-transfer-key is set, so no payload can be verified")
        body = {"prompt_token_ids": list(token_ids), "codec": self.settings.codec}
        async with self._client.stream("POST", "/v1/kv/export", json=body) as resp:
            payload = await self._read_bounded(resp)
            if resp.status_code != 200:
                raise PrefillError(f"the prefill server answered HTTP {resp.status_code}: {_error_message(payload)}")
            signature = resp.headers.get(SIGNATURE_HEADER)
        try:
            await asyncio.to_thread(verify_payload, self.transfer_key, payload, signature)
        except ValueError as exc:
            raise PrefillError(f"the prefill server's payload was refused: {exc}") from exc
        return payload

    async def _read_bounded(self, resp: httpx.Response) -> bytes:
        """The response body, read in chunks; PrefillError as soon as it passes the import limit."""
        limit = self.max_import_bytes
        declared = resp.headers.get("content-length", "")
        if limit is not None and declared.isdigit() and int(declared) > limit:
            raise PrefillError(
                f"the prefill server's payload of {declared} bytes is over --max-kv-import-bytes {limit}"
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.aiter_bytes():
            size += len(chunk)
            if limit is not None and size > limit:
                raise PrefillError(f"the prefill server's payload passed --max-kv-import-bytes {limit}; dropped")
            chunks.append(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        await self._client.aclose()


def _reason(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout_s:g} s ({type(exc).__name__}); raise --prefill-timeout if it is just slow"
    if isinstance(exc, httpx.TransportError):
        return f"the prefill server is unreachable ({type(exc).__name__}: {exc})"
    if isinstance(exc, ValueError):
        return f"the local engine refused the payload: {exc}"
    return str(exc)


def _error_message(body_bytes: bytes) -> str:
    """The OpenAI-shaped error message of a response body, or its first bytes."""
    try:
        body: Any = json.loads(body_bytes)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return body_bytes[:200].decode("utf-8", "replace")

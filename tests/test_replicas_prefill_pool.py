"""A decode replica's KV fetches over a Ray Serve handle to the prefill pool, without Ray: the handle is
a stand-in that calls an in-process prefill `EngineReplica` the way Ray Serve would (plain
`HttpRequest`, `kv_chain` keyword, streamed `ResponseStart` + chunks). Pins the routing chain, the
imported KV (greedy text equals a single engine's), and the fallback to a local prefill when the pool
refuses, dies mid-call or does not answer. The Ray Serve application is tested in
test_replicas_pd_pool.py."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import TINY_BLOCK, tiny_llama_config

from kvpager.api.replicas.asgi import HttpRequest, ResponseStart
from kvpager.api.replicas.deployment import EngineReplica
from kvpager.api.replicas.policy import hex_chain
from kvpager.api.replicas.prefill_pool import PREFILL_POOL_URL, export_chain, pool_settings
from kvpager.api.server.app import ServerSettings
from kvpager.api.server.disagg import PrefillSettings
from kvpager.core.hashing import hash_prompt_blocks

KEY = "pool-key"
API_KEY = "pool-api-key"  # NOTE: both pools sit behind it; the decode replicas' fetches must carry it
PROMPT = list(range(7, 50))  # 43 tokens: 10 full blocks of 4


class FakeStream:
    """What `handle.options(stream=True).handle.remote(...)` returns: an async iterator with cancel()."""

    def __init__(self, items: AsyncIterator[Any]) -> None:
        self.items = items
        self.cancelled = False

    def __anext__(self) -> Any:
        return self.items.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """A Ray Serve handle to one prefill replica; `mode` breaks it: refuse, die after start, hang."""

    def __init__(self, replica: EngineReplica | None, mode: str = "ok") -> None:
        self.replica = replica
        self.mode = mode
        self.chains: list[list[str]] = []
        self.streams: list[FakeStream] = []
        self.handle = self  # NOTE: `.handle.remote(...)` names the deployment method

    def options(self, **_: Any) -> FakeHandle:
        return self

    def remote(self, request: HttpRequest, kv_chain: list[str]) -> FakeStream:
        self.chains.append(kv_chain)
        if self.mode == "refuse":
            raise RuntimeError("no replicas of KVPagerPrefill are running")
        stream = FakeStream(self._items(request))
        self.streams.append(stream)
        return stream

    async def _items(self, request: HttpRequest) -> AsyncIterator[Any]:
        if self.mode == "hang":
            await asyncio.sleep(3600)
        assert self.replica is not None
        async for item in self.replica.handle(request):
            yield item
            if self.mode == "die" and isinstance(item, ResponseStart):
                raise RuntimeError("ActorDiedError: the replica's actor died")


@pytest.fixture(scope="module")
def replicas(llama_checkpoint: Path) -> Iterator[tuple[EngineReplica, ServerSettings]]:
    base = ServerSettings(served_model_names=["tiny"], kv_transfer_key=KEY, api_key=API_KEY)
    prefill_settings, decode_settings = pool_settings(base, timeout_s=0.5)
    prefill = EngineReplica(tiny_llama_config(llama_checkpoint, 64), prefill_settings)
    try:
        yield prefill, decode_settings
    finally:
        prefill.engine.shutdown()


def complete(replica: EngineReplica, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {API_KEY}".encode())]
    request = HttpRequest("POST", "/v1/completions", b"", headers, json.dumps(body).encode())

    async def run() -> dict:
        chunks = [item async for item in replica.handle(request) if isinstance(item, bytes)]
        return json.loads(b"".join(chunks))

    return asyncio.run(run())


def metric(replica: EngineReplica, name: str) -> float:
    _, page = asyncio.run(replica.metrics_page(0))
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(name + "{"))


def decode_replica(checkpoint: Path, settings: ServerSettings, handle: FakeHandle) -> EngineReplica:
    return EngineReplica(tiny_llama_config(checkpoint, 64), settings, prefill_handle=handle)


def test_pool_settings_split_one_servers_settings_into_the_two_roles() -> None:
    prefill, decode = pool_settings(ServerSettings(kv_transfer_key=KEY, api_key=API_KEY), timeout_s=7)
    assert prefill.role == "prefill" and prefill.prefill is None and prefill.kv_transfer_key == KEY
    assert decode.prefill == PrefillSettings(PREFILL_POOL_URL, api_key=API_KEY, timeout_s=7)
    assert decode.role == "decode" and prefill.api_key == decode.api_key == API_KEY
    with pytest.raises(ValueError, match="--kv-transfer-key"):
        pool_settings(ServerSettings())
    with pytest.raises(ValueError, match="drop --prefill-url"):
        pool_settings(ServerSettings(kv_transfer_key=KEY, role="decode", prefill=PrefillSettings("http://x:1")))
    with pytest.raises(ValueError, match="drop --role prefill"):
        pool_settings(ServerSettings(kv_transfer_key=KEY, role="prefill"))
    assert export_chain(b"not json", b"\x01" * 32, 4) == []


def test_decode_replica_imports_the_prefill_pools_kv_routed_by_the_prompt_chain(
    llama_checkpoint: Path, replicas: tuple[EngineReplica, ServerSettings]
) -> None:
    prefill, settings = replicas
    handle = FakeHandle(prefill)
    decode = decode_replica(llama_checkpoint, settings, handle)
    try:
        exported = metric(prefill, "kvpager:kv_exported_blocks_total")
        out = complete(decode, PROMPT)
        assert handle.chains == [hex_chain(hash_prompt_blocks(decode.fingerprint, PROMPT, TINY_BLOCK))]
        assert metric(decode, "kvpager:kv_fetches_ok_total") == 1
        assert metric(prefill, "kvpager:kv_exported_blocks_total") == exported + len(PROMPT) // TINY_BLOCK
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(PROMPT) - 1) // TINY_BLOCK * TINY_BLOCK
        local = EngineReplica(tiny_llama_config(llama_checkpoint, 64), ServerSettings(served_model_names=["tiny"]))
        try:
            assert out["choices"][0]["text"] == complete(local, PROMPT)["choices"][0]["text"]
        finally:
            local.engine.shutdown()
    finally:
        decode.engine.shutdown()


@pytest.mark.parametrize("mode", ["refuse", "die", "hang"])
def test_a_broken_prefill_pool_falls_back_to_a_local_prefill_with_the_reason_logged(
    mode: str,
    llama_checkpoint: Path,
    replicas: tuple[EngineReplica, ServerSettings],
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefill, settings = replicas
    handle = FakeHandle(prefill, mode)
    decode = decode_replica(llama_checkpoint, settings, handle)
    try:
        with caplog.at_level(logging.WARNING, logger="kvpager"):
            out = complete(decode, PROMPT[1:])
        assert out["usage"]["completion_tokens"] == 6, out
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "prefilled locally"
        assert metric(decode, "kvpager:kv_fetches_failed_total") == 1
        assert metric(decode, "kvpager:kv_fetches_ok_total") == 0
        reason = {"refuse": "refused the call", "die": "failed mid-response", "hang": "no answer within 0.5 s"}
        assert any(reason[mode] in r.getMessage() and "prefilling locally" in r.getMessage() for r in caplog.records)
        if mode == "hang":
            assert handle.streams[0].cancelled, "the call that never answered is cancelled"
    finally:
        decode.engine.shutdown()


def test_prefill_replicas_flag_is_refused_without_replicas_or_a_transfer_key(capsys: pytest.CaptureFixture) -> None:
    from kvpager.cli.serve import main

    assert main(["--prefill-replicas", "2", "--device", "cpu"]) == 2
    assert "--prefill-replicas M needs --replicas N" in capsys.readouterr().err
    assert main(["--replicas", "2", "--prefill-replicas", "2", "--device", "cpu"]) == 2
    assert "--prefill-replicas needs --kv-transfer-key" in capsys.readouterr().err
    assert main(["--replicas", "2", "--prefill-replicas", "-1", "--kv-transfer-key", KEY]) == 2
    assert "--prefill-replicas must be >= 0" in capsys.readouterr().err
    assert main(["--replicas", "2", "--cpus-per-replica", "0"]) == 2
    assert "--cpus-per-replica must be > 0" in capsys.readouterr().err

"""Disaggregated serving: a decode server fetches each prompt's KV from a prefill server process.

Two real `kvpager serve` processes on 127.0.0.1 share one tiny checkpoint: a prefill server (API
key set) and a decode server pointed at it. Greedy text must be identical on both and equal to the
offline engine with prefix caching off; the decode server must report the transferred blocks as
cached prompt tokens. Once the prefill server is stopped, the decode server must fall back to a
local prefill (same text) and say why. The refusal paths (non-200 answer,
payload from another model) are pinned in-process with a mock transport.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from checkpoints import random_ids
from server_harness import ServerProcess, launch_server, metric

from kvpager.api.llm import LLM
from kvpager.api.server.disagg import PrefillClient, PrefillSettings
from kvpager.core.config import EngineConfig
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.async_engine import AsyncEngine, EngineDeadError
from kvpager.engine.engine import Engine
from kvpager.kvstore.signing import SIGNATURE_HEADER, sign_payload

pytestmark = pytest.mark.slow  # a prefill and a decode server


BLOCK = 8
MAX_TOKENS = 8
KEY = "prefill-secret"
TRANSFER_KEY = "pair-transfer-key"
SERVER_ARGS = (
    "--block-size", str(BLOCK), "--kv-cache-memory", "2MiB", "--max-num-seqs", "8", "--kv-transfer-key", TRANSFER_KEY
)  # fmt: skip


def expected_cached(num_prompt_tokens: int) -> int:
    """Full blocks a prefix-cache lookup may reuse (it stops before the last prompt token)."""
    return (num_prompt_tokens - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def servers(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("disagg_logs")
    prefill = launch_server(llama_checkpoint, logs, *SERVER_ARGS, "--api-key", KEY, "--role", "prefill")
    decode = launch_server(
        llama_checkpoint, logs, *SERVER_ARGS, "--role", "decode", "--prefill-url", prefill.url + "/v1",
        "--prefill-api-key", KEY, "--prefill-timeout", "5",
    )  # fmt: skip
    procs = {"prefill": prefill, "decode": decode}
    try:
        for proc in procs.values():
            proc.wait_healthy()
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def reference(llama_checkpoint: Path) -> LLM:
    return LLM(str(llama_checkpoint), block_size=BLOCK, device="cpu", enable_prefix_caching=False)


def complete(server: ServerProcess, prompt: list[int] | str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_decode_server_imports_the_prompt_kv_and_matches_one_server(
    servers: dict[str, ServerProcess], reference: LLM
) -> None:
    prompts = [
        random_ids(45, 1),
        random_ids(45, 1)[:24] + random_ids(13, 2),
        random_ids(40, 3),
    ]  # partial block, shared prefix, exact blocks
    decode = servers["decode"]
    fetched_before = metric(decode.url, "kvpager:kv_fetches_ok_total")
    for prompt in prompts:
        want = reference.generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
        )
        want_text = want[0].outputs[0].text
        got = complete(decode, prompt)
        assert got["choices"][0]["text"] == want_text
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_cached(len(prompt))
        assert complete(servers["prefill"], prompt, KEY)["choices"][0]["text"] == want_text
    assert metric(decode.url, "kvpager:kv_fetches_ok_total") == fetched_before + len(prompts)
    assert metric(decode.url, "kvpager:kv_fetch_blocks_total") == sum(len(p) // BLOCK for p in prompts)
    assert metric(decode.url, "kvpager:kv_fetch_bytes_total") > 0
    assert metric(decode.url, "kvpager:kv_fetches_failed_total") == 0
    assert metric(servers["prefill"].url, "kvpager:kv_exported_blocks_total") >= 14


def test_chat_and_text_prompts_transfer_by_token_ids(servers: dict[str, ServerProcess]) -> None:
    messages = [
        {"role": "system", "content": "A paged KV cache stores keys and values in blocks. " * 3},
        {"role": "user", "content": "How much wood would a woodchuck chuck?"},
    ]
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    answers = {}
    for name in ("decode", "prefill"):
        headers = {"Authorization": f"Bearer {KEY}"} if name == "prefill" else {}
        resp = httpx.post(f"{servers[name].url}/v1/chat/completions", json=body, headers=headers, timeout=60)
        assert resp.status_code == 200, resp.text
        answers[name] = resp.json()
    usage = answers["decode"]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == expected_cached(usage["prompt_tokens"]) > 0
    assert answers["decode"]["choices"][0]["message"] == answers["prefill"]["choices"][0]["message"]

    text = "She sells sea shells by the sea shore. The quick brown fox jumps over the lazy dog."
    got = complete(servers["decode"], text)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_cached(got["usage"]["prompt_tokens"])
    assert got["choices"][0]["text"] == complete(servers["prefill"], text, KEY)["choices"][0]["text"]


def test_prompt_shorter_than_a_block_is_not_fetched(servers: dict[str, ServerProcess]) -> None:
    decode = servers["decode"]
    before = metric(decode.url, "kvpager:kv_fetches_ok_total"), metric(decode.url, "kvpager:kv_fetches_failed_total")
    got = complete(decode, random_ids(BLOCK - 1, 4))
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = metric(decode.url, "kvpager:kv_fetches_ok_total"), metric(decode.url, "kvpager:kv_fetches_failed_total")
    assert after == before


def test_unreachable_prefill_server_falls_back_to_local_prefill(
    servers: dict[str, ServerProcess], reference: LLM
) -> None:
    """Runs last among the process tests: it stops the prefill server for good."""
    decode = servers["decode"]
    servers["prefill"].stop()
    failed_before = metric(decode.url, "kvpager:kv_fetches_failed_total")
    prompt = random_ids(50, 5)
    want = reference.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    got = complete(decode, prompt)
    assert got["choices"][0]["text"] == want[0].outputs[0].text
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert metric(decode.url, "kvpager:kv_fetches_failed_total") == failed_before + 1
    log = decode.log()
    assert "WARNING kvpager: KV fetch from the prefill server" in log
    assert "prefilling locally instead: the prefill server is unreachable (ConnectError" in log


# -- refusal paths, in-process -------------------------------------------------------------------
def _fetch_with(transport: httpx.MockTransport, engine: AsyncEngine, prompt: list[int]) -> tuple[int | None, dict]:
    async def run() -> tuple[int | None, dict]:
        client = PrefillClient(
            PrefillSettings("http://prefill.test"), BLOCK, transfer_key=TRANSFER_KEY, transport=transport
        )
        try:
            return await client.fetch_into(engine, prompt), client.stats.as_dict()
        finally:
            await client.aclose()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def local_engine(llama_checkpoint: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(Engine(EngineConfig(model=str(llama_checkpoint), block_size=BLOCK, kv_cache_memory=1 << 20)))
    engine.start()
    yield engine
    engine.shutdown()


def test_refusing_prefill_server_is_a_logged_fallback(
    local_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/kv/export"
        return httpx.Response(401, json={"error": {"message": "Incorrect API key provided.", "type": "x"}})

    with caplog.at_level(logging.WARNING, logger="kvpager"):
        num_blocks, stats = _fetch_with(httpx.MockTransport(refuse), local_engine, random_ids(20, 6))
    assert num_blocks is None and stats["fetches_failed"] == 1 and stats["fetches_ok"] == 0
    assert "HTTP 401: Incorrect API key provided." in caplog.text


def test_payload_from_another_model_is_refused_on_import_and_falls_back(
    local_engine: AsyncEngine, qwen2_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = random_ids(20, 7)
    foreign = Engine(EngineConfig(model=str(qwen2_checkpoint), block_size=BLOCK, kv_cache_memory=1 << 20))
    payload = foreign.export_kv(prompt)

    def serve(request: httpx.Request) -> httpx.Response:
        headers = {"content-type": "application/octet-stream", SIGNATURE_HEADER: sign_payload(TRANSFER_KEY, payload)}
        return httpx.Response(200, content=payload, headers=headers)

    with caplog.at_level(logging.WARNING, logger="kvpager"):
        num_blocks, stats = _fetch_with(httpx.MockTransport(serve), local_engine, prompt)
    assert num_blocks is None and stats["fetches_failed"] == 1
    assert "refused the payload: KV payload was made for a different model" in caplog.text
    assert "architecture: expected 'LlamaForCausalLM'" in caplog.text


def test_run_in_engine_returns_results_and_errors_on_the_engine_thread(
    local_engine: AsyncEngine, llama_checkpoint: Path
) -> None:
    import threading

    async def run() -> None:
        name = await local_engine.run_in_engine(lambda e: threading.current_thread().name)
        assert name == "kvpager-engine-loop"
        assert await local_engine.run_in_engine(lambda e: e.config.block_size) == BLOCK
        with pytest.raises(ValueError, match="fewer than one KV block"):
            await local_engine.run_in_engine(lambda e: e.export_kv([5, 6]))
        assert await local_engine.run_in_engine(lambda e: e.config.block_size) == BLOCK  # the loop survived

    asyncio.run(run())
    stopped = AsyncEngine(Engine(EngineConfig(model=str(llama_checkpoint), block_size=BLOCK, kv_cache_memory=1 << 20)))
    stopped.start()
    stopped.shutdown()
    with pytest.raises(EngineDeadError):
        asyncio.run(stopped.run_in_engine(lambda e: None))


@pytest.mark.parametrize(
    ("signature", "reason"),
    [(None, "the KV payload is unsigned"), ("hmac-sha256=" + "0" * 64, "signature does not verify")],
)
def test_unsigned_or_forged_prefill_payload_is_refused_and_the_output_is_unchanged(
    local_engine: AsyncEngine, caplog: pytest.LogCaptureFixture, signature: str | None, reason: str
) -> None:
    """A payload for the victim prompt's tokens with another prompt's K/V (a poisoning attempt): the
    decode server refuses it without the pair's signature, so the victim's greedy output stays."""
    victim, other = random_ids(24, 20), random_ids(24, 21)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def greedy(prompt: list[int], rid: str) -> list[int]:
        stream = await local_engine.add_request(prompt, params, rid)
        return [o.outputs[0].token_ids async for o in stream][-1]

    want = asyncio.run(greedy(victim, f"want-{reason[:5]}"))
    forged = bytearray(asyncio.run(local_engine.run_in_engine(lambda e: e.export_kv(other))))
    payload = bytes(forged)

    def serve(request: httpx.Request) -> httpx.Response:
        headers = {SIGNATURE_HEADER: signature} if signature else {}
        return httpx.Response(200, content=payload, headers=headers)

    with caplog.at_level(logging.WARNING, logger="kvpager"):
        num_blocks, stats = _fetch_with(httpx.MockTransport(serve), local_engine, victim)
    assert num_blocks is None and stats["fetches_failed"] == 1
    assert reason in caplog.text
    assert asyncio.run(greedy(victim, f"got-{reason[:5]}")) == want


def test_oversized_prefill_response_is_dropped_without_buffering_it_whole(local_engine: AsyncEngine) -> None:
    sent = []

    async def body() -> AsyncIterator[bytes]:
        for _ in range(64):
            sent.append(1)
            yield b"\0" * 1024

    def serve(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body())

    async def run() -> tuple[int | None, dict]:
        client = PrefillClient(
            PrefillSettings("http://prefill.test"), BLOCK, 4096, TRANSFER_KEY, transport=httpx.MockTransport(serve)
        )
        try:
            return await client.fetch_into(local_engine, random_ids(20, 22)), client.stats.as_dict()
        finally:
            await client.aclose()

    num_blocks, stats = asyncio.run(run())
    assert num_blocks is None and stats["fetches_failed"] == 1
    assert len(sent) < 64  # reading stopped soon after the limit

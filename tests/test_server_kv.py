"""KV over HTTP: /v1/kv/export and /v1/kv/import between servers, their guards, and the disk tier
across a server restart.

The importing server is a real `kvpager serve` process (API key, a small JSON body limit, its own
KV import limit, a disk tier); the exporting server is the same app in-process (FastAPI's
TestClient, lifespan included). Greedy text served from imported or disk-restored KV must equal the
text of the server that computed it, with the reused blocks counted as cached prompt tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from checkpoints import random_ids
from fastapi.testclient import TestClient
from server_harness import ServerProcess, launch_server, metric

from kvpager.api.server.app import ServerSettings, build_app
from kvpager.core.config import EngineConfig
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.engine import Engine
from kvpager.kvstore.signing import SIGNATURE_HEADER, sign_payload

pytestmark = pytest.mark.slow  # real servers


BLOCK = 4
KEY = "kv-secret"
TRANSFER_KEY = "pair-transfer-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON_LIMIT = 4096
KV_LIMIT = 64 << 10
MAX_TOKENS = 6


def expected_cached(num_prompt_tokens: int) -> int:
    return (num_prompt_tokens - 1) // BLOCK * BLOCK


def server_args(kv_dir: Path) -> list[str]:
    return [
        "--block-size", str(BLOCK), "--kv-cache-memory", "1MiB", "--api-key", KEY,
        "--max-request-body-bytes", str(JSON_LIMIT), "--max-kv-import-bytes", str(KV_LIMIT),
        "--kv-cache-dir", str(kv_dir), "--enable-kv-import", "--kv-transfer-key", TRANSFER_KEY,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def kv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv_disk")


@pytest.fixture(scope="module")
def target(llama_checkpoint: Path, kv_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = launch_server(llama_checkpoint, tmp_path_factory.mktemp("kv_logs"), *server_args(kv_dir))
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def source(llama_checkpoint: Path, target: ServerProcess) -> Iterator[TestClient]:
    """The exporting server, in-process (asks for `target` so the process boots first)."""
    engine = Engine(EngineConfig(model=str(llama_checkpoint), block_size=BLOCK, kv_cache_memory=1 << 20))
    with TestClient(build_app(AsyncEngine(engine), ServerSettings(kv_transfer_key=TRANSFER_KEY))) as client:
        yield client


def completion(client: httpx.Client | TestClient, url: str, prompt: list[int], **headers: str) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    resp = client.post(f"{url}/v1/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.json()


def post_import(server: ServerProcess, payload: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    """POST a payload signed with the pair's transfer key (as its exporter would sign it)."""
    headers = {**(AUTH if headers is None else headers), SIGNATURE_HEADER: sign_payload(TRANSFER_KEY, payload)}
    return httpx.post(f"{server.url}/v1/kv/import", content=payload, headers=headers, timeout=60)


def test_export_from_one_server_import_into_another_serves_cached_tokens(
    source: TestClient, target: ServerProcess
) -> None:
    prompt = random_ids(42, 1)
    exported = source.post("/v1/kv/export", json={"prompt_token_ids": prompt})
    assert exported.status_code == 200, exported.text
    assert exported.headers["content-type"] == "application/octet-stream"
    assert exported.headers["x-kvpager-num-blocks"] == "10" and exported.headers["x-kvpager-num-tokens"] == "40"
    assert exported.headers[SIGNATURE_HEADER] == sign_payload(TRANSFER_KEY, exported.content)
    assert JSON_LIMIT < len(exported.content) < KV_LIMIT  # the JSON body limit must not apply to imports
    imported = post_import(target, exported.content)
    assert imported.status_code == 200, imported.text
    assert imported.json() == {"num_blocks_imported": 10}
    want = completion(source, "", prompt)
    with httpx.Client(timeout=60) as client:
        got = completion(client, target.url, prompt, **AUTH)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
    assert metric(target.url, "kvpager:kv_imported_blocks_total") >= 10


def test_chat_messages_export_covers_the_chat_prompt(source: TestClient, target: ServerProcess) -> None:
    messages = [
        {"role": "system", "content": "Memory management is the heart of serving. " * 2},
        {"role": "user", "content": "Hello, world!"},
    ]
    exported = source.post("/v1/kv/export", json={"messages": messages})
    assert exported.status_code == 200, exported.text
    assert post_import(target, exported.content).status_code == 200
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    want = source.post("/v1/chat/completions", json=body).json()
    got = httpx.post(f"{target.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    # the export rendered no generation prompt: its full blocks are a prefix of the chat prompt
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == int(exported.headers["x-kvpager-num-tokens"])


def test_payload_of_another_model_is_refused_naming_the_mismatch(target: ServerProcess, qwen2_checkpoint: Path) -> None:
    other = Engine(EngineConfig(model=str(qwen2_checkpoint), block_size=BLOCK, kv_cache_memory=1 << 20))
    resp = post_import(target, other.export_kv(random_ids(20, 2)))
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_kv_payload"
    assert "made for a different model" in error["message"]
    assert "architecture: expected 'LlamaForCausalLM', found 'Qwen2ForCausalLM'" in error["message"]


def test_oversize_import_is_413_naming_the_flag(target: ServerProcess) -> None:
    resp = post_import(target, b"\0" * (KV_LIMIT + 1))
    assert resp.status_code == 413
    assert "--max-kv-import-bytes" in resp.json()["error"]["message"]
    json_resp = httpx.post(f"{target.url}/v1/kv/export", json={"prompt": "x" * JSON_LIMIT}, headers=AUTH)
    assert json_resp.status_code == 413 and "--max-request-body-bytes" in json_resp.text


def test_corrupted_or_truncated_payload_is_refused(source: TestClient, target: ServerProcess) -> None:
    payload = source.post("/v1/kv/export", json={"prompt_token_ids": random_ids(24, 3)}).content
    flipped = bytearray(payload)
    flipped[-100] ^= 0x01
    resp = post_import(target, bytes(flipped))
    assert resp.status_code == 400 and "checksum" in resp.json()["error"]["message"]
    resp = post_import(target, payload[: len(payload) // 2])
    assert resp.status_code == 400 and "truncated" in resp.json()["error"]["message"]
    assert post_import(target, b"").status_code == 400


def test_api_key_guards_both_kv_endpoints(source: TestClient, target: ServerProcess) -> None:
    payload = source.post("/v1/kv/export", json={"prompt_token_ids": random_ids(8, 4)}).content
    export = httpx.post(f"{target.url}/v1/kv/export", json={"prompt_token_ids": random_ids(8, 4)}, timeout=30)
    assert export.status_code == 401 and export.json()["error"]["code"] == "invalid_api_key"
    assert post_import(target, payload, headers={}).status_code == 401
    wrong = post_import(target, payload, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "Incorrect API key" in wrong.text


def test_export_validates_its_input(source: TestClient) -> None:
    short = source.post("/v1/kv/export", json={"prompt_token_ids": [5, 6, 7]})
    assert short.status_code == 400 and "fewer than one KV block of 4" in short.text
    both = source.post("/v1/kv/export", json={"prompt": "hi there", "prompt_token_ids": [5, 6, 7, 8]})
    assert both.status_code == 400 and "exactly one of" in both.text
    codec = source.post("/v1/kv/export", json={"prompt_token_ids": random_ids(8, 5), "codec": "int3"})
    assert codec.status_code == 400 and "codec must be one of" in codec.text
    vocab = source.post("/v1/kv/export", json={"prompt_token_ids": [1000] * 8})
    assert vocab.status_code == 400 and "outside the vocabulary" in vocab.text
    lossless = source.post("/v1/kv/export", json={"prompt_token_ids": random_ids(32, 6)})
    int8 = source.post("/v1/kv/export", json={"prompt_token_ids": random_ids(32, 6), "codec": "int8"})
    assert int8.status_code == 200 and len(int8.content) < len(lossless.content) / 2


def test_restarted_server_serves_a_seen_prefix_from_disk(
    target: ServerProcess, llama_checkpoint: Path, kv_dir: Path, tmp_path: Path
) -> None:
    """Runs last: it stops the module's target server (SIGTERM flushes its cache to disk)."""
    prompt = random_ids(50, 7)
    with httpx.Client(timeout=60) as client:
        first = completion(client, target.url, prompt, **AUTH)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    target.stop()
    assert list(kv_dir.rglob("*.kvb")), "the server wrote no disk records at shutdown"
    restarted = launch_server(llama_checkpoint, tmp_path, *server_args(kv_dir)).wait_healthy()
    try:
        with httpx.Client(timeout=60) as client:
            again = completion(client, restarted.url, prompt, **AUTH)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_cached(len(prompt)) == 48
        assert metric(restarted.url, "kvpager:kv_disk_hits_total") >= 12
        assert metric(restarted.url, "kvpager:kv_restored_blocks_total") >= 12
    finally:
        restarted.stop()


def test_serve_flags_validate_the_roles() -> None:
    from kvpager.cli.serve import build_parser, settings_from_args

    def settings(*argv: str) -> ServerSettings:
        return settings_from_args(build_parser().parse_args(list(argv)))

    with pytest.raises(ValueError, match="--role decode needs --prefill-url"):
        settings("--role", "decode")
    with pytest.raises(ValueError, match="--prefill-url is only for --role decode"):
        settings("--prefill-url", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match="must start with http"):
        settings("--role", "decode", "--prefill-url", "127.0.0.1:9")
    with pytest.raises(ValueError, match="--role decode needs --kv-transfer-key"):
        settings("--role", "decode", "--prefill-url", "http://h:1/v1/")
    with pytest.raises(ValueError, match="--enable-kv-import needs --kv-transfer-key"):
        settings("--enable-kv-import")
    decode = settings(
        "--role", "decode", "--prefill-url", "http://h:1/v1/", "--max-kv-import-bytes", "2GiB", "--kv-transfer-key", "k"
    )  # fmt: skip
    assert decode.prefill is not None and decode.prefill.base_url == "http://h:1"
    assert decode.max_kv_import_bytes == 2 << 30 and settings().max_kv_import_bytes == 1 << 30

"""Hostile and careless HTTP input against the in-process app (issue 16): KV import trust, auth
before body, lone surrogates, nested JSON, limits, the published schema and small leaks.

Each test reproduces one failure the hardening pass found and pins its fix. The app runs with a
real engine on the tiny llama checkpoint through FastAPI's TestClient (lifespan included).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from checkpoints import random_ids
from fastapi.testclient import TestClient

from kvpager.api.server.app import ServerSettings, build_app
from kvpager.core.config import EngineConfig
from kvpager.core.hashing import hash_prompt_blocks
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.engine import Engine
from kvpager.kvstore.pack import PackHeader, encode_payload
from kvpager.kvstore.signing import SIGNATURE_HEADER, sign_payload

BLOCK = 4
API_KEY = "clé-secrète-ü"  # non-ASCII on purpose (issue 16 item 10: latin-1 vs UTF-8)
TRANSFER_KEY = "pair-transfer-key"
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def auth(key: str = API_KEY) -> dict[str, str]:
    # NOTE: httpx sends str header values as ASCII; the UTF-8 bytes of a non-ASCII key go as bytes.
    return {"Authorization": b"Bearer " + key.encode("utf-8")}  # type: ignore[dict-item]


def make_client(checkpoint: Path, **settings: Any) -> TestClient:
    """The app over a fresh engine; `client.engine` is that engine (read it only while it is idle)."""
    engine = Engine(EngineConfig(model=str(checkpoint), block_size=BLOCK, kv_cache_memory=1 << 20))
    client = TestClient(build_app(AsyncEngine(engine), ServerSettings(**settings)))
    client.engine = engine  # type: ignore[attr-defined]
    return client


@pytest.fixture(scope="module")
def client(llama_checkpoint: Path) -> Iterator[TestClient]:
    """API key + import enabled with the pair's transfer key."""
    settings = {"api_key": API_KEY, "enable_kv_import": True, "kv_transfer_key": TRANSFER_KEY}
    with make_client(llama_checkpoint, **settings) as c:
        yield c


@pytest.fixture(scope="module")
def open_client(llama_checkpoint: Path) -> Iterator[TestClient]:
    """The defaults: no API key, no import."""
    with make_client(llama_checkpoint) as c:
        yield c


def greedy_text(client: TestClient, prompt: list[int], headers: dict[str, str] | None = None) -> str:
    resp = client.post("/v1/completions", json={"prompt": prompt, **GREEDY}, headers=headers or auth())
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def signed(payload: bytes, key: str = TRANSFER_KEY) -> dict[str, str]:
    return {**auth(), SIGNATURE_HEADER: sign_payload(key, payload)}


# -- KV import trust (item 2) --------------------------------------------------------------------
def test_kv_import_is_off_by_default_and_answers_403_without_reading_the_body(open_client: TestClient) -> None:
    resp = open_client.post("/v1/kv/import", content=b"KVPACK" + b"\0" * 100)
    assert resp.status_code == 403 and "--enable-kv-import" in resp.json()["error"]["message"]
    assert asgi_body_reads(open_client.app, "/v1/kv/import", {}) == 0


def forged_payload(client: TestClient, victim: list[int], donor: list[int]) -> bytes:
    """A pack whose header carries the victim's token ids but whose K/V bytes are the donor's."""
    donor_pack = client.post("/v1/kv/export", json={"prompt_token_ids": donor}, headers=auth()).content
    engine: Engine = client.engine  # type: ignore[attr-defined]
    decoded = engine.decode_kv(donor_pack)
    header = PackHeader(decoded.header.model_fingerprint, decoded.header.model, tuple(victim))
    victim_hashes = hash_prompt_blocks(engine.loaded.fingerprint, victim, BLOCK)
    blocks = [(h, b) for h, (_, b) in zip(victim_hashes, decoded.blocks, strict=False)]
    return encode_payload(header, blocks, "lossless")


@pytest.mark.parametrize("signature", ["none", "wrong-key", "garbage"])
def test_unsigned_or_forged_pack_is_refused_and_never_changes_another_requests_output(
    client: TestClient, signature: str
) -> None:
    victim, donor = random_ids(21, 1), random_ids(21, 2)
    want = greedy_text(client, victim)
    payload = forged_payload(client, victim, donor)
    headers = {
        "none": auth(),
        "wrong-key": signed(payload, "not-the-key"),
        "garbage": {**auth(), SIGNATURE_HEADER: "hmac-sha256=zz"},
    }[signature]
    resp = client.post("/v1/kv/import", content=payload, headers=headers)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_kv_signature"
    assert greedy_text(client, victim) == want
    assert greedy_text(client, victim[:12] + random_ids(9, 3)) == greedy_text(client, victim[:12] + random_ids(9, 3))


def test_signed_pack_round_trips_and_the_transfer_key_alone_authenticates_the_route(client: TestClient) -> None:
    prompt = random_ids(22, 4)
    exported = client.post("/v1/kv/export", json={"prompt_token_ids": prompt}, headers=auth())
    assert exported.headers[SIGNATURE_HEADER] == sign_payload(TRANSFER_KEY, exported.content)
    headers = {"Authorization": f"Bearer {TRANSFER_KEY}", SIGNATURE_HEADER: exported.headers[SIGNATURE_HEADER]}
    resp = client.post("/v1/kv/import", content=exported.content, headers=headers)
    assert resp.status_code == 200, resp.text
    # the transfer key opens only the import route
    assert client.post("/v1/completions", json={"prompt": prompt}, headers=headers).status_code == 401


def test_nan_or_inf_kv_values_are_refused_at_import_even_when_signed(client: TestClient) -> None:
    prompt = random_ids(20, 5)
    engine: Engine = client.engine  # type: ignore[attr-defined]
    pack = engine.decode_kv(client.post("/v1/kv/export", json={"prompt_token_ids": prompt}, headers=auth()).content)
    for bad in (math.nan, math.inf):
        blocks = [(h, b.clone()) for h, b in pack.blocks]
        blocks[1][1].view(-1)[7] = bad
        payload = encode_payload(pack.header, blocks, "lossless")
        resp = client.post("/v1/kv/import", content=payload, headers=signed(payload))
        assert resp.status_code == 400 and "NaN or Inf" in resp.json()["error"]["message"]


def test_import_of_more_tokens_than_max_model_len_is_refused(client: TestClient) -> None:
    engine: Engine = client.engine  # type: ignore[attr-defined]
    pack = engine.decode_kv(
        client.post("/v1/kv/export", json={"prompt_token_ids": random_ids(8, 6)}, headers=auth()).content
    )
    header = PackHeader(pack.header.model_fingerprint, pack.header.model, tuple([5] * (engine.max_model_len + 1)))
    payload = encode_payload(header, [], "lossless")
    resp = client.post("/v1/kv/import", content=payload, headers=signed(payload))
    assert resp.status_code == 400 and "maximum context length" in resp.json()["error"]["message"]


# -- authentication before the body (item 3) -----------------------------------------------------
def asgi_body_reads(app: Any, path: str, headers: dict[bytes, bytes]) -> int:
    """How many body chunks the app pulls from a client uploading 1 GiB, before it answers."""
    reads = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"\0" * (1 << 20), "more_body": reads < 1024}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [(b"content-type", b"application/octet-stream"), *headers.items()], "http_version": "1.1",
        "scheme": "http", "server": ("test", 80), "client": ("test", 1), "root_path": "",
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    assert sent and sent[0]["status"] in (401, 403)
    return reads


@pytest.mark.parametrize("path", ["/v1/kv/import", "/v1/completions", "/v1/chat/completions"])
def test_unauthenticated_upload_is_refused_before_its_body_is_read(client: TestClient, path: str) -> None:
    assert asgi_body_reads(client.app, path, {}) == 0
    assert asgi_body_reads(client.app, path, {b"authorization": b"Bearer wrong"}) == 0


def test_non_ascii_api_key_is_accepted(client: TestClient) -> None:
    assert client.get("/v1/models", headers=auth()).status_code == 200
    assert client.get("/v1/models", headers=auth("clé-secrète-u")).status_code == 401


# -- bad text and JSON → 400, never 500 (item 9) -------------------------------------------------
LONE = '"x \\ud800 y"'


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", '{"prompt": ' + LONE + ', "max_tokens": 2}'),
        ("/v1/completions", '{"prompt": [' + LONE + ', "ok"], "max_tokens": 2}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": ' + LONE + "}]}"),
        ("/tokenize", '{"prompt": ' + LONE + "}"),
        ("/tokenize", '{"messages": [{"role": "user", "content": ' + LONE + "}]}"),
        ("/v1/kv/export", '{"prompt": ' + LONE + "}"),
    ],
)
def test_lone_surrogate_is_a_400_naming_the_problem(client: TestClient, path: str, body: str) -> None:
    resp = client.post(path, content=body, headers={**auth(), "content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert "surrogate" in resp.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_deeply_nested_json_body_is_a_400(client: TestClient, path: str) -> None:
    body = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    resp = client.post(path, content=body, headers={**auth(), "content-type": "application/json"})
    assert resp.status_code == 400, resp.text[:300]


# -- per-request limits on the HTTP side (item 6) ------------------------------------------------
def test_prompts_times_n_over_the_limit_is_refused_before_tokenizing(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine: Engine = client.engine  # type: ignore[attr-defined]
    calls = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: calls.append(1) or [5])
    body = {"prompt": ["a"] * 2000, "n": 64, "max_tokens": 1}
    resp = client.post("/v1/completions", json=body, headers=auth())
    assert resp.status_code == 400 and "--max-sequences-per-request" in resp.json()["error"]["message"]
    assert calls == []


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("stop_token_ids", list(range(1_000)), "--max-stop-token-ids"),
        ("stop", [f"s{i}" for i in range(100)], "--max-stop-strings"),
        ("stop", ["x" * 5000], "--max-stop-string-chars"),
        ("seed", 2**64, "seed"),
    ],
)
def test_request_limits_are_400s_naming_the_flag(client: TestClient, field: str, value: object, flag: str) -> None:
    resp = client.post("/v1/completions", json={"prompt": "hi", field: value, "max_tokens": 2}, headers=auth())
    assert resp.status_code == 400 and flag in resp.json()["error"]["message"]
    assert client.get("/health").status_code == 200
    assert greedy_text(client, [5, 6, 7])


# -- tokenization off the event loop (item 5) ----------------------------------------------------
def test_large_prompts_are_tokenized_and_detokenized_off_the_event_loop(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine: Engine = client.engine  # type: ignore[attr-defined]
    threads: dict[str, set[str]] = {"encode": set(), "decode": set()}
    real_encode, real_decode = engine.tokenizer.encode, engine.tokenizer.decode

    def encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
        threads["encode"].add(threading.current_thread().name)
        return real_encode(text[:50], *args, **kwargs)

    def decode(token_ids: list[int], *args: Any, **kwargs: Any) -> str:
        threads["decode"].add(threading.current_thread().name)
        return real_decode(token_ids, *args, **kwargs)

    loop_thread: set[str] = set()

    @client.app.get("/__loop_thread")  # type: ignore[attr-defined]
    async def loop_name() -> dict[str, str]:
        loop_thread.add(threading.current_thread().name)
        return {}

    client.get("/__loop_thread", headers=auth())
    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    monkeypatch.setattr(engine.tokenizer, "decode", decode)
    big = "word " * 20_000
    assert client.post("/v1/completions", json={"prompt": big, "max_tokens": 1}, headers=auth()).status_code == 200
    assert client.post("/tokenize", json={"prompt": big}, headers=auth()).status_code == 200
    chat = {"messages": [{"role": "user", "content": big}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=chat, headers=auth()).status_code == 200
    assert client.post("/detokenize", json={"tokens": [5] * 10_000}, headers=auth()).status_code == 200
    assert threads["encode"] and threads["decode"]
    assert not (threads["encode"] | threads["decode"]) & loop_thread


# -- small items (item 10) -----------------------------------------------------------------------
def test_health_has_a_content_type_and_metrics_do_not_show_the_model_path(
    client: TestClient, llama_checkpoint: Path
) -> None:
    health = client.get("/health")
    assert health.status_code == 200 and health.headers["content-type"] == "application/json"
    metrics = client.get("/metrics").text
    assert str(llama_checkpoint) not in metrics and f'model_name="{llama_checkpoint.name}"' in metrics


def test_openapi_documents_400_not_422(client: TestClient) -> None:
    schema = client.get("/openapi.json", headers=auth()).json()
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (path, method)
            assert "400" in operation["responses"], (path, method)
    resp = client.post("/v1/completions", json={"prompt": "x", "n": 0}, headers=auth())
    assert resp.status_code == 400


def test_export_under_pool_pressure_is_503_with_retry_after(llama_checkpoint: Path) -> None:
    engine = Engine(EngineConfig(model=str(llama_checkpoint), block_size=BLOCK, kv_cache_memory=8 * 1024))
    with TestClient(build_app(AsyncEngine(engine), ServerSettings())) as c:
        num_blocks = engine.pool.num_blocks
        pool = engine.kv_manager.block_pool
        hold = pool.allocate(pool.num_free_blocks)  # every block owned by a request (the engine is idle)
        try:
            resp = c.post("/v1/kv/export", json={"prompt_token_ids": random_ids(2 * BLOCK, 7)})
        finally:
            pool.free(hold)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1", resp.text
        too_big = c.post("/v1/kv/export", json={"prompt_token_ids": random_ids((num_blocks + 1) * BLOCK, 8)})
        assert too_big.status_code == 400, too_big.text

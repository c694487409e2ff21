"""The KV map of a real engine (tiny random Llama, host tier) and its HTTP routes.

After every engine step of a workload with a shared prefix, preemption and blocks moving to the host
tier and back, the snapshot agrees with the block pool; the tier rows are the engine's own tier
counters. Over HTTP: /v1/kv/map and /v1/kv/stream, the API key (header or the login cookie, which
opens only the KV map's GET routes), the page and its assets served from the package.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_helpers import TINY_BLOCK, TINY_BLOCK_BYTES, tiny_llama_config
from kv_map_checks import check_snapshot, serve_in_thread

from kvpager.api.server.app import ServerSettings, build_app
from kvpager.api.server.kv_view import COOKIE_NAME
from kvpager.core.kv_snapshot import KVMapper
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.engine import Engine
from kvpager.engine.kv_map import capture_engine, planner_prediction

pytestmark = pytest.mark.slow  # an engine per test and real servers

SHARED = list(range(10, 26))  # four full blocks of 4
KEY = "sk-kv-test"


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_engine_snapshot_matches_the_pool_through_sharing_preemption_and_host_tier(llama_checkpoint: Path) -> None:
    config = tiny_llama_config(llama_checkpoint, 14, host_kv_cache_memory=64 * TINY_BLOCK_BYTES, max_num_seqs=4)
    engine = Engine(config)
    mapper = KVMapper(decode=lambda ids: engine.tokenizer.decode(list(ids)), planner=planner_prediction(engine))
    host = engine.kv_store.tiers.host if engine.kv_store is not None else None
    assert host is not None

    def tiers_of(block_hash: bytes) -> list[str]:
        return ["host"] if block_hash in host else []

    waves = [
        {f"s{i}": SHARED + [40 + i] for i in range(3)},  # three requests on one prefix, too many blocks at once
        {"f0": list(range(100, 130))},  # unrelated: evicts the prefix into the host tier
        {"s9": SHARED + [99]},  # the prefix comes back from the host tier
    ]
    seen = {"shared": 0, "preempted": 0, "copies": 0}
    for wave in waves:
        for name, prompt in wave.items():
            engine.add_request(name, prompt, params(16))
        while engine.has_unfinished_requests():
            engine.step()
            doc = mapper.render(capture_engine(engine))
            check_snapshot(doc, engine.scheduler, tiers_of)
            seen["shared"] = max(seen["shared"], doc["counts"]["shared"])
            seen["preempted"] = doc["num_preemptions"]
            seen["copies"] = max(seen["copies"], len(doc["blocks"]["tiers"]))
            stats = engine.kv_tier_stats()
            device, host_row = doc["tiers"]
            assert host is not None and stats.host is not None
            assert (host_row["name"], host_row["hits"], host_row["misses"]) == (
                "host",
                stats.host.hits,
                stats.host.misses,
            )
            assert (host_row["num_blocks"], host_row["bytes_in"]) == (len(host), stats.host.bytes_in)
            assert device["evictions"] == stats.device_evictions and device["bytes_in"] == stats.restored.bytes
    assert seen["shared"] >= 4 and seen["preempted"] >= 1 and seen["copies"] >= 1, seen
    assert engine.kv_tier_stats().restored.blocks >= 1  # s9's prefix really came back from the host tier
    assert doc["planner"]["num_blocks"] == doc["planner"]["measured_num_blocks"] == 14


@pytest.fixture(scope="module")
def served(llama_checkpoint: Path) -> Iterator[tuple[httpx.Client, Any]]:
    engine = Engine(tiny_llama_config(llama_checkpoint, 32))
    app = build_app(AsyncEngine(engine), ServerSettings(api_key=KEY))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10.0) as http:
        yield http, app


@pytest.fixture
def client(served: tuple[httpx.Client, Any]) -> httpx.Client:
    return served[0]


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_kv_map_json_adds_up_after_a_completion_and_carries_history_and_plan(client: httpx.Client) -> None:
    body = {"prompt": SHARED, "max_tokens": 3, "temperature": 0}
    assert client.post("/v1/completions", json=body, headers=auth()).status_code == 200
    doc = client.get("/v1/kv/map?history=1", headers=auth()).json()
    counts = doc["counts"]
    assert doc["num_blocks"] == 32 == sum(counts[s] for s in ("free", "cached", "owned", "pinned"))
    assert counts["cached"] == 4 and counts["owned"] == 0  # the prompt's four full blocks stay cached
    assert doc["blocks"]["state"].count("c") == 4 and len(doc["blocks"]["state"]) == 32
    assert sorted(doc["evict_order"]) == sorted(int(k) for k in doc["blocks"]["hash"])
    assert doc["prefix_cache"]["queries"] >= len(SHARED) and doc["tiers"][0]["name"] == "device"
    assert doc["block_size"] == TINY_BLOCK and doc["history"] and doc["history"][-1]["t"] == doc["time"]
    assert doc["planner"]["num_blocks"] == 32


def test_api_key_guards_the_map_and_the_login_cookie_opens_only_its_get_routes(client: httpx.Client) -> None:
    assert client.get("/v1/kv/map").status_code == 401
    assert client.get("/v1/kv/stream").status_code == 401
    for path in ("/", "/kv", "/kv/kv.js", "/kv/kv.css"):  # no engine data: open, so the page can ask for the key
        assert client.get(path).status_code == 200, path
    assert "/kv" in client.get("/").text and KEY not in client.get("/kv").text
    assert client.post("/kv/login", data={"key": "wrong"}).status_code == 401
    login = client.post("/kv/login", data={"key": KEY})  # form-encoded, as the page sends it
    assert login.status_code == 204
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower() and KEY not in cookie
    token = login.cookies[COOKIE_NAME]
    client.cookies.clear()
    jar = {"Cookie": f"{COOKIE_NAME}={token}"}
    assert client.get("/v1/kv/map", headers=jar).status_code == 200
    assert client.get("/v1/models", headers=jar).status_code == 401  # the cookie is no API key
    assert client.post("/v1/completions", json={"prompt": "x"}, headers=jar).status_code == 401
    assert client.get("/v1/kv/map", headers={"Cookie": f"{COOKIE_NAME}=forged"}).status_code == 401
    assert client.post("/kv/logout").status_code == 204


def test_stream_sends_the_history_first_then_snapshots(client: httpx.Client) -> None:
    assert client.get("/v1/kv/stream?interval=0.01", headers=auth()).status_code == 400
    events = []
    with client.stream("GET", "/v1/kv/stream?interval=0.25", headers=auth()) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
            if len(events) == 2:
                break
    assert "history" in events[0] and "history" not in events[1]
    assert events[1]["time"] > events[0]["time"] and events[1]["num_blocks"] == 32


def test_watchers_share_one_capture_per_interval(served: tuple[httpx.Client, Any]) -> None:
    client, app = served
    sampler = app.state.kv_sampler
    before = sampler.num_captures
    first = client.get("/v1/kv/map", headers=auth()).json()
    second = client.get("/v1/kv/map", headers=auth()).json()
    assert sampler.num_captures - before <= 1 + (second["time"] != first["time"])


def test_kv_top_prints_the_grid_requests_and_tiers_once(
    client: httpx.Client, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvpager.cli.kv import main
    from kvpager.cli.kv_top import render

    assert main(["top", "--url", str(client.base_url), "--once"]) == 2  # no key: told how to pass it
    assert "--api-key" in capsys.readouterr().err
    assert main(["top", "--url", str(client.base_url), "--once", "--api-key", KEY]) == 0
    out = capsys.readouterr().out
    doc = client.get("/v1/kv/map", headers=auth()).json()
    grid = "".join(line for line in out.splitlines() if set(line) <= set(".coP+23456789") and line)
    assert len(grid) == doc["num_blocks"] and grid.count("c") == doc["counts"]["cached"]
    assert "Tiers" in out and "device" in out and f"Planner: {doc['planner']['num_blocks']} blocks" in out
    request = {"id": "r-1", "status": "running", "prompt_tokens": 9, "output_tokens": 2, "computed_tokens": 10}
    request |= {"cached_tokens": 8, "preemptions": 1, "max_tokens": 4, "blocks": [0, 1, 2]}
    doc["blocks"]["state"] = "o" + doc["blocks"]["state"][1:]
    doc["blocks"]["ref"]["0"] = 2  # a shared block is drawn as its ref count
    lines = render({**doc, "requests": [request]}, width=60)
    row = next(line for line in lines if line.startswith("r-1"))
    tail = doc["blocks"]["state"][1:3]
    assert row.split()[1:5] == ["running", "10/11", "8", "1"] and row.endswith("2" + tail)

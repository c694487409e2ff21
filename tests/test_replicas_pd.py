"""Prefill/decode split with Ray Serve replicas: a decode replica deployment (demo model, local Ray
with 2 CPUs) behind one endpoint, a prefill server, and a real Redis/Valkey store shared by both.
One decode replica keeps the suite short; the routing between several is tests/test_replicas_kv_routing.py's.

A prompt the prefill server has computed is in the store: the decode replica that gets it loads its
blocks from there (no HTTP fetch). A prompt in no store is fetched from the prefill server over HTTP.
Greedy text equals a single engine's either way."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from ray_cluster import BLOCK, ENGINE, NUM_NEW, RayCluster, complete, delete_app, greedy_text
from redis_server import StoreServer
from server_harness import launch_server, metric

from kvpager.api.llm import LLM
from kvpager.api.server.app import ServerSettings
from kvpager.api.server.disagg import PrefillSettings
from kvpager.core.config import EngineConfig
from kvpager.engine.paths import resolve_model_dir

pytestmark = pytest.mark.slow
KEY = "pd-replicas-key"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, ray_cluster: RayCluster) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("replicas_pd")
    store = StoreServer(logs)
    engine_args = ["--block-size", str(BLOCK), "--kv-cache-memory", "64MiB", "--kv-transfer-key", KEY]
    prefill = launch_server(
        resolve_model_dir(None), logs, *engine_args, "--kv-cache-remote", store.url, "--role", "prefill"
    )
    try:
        prefill.wait_healthy(timeout=300)
        url = ray_cluster.start()
        from ray import serve

        from kvpager.api.replicas.launch import build_application

        settings = ServerSettings(
            served_model_names=["demo"],
            role="decode",
            prefill=PrefillSettings(prefill.url, timeout_s=60),
            kv_transfer_key=KEY,
        )
        config = EngineConfig(**ENGINE, kv_cache_remote=store.url)
        app = build_application(config, settings, 1, cpus_per_replica=1, routing_stats_period_s=0.2)
        serve.run(app, name="kvpager", route_prefix="/")
        try:
            yield {"url": url, "prefill": prefill, "store": store}
        finally:
            delete_app()
    finally:
        prefill.stop()
        store.stop()


def replica_sum(url: str, name: str) -> float:
    page = httpx.get(f"{url}/metrics", timeout=60).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", page, re.M))


def test_decode_replicas_pull_from_the_store_or_the_prefill_server(deployment: dict) -> None:
    url, prefill = deployment["url"], deployment["prefill"]
    single = LLM(None, **ENGINE)
    rng = random.Random(9)
    fresh = [rng.randrange(5, 4000) for _ in range(50)]  # in no store: the KV comes over HTTP
    text, _, cached = complete(url, fresh)
    assert text == greedy_text(single, fresh)
    assert cached == (len(fresh) - 1) // BLOCK * BLOCK
    assert replica_sum(url, "kvpager:kv_fetches_ok_total") == 1

    stored = [rng.randrange(5, 4000) for _ in range(70)]
    published = metric(prefill.url, "kvpager:kv_remote_published_total")
    body = {"prompt": stored, "max_tokens": NUM_NEW, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=120).status_code == 200
    deadline = time.monotonic() + 30
    while metric(prefill.url, "kvpager:kv_remote_published_total") < published + len(stored) // BLOCK:
        assert time.monotonic() < deadline, "the prefill server never wrote its blocks to the store"
        time.sleep(0.1)
    exported = metric(prefill.url, "kvpager:kv_exported_blocks_total")
    text, _, cached = complete(url, stored)
    assert text == greedy_text(single, stored)
    assert cached == (len(stored) - 1) // BLOCK * BLOCK, "every reusable block came from the store"
    assert replica_sum(url, "kvpager:kv_fetches_from_store_total") == 1
    assert replica_sum(url, "kvpager:kv_fetches_ok_total") == 1, "no second HTTP fetch"
    assert metric(prefill.url, "kvpager:kv_exported_blocks_total") == exported

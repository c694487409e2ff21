"""One Ray Serve application with both pools (`kvpager serve --replicas 1 --prefill-replicas 2`):
the decode replica behind the endpoint fetches each prompt's KV from two prefill replicas through a
Serve handle, routed by the prompt's block-hash chain (demo model, local Ray with 2 CPUs).

A request is prefilled on a prefill replica (its export counter moves, the decode side counts the
fetch and serves all but the tail from cache); a second prompt with the same prefix is exported by the
same prefill replica; a different prefix goes to the other one; greedy text equals a single engine's.
Last, the prefill pool dies (its replicas killed, its controller gone so they stay dead): a request
still succeeds, prefilled locally, with the same text."""

from __future__ import annotations

import glob
import os
import random
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ray_cluster import BLOCK, ENGINE, RayCluster, complete, greedy_text

from kvpager.api.llm import LLM
from kvpager.api.server.app import ServerSettings
from kvpager.core.config import EngineConfig

pytestmark = pytest.mark.slow
KEY = "pd-pool-key"


@pytest.fixture(scope="module")
def endpoint(ray_cluster: RayCluster) -> Iterator[tuple[str, Any]]:
    url = ray_cluster.start()
    from ray import serve

    from kvpager.api.replicas.launch import build_application

    try:
        settings = ServerSettings(served_model_names=["demo"], kv_transfer_key=KEY)
        app = build_application(
            EngineConfig(**ENGINE),
            settings,
            1,  # NOTE: one decode replica: the routing under test is the decode side's, among prefill replicas
            prefill_replicas=2,
            cpus_per_replica=0.5,  # NOTE: three engines on the test's 2 Ray CPUs
            routing_stats_period_s=0.2,
            prefill_timeout_s=8,  # NOTE: a dead pool is waited for this long before the local prefill
        )
        serve.run(app, name="kvpager", route_prefix="/")
        yield url, ray_cluster.ray
    finally:
        # NOTE: the last test kills Serve's controller, so the cluster cannot host another application
        ray_cluster.stop()


@pytest.fixture(scope="module")
def single() -> LLM:
    return LLM(None, **ENGINE)


def by_replica(url: str, name: str, role: str) -> dict[str, float]:
    page = httpx.get(f"{url}/metrics", timeout=60).text
    pattern = rf'^{re.escape(name)}\{{replica="([^"]+)",role="{role}"[^}}]*\}} (\S+)$'
    return {replica: float(value) for replica, value in re.findall(pattern, page, re.M)}


def exported_on(url: str, before: dict[str, float]) -> list[str]:
    """The prefill replicas whose exported-block counter moved since `before`."""
    now = by_replica(url, "kvpager:kv_exported_blocks_total", "prefill")
    assert len(now) == 2, f"both prefill replicas report: {now}"
    return [replica for replica, value in now.items() if value > before.get(replica, 0.0)]


def logged(ray: Any, pattern: str, text: str, timeout_s: float = 15.0) -> bool:
    """Whether a Ray log file matching `pattern` (under the session's logs) contains `text`."""
    return text in log_text(ray, pattern, text, timeout_s)


def log_text(ray: Any, pattern: str, text: str, timeout_s: float = 15.0) -> str:
    """The Ray log files matching `pattern`, once one contains `text` or `timeout_s` has passed."""
    logs = ray._private.worker._global_node.get_logs_dir_path()  # NOTE: no public accessor in Ray 2.60
    deadline = time.monotonic() + timeout_s
    while True:
        found = ""
        for path in glob.glob(os.path.join(logs, pattern)):
            with open(path, encoding="utf-8", errors="replace") as file:
                found += file.read()
        if text in found or time.monotonic() >= deadline:
            return found
        time.sleep(0.5)


def test_prompts_are_prefilled_on_the_prefill_replica_holding_their_prefix(
    endpoint: tuple[str, Any], single: LLM
) -> None:
    url, ray = endpoint
    rng = random.Random(21)
    prefix = {name: [rng.randrange(5, 4000) for _ in range(48)] for name in ("a", "b")}
    exporter: dict[str, list[str]] = {"a": [], "b": []}
    for name in ("a", "a", "b"):
        prompt = prefix[name] + [rng.randrange(5, 4000) for _ in range(20)]
        before = by_replica(url, "kvpager:kv_exported_blocks_total", "prefill")
        text, _, cached = complete(url, prompt)
        assert text == greedy_text(single, prompt), f"prompt of {name} differs from one engine"
        assert cached == (len(prompt) - 1) // BLOCK * BLOCK, "all but the tail came from the prefill pool"
        moved = exported_on(url, before)
        assert len(moved) == 1, f"one prefill replica exported the prompt: {moved}"
        exporter[name].extend(moved)
    fetched = sum(by_replica(url, "kvpager:kv_fetches_ok_total", "decode").values())
    assert fetched == 3, "every prompt was fetched from the prefill pool"
    assert exporter["a"][0] == exporter["a"][1], "the same prefix went to the same prefill replica"
    assert exporter["b"][0] != exporter["a"][0], "a new prefix went to the other prefill replica"
    decision = f"kvpager router: 3/4 blocks of the prompt held on replica {exporter['a'][0]}"
    routed = log_text(ray, "serve/replica_kvpager_KVPagerEngine_*.log", decision)
    lines = [line for line in routed.splitlines() if "kvpager router:" in line]
    assert decision in routed, f"a decode replica's router log holds {decision!r}: {lines}"


def test_a_dead_prefill_pool_degrades_to_a_local_prefill(endpoint: tuple[str, Any], single: LLM) -> None:
    url, ray = endpoint
    # NOTE: the controller goes first, so nothing restarts the prefill replicas; the decode replicas
    # and the HTTP proxy keep serving without it (Ray Serve's data plane does not need the controller).
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    controller = [n for n in names if n == "SERVE_CONTROLLER_ACTOR"]
    prefill = [n for n in names if "KVPagerPrefill" in n]
    assert controller and len(prefill) == 2, names
    for name in controller + prefill:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    prompt = [random.Random(22).randrange(5, 4000) for _ in range(50)]
    text, _, cached = complete(url, prompt)
    assert text == greedy_text(single, prompt)
    assert cached == 0, "no KV came from the dead pool: the prompt was prefilled locally"
    reason = "KV fetch from the prefill server http://kvpagerprefill.serve failed, prefilling locally instead"
    assert logged(ray, "worker-*.err", reason), "the decode replica logs why it prefilled locally"

"""Two demo-model replicas on a local Ray Serve (2 CPUs) behind one endpoint, KV-aware routing:
every turn of a conversation after the first lands on the replica holding its prefix (its cached
tokens show the hit), two conversations spread over both replicas, outputs equal a single engine's,
and streaming, abort on disconnect and the merged /metrics work through the ingress."""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from ray_cluster import BLOCK, ENGINE, RayCluster, complete, delete_app, greedy_text

from kvpager.api.llm import LLM
from kvpager.api.server.app import ServerSettings
from kvpager.core.config import EngineConfig

pytestmark = pytest.mark.slow
CONFIG = EngineConfig(**ENGINE)


@pytest.fixture(scope="module")
def endpoint(ray_cluster: RayCluster) -> Iterator[str]:
    url = ray_cluster.start()
    from ray import serve

    from kvpager.api.replicas.launch import build_application

    app = build_application(
        CONFIG, ServerSettings(served_model_names=["demo"]), 2, cpus_per_replica=1, routing_stats_period_s=0.2
    )
    serve.run(app, name="kvpager", route_prefix="/")
    try:
        yield url
    finally:
        delete_app()


@pytest.fixture(scope="module")
def single() -> LLM:
    return LLM(None, **ENGINE)


def test_conversation_turns_follow_their_prefix_and_conversations_spread(endpoint: str, single: LLM) -> None:
    rng = random.Random(5)
    # NOTE: each conversation has its own 3-block opening, so only its own turns match it
    history = {name: [rng.randrange(5, 4000) for _ in range(48)] for name in ("a", "b")}
    replicas: dict[str, list[str]] = {"a": [], "b": []}
    for turn in range(3):
        for name in ("a", "b"):
            prompt = history[name] + [rng.randrange(5, 4000) for _ in range(20)]
            text, replica, cached = complete(endpoint, prompt)
            assert text == greedy_text(single, prompt), f"turn {turn} of {name} differs from one engine"
            replicas[name].append(replica)
            if turn > 0:
                assert cached >= (len(history[name]) // BLOCK) * BLOCK, f"turn {turn} of {name} missed its prefix"
            history[name] = prompt  # NOTE: the next turn extends this prompt (its full blocks are cached)
    assert len(set(replicas["a"])) == 1 and len(set(replicas["b"])) == 1, replicas
    assert replicas["a"][0] != replicas["b"][0], "two conversations should spread over both replicas"


def test_streaming_abort_and_metrics_through_the_ingress(endpoint: str) -> None:
    body = {"model": "demo", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{endpoint}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    with httpx.stream("POST", f"{endpoint}/v1/completions", json={**body, "stream": True}, timeout=120) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == full
    page = httpx.get(f"{endpoint}/metrics", timeout=60).text
    assert len(set(re.findall(r'replica="([^"]+)"', page))) == 2, "every replica's metrics, labelled"
    with httpx.stream(
        "POST", f"{endpoint}/v1/completions", json={**body, "max_tokens": 900, "stream": True}, timeout=120
    ) as resp:
        next(resp.iter_lines())  # the first event arrived; now leave
    deadline = time.monotonic() + 20
    running = None
    while time.monotonic() < deadline:
        page = httpx.get(f"{endpoint}/metrics", timeout=30).text
        running = [float(v) for v in re.findall(r"^kvpager:num_requests_running\{[^}]*\} (\S+)$", page, re.M)]
        if len(running) == 2 and sum(running) == 0:
            break
        time.sleep(0.5)
    assert running is not None and len(running) == 2 and sum(running) == 0, "the abandoned stream is still running"

"""Shared fixtures: one torch thread, session-scoped tiny random checkpoints (see checkpoints.py), a real
Redis/Valkey server (redis_server.py), an engine over a held host tier (held_tiers.py) and one local
Ray Serve cluster for the Ray Serve modules (ray_cluster.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoints import make_llama_checkpoint, make_mistral_checkpoint, make_qwen2_checkpoint, make_qwen3_checkpoint
from held_tiers import engine_with_a_held_host_tier
from ray_cluster import RayCluster
from redis_server import StoreServer

from kvpager.engine.engine import Engine

torch.set_num_threads(1)
RAY_CLUSTER = pytest.StashKey[RayCluster]()


@pytest.fixture(scope="session")
def ray_cluster(request: pytest.FixtureRequest) -> RayCluster:
    """The shared local Ray + Serve cluster; `start()` gives the endpoint, starting it if needed."""
    cluster = RayCluster()
    request.config.stash[RAY_CLUSTER] = cluster
    request.addfinalizer(cluster.stop)
    return cluster


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the item's fixtures are torn down: stop Ray when the next test does not use it."""
    yield
    cluster = item.config.stash.get(RAY_CLUSTER, None)
    if cluster is not None and (nextitem is None or "ray_cluster" not in getattr(nextitem, "fixturenames", ())):
        cluster.stop()


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny LlamaForCausalLM: hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 384, with tokenizer."""
    return make_llama_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def qwen2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2ForCausalLM: q/k/v bias, tied embeddings, ChatML template."""
    return make_qwen2_checkpoint(tmp_path_factory.mktemp("qwen2"), seed=1)


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3ForCausalLM: per-head q/k norm, head_dim 32."""
    return make_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3"), seed=2)


@pytest.fixture(scope="session")
def mistral_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny MistralForCausalLM (sliding window 4096, never reached)."""
    return make_mistral_checkpoint(tmp_path_factory.mktemp("mistral"), seed=3)


@pytest.fixture
def store_server(tmp_path: Path) -> Iterator[StoreServer]:
    """A real Redis/Valkey server on a free loopback port, stopped after the test.

    Skips, with the reason, where neither valkey-server nor redis-server is installed.
    """
    server = StoreServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def held_host_tier(llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Engine, threading.Event]]:
    """(engine, release): the engine's host tier holds PROMPTS["a"]'s prefix (held_tiers.py) and answers
    lookups only once `release` is set; set at teardown too, so a failed test leaves no thread waiting."""
    engine, release = engine_with_a_held_host_tier(llama_checkpoint, monkeypatch)
    try:
        yield engine, release
    finally:
        release.set()

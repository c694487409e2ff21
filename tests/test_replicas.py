"""Replicas without Ray: the routing rule, the prompt hashing of the ingress (equal to the engine's),
an engine replica's in-process HTTP path (streams stream, leaving early aborts), and the merged
/metrics page. The Ray Serve deployment itself is tested in test_replicas_kv_routing.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from engine_helpers import TINY_BLOCK, tiny_llama_config

from kvpager.api.replicas.asgi import HttpRequest, ResponseStart
from kvpager.api.replicas.deployment import EngineReplica, Ingress
from kvpager.api.replicas.metrics_merge import merge_pages
from kvpager.api.replicas.policy import ReplicaView, hex_chain, matched, rank
from kvpager.api.server.app import ServerSettings
from kvpager.core.hashing import hash_prompt_blocks


def test_longest_match_wins_unless_its_queue_is_too_long() -> None:
    views = [ReplicaView("a", 0, 0), ReplicaView("b", 5, 2), ReplicaView("c", 3, 0)]
    assert [v.replica for v in rank(views)] == ["b", "c", "a"]
    crowded = [ReplicaView("a", 0, 0), ReplicaView("b", 5, 9)]
    assert [v.replica for v in rank(crowded, max_imbalance=4)] == ["a", "b"]


def test_new_conversations_spread_over_idle_replicas() -> None:
    views = [ReplicaView("a", 0, 0, num_routed=1), ReplicaView("b", 0, 0, num_routed=0)]
    assert rank(views)[0].replica == "b"
    with pytest.raises(ValueError, match="max_imbalance"):
        rank(views, max_imbalance=-1)


def test_match_counts_leading_blocks_only() -> None:
    chain = hex_chain(hash_prompt_blocks(b"\x01" * 32, list(range(16)), 4))
    assert matched(chain, set(chain)) == 4
    assert matched(chain, set(chain[:1] + chain[2:])) == 1
    assert matched(chain, set()) == 0


def replica_for(checkpoint: Path) -> EngineReplica:
    return EngineReplica(tiny_llama_config(checkpoint, 32), ServerSettings(served_model_names=["tiny"]))


def post(path: str, body: dict) -> HttpRequest:
    return HttpRequest("POST", path, b"", [(b"content-type", b"application/json")], json.dumps(body).encode())


async def collect(replica: EngineReplica, request: HttpRequest) -> tuple[int, dict[bytes, bytes], bytes]:
    start, chunks = None, []
    async for item in replica.handle(request):
        if isinstance(item, ResponseStart):
            start = item
        else:
            chunks.append(item)
    assert start is not None
    return start.status, dict(start.headers), b"".join(chunks)


def test_engine_replica_serves_streams_and_aborts_when_left(llama_checkpoint: Path) -> None:
    replica = replica_for(llama_checkpoint)
    prompt = list(range(3, 40))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def run() -> None:
        status, headers, raw = await collect(replica, post("/v1/completions", body))
        assert status == 200 and headers[b"x-kvpager-replica"] == b"local"
        full = json.loads(raw)["choices"][0]["text"]
        status, _, raw = await collect(replica, post("/v1/completions", {**body, "stream": True}))
        events = [line[6:] for line in raw.decode().splitlines() if line.startswith("data: ")]
        assert status == 200 and events[-1] == "[DONE]" and len(events) > 3
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == full
        status, _, raw = await collect(replica, post("/v1/completions", {**body, "model": "other"}))
        assert status == 404 and "does not exist" in raw.decode()
        # a client that leaves after the first chunk: the engine request is aborted at once
        long = {**body, "max_tokens": 200, "stream": True}
        stream = replica.handle(post("/v1/completions", long))
        async for item in stream:
            if isinstance(item, bytes):
                break
        await stream.aclose()
        for _ in range(100):
            if replica.engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert replica.engine.stats().num_running == 0
        stats = await replica.record_routing_stats()
        held = set(stats["kv_blocks"])
        expected = hex_chain(hash_prompt_blocks(replica.fingerprint, prompt, TINY_BLOCK))
        assert matched(expected, held) == len(expected) and stats["queue_len"] == 0
        _, page = await replica.metrics_page(0)
        assert "kvpager:prompt_tokens_total" in page

    try:
        asyncio.run(run())
    finally:
        replica.engine.shutdown()


def test_ingress_hashes_prompts_like_the_engine(llama_checkpoint: Path) -> None:
    ingress = Ingress(None, 2, str(llama_checkpoint), None)
    seed, ids = b"\x02" * 32, list(range(3, 30))
    expected = hex_chain(hash_prompt_blocks(seed, ids, 4))
    assert ingress.chain_for("/v1/completions", json.dumps({"prompt": ids}).encode(), seed, 4) == expected
    text = "hello world, hello again"
    from_text = ingress.chain_for("/v1/completions", json.dumps({"prompt": text}).encode(), seed, 4)
    assert from_text == hex_chain(hash_prompt_blocks(seed, ingress.tokenizer.encode(text), 4))
    assert ingress.chain_for("/v1/completions", b"not json", seed, 4) == []
    assert ingress.chain_for("/v1/models", b"", seed, 4) == []
    export = json.dumps({"prompt_token_ids": ids}).encode()  # a decode server's KV fetch from a prefill pool
    assert ingress.chain_for("/v1/kv/export", export, seed, 4) == expected


def test_metrics_pages_merge_with_a_replica_label() -> None:
    page = '# HELP x_total things\n# TYPE x_total counter\nx_total{model_name="m"} 3.0\n'
    merged = merge_pages([("r1", page), ("r2", page.replace("3.0", "4.0"))])
    assert merged.count("# TYPE x counter") == 1
    assert 'x_total{replica="r1",model_name="m"} 3.0' in merged
    assert 'x_total{replica="r2",model_name="m"} 4.0' in merged


def test_replicas_flag_says_how_to_install_ray_when_it_is_missing(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import sys

    from kvpager.cli.serve import main

    monkeypatch.setitem(sys.modules, "ray", None)  # NOTE: makes `import ray` fail as if not installed
    assert main(["--replicas", "2", "--device", "cpu"]) == 2
    assert "pip install 'kvpager[ray]'" in capsys.readouterr().err
    assert main(["--replicas", "0"]) == 2

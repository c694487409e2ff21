"""Tensor parallelism across nodes and with the host KV tier, on loopback (gloo, one torch thread per rank).

Two nodes: node 0 is a real `kvpager serve` (engine, API server, rank 0) and node 1 a `kvpager serve
--headless --node-rank 1` process (rank 1 only); they meet at the --master-addr/--master-port given
on both command lines. Their greedy completion equals a TP=1 engine's; killing node 1 (its whole
process group, as when the machine goes away) makes node 0 answer 503 within seconds, with nothing
in flight (heartbeats, not a failed collective, tell). A wrong master address is a clear error
within --distributed-timeout, on either side, not a hang; a node whose flags disagree with node 0's
(block size here) is refused naming the flag. With the host tier, TP=2 reloads an
evicted prefix shard by shard and gives TP=1's cold greedy tokens; with the disk tier too, every
rank flushes its shards into its own directory at shutdown and a restarted TP=2 engine serves the
prefix from disk, again with TP=1's tokens.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import make_llama_checkpoint
from server_harness import REPO_ROOT, free_port, launch_server

from kvpager.core.config import EngineConfig
from kvpager.core.invariants import check_scheduler
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.engine import Engine
from kvpager.engine.executor import RendezvousError, init_rank
from kvpager.model.spec import load_model_spec

pytestmark = pytest.mark.slow

DEAD_WITHIN_S = 10.0
PROMPT = "Memory management is the heart of serving"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama_checkpoint(tmp_path_factory.mktemp("tp-nodes-llama"))  # 4 heads, 2 KV heads


def _engine(model: Path, tp: int, **fields: object) -> Engine:
    config = EngineConfig(
        model=str(model), dtype="float32", device="cpu", num_threads=1, tensor_parallel_size=tp, **fields
    )  # type: ignore[arg-type]
    return Engine(config)


def _generate(engine: Engine, prompt: str, params: SamplingParams) -> tuple[list[int], str]:
    engine.add_request(f"r-{time.monotonic_ns()}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return list(out.outputs[0].token_ids), out.outputs[0].text
    raise AssertionError("the request never finished")


def _headless(model: Path, port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`kvpager serve --headless` as node 1 of 2, in its own process group (so a test can kill the node)."""
    cmd = [sys.executable, "-m", "kvpager", "serve", "--model", str(model), "--headless", "-tp", "2"]
    cmd += ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    cmd += ["--device", "cpu", "--num-threads", "1", "--dtype", "float32", "--kv-cache-memory", "1MiB", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    with open(log, "wb") as out:
        return subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def test_two_nodes_serve_tp1s_greedy_text_and_a_lost_node_makes_node0_answer_503(
    llama_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    node1 = _headless(llama_dir, port, tmp_path / "node1.log")
    node0_flags = ["-tp", "2", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"]
    node0_flags += ["--master-port", str(port), "--dtype", "float32", "--kv-cache-memory", "1MiB"]
    server = launch_server(llama_dir, tmp_path, *node0_flags)
    try:
        server.wait_healthy(timeout=300)
        body = {"model": str(llama_dir), "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        _, tp1_text = _generate(_engine(llama_dir, 1, kv_cache_memory=1 << 20, kernel_backend="torch"), PROMPT, GREEDY)
        assert r.json()["choices"][0]["text"] == tp1_text
        os.killpg(node1.pid, signal.SIGKILL)  # NOTE: the headless process and its worker, as a lost machine
        deadline = time.monotonic() + DEAD_WITHIN_S
        while httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "/health still ok after node 1 was killed"
            time.sleep(0.1)
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "rank 1 (node 1)" in r.text, r.text
    finally:
        server.stop()
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
        node1.wait()


def test_a_rank_with_an_unreachable_master_fails_clearly_within_the_timeout(llama_dir: Path) -> None:
    """What a headless node's worker runs first (`init_rank`); nobody listens at the port. (A worker that
    fails this exits 1 and its headless node with it: the configuration test below sees that exit.)"""
    port = free_port()
    spec = load_model_spec(str(llama_dir))
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=f"rendezvous at 127.0.0.1:{port} failed for rank 1: could not reach"):
        init_rank(spec, 1, 2, "127.0.0.1", port, torch.device("cpu"), 2.0)
    assert time.monotonic() - start < 10


def test_node0_whose_other_node_never_joins_fails_clearly_within_the_timeout(llama_dir: Path) -> None:
    config = EngineConfig(
        model=str(llama_dir),
        device="cpu",
        num_threads=1,
        tensor_parallel_size=2,
        nnodes=2,
        distributed_master_addr="127.0.0.1",
        distributed_master_port=free_port(),
        distributed_timeout=2.0,
        kv_cache_memory=1 << 20,
    )
    start = time.monotonic()
    with pytest.raises(RendezvousError, match="not every one of the 2 ranks joined within 2 s"):
        Engine(config)
    assert time.monotonic() - start < 20


def test_a_node_started_with_another_configuration_is_refused_naming_the_difference(
    llama_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    node1 = _headless(llama_dir, port, tmp_path / "node1.log", "--block-size", "32")
    config = EngineConfig(
        model=str(llama_dir),
        dtype="float32",
        device="cpu",
        num_threads=1,
        tensor_parallel_size=2,
        nnodes=2,
        distributed_master_addr="127.0.0.1",
        distributed_master_port=port,
        kv_cache_memory=1 << 20,
    )
    try:
        with pytest.raises(
            ValueError, match="rank 1 \\(node 1\\) has another configuration than node 0: --block-size 16"
        ):
            Engine(config)
        assert node1.wait(timeout=60) == 1
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
        node1.wait()


# 12 blocks of 16 tokens per rank: [blocks, block_size, (K, V), layers, KV heads per rank, head_dim, fp32]
SMALL_POOL = 12 * 16 * 2 * 2 * 1 * 16 * 4
LONG = "She sells sea shells by the sea shore, and the shells she sells are sea shells for sure. " * 2
FILLERS = [
    f"Filler text number {i}: the quick brown fox jumps over the lazy dog again and again." * 2 for i in range(4)
]


def test_tp2_reloads_an_evicted_prefix_from_the_host_then_the_disk_tier_with_tp1s_cold_tokens(
    llama_dir: Path, tmp_path: Path
) -> None:
    tp1 = _engine(llama_dir, 1, kv_cache_memory=1 << 20, kernel_backend="torch")
    tp1_cold, _ = _generate(tp1, LONG, GREEDY)
    num_prefix_blocks = (len(tp1.tokenizer.encode(LONG)) - 1) // 16  # the full blocks a prefix hit may reuse
    tiers = {"kv_cache_memory": SMALL_POOL, "host_kv_cache_memory": 1 << 20, "kv_cache_dir": str(tmp_path / "kv")}
    engine = _engine(llama_dir, 2, **tiers)
    try:
        first, _ = _generate(engine, LONG, GREEDY)
        for filler in FILLERS:  # NOTE: each takes most of the 12 blocks: LONG's are evicted to the host tier
            _generate(engine, filler, GREEDY)
        stats = engine.kv_tier_stats()
        assert stats.offloaded.blocks > 0 and stats.restored.blocks == 0
        again, _ = _generate(engine, LONG, GREEDY)
        assert engine.kv_tier_stats().restored.blocks >= num_prefix_blocks, "the prefix did not come from the host tier"
        assert first == tp1_cold and again == tp1_cold
        assert check_scheduler(engine.scheduler) == []
    finally:
        engine.shutdown()  # NOTE: every rank flushes its host tier into its own directory
    for rank in (0, 1):
        assert any((tmp_path / "kv" / f"tp2-rank{rank}").iterdir()), f"rank {rank} wrote no shards to disk"
    restarted = _engine(llama_dir, 2, **tiers)
    try:
        cold_start, _ = _generate(restarted, LONG, GREEDY)
        stats = restarted.kv_tier_stats()
        assert stats.disk is not None and stats.restored.blocks >= num_prefix_blocks, "not served from the disk tier"
        assert cold_start == tp1_cold
    finally:
        restarted.shutdown()

"""Tensor parallelism on CPU: two processes on loopback (gloo), one torch thread each.

A TP=2 engine (rank 0 here, rank 1 a worker process it starts) gives the same greedy tokens as a
TP=1 engine and transformers, for a Llama with its 2 KV heads split over the ranks and a Qwen2 (q/k/v
bias, tied embeddings, a vocabulary of 383 rows: the last rank's shard padded) with 1 KV head,
replicated. Prompt logprobs equal transformers' within 1e-4: float32 throughout, the only difference
being the order of the sums (each rank's partial products, then the all-reduce). Prefix caching and
recompute preemption stay exact under TP=2; killing a worker with SIGKILL makes the engine report
it dead within seconds (and the server answer 503, /health included).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from checkpoints import make_llama_checkpoint, make_qwen2_checkpoint
from server_harness import launch_server

from kvpager.cli.plan import main as plan_main
from kvpager.core.config import EngineConfig
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.engine import Engine

pytestmark = pytest.mark.slow

ATOL = 1e-4  # float32; TP=2 only reorders the sums of the row-parallel and vocab-parallel products
PROMPTS = ["The quick brown fox jumps", "Memory management is the heart of serving", "Hello, world! 0123"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
DEAD_WITHIN_S = 10.0


def _engine(model: Path, tp: int, **fields: object) -> Engine:
    config = EngineConfig(
        model=str(model), dtype="float32", device="cpu", num_threads=1, tensor_parallel_size=tp, **fields
    )  # type: ignore[arg-type]
    return Engine(config)


def _run(engine: Engine, prompts: list[str], params: SamplingParams) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return {rid.split("-")[0]: tokens for rid, tokens in done.items()}


def _hf_greedy(model: Path, engine: Engine, prompts: list[str], max_tokens: int) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    out = {}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([engine.tokenizer.encode(prompt)])
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        out[f"r{i}"] = gen[0, ids.shape[1] :].tolist()
    return out


def _hf_prompt_logprobs(model: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama_checkpoint(tmp_path_factory.mktemp("tp-llama"))  # 4 heads, 2 KV heads: split


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 1 KV head (replicated on both ranks), q/k/v bias, tied embeddings, 383 rows: an uneven vocab split
    return make_qwen2_checkpoint(tmp_path_factory.mktemp("tp-qwen2"), num_key_value_heads=1, vocab_size=383)


# 12 blocks of 16 tokens per rank: three requests of ~75 tokens need 15, so one is preempted.
SMALL_POOL = 12 * 16 * 2 * 2 * 1 * 16 * 4  # blocks x block_size x (K, V) x layers x KV heads/rank x head_dim x fp32


@pytest.fixture(scope="module")
def llama_tp2(llama_dir: Path) -> Iterator[Engine]:
    engine = _engine(llama_dir, 2, kv_cache_memory=SMALL_POOL)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def qwen_tp2(qwen_dir: Path) -> Iterator[Engine]:
    engine = _engine(qwen_dir, 2, kv_cache_memory=1 << 20)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("which", ["llama_kv_heads_split", "qwen2_kv_head_replicated_bias_tied"])
def test_tp2_greedy_tokens_equal_tp1_and_transformers(
    which: str, request: pytest.FixtureRequest, llama_dir: Path, qwen_dir: Path
) -> None:
    model, engine = (
        (llama_dir, request.getfixturevalue("llama_tp2"))
        if which.startswith("llama")
        else (qwen_dir, request.getfixturevalue("qwen_tp2"))
    )
    tp2 = _run(engine, PROMPTS, GREEDY)
    tp1_engine = _engine(model, 1, kv_cache_memory=1 << 20, kernel_backend="torch")
    tp1 = _run(tp1_engine, PROMPTS, GREEDY)
    assert tp2 == tp1
    assert tp2 == _hf_greedy(model, tp1_engine, PROMPTS, GREEDY.max_tokens or 0)


def test_tp2_prompt_logprobs_equal_transformers(qwen_tp2: Engine, qwen_dir: Path) -> None:
    prompt = PROMPTS[1]
    qwen_tp2.add_request("lp", prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3))
    outputs = []
    while qwen_tp2.has_unfinished_requests():
        outputs += qwen_tp2.step()
    final = outputs[-1]
    ids = list(final.prompt_token_ids)
    ref = _hf_prompt_logprobs(qwen_dir, ids)
    assert final.prompt_logprobs is not None and final.prompt_logprobs[0] is None
    got = torch.tensor([lp.logprob for lp in final.prompt_logprobs[1:] if lp is not None])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_tp2_prefix_cache_hit_gives_the_same_tokens(qwen_tp2: Engine) -> None:
    prompt = "She sells sea shells by the sea shore. How much wood would a woodchuck chuck?"
    first = _run(qwen_tp2, [prompt], GREEDY)
    hits_before = qwen_tp2.stats().prefix_cache_hits
    second = _run(qwen_tp2, [prompt], GREEDY)
    assert qwen_tp2.stats().prefix_cache_hits > hits_before  # the second prompt's full blocks were cached
    assert second == first


def test_tp2_preemption_recomputes_exactly(llama_tp2: Engine, llama_dir: Path) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)  # ~5 blocks each, 12 in the pool
    preempted_before = llama_tp2.stats().num_preemptions
    tp2 = _run(llama_tp2, PROMPTS, long)
    assert llama_tp2.stats().num_preemptions > preempted_before, "the small pool must have preempted"
    tp1 = _run(_engine(llama_dir, 1, kv_cache_memory=1 << 20, kernel_backend="torch"), PROMPTS, long)
    assert tp2 == tp1


def test_tp2_pool_holds_each_ranks_kv_heads_and_the_planners_block_count(
    llama_tp2: Engine, llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kv = llama_tp2.runner.kv_cache  # [layers, 2, blocks, block_size, kv heads of this rank, head_dim]
    assert kv.shape[4] == 1 and kv.shape[2] == llama_tp2.pool.num_blocks == 12
    args = [str(llama_dir), "--kv-cache-memory", str(SMALL_POOL), "--kv-dtype", "fp32", "--json"]
    assert plan_main([*args, "--tensor-parallel-size", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["engine_num_blocks"] == llama_tp2.pool.num_blocks
    assert plan["engine_kv_heads_per_rank"] == 1


def test_killed_worker_makes_the_engine_dead_within_seconds(qwen_tp2: Engine) -> None:
    """Runs last on this engine: SIGKILL the worker while a request decodes."""
    qwen_tp2.add_request("doomed", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    qwen_tp2.step()
    os.kill(qwen_tp2.executor.workers[0].pid, signal.SIGKILL)  # type: ignore[union-attr]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 .* killed by signal 9"):
        while time.monotonic() - start < 60:
            qwen_tp2.step()
    assert time.monotonic() - start < DEAD_WITHIN_S
    assert qwen_tp2.dead_reason is not None


def _worker_pids(parent: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"kvpager.engine.tp_worker" in cmdline:
                pids.append(int(entry.name))
    return pids


def test_server_with_tp2_answers_then_reports_a_killed_worker(llama_dir: Path, tmp_path: Path) -> None:
    server = launch_server(llama_dir, tmp_path, "--tensor-parallel-size", "2", "--dtype", "float32")
    try:
        server.wait_healthy(timeout=300)
        body = {"model": str(llama_dir), "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        (worker,) = _worker_pids(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + DEAD_WITHIN_S
        while httpx.get(f"{server.url}/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "/health still ok after the worker was killed"
            time.sleep(0.1)
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "worker rank 1" in r.text, r.text
    finally:
        server.stop()


def test_tp2_int8_shards_give_the_tp1_int8_tokens(llama_dir: Path) -> None:
    """Groups of 32 fit the row-parallel shards' 32 columns, so quantizing each shard equals slicing the
    quantized model: the packed path under TP=2 must give TP=1's tokens."""
    fields = {"quantization": "int8", "quantization_group_size": 32, "kv_cache_memory": 1 << 20}
    tp2_engine = _engine(llama_dir, 2, **fields)
    try:
        tp2 = _run(tp2_engine, PROMPTS, GREEDY)
    finally:
        tp2_engine.shutdown()
    assert tp2 == _run(_engine(llama_dir, 1, kernel_backend="torch", **fields), PROMPTS, GREEDY)

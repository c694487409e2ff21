"""The engine end to end on a tiny checkpoint: exact greedy tokens under memory pressure, seeds,
n > 1, stop handling, aborts and bad input. The reference is transformers on the same weights."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
import torch
from engine_helpers import run_greedy, tiny_llama_config

from kvpager.api.llm import LLM
from kvpager.core.config import EngineConfig
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.args import add_engine_args, config_from_args
from kvpager.engine.engine import Engine

# Tiny llama (tests/checkpoints.py): 2 layers, 2 KV heads, head_dim 16, fp32 → 512 bytes per token.
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def make_prompts(num: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths; every third prompt shares a 40-token prefix, so the prefix cache is hit."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = []
    for i in range(num):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 60))]
        prompts.append(shared + tail if i % 3 == 0 else tail)
    return prompts


def test_greedy_matches_transformers_under_chunking_preemption_and_prefix_hits(llama_checkpoint: Path) -> None:
    num_new = 12
    prompts = make_prompts(18, vocab=384)
    # 40 blocks of 4 tokens: far less than 18 requests need at once, so requests are preempted.
    config = EngineConfig(
        model=str(llama_checkpoint),
        block_size=4,
        kv_cache_memory=40 * 4 * BYTES_PER_TOKEN,
        max_num_batched_tokens=48,  # < the longest prompt: prefills are chunked
        max_num_seqs=16,
    )
    engine = Engine(config)
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert stats.num_owned_blocks == 0
    for i, p in enumerate(prompts):
        assert finished[f"r{i}"] == hf_greedy(llama_checkpoint, p, num_new), f"request r{i} diverged"


def test_seeded_request_samples_the_same_alone_and_in_a_batch(llama_checkpoint: Path) -> None:
    llm = LLM(model=str(llama_checkpoint), kv_cache_memory=1 << 22)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[5, 6, 7, 8, 9]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True), SamplingParams(temperature=0.0)]
    batch = llm.generate(
        [[20, 21, 22], [5, 6, 7, 8, 9], [30, 31, 32, 33]], [others[0], seeded, others[1]], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone


def test_n_samples_share_the_prompt_blocks(llama_checkpoint: Path) -> None:
    engine = Engine(EngineConfig(model=str(llama_checkpoint), block_size=4, kv_cache_memory=1 << 22))
    prompt = list(range(10, 50))  # 40 tokens = 10 full blocks
    engine.add_request("x", prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True))
    engine.step()  # all three samples admitted in one step: the second and third hit the first's blocks
    assert engine.stats().prefix_cache_hits >= 2 * 36
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final is not None and final.finished
    assert [o.index for o in final.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 5 for o in final.outputs)
    assert engine.stats().num_owned_blocks == 0


def test_stop_string_is_excluded_and_ends_the_request(llama_checkpoint: Path) -> None:
    llm = LLM(model=str(llama_checkpoint), kv_cache_memory=1 << 22)
    base = llm.generate(
        ["The quick brown"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )
    text = base[0].outputs[0].text
    assert len(text) > 4
    stop = text[2:4]
    stopped = llm.generate(
        ["The quick brown"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]


def test_abort_frees_every_block_and_leaves_others_running(llama_checkpoint: Path) -> None:
    engine = Engine(EngineConfig(model=str(llama_checkpoint), block_size=4, kv_cache_memory=1 << 22))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), params)
    engine.add_request("b", list(range(40, 60)), params)
    engine.step()
    engine.step()
    final = engine.abort_request("a")
    assert final is not None and final.finished and final.outputs[0].finish_reason == "abort"
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert "a" not in outs and outs["b"].outputs[0].finish_reason == "length"
    assert outs["b"].outputs[0].token_ids == hf_greedy(llama_checkpoint, list(range(40, 60)), 30)
    assert engine.stats().num_owned_blocks == 0


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ([1, 2, 384], SamplingParams(), "out of vocabulary"),
        ([1, -1], SamplingParams(), "out of vocabulary"),
        (list(range(3, 300)), SamplingParams(), "maximum context length is 256"),
        (list(range(3, 250)), SamplingParams(max_tokens=20), "maximum context length is 256"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error_and_others_continue(
    llama_checkpoint: Path, prompt: object, params: SamplingParams, message: str
) -> None:
    engine = Engine(EngineConfig(model=str(llama_checkpoint), kv_cache_memory=1 << 22))
    engine.add_request("ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)  # type: ignore[arg-type]
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["ok"]
    assert engine.stats().num_owned_blocks == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n must be"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_invalid_sampling_values_name_the_parameter(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_missing_or_malformed_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match="does-not-exist"):
        Engine(EngineConfig(model=str(tmp_path / "does-not-exist"), kv_cache_memory=1 << 22))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        Engine(EngineConfig(model=str(tmp_path), kv_cache_memory=1 << 22))


def test_request_too_large_for_the_whole_pool_is_refused(llama_checkpoint: Path) -> None:
    engine = Engine(EngineConfig(model=str(llama_checkpoint), block_size=4, kv_cache_memory=10 * 4 * BYTES_PER_TOKEN))
    with pytest.raises(ValueError, match="block"):
        engine.add_request("big", list(range(3, 40)), SamplingParams(max_tokens=8))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_both_kernel_backends_give_transformers_greedy_tokens(
    llama_checkpoint: Path, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = make_prompts(1, 384, seed=3)[0][:20]
    with caplog.at_level("INFO", logger="kvpager"):
        engine = Engine(EngineConfig(model=str(llama_checkpoint), kv_cache_memory=1 << 22, kernel_backend=backend))
    assert engine.runner.model.ops.name == backend
    assert f"model math: {backend} ops" in caplog.text
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.outputs[0].delta_token_ids]
    assert tokens == hf_greedy(llama_checkpoint, prompt, 12)


def test_fp32_matmul_precision_is_in_force_while_the_model_runs_and_restored_after(llama_checkpoint: Path) -> None:
    engine = Engine(EngineConfig(model=str(llama_checkpoint), kv_cache_memory=1 << 22, fp32_matmul_precision="medium"))
    seen: list[str] = []
    forward = engine.runner.model.forward

    def spy(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_float32_matmul_precision())
        return forward(*args, **kwargs)

    engine.runner.model.forward = spy  # type: ignore[method-assign]
    tokens, _ = run_greedy(engine, make_prompts(1, 384, seed=4)[0][:40], 3)
    assert len(tokens) == 3 and seen == ["medium"] * 3
    assert torch.get_float32_matmul_precision() == "highest"
    with pytest.raises(ValueError, match="fp32_matmul_precision must be one of"):
        EngineConfig(model=str(llama_checkpoint), fp32_matmul_precision="low")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).fp32_matmul_precision == "highest"
    assert config_from_args(parser.parse_args(["--fp32-matmul-precision", "medium"])).fp32_matmul_precision == "medium"


def test_unknown_kernel_backend_is_refused_and_bf16_runs_in_the_cpu_kernels(llama_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="kernel_backend must be one of"):
        EngineConfig(model=str(llama_checkpoint), kernel_backend="avx9")
    # a bfloat16 model computes in float32 on the CPU (kvpager.model.precision): the kernels take it
    engine = Engine(
        EngineConfig(model=str(llama_checkpoint), kv_cache_memory=1 << 22, dtype="bfloat16", kernel_backend="cpu")
    )
    assert engine.loaded.model.ops.name == "cpu" and engine.runner.kv_cache.dtype == torch.bfloat16
    assert len(run_greedy(engine, [1, 2, 3], 3)[0]) == 3


def test_engine_reports_its_ops_kernel_fallbacks_for_metrics(llama_checkpoint: Path) -> None:
    engine = Engine(tiny_llama_config(llama_checkpoint, num_blocks=32))
    run_greedy(engine, [1, 2, 3], 3)
    fallbacks = engine.kernel_fallbacks()
    assert fallbacks == engine.runner.model.ops.kernel_stats()["fallbacks"]
    assert all(isinstance(calls, int) for reasons in fallbacks.values() for calls in reasons.values())

"""`kvpager plan` predicts exactly the pool the engine allocates for the same configuration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpager.cli.plan import main as plan_main
from kvpager.core.config import EngineConfig
from kvpager.engine.engine import Engine


@pytest.mark.parametrize(("budget", "block_size", "max_model_len"), [(1 << 20, 16, 256), (777_777, 5, 100)])
def test_plan_block_count_equals_the_engines(
    llama_checkpoint: Path, capsys: pytest.CaptureFixture[str], budget: int, block_size: int, max_model_len: int
) -> None:
    engine = Engine(
        EngineConfig(
            model=str(llama_checkpoint), kv_cache_memory=budget, block_size=block_size, max_model_len=max_model_len
        )
    )
    rc = plan_main(
        [
            str(llama_checkpoint),
            "--kv-cache-memory",
            str(budget),
            "--kv-dtype",
            "float32",
            "--block-size",
            str(block_size),
            "--max-model-len",
            str(max_model_len),
            "--json",
        ]
    )
    assert rc in (0, 1)
    plan = json.loads(capsys.readouterr().out)
    assert plan["engine_num_blocks"] == engine.pool.num_blocks
    assert engine.runner.kv_cache.shape[2] == engine.pool.num_blocks
    assert plan["engine_max_concurrency"] == engine.pool.max_concurrency(max_model_len)


def test_engine_logs_the_pool_it_allocates(llama_checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="kvpager"):
        engine = Engine(EngineConfig(model=str(llama_checkpoint), kv_cache_memory=1 << 20, block_size=16))
    assert f"{engine.pool.num_blocks} blocks of 16 tokens" in caplog.text
    assert f"max concurrency at max_model_len 256: {engine.pool.max_concurrency(256)}" in caplog.text


ENGINE_FORMATS = {
    "float32": ({"dtype": "float32"}, ["--dtype", "float32"]),
    "bf16": ({"dtype": "bfloat16"}, ["--dtype", "bfloat16"]),
    "fp16": ({"dtype": "float16"}, ["--dtype", "float16"]),
    "int8": ({"quantization": "int8"}, ["--quantization", "int8", "--dtype", "auto"]),
    "int8_g32": (
        {"quantization": "int8", "quantization_group_size": 32},
        ["--quantization", "int8", "--quantization-group-size", "32", "--dtype", "float32"],
    ),
    "int4": ({"quantization": "int4", "dtype": "bfloat16"}, ["--quantization", "int4", "--dtype", "bfloat16"]),
    "int4_g32": (
        {"quantization": "int4", "quantization_group_size": 32},
        ["--quantization", "int4", "--quantization-group-size", "32", "--dtype", "auto"],
    ),
    "w8a8_int8": ({"quantization": "w8a8_int8"}, ["--quantization", "w8a8_int8", "--dtype", "auto"]),
    "w4a8_int8_g64": (
        {"quantization": "w4a8_int8", "quantization_group_size": 64, "dtype": "bfloat16"},
        ["--quantization", "w4a8_int8", "--quantization-group-size", "64", "--dtype", "bfloat16"],
    ),
}


@pytest.mark.parametrize("fmt", list(ENGINE_FORMATS))
def test_plan_weight_bytes_and_blocks_equal_the_engines_in_every_format(
    llama_checkpoint: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    fields, flags = ENGINE_FORMATS[fmt]
    budget = 1 << 20
    engine = Engine(EngineConfig(model=str(llama_checkpoint), kv_cache_memory=budget, **fields))  # type: ignore[arg-type]
    kv = engine.config.resolved_kv_cache_dtype
    kv_flag = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[kv]
    rc = plan_main([str(llama_checkpoint), "--kv-cache-memory", str(budget), "--kv-dtype", kv_flag, "--json", *flags])
    assert rc in (0, 1)
    plan = json.loads(capsys.readouterr().out)
    assert plan["weight_bytes"] == engine.loaded.weight_bytes
    assert plan["engine_num_blocks"] == engine.pool.num_blocks
    if "quantization" in fields:
        element = 2 if engine.config.dtype == "bfloat16" else 4
        assert plan["weight_bytes"] < element * engine.model_spec.num_parameters()  # smaller than unquantized


def test_plan_refuses_weights_together_with_quantization(llama_checkpoint: Path) -> None:
    assert plan_main([str(llama_checkpoint), "--weights", "q4_0", "--quantization", "int4"]) == 2

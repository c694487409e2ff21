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

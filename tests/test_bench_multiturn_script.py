"""scripts/bench_multiturn.py runs from a checkout (no install, any working directory) on the bundled
demo model at a tiny size and reports every setting with per-turn prefix hit rate and TTFT."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from redis_server import server_binary

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_multiturn.py"
SETTINGS = ("single", "kv-aware", "round-robin", "power-of-two", "kv-aware+store")


@pytest.mark.slow
def test_bench_multiturn_reports_every_setting_per_turn(tmp_path: Path) -> None:
    server_binary()  # the kv-aware+store setting starts its own store
    out = tmp_path / "multiturn.json"
    args = ["--conversations", "2", "--turns", "2", "--system-tokens", "32", "--user-tokens", "8"]
    args += ["--max-tokens", "1:3", "--think-ms", "0:5", "--kv-cache-memory", "4MiB", "--json-out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["router_store_aware"] is False  # kv-aware+store runs the device-only rule by default
    results = report["results"]
    assert tuple(results) == SETTINGS
    prompt_tokens = {r["prompt_tokens"] for r in results.values()}
    assert len(prompt_tokens) == 1, "every setting runs the same workload"
    for name, result in results.items():
        assert [t["turn"] for t in result["turns"]] == [1, 2], name
        assert all(t["ttft_p50_s"] > 0 and 0 <= t["hit_rate"] < 1 for t in result["turns"]), name
        assert result["prefill_tokens"] == round(result["prompt_tokens"] * (1 - result["hit_rate"]))
    for name, result in results.items():  # every request was routed once
        assert sum(result["routed"]) == 4 and len(result["routed"]) == (1 if name == "single" else 2), name
    for name in ("single", "kv-aware", "kv-aware+store"):  # turn 2 finds its history where it was computed
        assert results[name]["turns"][1]["hit_rate"] > 0.5, name
    assert "turn 2" in proc.stdout and "kv-aware+store" in proc.stdout and "router device-only" in proc.stdout


@pytest.mark.parametrize("flag, value", [("--think-ms", "5:1"), ("--max-tokens", "0"), ("--max-tokens", "a:b")])
def test_bench_multiturn_refuses_a_bad_span_naming_the_flag(flag: str, value: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), flag, value], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and flag in proc.stderr, proc.stderr[-2000:]

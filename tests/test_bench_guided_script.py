"""scripts/bench_guided.py runs its three phases on a tiny model and reports the ratios it promises."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_guided.py"


@pytest.mark.slow
def test_bench_guided_reports_plain_mixed_and_guided_phases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_guided", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "guided.json"
    argv = ["--batch", "3", "--max-tokens", "3", "--rounds", "1", "--device", "cpu", "--kv-cache-memory", str(8 << 20)]
    assert module.main([*argv, "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    for phase in ("plain", "mixed", "guided"):
        assert report[f"{phase}_tokens_per_s"] > 0
    assert report["mixed_over_plain_step_time"] > 0 and report["guided_over_plain_throughput"] > 0
    assert "3 guided requests" in capsys.readouterr().out

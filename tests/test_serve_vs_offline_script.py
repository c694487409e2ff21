"""scripts/serve_vs_offline.py runs both phases against a real in-process server and reports them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import free_port

pytestmark = pytest.mark.slow  # a server and a client process


ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def test_serve_vs_offline_alternates_phases_and_reports_ratios(llama_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "svo.json"
    argv = [sys.executable, "scripts/serve_vs_offline.py", "--rounds", "2", "--concurrency", "2"]
    argv += ["--num-prompts", "3", "--input-len", "8", "--output-len", "3", "--port", str(free_port())]
    argv += [
        "--json-out",
        str(out),
        "--",
        "--model",
        str(llama_checkpoint),
        "--log-level",
        "warning",
        "--num-threads",
        "1",
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert [p["phase"] for p in result["phases"]] == ["offline", "serve", "serve", "offline"]
    for phase in result["phases"]:
        assert round(phase["output_tokens"]) == 3 * 3 and phase["tok_s"] > 0
    assert len(result["ratios"]) == 2 and all(r > 0 for r in result["ratios"])
    assert "serve / offline:" in proc.stdout


def test_serve_vs_offline_refuses_a_batch_limit_other_than_the_concurrency(llama_checkpoint: Path) -> None:
    argv = [sys.executable, "scripts/serve_vs_offline.py", "--concurrency", "4", "--"]
    argv += ["--model", str(llama_checkpoint), "--max-num-seqs", "8"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 2
    assert "--max-num-seqs must equal --concurrency (4)" in proc.stderr


def test_serve_vs_offline_stops_its_server_when_the_client_fails(llama_checkpoint: Path) -> None:
    argv = [sys.executable, "scripts/serve_vs_offline.py", "--rounds", "1", "--concurrency", "2", "--num-prompts", "2"]
    argv += ["--input-len", "8", "--output-len", "2", "--port", str(free_port()), "--client-loop", "no-such-loop"]
    argv += ["--", "--model", str(llama_checkpoint), "--log-level", "warning", "--num-threads", "1"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, env=ENV)
    assert proc.returncode != 0
    assert "kvpager bench serve exited with 2" in proc.stderr

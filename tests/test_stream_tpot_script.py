"""scripts/stream_tpot.py alternates real servers per round and reports each request's TTFT and TPOT."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import REPO_ROOT, launch_server

pytestmark = pytest.mark.slow  # two server processes


def test_stream_tpot_alternates_servers_abba_with_the_same_fresh_prompts(
    llama_checkpoint: Path, tmp_path: Path
) -> None:
    servers = [launch_server(llama_checkpoint, tmp_path) for _ in range(2)]
    try:
        for server in servers:
            server.wait_healthy()
        argv = [sys.executable, "scripts/stream_tpot.py", "--rounds", "2", "--requests", "1", "--prompt-len", "12"]
        argv += ["--max-tokens", "5", "--vocab", "200"]
        for server in servers:
            argv += ["--url", server.url]
        proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        records = [json.loads(line) for line in proc.stdout.splitlines()]
    finally:
        for server in servers:
            server.stop()
    a, b = servers[0].url, servers[1].url
    assert [(r["round"], r["url"]) for r in records] == [(0, a), (0, b), (1, b), (1, a)]
    for r in records:
        assert r["tokens"] == 5, r  # ignore_eos: every requested token generated
        assert 1 <= r["chunks"] <= 5 and r["ttft_s"] > 0 and r["tpot_p50_s"] >= 0

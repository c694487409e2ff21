"""A short soak (scripts/soak.py) in the suite: streaming clients with disconnects and bad requests
against a real server with a small KV pool; it must end with 0 owned blocks, 0 running, greedy
outputs equal to a cold engine's, no 5xx, and its counts are printed (issue 16)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_short_soak_ends_clean_with_exact_greedy_outputs(llama_checkpoint: Path, capsys: pytest.CaptureFixture) -> None:
    spec = importlib.util.spec_from_file_location("soak", REPO_ROOT / "scripts" / "soak.py")
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = soak  # NOTE: dataclasses look their module up there
    spec.loader.exec_module(soak)
    argv = ["--model", str(llama_checkpoint), "--clients", "8", "--duration", "6", "--kv-blocks", "12"]
    rc = soak.main([*argv, "--max-tokens", "6", "--bad-rate", "0.2", "--json"])
    out = capsys.readouterr().out
    with capsys.disabled():
        print(f"\n{out.strip()}")
    report = json.loads(out.strip().splitlines()[-1])
    assert rc == 0, report["failures"]
    assert report["greedy_checked"] > 0 and report["streams_dropped"] > 0 and report["bad_refused_4xx"] > 0
    assert report["owned_blocks_end"] == 0 and report["server_errors_5xx"] == 0

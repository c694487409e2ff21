"""A GGUF file through the serving and benchmark paths (what a side-by-side run against llama-server
uses): `kvpager serve --model FILE.gguf` names in its start-up log, per ggml type, the form each tensor
executes in, `kvpager bench serve` drives it, and `kvpager bench throughput --model FILE.gguf` runs it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from server_harness import launch_server

from kvpager.bench import serve as bench_serve
from kvpager.cli.bench import main as bench_main
from kvpager.gguf import open_gguf
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.planner.gguf_bytes import gguf_resident_weights

Q5_K_M = Path(__file__).parent / "data" / "gguf" / "tiny-llama-Q5_K_M.gguf"  # 13 Q5_K, 3 Q6_K, 5 F32


@pytest.mark.slow
def test_serve_logs_each_types_executed_form_and_bench_serve_drives_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = launch_server(Q5_K_M, tmp_path, "--log-level", "info", "--kv-cache-memory", "4MiB").wait_healthy()
    try:
        argv = ["--url", server.url, "--concurrency", "2", "--num-prompts", "4", "--input-len", "16"]
        assert bench_serve.main([*argv, "--output-len", "6", "--vocab-size", "384", "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        log = server.log()
    finally:
        server.stop()
    assert result["num_failed"] == 0 and result["num_prompts"] == 4
    assert result["output_throughput"] == pytest.approx(4 * 6 / result["duration_s"])
    assert "GGUF weights Q5_K: 1 tensor(s) dequantized to bfloat16 at load (embedding)" in log
    assert "GGUF weights F32: 5 tensor(s) as float32" in log
    if quant_kernels_or_none() is not None:
        assert "GGUF weights Q5_K: 12 tensor(s) executed as int4 g32 + a fifth-bit plane" in log
        assert "GGUF weights Q6_K: 3 tensor(s) executed as int4 g16 + a plane of the high two bits" in log


def test_throughput_bench_runs_a_gguf_file(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["throughput", "--model", str(Q5_K_M), "--num-requests", "2", "--input-len", "16", "--output-len", "3"]
    assert bench_main([*argv, "--sequential-requests", "1", "--num-threads", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    w = result["workload"]
    assert w["gguf_tensor_types"] == "F32 x5, Q5_K x13, Q6_K x3"
    assert result["batched"]["output_tokens"] == 2 * 3 and result["num_preemptions"] == 0
    if quant_kernels_or_none() is not None:  # the planner's count of what the engine holds (int8 activations)
        resident = gguf_resident_weights(open_gguf(Q5_K_M), w["dtype"], int8_activations=True)
        assert w["weight_bytes"] == resident.num_bytes


def test_side_by_side_hands_the_load_generator_a_gguf_files_vocabulary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    from tokenizers import Tokenizer as HFTokenizer

    from kvpager.text.gguf_tokenizer import tokenizer_from_gguf

    spec = importlib.util.spec_from_file_location(
        "side_by_side", Path(__file__).parents[1] / "scripts" / "side_by_side.py"
    )
    assert spec is not None and spec.loader is not None
    side_by_side = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "side_by_side", side_by_side)  # its dataclasses look the module up
    spec.loader.exec_module(side_by_side)
    written = Path(side_by_side.loadgen_tokenizer(str(Q5_K_M), tmp_path))
    text = "Hello world! 你好，世界 def main(): return 42"
    ours = tokenizer_from_gguf(open_gguf(Q5_K_M))
    assert HFTokenizer.from_file(str(written)).encode(text, add_special_tokens=False).ids == ours.encode(
        text, add_special_tokens=False
    )
    assert side_by_side.loadgen_tokenizer(str(tmp_path), tmp_path) == str(tmp_path)  # a directory: as given

"""`kvpager plan` as a user meets it: JSON keys, tables, safetensors checkpoints, and bad input."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvpager.cli.plan import main
from kvpager.planner.devices import measure_cpu

REQUIRED_JSON_KEYS = {
    "num_parameters", "weight_bytes", "kv_bytes_per_token", "kv_bytes_per_token_per_layer", "kv_bytes_at_context",
    "usable_kv_bytes", "max_context_tokens", "max_concurrency", "max_concurrency_contiguous",
    "decode_tokens_per_s_bound", "attention_pairs_cached", "attention_pairs_uncached",
    "engine_num_blocks", "engine_max_concurrency",
}  # fmt: skip


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_every_documented_key(capsys) -> None:
    code, out, _ = run(capsys, "Llama-3.1-8B", "--device", "RTX-4090", "--prompt", "6", "--generate", "2", "--json")
    doc = json.loads(out)
    assert code == 0 and REQUIRED_JSON_KEYS <= doc.keys()
    assert (doc["attention_pairs_cached"], doc["attention_pairs_uncached"]) == (36, 85)
    assert doc["kv_bytes_at_context"] == 1024**3 and len(doc["kv_bytes_per_token_per_layer"]) == 32


def test_text_report_states_effective_bits_per_weight(capsys) -> None:
    code, out, _ = run(capsys, "Qwen2.5-7B", "--memory", "6GiB", "--bandwidth", "192GB/s", "--weights", "q4_k_m")
    assert code == 0
    assert "4.84 bits/weight" in out and "longest single sequence" in out and "tok/s" in out


def test_engine_configuration_prints_engine_block_count(capsys) -> None:
    code, out, _ = run(
        capsys,
        "SmolLM2-135M",
        "--kv-cache-memory",
        "64MiB",
        "--kv-dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--json",
    )
    doc = json.loads(out)
    assert code == 0 and doc["engine_num_blocks"] == 64 * 1024**2 // (2 * 30 * 3 * 64 * 4 * 16)
    assert doc["engine_max_concurrency"] == doc["engine_num_blocks"] // (1024 // 16)


def _write_checkpoint(model_dir: Path) -> int:
    """A tiny two-shard checkpoint with an index; returns its weight bytes."""
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
        "max_position_embeddings": 512,
    }
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    first = {"model.embed_tokens.weight": np.zeros((1000, 64), dtype=np.float16)}
    second = {"model.norm.weight": np.zeros((64,), dtype=np.float32), "x.weight": np.zeros((3, 5), dtype=np.int8)}
    save_file(first, str(model_dir / "model-00001-of-00002.safetensors"))
    save_file(second, str(model_dir / "model-00002-of-00002.safetensors"))
    weight_map = {name: "model-00001-of-00002.safetensors" for name in first} | {
        name: "model-00002-of-00002.safetensors" for name in second
    }
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return 1000 * 64 * 2 + 64 * 4 + 15


def test_model_directory_weights_are_exact_safetensors_bytes(capsys, tmp_path) -> None:
    expected = _write_checkpoint(tmp_path / "tiny")
    code, out, _ = run(capsys, str(tmp_path / "tiny"), "--memory", "4GiB", "--bandwidth", "10GB/s", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["weight_bytes"] == expected and doc["weight_format"] == "checkpoint"
    assert doc["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2


def test_table_lists_models_by_formats_in_markdown_and_csv(capsys) -> None:
    code, out, _ = run(
        capsys, "--table", "--device", "L4", "--models", "SmolLM2-135M,Llama-3.1-70B", "--weights", "bf16,q4_k_m"
    )
    assert code == 0 and out.count("\n| SmolLM2-135M |") == 2
    assert "| Llama-3.1-70B | bf16 | 131.42 GiB | no |" in out
    code, out, _ = run(capsys, "--csv", "--device", "L4", "--models", "SmolLM2-135M", "--weights", "bf16")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert (
        code == 0
        and rows[0]["model"] == "SmolLM2-135M"
        and rows[0]["fits"] == "True"
        and int(rows[0]["max_concurrency"]) > 0
    )


def test_plot_writes_a_png(capsys, tmp_path) -> None:
    png = tmp_path / "cap.png"
    code, _, _ = run(capsys, "--plot", str(png), "--device", "RTX-3090", "--models", "SmolLM2-360M,Qwen3-0.6B")
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run(capsys, "--plot", str(tmp_path / "x.png"), "--device", "RTX-3090", "--models", "SmolLM2-135M")
    assert code == 2 and "pip install" in err and "Traceback" not in err


def test_unknown_model_suggests_close_names(capsys) -> None:
    code, out, err = run(capsys, "Lama-3.1-8B", "--device", "RTX-4090")
    assert code == 2 and out == "" and "Did you mean: Llama-3.1-8B" in err


def test_unknown_device_suggests_close_names(capsys) -> None:
    code, _, err = run(capsys, "Llama-3.1-8B", "--device", "RTX-4900")
    assert code == 2 and "RTX-4090" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"model_type": "llama", "hidden_size": 64}', "missing integer field"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_malformed_config_is_a_clear_error(capsys, tmp_path, content: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    code, _, err = run(capsys, str(path), "--device", "RTX-4090")
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["Llama-3.1-8B", "--memory", "-6GiB", "--bandwidth", "100GB/s"],
        ["Llama-3.1-8B", "--memory", "6 parsecs", "--bandwidth", "100GB/s"],
        ["Llama-3.1-8B", "--memory", "6GiB"],
        ["Llama-3.1-8B", "--prompt", "10"],
        ["Llama-3.1-8B", "--context", "0"],
        ["Llama-3.1-8B", "--weights", "q3_xyz"],
        ["Llama-3.1-8B", "--kv-dtype", "int3"],
        ["Llama-3.1-8B", "--no-such-flag"],
    ],
)
def test_bad_flags_exit_non_zero_with_a_message(capsys, argv: list[str]) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.startswith("kvpager plan: error: ") and "Traceback" not in err


def test_model_that_does_not_fit_names_formats_that_would(capsys) -> None:
    code, _, err = run(capsys, "Llama-3.1-8B", "--device", "RTX-3060-12GB")
    assert code == 1 and "does not fit on RTX-3060-12GB" in err and "q4_k_m" in err and "bf16 (" not in err


def test_model_that_fits_no_format_says_so(capsys) -> None:
    code, _, err = run(capsys, "Llama-3.1-70B", "--memory", "8GiB", "--bandwidth", "100GB/s")
    assert code == 1 and "No weight format fits" in err


def test_cpu_device_reads_memavailable(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  16000000 kB\nMemAvailable:  8000000 kB\n")
    device = measure_cpu(meminfo, seconds=0.05)
    assert device.memory_bytes == 8_000_000 * 1024 and device.bandwidth_bytes_per_s > 1e8


def test_kv_memory_docs_match_fresh_plan_output() -> None:
    """docs/kv-memory*.md are generated; a planner change must come with `python scripts/gen_kv_memory_doc.py`."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        [sys.executable, "scripts/gen_kv_memory_doc.py", "--check"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("reserve", "expected"), [("2GiB", 2 * 1024**3), ("25%", 6 * 1024**3)])
def test_reserve_overrides_the_default_in_bytes_or_percent(capsys, reserve: str, expected: int) -> None:
    code, out, _ = run(
        capsys, "SmolLM2-135M", "--memory", "24GiB", "--bandwidth", "100GB/s", "--reserve", reserve, "--json"
    )
    doc = json.loads(out)
    assert code == 0 and doc["reserve_bytes"] == expected
    assert doc["usable_kv_bytes"] == 24 * 1024**3 - expected - doc["weight_bytes"]

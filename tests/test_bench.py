"""`kvpager bench …` commands run on a tiny model and emit well-formed results; the paging study's
three allocation modes account for every token they store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpager.bench.allocators import FirstFitAllocator, PagedAllocator, SlotAllocator
from kvpager.bench.dummy_models import make_dummy_model_dir
from kvpager.bench.memory import make_allocators, make_trace, simulate
from kvpager.bench.report import machine_info, machine_line, read_cpu_id
from kvpager.cli.bench import main as bench_main

torch.set_num_threads(1)

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 384,
    "max_position_embeddings": 512,
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_dummy_model_dir(tmp_path_factory.mktemp("bench-tiny"), **TINY)


def run_bench(capsys: pytest.CaptureFixture[str], tiny_model: Path, *argv: str) -> dict[str, Any]:
    model = ["--model", str(tiny_model), "--load-format", "dummy", "--num-threads", "1", "--json"]
    assert bench_main([*argv, *model]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["machine"]["cores"] >= 1 and result["machine"]["threads"] == 1
    assert result["command"].startswith(f"kvpager bench {argv[0]} ")
    assert result["peak_rss_bytes"] > 0
    return result


def test_throughput_bench_reports_both_modes_and_full_utilisation(capsys, tiny_model):
    r = run_bench(
        capsys, tiny_model, "throughput", "--num-requests", "6", "--input-len", "32", "--output-len", "5",
        "--sequential-requests", "2",
    )  # fmt: skip
    assert r["sequential"]["output_tokens"] == 2 * 5 and r["batched"]["output_tokens"] == 6 * 5
    assert r["sequential"]["output_tokens_per_s"] > 0 and r["speedup"] > 0
    assert r["batched"]["max_running"] == 6
    # 32 + up to 4 stored tokens in blocks of 16: at least 32/48 of the owned slots hold tokens
    assert 32 / 48 <= r["kv_utilisation"]["mean"] <= 1.0
    assert r["owned_blocks_after"] == 0 and r["num_preemptions"] == 0
    assert set(r["targets"]) == {"speedup_ge_4x_issue2", "speedup_ge_8x_issue6", "kv_utilisation_ge_95pct"}
    assert (r["workload"]["kv_cache_dtype"], r["workload"]["fp32_matmul_precision"]) == ("float32", "highest")


def test_throughput_bench_runs_the_kv_cache_dtype_it_is_given(capsys, tiny_model):
    r = run_bench(
        capsys, tiny_model, "throughput", "--num-requests", "3", "--input-len", "16", "--output-len", "3",
        "--sequential-requests", "1", "--kv-cache-dtype", "bfloat16",
    )  # fmt: skip
    assert r["workload"]["kv_cache_dtype"] == "bfloat16"  # read from the engine's cache tensor
    assert r["batched"]["output_tokens"] == 3 * 3 and r["num_preemptions"] == 0


def test_throughput_bench_reads_kv_cache_memory_as_serve_does(capsys):
    from kvpager.bench import throughput

    parser = throughput.build_parser()
    assert parser.parse_args(["--kv-cache-memory", "2GiB"]).kv_cache_memory == 2 << 30
    assert parser.parse_args(["--kv-cache-memory", "1048576"]).kv_cache_memory == 1 << 20
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-memory", "lots"])
    assert "cannot read 'lots' as a size in bytes" in capsys.readouterr().err


def test_prefix_bench_hits_the_shared_prefix(capsys, tiny_model):
    r = run_bench(capsys, tiny_model, "prefix", "--prefix-len", "64", "--suffix-len", "4", "--repetitions", "3")
    assert len(r["cold"]["all_s"]) == len(r["hit"]["all_s"]) == 3
    assert r["cached_tokens_per_hit"] == 64  # four full blocks of the shared prefix
    assert r["hit"]["median_s"] <= r["hit"]["p90_s"] <= r["hit"]["max_s"]
    assert r["speedup_median"] == pytest.approx(r["cold"]["median_s"] / r["hit"]["median_s"])


def test_roofline_bench_reports_bounds_per_batch(capsys, tiny_model):
    r = run_bench(
        capsys, tiny_model, "roofline", "--batch-sizes", "1,3", "--context-len", "20", "--decode-steps", "2",
        "--bandwidth-mib", "8", "--gemm-sizes", "64", "--reps", "1",
    )  # fmt: skip
    assert r["measured"]["read_gbs"] > 0 and r["measured"]["gemm_gflops"] > 0
    one, three = r["decode"]
    assert (one["batch"], three["batch"]) == (1, 3)
    assert three["kv_read_bytes"] == pytest.approx(3 * one["kv_read_bytes"])
    assert three["weight_bytes"] == one["weight_bytes"]
    assert three["flops"] > 2.9 * one["flops"]
    for row in (one, three):
        assert 0 < row["achieved_tok_s"] and 0 < row["fraction_of_roofline"]
        assert row["roofline_tok_s"] == pytest.approx(min(row["memory_bound_tok_s"], row["compute_bound_tok_s"]))
        assert len(row["step_seconds"]) == 2
        assert row["paired_read_gbs_median"] > 0 and row["paired_gemm_gflops_median"] > 0
        assert row["paired_fraction_of_memory_roofline"] > 0 and row["paired_fraction_of_compute_roofline"] > 0
    assert r["targets"]["batch1_paired_memory_fraction"] == one["paired_fraction_of_memory_roofline"]


def test_roofline_bench_without_paired_probes_reports_only_the_up_front_bounds(capsys, tiny_model):
    r = run_bench(
        capsys, tiny_model, "roofline", "--batch-sizes", "2", "--context-len", "8", "--decode-steps", "1",
        "--bandwidth-mib", "8", "--gemm-sizes", "64", "--reps", "1", "--no-paired-probes",
        "--fp32-matmul-precision", "medium",
    )  # fmt: skip
    assert r["measured"]["fp32_matmul_precision"] == "medium"
    (row,) = r["decode"]
    assert "paired_fraction_of_memory_roofline" not in row and row["fraction_of_memory_roofline"] > 0
    assert r["targets"]["batch1_paired_memory_fraction"] is None


def test_memory_bench_runs_every_mode_and_the_real_engine(capsys, tiny_model, tmp_path):
    r = run_bench(
        capsys, tiny_model, "memory", "--num-requests", "40", "--max-model-len", "256", "--budget-tokens", "1024",
        "--prompt-median", "40", "--output-median", "20", "--real-requests", "4", "--real-input-len", "8",
        "--real-output-len", "3", "--json-out", str(tmp_path / "memory.json"),
    )  # fmt: skip
    assert [m["mode"] for m in r["modes"]][:3] == [
        "contiguous max-len slots",
        "contiguous exact-size first-fit",
        "paged, block 16",
    ]
    assert all(m["num_completed"] + m["num_refused"] == 40 for m in r["modes"])
    slots, paged = r["modes"][0], r["modes"][2]
    assert slots["concurrency_max"] <= 1024 // 256
    assert paged["utilisation_mean"] > slots["utilisation_mean"]
    assert [row["output_tokens"] for row in r["real"]] == [4 * 3] * 3
    assert json.loads((tmp_path / "memory.json").read_text())["modes"] == r["modes"]


@pytest.mark.parametrize("block_sizes", [(16,), (1, 8, 32)])
def test_paging_study_modes_account_for_every_token(block_sizes):
    trace = make_trace(120, seed=3, arrival_rate=0.5, max_model_len=300, prompt_median=60, output_median=30)
    for allocator in make_allocators(2400, 300, block_sizes):
        result = simulate(trace, allocator, check=True)  # checks stored == live lengths, no overlap, every step
        assert result.num_completed == len(trace)
        assert allocator.stored_tokens() == 0 and allocator.reserved_tokens() == 0
        assert all(0.0 <= u <= 1.0 for u in result.utilisation)


def test_first_fit_fragments_and_coalesces():
    arena = FirstFitAllocator(100)
    assert arena.reserve(1, 10, 30) and arena.reserve(2, 10, 30) and arena.reserve(3, 10, 30)
    arena.release(2)
    assert not arena.reserve(4, 10, 40)  # 40 tokens free (30 + 10) but no hole of 40
    assert arena.num_fragmentation_refusals == 1
    arena.release(3)  # merges 30 + 30 + 10 into one hole of 70
    assert arena.reserve(4, 10, 70)
    arena.check()


def test_allocator_check_catches_overlap_and_miscount():
    slots = SlotAllocator(1000, 100)
    assert slots.reserve(1, 5, 50)
    slots._live[2] = slots._live[1].__class__(slots._live[1].start + 10, 100, 0)  # forged overlap
    with pytest.raises(ValueError, match="overlaps"):
        slots.check()
    paged = PagedAllocator(64, 16)
    assert paged.reserve(1, 20, 40) and paged.grow(1, 33)
    assert paged.reserved_tokens() == 48 and paged.stored_tokens() == 33
    paged.check()
    assert not paged.reserve(2, 20, 40)  # one block left, two needed


def test_bench_cli_rejects_unknown_bench(capsys):
    assert bench_main(["nope"]) == 2
    assert "unknown bench" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--dtype", "bfloat16"], ("bfloat16", None, "bfloat16")),
        (["--quantization", "int4", "--quantization-group-size", "32"], ("float32", "int4", "float32")),
        (["--quantization", "int8", "--dtype", "bfloat16"], ("bfloat16", "int8", "bfloat16")),
    ],
)
def test_throughput_bench_runs_the_weight_format_it_is_given(capsys, tiny_model, flags, expected):
    r = run_bench(
        capsys, tiny_model, "throughput", "--num-requests", "2", "--input-len", "16", "--output-len", "3",
        "--sequential-requests", "1", *flags,
    )  # fmt: skip
    w = r["workload"]
    assert (w["dtype"], w["quantization"], w["kv_cache_dtype"]) == expected
    assert r["batched"]["output_tokens"] == 2 * 3 and w["weight_bytes"] > 0


def test_dummy_shapes_include_the_real_model_shapes(tmp_path: Path) -> None:
    from kvpager.bench.dummy_models import SHAPES
    from kvpager.model.spec import load_model_spec
    from kvpager.planner.models import load_model_facts
    from kvpager.planner.params import count_parameters

    for shape, name in [
        ("llama-3.2-1b", "Llama-3.2-1B"),
        ("qwen2.5-7b", "Qwen2.5-7B"),
        ("llama-3.1-8b", "Llama-3.1-8B"),
    ]:
        spec = load_model_spec(make_dummy_model_dir(tmp_path / shape, shape))
        assert spec.torch_dtype == "bfloat16"
        assert spec.num_parameters() == count_parameters(load_model_facts(name)).total, shape
    assert {"llama-3.2-3b", "qwen2.5-0.5b", "qwen2.5-1.5b"} <= set(SHAPES)


@pytest.mark.slow
def test_throughput_bench_runs_tensor_parallel(capsys, tiny_model):
    r = run_bench(
        capsys, tiny_model, "throughput", "--num-requests", "2", "--input-len", "16", "--output-len", "3",
        "--sequential-requests", "1", "--tensor-parallel-size", "2",
    )  # fmt: skip
    w = r["workload"]
    assert (w["tensor_parallel_size"], w["kernel_ops"]) == (2, "torch")  # TP runs torch's ops
    assert r["batched"]["output_tokens"] == 2 * 3 and r["sequential"]["output_tokens"] == 3


def test_a_result_names_the_cpus_family_model_and_kernel_flags(tmp_path: Path) -> None:
    # "AMD EPYC" alone spans Zen 1 to Zen 5: a record says which CPU and which kernel paths it had
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC\n"
        "flags\t\t: fpu sse2 avx fma f16c avx2 sha_ni\n\nprocessor\t: 1\ncpu family\t: 99\nflags\t\t: avx512f\n"
    )
    ident = read_cpu_id(cpuinfo)
    assert ident == {"cpu_family_model": "23/49", "cpu_flags": ["avx2", "fma", "f16c"]}
    assert read_cpu_id(tmp_path / "missing") == {}
    info = {"cpu": "AMD EPYC", **ident, "cores": 2, "torch": "2.13.0", "threads": 2, "python": "3.11"}
    assert machine_line(info).startswith("AMD EPYC (family/model 23/49; avx2 fma f16c), 2 cores")
    assert set(machine_info()) >= {"cpu", "cores", "torch", "threads"}


def test_roofline_counts_the_bytes_the_engine_holds_in_its_dtype_and_format(capsys, tiny_model):
    def row(*fmt: str) -> dict[str, Any]:
        r = run_bench(
            capsys, tiny_model, "roofline", "--batch-sizes", "1", "--context-len", "8", "--decode-steps", "1",
            "--bandwidth-mib", "8", "--gemm-sizes", "64", "--reps", "1", "--no-paired-probes", *fmt,
        )  # fmt: skip
        return r["decode"][0]

    f32, bf16, int8 = row("--dtype", "float32"), row("--dtype", "bfloat16"), row("--quantization", "int8")
    h, layers, vocab, inter = (TINY[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"))
    kv = h // TINY["num_attention_heads"] * TINY["num_key_value_heads"]
    linears = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter) + vocab * h  # the tied lm_head: the table, once
    norms = (2 * layers + 1) * h
    assert f32["weight_bytes"] == 4 * (linears + norms)
    assert bf16["weight_bytes"] == 2 * linears + 4 * norms  # bfloat16 weights; norms stay float32 (precision rule)
    assert bf16["kv_read_bytes"] == f32["kv_read_bytes"] / 2  # the KV cache in the model's dtype
    assert int8["weight_bytes"] < 0.7 * bf16["weight_bytes"]  # int8 codes (+ scales) in place of 16-bit weights
    assert f32["memory_bound_tok_s"] < bf16["memory_bound_tok_s"]

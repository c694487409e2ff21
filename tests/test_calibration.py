"""`kvpager plan` predicts exactly the pool the engine allocates, and the weight bytes it holds, for the
same configuration: safetensors checkpoints in every kvpager format, GGUF files of every tensor type."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import make_llama_checkpoint, make_qwen2_checkpoint
from gguf_files import write_gguf

from kvpager.cli.plan import main as plan_main
from kvpager.core.config import EngineConfig
from kvpager.engine.engine import Engine
from kvpager.gguf import open_gguf
from kvpager.gguf.executed import DOT_FORMS, PACKED_FORMS, checkpoint_name, is_linear_weight
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.backends.quant_weights import Int8Weight, PackedWeight


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


@pytest.mark.parametrize("quantize_lm_head", [True, False], ids=["lm_head-int8", "no-quantize-lm-head"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("quantization", ["int4", "w8a8_int8"])
def test_plan_counts_the_quantized_lm_head_as_the_engine_holds_it(
    llama_checkpoint: Path,
    qwen2_checkpoint: Path,
    capsys: pytest.CaptureFixture[str],
    quantization: str,
    tied: bool,
    quantize_lm_head: bool,
) -> None:
    checkpoint = qwen2_checkpoint if tied else llama_checkpoint
    budget = 1 << 20
    config = EngineConfig(
        model=str(checkpoint), kv_cache_memory=budget, quantization=quantization, quantize_lm_head=quantize_lm_head
    )
    engine = Engine(config)
    kv = KV_FLAGS[engine.config.resolved_kv_cache_dtype]
    flags = ["--quantization", quantization, "--dtype", "auto", "--kv-dtype", kv, "--kv-cache-memory", str(budget)]
    flags += [] if quantize_lm_head else ["--no-quantize-lm-head"]
    plan = plan_json(capsys, str(checkpoint), *flags)
    assert plan["weight_bytes"] == engine.loaded.weight_bytes
    assert plan["engine_num_blocks"] == engine.pool.num_blocks
    spec = engine.model_spec
    head_int8 = spec.vocab_size * (spec.hidden_size + 4)  # int8 rows + one float32 scale per row
    if quantize_lm_head:
        assert isinstance(engine.loaded.model.lm_head.weight, Int8Weight)
        # the other setting's plan differs by exactly the lm_head's change of format
        other = plan_json(capsys, str(checkpoint), *flags, "--no-quantize-lm-head")
        element = {"float32": 4, "bfloat16": 2}[engine.config.dtype]
        dense_head = 0 if tied else spec.vocab_size * spec.hidden_size * element
        assert plan["weight_bytes"] - other["weight_bytes"] == head_int8 - dense_head
        # tied: more bytes than the unquantized tied lm_head, and the plan says so
        assert "lm_head int8 per output channel" in plan["weight_assumption"]
        assert ("copy of the tied embedding" in plan["weight_assumption"]) == tied
    else:
        assert isinstance(engine.loaded.model.lm_head.weight, torch.Tensor)
        assert "lm_head int8" not in plan["weight_assumption"]


def test_plan_refuses_weights_together_with_quantization(llama_checkpoint: Path) -> None:
    assert plan_main([str(llama_checkpoint), "--weights", "q4_0", "--quantization", "int4"]) == 2


# --- GGUF files: the plan reports the file's bytes and what the engine holds, and sizes KV from the latter ---

GGUF_DATA = Path(__file__).parent / "data" / "gguf"
# Written by tests/gguf_files.py from one checkpoint (rows a multiple of 256 for the K-quants); Q4_K_M
# mixes Q4_K and Q6_K within the fused q/k/v and gate/up projections.
WRITTEN_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K", "Q6_K")
# llama.cpp's own files (tests/data/gguf): Q5_K_M mixes Q5_K and Q6_K, Q4_0 has a Q6_K output.
LLAMA_CPP_FILES = ("tiny-llama-Q4_0.gguf", "tiny-llama-Q4_K_M.gguf", "tiny-llama-Q5_K_M.gguf", "tiny-llama-Q6_K.gguf")
KV_FLAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("gguf_calibration")

    def get(kind: str) -> Path:
        if kind.endswith(".gguf"):
            return GGUF_DATA / kind
        if kind not in made:
            if kind.startswith("tied-"):
                checkpoint = root / "qwen2"
                if not checkpoint.exists():
                    make_qwen2_checkpoint(checkpoint, seed=1)
            else:
                checkpoint = root / "llama"
                if not checkpoint.exists():
                    make_llama_checkpoint(checkpoint, hidden_size=256, intermediate_size=512)
            made[kind] = write_gguf(checkpoint, root / f"{kind}.gguf", tensor_type=kind.removeprefix("tied-"))
        return made[kind]

    return get


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert plan_main([*argv, "--json"]) in (0, 1)
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


@pytest.mark.parametrize(
    ("kind", "dtype", "quantization"),
    [(t, "auto", None) for t in (*WRITTEN_TYPES, *LLAMA_CPP_FILES)]
    + [
        ("tiny-llama-Q5_K_M.gguf", "float32", None),
        ("tiny-llama-Q5_K_M.gguf", "float16", None),
        ("Q4_K_M", "float16", None),
        ("F16", "float16", None),
        ("tied-Q4_0", "auto", None),
        ("tied-Q8_0", "float16", None),
        ("tiny-llama-Q4_K_M.gguf", "auto", "int8"),
        ("Q5_K", "float32", "int4"),
        ("tiny-llama-Q5_K_M.gguf", "auto", "w8a8_int8"),
    ],
)
def test_plan_weight_bytes_and_blocks_equal_the_engines_for_gguf_files(
    gguf_file: Callable[[str], Path],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    kind: str,
    dtype: str,
    quantization: str | None,
) -> None:
    path, budget = gguf_file(kind), 1 << 20
    fields: dict[str, Any] = {"dtype": dtype, "quantization": quantization}
    with caplog.at_level("INFO", logger="kvpager"):
        engine = Engine(EngineConfig(model=str(path), kv_cache_memory=budget, **fields))
    flags = ["--dtype", dtype, "--kv-dtype", KV_FLAGS[engine.config.resolved_kv_cache_dtype]]
    flags += ["--quantization", quantization] if quantization else []
    plan = plan_json(capsys, str(path), "--kv-cache-memory", str(budget), *flags)
    assert plan["weight_bytes"] == engine.loaded.weight_bytes
    assert plan["weight_file_bytes"] == open_gguf(path).tensor_bytes()
    assert plan["engine_num_blocks"] == engine.pool.num_blocks
    # with a device, the KV budget is what is left after the bytes the engine holds (not the file's)
    memory, reserve = 64 << 20, 1 << 20
    on_device = plan_json(
        capsys, str(path), "--memory", str(memory), "--bandwidth", "10GB/s", "--reserve", str(reserve), *flags
    )
    assert on_device["usable_kv_bytes"] == memory - reserve - engine.loaded.weight_bytes
    # each packed type: the plan names the form the start-up log says the engine executes it in
    executed = [m for m in caplog.messages if m.startswith("GGUF weights ") and " tensor(s) executed as " in m]
    for line in executed:
        ggml_type, rest = line.removeprefix("GGUF weights ").split(": ", 1)
        count, form = rest.removesuffix(" (exact, no requantization)").split(" tensor(s) executed as ")
        form = form.split(" x int8 activations")[0]  # (the default on the CPU: the file's blocks x int8)
        assert f"{ggml_type} x{count} executed as {form}" in plan["weight_assumption"], line
    quantized = any(t.startswith("Q") for t in open_gguf(path).type_counts())
    assert bool(executed) == (quantized and quantization is None and quant_kernels_or_none() is not None)


@pytest.mark.parametrize(
    "kind", ["tied-Q4_0", "tied-Q8_0", "tiny-llama-Q4_0.gguf", "tiny-llama-Q4_K_M.gguf", "tiny-llama-Q5_K_M.gguf"]
)
def test_with_int8_activations_a_tied_lm_head_copies_the_embedding_blocks_and_the_plan_counts_them(
    gguf_file: Callable[[str], Path],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    kind: str,
) -> None:
    if quant_kernels_or_none() is None:  # pragma: no cover - every CI machine has g++
        pytest.skip("no C++ compiler for the packed-weight kernels: GGUF blocks are dequantized")
    path, budget = gguf_file(kind), 1 << 20
    gguf = open_gguf(path)
    tied = "output.weight" not in gguf.tensors
    with caplog.at_level("INFO", logger="kvpager"):
        engine = Engine(EngineConfig(model=str(path), kv_cache_memory=budget, gguf_int8_activations=True))
    exact = Engine(EngineConfig(model=str(path), kv_cache_memory=budget, gguf_int8_activations=False))
    flags = ["--kv-dtype", KV_FLAGS[engine.config.resolved_kv_cache_dtype]]
    plan = plan_json(capsys, str(path), "--kv-cache-memory", str(budget), "--gguf-int8-activations", *flags)
    assert plan["weight_bytes"] == engine.loaded.weight_bytes
    assert plan["engine_num_blocks"] == engine.pool.num_blocks
    exact_plan = plan_json(capsys, str(path), "--kv-cache-memory", str(budget), "--no-gguf-int8-activations", *flags)
    assert exact_plan["weight_bytes"] == exact.loaded.weight_bytes
    copied = [m for m in caplog.messages if "copied for the tied lm_head" in m]
    head = engine.loaded.model.lm_head.weight
    # Q4_K's and Q6_K's linear weights hold the file's super-block records on the integer dot
    # (DOT_FORMS), fewer bytes than the exact form's float32 scales (and offsets)
    records = sum(
        DOT_FORMS[t.type_name].num_bytes(*t.shape) - PACKED_FORMS[t.type_name].num_bytes(*t.shape)
        for name, t in gguf.tensors.items()
        if t.type_name in DOT_FORMS and is_linear_weight(checkpoint_name(name, gguf))
    )
    if tied:
        embedding = gguf.tensors["token_embd.weight"]
        form = DOT_FORMS.get(embedding.type_name, PACKED_FORMS[embedding.type_name])
        delta = engine.loaded.weight_bytes - exact.loaded.weight_bytes
        assert delta == form.num_bytes(*embedding.shape) + records
        assert len(copied) == 1 and form.name in copied[0]
        assert isinstance(head, PackedWeight)
        # the copy holds the embedding's own values: rounded to the table's dtype, the lm_head is the table
        table = engine.loaded.model.embed_tokens.weight
        assert torch.equal(head.dequantize(torch.float32).to(table.dtype), table)
    else:
        assert engine.loaded.weight_bytes - exact.loaded.weight_bytes == records
        assert not copied

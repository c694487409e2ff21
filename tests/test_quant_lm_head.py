"""The quantized lm_head (kvpager.model.lm_head): with --quantization the lm_head is int8 per output
channel in every mode, tied or untied, unless --no-quantize-lm-head.

- Its logits are the dequantize-then-matmul reference's to float32 rounding (int8 / int4: the hidden
  state times the dequantized weight; w8a8_int8 / w4a8_int8: the int8-rounded hidden state times it), at
  1, 3, 12 and 36 rows (the kernel's one-row path, its shared tile and, for the dynamic modes, both the
  integer-dot kernel and the exact path past its row limit, quant_dot.dot_kernel_max_rows).
- A quantized tied model generates the greedy tokens of a float model holding the dequantized weights
  (an untied float checkpoint: the embedding as before, the lm_head dequantized).
- --no-quantize-lm-head is the previous behaviour: the lm_head in --dtype (tied: the embedding itself).
- The KV fingerprint names the lm_head's format: a pack or disk record made under one is not reused
  under the other. A GGUF file's lm_head keeps its own form under --quantization (as before).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from checkpoints import make_qwen2_checkpoint
from dequantized import dequantized_checkpoint
from engine_helpers import run_greedy
from safetensors.torch import load_file

from kvpager.core.config import EngineConfig
from kvpager.engine.args import add_engine_args, config_from_args
from kvpager.engine.engine import Engine
from kvpager.engine.executor import AGREED_FIELDS
from kvpager.model import allocate_kv_cache, build_attention_metadata, load_model
from kvpager.model.backends.quant_dot import Int8DotWeight, fake_quantize_activations
from kvpager.model.backends.quant_weights import Int8Weight
from kvpager.model.backends.weight_layout import unblocked
from kvpager.model.llama import CausalLM

BLOCK = 16
PROMPT = [5, 77, 301, 12, 250, 9, 133, 64, 18, 200, 37, 99]
GROUPS = {"int8": None, "int4": 32, "w8a8_int8": None, "w4a8_int8": 32}
GGUF_DATA = Path(__file__).parent / "data" / "gguf"


def _checkpoint(request: pytest.FixtureRequest, tied: bool) -> Path:
    path: Path = request.getfixturevalue("qwen2_checkpoint" if tied else "llama_checkpoint")
    return path


def _load(checkpoint: Path, method: str, quantize_lm_head: bool = True) -> CausalLM:
    return load_model(
        checkpoint,
        dtype=torch.float32,
        device="cpu",
        quantization=method,
        quantization_group_size=GROUPS[method],
        quantize_lm_head=quantize_lm_head,
    )


def _final_hidden(model: CausalLM) -> torch.Tensor:
    """The final hidden states [len(PROMPT), hidden] of one prefill of PROMPT."""
    blocks = -(-len(PROMPT) // BLOCK)
    kv = allocate_kv_cache(model.spec, blocks, BLOCK, torch.float32, "cpu")
    meta = build_attention_metadata([len(PROMPT)], [len(PROMPT)], [list(range(blocks))], BLOCK, "cpu")
    with torch.inference_mode():
        return model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), kv, meta)


def _engine(checkpoint: Path, **fields: object) -> Engine:
    return Engine(EngineConfig(model=str(checkpoint), kv_cache_memory=1 << 20, block_size=4, **fields))  # type: ignore[arg-type]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("method", list(GROUPS))
def test_quantized_lm_head_logits_equal_the_dequantize_then_matmul_reference(
    request: pytest.FixtureRequest, method: str, tied: bool
) -> None:
    checkpoint = _checkpoint(request, tied)
    model = _load(checkpoint, method)
    weight = model.lm_head.weight
    dynamic = method.startswith("w")
    assert type(weight) is (Int8DotWeight if dynamic else Int8Weight)
    assert weight.group_size == model.spec.hidden_size  # per output channel, whatever the projections use
    # round-to-nearest of the tensor the lm_head multiplies: the embedding (tied, which keeps its float32
    # table for the lookup) or the checkpoint's own lm_head
    source = model.embed_tokens.weight if tied else load_file(checkpoint / "model.safetensors")["lm_head.weight"]
    assert model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(weight.plain_qweight(), Int8Weight.from_float(source.float()).qweight)
    hidden = torch.cat([_final_hidden(model)] * 3)  # NOTE: 36 rows pass every integer-dot row limit
    for rows in (1, 3, len(PROMPT), hidden.shape[0]):
        x = hidden[:rows]
        with torch.inference_mode():
            got = model.compute_logits(x).double()
        xq = (fake_quantize_activations(x.float()) if dynamic else x.float()).double()
        w = weight.dequantize(torch.float64)
        ref = xq @ w.T
        bound = 2 * weight.in_features * 2.0**-24 * (xq.abs() @ w.abs().T) + 1e-30
        excess = ((got - ref).abs() - bound).max().item()
        assert excess <= 0, f"{rows} rows: off by more than float32 rounding ({excess:.3e} over the bound)"
        assert (got - (x.double() @ source.double().T)).abs().max() > 0  # the weights really are rounded


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_tied_quantized_model_generates_the_tokens_of_a_float_model_holding_the_dequantized_weights(
    qwen2_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, method: str
) -> None:
    group = {} if GROUPS[method] is None else {"quantization_group_size": GROUPS[method]}
    with caplog.at_level("INFO", logger="kvpager"):
        quantized = _engine(qwen2_checkpoint, quantization=method, **group)
    assert "; lm_head: int8 per output channel (a copy of the tied embedding)" in caplog.text  # the start-up log
    dense = _engine(dequantized_checkpoint(quantized.loaded.model, qwen2_checkpoint, tmp_path / "dq"))
    opted_out = _engine(qwen2_checkpoint, quantization=method, quantize_lm_head=False, **group)
    for seed in range(4):
        prompt = [int(t) for t in torch.randint(3, 384, (9 + seed,), generator=torch.Generator().manual_seed(seed))]
        assert run_greedy(quantized, prompt, 12)[0] == run_greedy(dense, prompt, 12)[0]
    # the int8 copy is the table's rows in 1 byte + one float32 scale each, beside the float32 table
    spec = quantized.model_spec
    assert quantized.loaded.weight_bytes - opted_out.loaded.weight_bytes == spec.vocab_size * (spec.hidden_size + 4)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_no_quantize_lm_head_keeps_the_lm_head_in_dtype_as_before(request: pytest.FixtureRequest, tied: bool) -> None:
    checkpoint = _checkpoint(request, tied)
    model = _load(checkpoint, "w8a8_int8", quantize_lm_head=False)
    assert isinstance(model.layers[0].mlp.down_proj.weight, Int8DotWeight)  # the projections still quantized
    head = model.lm_head.weight
    assert isinstance(head, torch.Tensor) and head.dtype == torch.float32
    if tied:
        assert head is model.embed_tokens.weight  # one table, as before
    else:
        assert torch.equal(unblocked(head), load_file(checkpoint / "model.safetensors")["lm_head.weight"])
    hidden = _final_hidden(model)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits, hidden @ unblocked(head).T, rtol=1e-5, atol=1e-5)


def test_kv_fingerprint_names_the_lm_head_format_and_refuses_the_others_pack_and_records(
    llama_checkpoint: Path, tmp_path: Path
) -> None:
    kv_dir = tmp_path / "kv"
    prompt = list(range(5, 5 + 6 * 4 + 2))
    tiers = {"host_kv_cache_memory": 1 << 20, "kv_cache_dir": str(kv_dir)}
    on = _engine(llama_checkpoint, quantization="int8", **tiers)
    assert "+lm_head-int8" in on.loaded.weights_digest
    payload = on.export_kv(prompt)
    run_greedy(on, prompt, 4)
    on.shutdown()  # the disk tier now holds int8-lm_head blocks
    assert list(kv_dir.rglob("*.kvb"))
    off = _engine(llama_checkpoint, quantization="int8", quantize_lm_head=False, **tiers)
    assert "+lm_head-int8" not in off.loaded.weights_digest
    assert off.loaded.fingerprint != on.loaded.fingerprint
    with pytest.raises(ValueError, match="model_fingerprint"):
        off.import_kv(payload)
    assert run_greedy(off, prompt, 4)[1] == 0  # nothing of the other format's was reused
    off.shutdown()
    # each setting is its own format, reproducibly: the same setting reloaded names the same KV
    again = _engine(llama_checkpoint, quantization="int8", enable_prefix_caching=False)
    assert again.loaded.fingerprint == on.loaded.fingerprint


def test_gguf_file_under_quantization_keeps_its_lm_head_as_before() -> None:
    engine = _engine(GGUF_DATA / "tiny-llama-Q8_0.gguf", quantization="int8")
    assert isinstance(engine.loaded.model.layers[0].mlp.down_proj.weight, Int8Weight)
    assert not isinstance(engine.loaded.model.lm_head.weight, Int8Weight)
    assert "+lm_head-int8" not in engine.loaded.weights_digest


@pytest.mark.slow
def test_tp2_with_the_int8_lm_head_gives_the_tp1_tokens(tmp_path: Path) -> None:
    """Tensor parallelism splits the lm_head by vocabulary rows (the last rank's shard padded with zero
    rows) and quantizes each rank's rows per output channel: the rows TP=1 quantizes, so TP=2 (groups of
    32 keep the row-parallel projections exact too) must give TP=1's greedy tokens."""
    qwen = make_qwen2_checkpoint(tmp_path / "qwen2", num_key_value_heads=1, vocab_size=383)  # tied, uneven split
    fields = {"quantization": "w8a8_int8", "quantization_group_size": 32, "dtype": "float32", "num_threads": 1}
    prompts = [
        [int(t) for t in torch.randint(3, 383, (10,), generator=torch.Generator().manual_seed(s))] for s in (1, 2)
    ]
    tp2 = _engine(qwen, tensor_parallel_size=2, **fields)
    try:
        assert isinstance(tp2.loaded.model.lm_head.weight, Int8DotWeight)  # rank 0's shard
        got = [run_greedy(tp2, p, 10)[0] for p in prompts]
    finally:
        tp2.shutdown()
    tp1 = _engine(qwen, kernel_backend="torch", **fields)
    assert isinstance(tp1.loaded.model.lm_head.weight, Int8DotWeight)
    assert got == [run_greedy(tp1, p, 10)[0] for p in prompts]


def test_quantize_lm_head_flag_defaults_on_and_opts_out_into_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--quantization", "int4"])).quantize_lm_head is True
    config = config_from_args(parser.parse_args(["--quantization", "int4", "--no-quantize-lm-head"]))
    assert config.quantize_lm_head is False
    assert "quantize_lm_head" in AGREED_FIELDS  # every tensor-parallel node must agree on it

"""GGUF models: kvpager's loading equals transformers' on the same file (F32 exactly, quantized within
fp32 rounding of the same dequantized values), split files and directories load the same model, and
the engine fingerprints a GGUF model by its tensor data.

Files are written by tests/gguf_files.py (the `gguf` package's writer, llama.cpp's names and q/k
permutation) from tiny random transformers checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from checkpoints import make_llama_checkpoint, make_mistral_checkpoint, make_qwen2_checkpoint, make_qwen3_checkpoint
from engine_helpers import run_greedy
from gguf_files import write_gguf
from test_model_equivalence import LLAMA3_ROPE, PagedHarness

from kvpager.core.config import EngineConfig
from kvpager.engine.engine import Engine
from kvpager.gguf import open_gguf
from kvpager.model import load_model
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.llama import CausalLM
from kvpager.model.loader import packed_weights

PROMPT = [1, 5, 9, 33, 77, 100, 200, 17, 3, 250]
ATOL = 1e-4
QUANT_ATOL = 2e-5
# Qwen3 with head_dim 128 (not hidden/heads): transformers' GGUF loader takes Qwen3's default head_dim
# of 128 and ignores qwen3.attention.key_length, so only this head_dim loads there.
CASES: dict[str, tuple[Callable[..., Path], dict[str, Any], bool]] = {
    "llama_gqa_sentencepiece": (make_llama_checkpoint, {}, True),
    "qwen2_bias_tied": (make_qwen2_checkpoint, {}, False),
    "qwen3_qk_norm": (make_qwen3_checkpoint, {"head_dim": 128}, False),
    # K-quant blocks hold 256 values: every matrix row must be a multiple of 256 wide.
    "llama_wide": (make_llama_checkpoint, {"hidden_size": 256, "intermediate_size": 512}, True),
    # llama.cpp files Mistral under "llama" (general.name says Mistral): a MistralForCausalLM converted.
    "mistral_as_llama": (make_mistral_checkpoint, {}, True),
}
F32_CASES = ["llama_gqa_sentencepiece", "qwen2_bias_tied", "qwen3_qk_norm", "mistral_as_llama"]
# Measured on these models: kvpager (packed Q8_0/Q4_0 or floats) and transformers compute on the same
# dequantized float32 values, so the logits (|logit| ~ 3) agree to fp32 rounding whatever the format:
# max |diff| seen 1.2e-6 (Q4_0), 3.5e-6 (K-quants); QUANT_ATOL leaves 5x for other summation orders.
QUANT_TYPES = ("F16", "BF16", "Q8_0", "Q4_0")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    made: dict[tuple[str, str], Path] = {}
    checkpoints: dict[str, Path] = {}

    def get(case: str, tensor_type: str = "F32") -> Path:
        if case not in checkpoints:
            make, overrides, _ = CASES[case]
            checkpoints[case] = make(tmp_path_factory.mktemp(case), seed=len(checkpoints), **overrides)
        if (case, tensor_type) not in made:
            out = tmp_path_factory.mktemp(f"{case}_{tensor_type}") / f"model-{tensor_type}.gguf"
            made[case, tensor_type] = write_gguf(
                checkpoints[case], out, tensor_type=tensor_type, sentencepiece=CASES[case][2], name=f"tiny {case}"
            )
        return made[case, tensor_type]

    get.checkpoints = checkpoints  # type: ignore[attr-defined]
    return get


def hf_gguf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def paged_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    return PagedHarness(model, block_size=4).step([("s", ids)])[0]


@pytest.mark.parametrize("case", F32_CASES)
def test_f32_gguf_greedy_output_equals_transformers_gguf_loading(files: Callable[..., Path], case: str) -> None:
    path = files(case)
    hf = hf_gguf_model(path)
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    engine = Engine(EngineConfig(model=str(path), block_size=4, kv_cache_memory=1 << 22, max_num_seqs=2))
    got, _ = run_greedy(engine, PROMPT, 12)
    assert got == expected[0, len(PROMPT) :].tolist()
    model = load_model(path, dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        torch.testing.assert_close(paged_logits(model, PROMPT), hf(torch.tensor([PROMPT])).logits[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("tensor_type", QUANT_TYPES)
def test_quantized_gguf_logits_equal_transformers_dequantized_model(
    files: Callable[..., Path], tensor_type: str, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Q8_0/Q4_0 run packed (their blocks' own codes), F16/BF16 as floats: either way the model computes
    with the values transformers dequantizes, so logits agree to float32 rounding and greedy outputs match."""
    path = files("llama_gqa_sentencepiece", tensor_type)
    with caplog.at_level("INFO", logger="kvpager"):
        model = load_model(path, dtype=torch.float32, device="cpu")
    if tensor_type in ("Q8_0", "Q4_0") and quant_kernels_or_none() is not None:
        assert f"{tensor_type}: 15 tensor(s) executed as" in caplog.text  # 2 layers x 7 projections + lm_head
    hf = hf_gguf_model(path)
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT])).logits[0]
        f32 = hf_gguf_model(files("llama_gqa_sentencepiece"))(torch.tensor([PROMPT])).logits[0]
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
    got = paged_logits(model, PROMPT)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", block_size=4, kv_cache_memory=1 << 22))
    greedy, _ = run_greedy(engine, PROMPT, 12)
    same = sum(a == b for a, b in zip(greedy, expected[0, len(PROMPT) :].tolist(), strict=True))
    diff = (got - ref).abs().max().item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    with capsys.disabled():
        print(
            f"\n{tensor_type}: max |logit diff| vs transformers' dequantized model {diff:.2e} (tolerance {QUANT_ATOL:.0e}),"
            f" argmax agreement {agree:.0%}, greedy {same}/12 tokens equal;"
            f" the format's own error vs F32 weights {(ref - f32).abs().max().item():.2e}"
        )
    assert diff < QUANT_ATOL
    assert agree == 1.0
    assert same == 12


@pytest.mark.parametrize("tensor_type", ("Q4_K_M", "Q5_K", "Q6_K"))
def test_k_quant_gguf_logits_equal_transformers_own_dequantizer(
    files: Callable[..., Path], tensor_type: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """K-quant blocks from tests/kquants.py; transformers decodes them with its own torch dequantizer."""
    path = files("llama_wide", tensor_type)
    got = paged_logits(load_model(path, dtype=torch.float32, device="cpu"), PROMPT)
    with torch.inference_mode():
        ref = hf_gguf_model(path)(torch.tensor([PROMPT])).logits[0]
        f32 = hf_gguf_model(files("llama_wide"))(torch.tensor([PROMPT])).logits[0]
    diff = (got - ref).abs().max().item()
    with capsys.disabled():
        print(
            f"\n{tensor_type}: max |logit diff| vs transformers {diff:.2e}; the format's error vs F32 {(ref - f32).abs().max().item():.2e}"
        )
    assert diff < QUANT_ATOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_llama3_rope_scaling_from_rope_freqs_tensor_matches_transformers_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = make_llama_checkpoint(tmp_path / "ck", rope_parameters=LLAMA3_ROPE)
    path = write_gguf(checkpoint, tmp_path / "gguf" / "llama3.gguf")
    model = load_model(path, dtype=torch.float32, device="cpu")
    assert model.spec.rope_type == "freq_factors"
    ids = list(range(3, 43))  # past original_max_position_embeddings (16): the scaled frequencies matter
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        torch.testing.assert_close(paged_logits(model, ids), hf(torch.tensor([ids])).logits[0], atol=ATOL, rtol=0)


def test_split_files_and_directory_load_the_same_model(files: Callable[..., Path], tmp_path: Path) -> None:
    checkpoint = files.checkpoints["qwen2_bias_tied"]  # type: ignore[attr-defined]
    if checkpoint is None:
        pytest.fail("fixture did not build the checkpoint")
    single = files("qwen2_bias_tied")
    write_gguf(checkpoint, tmp_path / "split" / "model.gguf", split_max_tensors=8)
    parts = sorted((tmp_path / "split").glob("*.gguf"))
    assert len(parts) > 1 and parts[0].name.endswith(f"-00001-of-{len(parts):05d}.gguf")
    expected = paged_logits(load_model(single, dtype=torch.float32, device="cpu"), PROMPT)
    for target in (parts[-1], tmp_path / "split", single.parent):
        got = paged_logits(load_model(target, dtype=torch.float32, device="cpu"), PROMPT)
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_gguf_fingerprint_names_the_tensor_data(files: Callable[..., Path]) -> None:
    def fingerprint(path: Path) -> tuple[bytes, str]:
        engine = Engine(EngineConfig(model=str(path), block_size=4, kv_cache_memory=1 << 20))
        return engine.loaded.fingerprint, engine.loaded.weights_digest

    f32, q8 = files("llama_gqa_sentencepiece"), files("llama_gqa_sentencepiece", "Q8_0")
    first, digest = fingerprint(f32)
    assert digest.startswith("gguf:")
    assert fingerprint(f32)[0] == first
    assert fingerprint(q8)[0] != first


def test_bfloat16_load_runs_q8_0_packed_and_the_rest_in_the_model_dtype(
    files: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    path = files("llama_gqa_sentencepiece", "Q8_0")
    with caplog.at_level("INFO", logger="kvpager"):
        model = load_model(path, dtype=torch.bfloat16, device="cpu", kernel_backend="torch")
    # matrices in bfloat16; norms (vectors) in float32, the CPU compute dtype (kvpager.model.precision),
    # read as the file's F32 values (not rounded through bfloat16)
    assert {p.dtype for p in model.parameters() if p.dim() > 1} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.dim() == 1} == {torch.float32}
    norm = open_gguf(path).tensors["output_norm.weight"]
    assert torch.equal(model.norm.weight, torch.from_numpy(np.array(norm.data, dtype=np.float32)))
    assert "Q8_0: 1 tensor(s) dequantized to bfloat16 at load (embedding)" in caplog.text
    assert "F32: 5 tensor(s) as float32" in caplog.text
    if quant_kernels_or_none() is not None:
        assert "Q8_0: 15 tensor(s) executed as int8 g32, float16 scales (exact, no requantization)" in caplog.text
        assert {type(w).__name__ for w in packed_weights(model).values()} == {"Int8Weight"}


def test_quantization_flag_requantizes_gguf_tensors_from_their_floats(
    files: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="kvpager"):
        model = load_model(files("llama_wide", "Q4_K_M"), dtype=torch.float32, device="cpu", quantization="int4")
    weights = packed_weights(model)
    assert {(type(w).__name__, w.group_size) for w in weights.values()} == {("Int4Weight", 128)}
    assert "Q4_K: 8 tensor(s) dequantized, requantized to int4 g128 (--quantization)" in caplog.text
    assert "Q6_K: 6 tensor(s) dequantized, requantized to int4 g128 (--quantization)" in caplog.text
    assert "Q6_K: 1 tensor(s) dequantized to float32 at load (lm_head, not quantized by --quantization)" in caplog.text


def test_packed_and_float_execution_of_one_file_have_different_fingerprints(files: Callable[..., Path]) -> None:
    """KV computed by packed weights differs from the dequantized-float model's in the last bits: the
    weights digest names the executed form (kvpager.model.loader.packed_layout_digest)."""
    if quant_kernels_or_none() is None:
        pytest.skip("the packed-weight C++ kernels do not build here: GGUF blocks are dequantized")
    engine = Engine(EngineConfig(model=str(files("llama_wide", "Q4_K_M")), block_size=4, kv_cache_memory=1 << 20))
    assert "+packed:" in engine.loaded.weights_digest
    f32 = Engine(EngineConfig(model=str(files("llama_wide")), block_size=4, kv_cache_memory=1 << 20))
    assert "+packed:" not in f32.loaded.weights_digest

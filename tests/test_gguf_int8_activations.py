"""--gguf-int8-activations: a GGUF file's Q8_0 / Q4_0 / Q4_K / Q6_K blocks multiply int8-quantized activations.

- each such tensor is packed with the file's own codes and scales in the integer-dot classes (the
  weights are still exactly gguf-py's dequantized values), other types stay in their exact forms;
- a layer's matmul equals the torch reference (activations quantized per block of 32, times the
  dequantized weight) to float32 rounding;
- a whole model's logits stay within a measured bound of the exact packed model's, and its KV
  fingerprint differs from the exact model's (other arithmetic, other KV);
- the flag is refused with --quantization and on a safetensors checkpoint, naming the problem;
- unset, it is on wherever the CPU kernels run the file's blocks (llama.cpp's arithmetic, what a
  llama.cpp user expects), off where they cannot (--quantization, tensor parallelism, no kernels);
  --no-gguf-int8-activations keeps the exact path.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from test_model_equivalence import PagedHarness

from kvpager.core.config import EngineConfig, resolve_gguf_int8_activations
from kvpager.engine.args import add_engine_args, config_from_args
from kvpager.engine.engine import Engine
from kvpager.model import load_model
from kvpager.model.backends.quant_dot import Int4DotWeight, Int8DotWeight, reference_matmul
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.backends.quant_weights import Int4Weight, Int8Weight
from kvpager.model.gguf_packed import AffineInt8Weight, RowStack
from kvpager.model.loader import packed_weights

DATA = Path(__file__).parent / "data" / "gguf"
FILES = ["tiny-llama-Q8_0.gguf", "tiny-llama-Q4_0.gguf", "tiny-llama-Q4_K_M.gguf", "tiny-llama-Q5_K_M.gguf"]
PROMPT = [1, 40, 7, 99, 250, 13, 64, 300]
# |logit| ~ 3. Measured max |diff| vs the exact packed model over the 8 prompt positions: 5.5e-2
# (Q8_0), 4.6e-2 (Q4_0), 5.9e-2 (Q4_K_M, its Q6_K tensors included), 4.9e-2 (Q5_K_M), top-1 equal at
# every position:
# the size of Q8_0's own weight error against the float checkpoint (max |diff| 0.05). The bound leaves
# 1.7x room; a wrong scale or a mis-read block moves logits by O(1).
LOGIT_BOUND = 0.1

pytestmark = pytest.mark.skipif(quant_kernels_or_none() is None, reason="packed-weight kernels did not build here")


def _parts(weight: object) -> list[object]:
    return list(weight.parts) if isinstance(weight, RowStack) else [weight]


@pytest.mark.parametrize("name", FILES)
def test_dot_types_use_the_files_codes_and_others_stay_exact(name: str) -> None:
    exact = packed_weights(load_model(DATA / name, dtype=torch.float32, device="cpu"))
    dot = packed_weights(load_model(DATA / name, dtype=torch.float32, device="cpu", gguf_int8_activations=True))
    assert exact.keys() == dot.keys() and exact
    dynamic = 0
    for key, weight in dot.items():
        for a, b in zip(_parts(exact[key]), _parts(weight), strict=True):
            assert torch.equal(a.dequantize(), b.dequantize()), key  # the file's values, unchanged
            if isinstance(b, Int8DotWeight | Int4DotWeight):
                dynamic += 1
                # Q6_K: group 16; Q5_K: the exact form's offsets beside the int8 codes
                assert type(a) in (Int8Weight, Int4Weight, AffineInt8Weight) and b.group_size in (32, 16)
            else:
                assert type(a) is type(b), key  # float parts keep their form
            x = torch.randn(3, b.in_features, generator=torch.Generator().manual_seed(0))
            got = b.matmul(x, None).double()
            ref = (
                reference_matmul(b, x)
                if isinstance(b, Int8DotWeight | Int4DotWeight)
                else x.double() @ b.dequantize(torch.float64).T
            )
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), key
    assert dynamic > 0


@pytest.mark.parametrize("name", FILES)
def test_logits_stay_within_the_activation_rounding_bound(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    exact = PagedHarness(load_model(DATA / name, dtype=torch.float32, device="cpu"), block_size=4)
    dot = PagedHarness(
        load_model(DATA / name, dtype=torch.float32, device="cpu", gguf_int8_activations=True), block_size=4
    )
    a, b = exact.step([("s", PROMPT)])[0], dot.step([("s", PROMPT)])[0]
    diff = (a - b).abs().max().item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    with capsys.disabled():
        print(f"\n{name} --gguf-int8-activations: logits max |diff| vs exact {diff:.2e}; top-1 agreement {agree:.0%}")
    assert 0 < diff < LOGIT_BOUND
    assert agree >= 7 / 8


def test_the_start_up_log_points_exact_runs_to_the_flag(caplog: pytest.LogCaptureFixture) -> None:
    hint = "computed exactly (--no-gguf-int8-activations); the default computes them as llama.cpp does"
    with caplog.at_level("INFO", logger="kvpager"):
        load_model(DATA / "tiny-llama-Q4_K_M.gguf", dtype=torch.float32, device="cpu")
    assert f"Q4_K, Q6_K {hint}" in caplog.text  # the types the flag would change, named once
    caplog.clear()
    with caplog.at_level("INFO", logger="kvpager"):
        load_model(DATA / "tiny-llama-Q4_K_M.gguf", dtype=torch.float32, device="cpu", gguf_int8_activations=True)
    assert "GGUF weights" in caplog.text and hint not in caplog.text


def test_fingerprint_differs_from_the_exact_model() -> None:
    path = str(DATA / "tiny-llama-Q4_K_M.gguf")
    common = {"model": path, "dtype": "float32", "block_size": 4, "kv_cache_memory": 1 << 22}
    exact = Engine(EngineConfig(**common, gguf_int8_activations=False)).kv_expectation().model_fingerprint
    dot = Engine(EngineConfig(**common, gguf_int8_activations=True)).kv_expectation().model_fingerprint
    assert exact != dot


def test_flag_with_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot be combined with --quantization"):
        EngineConfig(model=str(DATA / FILES[0]), quantization="int8", gguf_int8_activations=True)


def test_flag_on_a_safetensors_checkpoint_is_refused(llama_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="applies to GGUF files"):
        load_model(llama_checkpoint, dtype=torch.float32, device="cpu", gguf_int8_activations=True)


def test_flag_with_tensor_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="--gguf-int8-activations cannot be combined with --tensor-parallel-size"):
        EngineConfig(model=str(DATA / FILES[0]), tensor_parallel_size=2, gguf_int8_activations=True)


def test_flag_where_the_file_is_dequantized_is_refused() -> None:
    # CUDA and tensor parallelism dequantize GGUF blocks the same way gguf_dequantize does: the flag
    # would change nothing there, so it is refused instead of ignored
    with pytest.raises(ValueError, match=r"GGUF weights are dequantized \(floats asked for\)"):
        load_model(DATA / FILES[0], dtype=torch.float32, device="cpu", gguf_dequantize=True, gguf_int8_activations=True)


def test_unset_the_cpu_runs_a_gguf_file_with_int8_activations(caplog: pytest.LogCaptureFixture) -> None:
    common = {"model": str(DATA / "tiny-llama-Q4_K_M.gguf"), "dtype": "float32", "block_size": 4}
    with caplog.at_level("INFO", logger="kvpager"):
        default = Engine(EngineConfig(**common, kv_cache_memory=1 << 22))
    # the start-up log says what runs and how to get the exact path back
    assert "x int8 activations per block of 32 (llama.cpp's arithmetic, not exact; --no-gguf-int8-activations" in (
        caplog.text
    )
    assert EngineConfig(**common).gguf_int8_activations is None  # resolved at load, where the device is known
    assert default.config.gguf_int8_activations is True
    flag = Engine(EngineConfig(**common, kv_cache_memory=1 << 22, gguf_int8_activations=True))
    exact = Engine(EngineConfig(**common, kv_cache_memory=1 << 22, gguf_int8_activations=False))
    assert exact.config.gguf_int8_activations is False
    fingerprint = default.kv_expectation().model_fingerprint
    assert fingerprint == flag.kv_expectation().model_fingerprint
    assert fingerprint != exact.kv_expectation().model_fingerprint


@pytest.mark.parametrize(
    ("requested", "gguf", "quantization", "ranks", "cpu_kernels", "expected"),
    [
        (None, True, None, 1, True, True),
        (None, False, None, 1, True, False),  # a safetensors checkpoint
        (None, True, "int8", 1, True, False),  # requantized from floats
        (None, True, None, 2, True, False),  # ranks slice dequantized floats
        (None, True, None, 1, False, False),  # a GPU, or no compiler for the kernels
        (False, True, None, 1, True, False),
        (True, True, None, 1, True, True),
    ],
)
def test_unset_int8_activations_resolve_on_only_where_the_kernels_run_the_files_blocks(
    requested: bool | None, gguf: bool, quantization: str | None, ranks: int, cpu_kernels: bool, expected: bool
) -> None:
    got = resolve_gguf_int8_activations(
        requested, gguf=gguf, quantization=quantization, tensor_parallel_size=ranks, cpu_kernels=cpu_kernels
    )
    assert got is expected


def test_unset_with_quantization_or_ranks_is_accepted_and_stays_exact() -> None:
    path = str(DATA / "tiny-llama-Q4_K_M.gguf")
    assert EngineConfig(model=path, tensor_parallel_size=2).gguf_int8_activations is None
    engine = Engine(EngineConfig(model=path, quantization="int8", block_size=4, kv_cache_memory=1 << 22))
    assert engine.config.gguf_int8_activations is False


@pytest.mark.parametrize(
    ("argv", "expected"), [([], None), (["--gguf-int8-activations"], True), (["--no-gguf-int8-activations"], False)]
)
def test_command_line_takes_the_flag_and_its_negation(argv: list[str], expected: bool | None) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = config_from_args(parser.parse_args(["--model", str(DATA / FILES[0]), *argv]))
    assert config.gguf_int8_activations is expected

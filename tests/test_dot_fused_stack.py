"""Decode steps over int8-activation weights (w8a8_int8 / w4a8_int8) in the fused layer stack.

The fused stack calls kvq_dot_linear with the scales, offsets, format value and group each weight's own
matmul passes, and the other kernels in the per-op path's order, so a decode step gives the per-op
path's logits and KV bit for bit; steps the per-op path would send elsewhere (weights capped at
different kernel paths) stay layer by layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_model_equivalence import PagedHarness, _prompts, _spy_fused_calls, assert_fused_steps_equal_per_op

from kvpager.model import load_model
from kvpager.model.backends.fused_stack import FusedLayerStack, has_quantized_weights
from kvpager.model.backends.kernels.binding import KernelArgumentError
from kvpager.model.backends.quant_dot import Int4DotWeight, Int8DotWeight
from kvpager.model.backends.quant_kernels import LEVEL_PORTABLE, quant_kernels_or_none


def _load(path: Path, quantization: str, group: int | None) -> object:
    model = load_model(
        path, dtype=torch.float32, device="cpu", quantization=quantization, quantization_group_size=group
    )
    if model.ops.name != "cpu" or not isinstance(model.layers[0].mlp.down_proj.weight, Int8DotWeight | Int4DotWeight):
        pytest.skip("no C++ compiler here: no kernels, no fused layer stack")
    return model


def _steps(path: Path) -> list[list[tuple[str, list[int]]]]:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab, [5, 12, 9], seed=3)
    extra = _prompts(vocab, [3, 3, 3], seed=4)
    steps = [[(str(i), p) for i, p in enumerate(prompts)]]
    return steps + [[(str(i), [extra[i][t]]) for i in range(3)] for t in range(2)] + [[("0", [extra[0][2]])]]


@pytest.mark.parametrize(("quantization", "group"), [("w4a8_int8", 32), ("w4a8_int8", 64), ("w8a8_int8", None)])
@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_int8_activation_decode_steps_run_fused_and_equal_the_per_op_path(
    llama_checkpoint: Path,
    qwen2_checkpoint: Path,
    case: str,
    quantization: str,
    group: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = llama_checkpoint if case == "llama" else qwen2_checkpoint  # qwen2: q/k/v biases
    model = _load(path, quantization, group)
    assert not has_quantized_weights(model.layers)  # every weight is one the fused stack reads
    taken = assert_fused_steps_equal_per_op(model, _steps(path), monkeypatch)
    assert taken == [False, True, True, True]  # prefill layer by layer; 3 rows, 3 rows, 1 row fused


def test_int8_activation_weights_capped_at_different_paths_run_layer_by_layer(
    llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _load(llama_checkpoint, "w4a8_int8", 32)
    kernels = quant_kernels_or_none()
    assert kernels is not None
    if kernels.default_level == LEVEL_PORTABLE:
        pytest.skip("this CPU runs the portable kernels only: no lower kernel path to cap one weight at")
    # one weight capped below the others' path (AVX2 under AVX-512, portable under AVX2)
    model.layers[0].mlp.down_proj.weight.max_level = kernels.default_level - 1
    fused_calls = _spy_fused_calls(model, monkeypatch)
    harness = PagedHarness(model, block_size=4)
    for batch in _steps(llama_checkpoint)[:2]:
        harness.step(batch)
    assert fused_calls == [False, False]


def test_the_layer_kernel_refuses_an_int8_activation_weight_without_the_dot_kernel(
    llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _load(llama_checkpoint, "w4a8_int8", 32)
    monkeypatch.setattr(FusedLayerStack, "_dot_linear", lambda self, built, rows: (0, 0))
    harness = PagedHarness(model, block_size=4)
    steps = _steps(llama_checkpoint)
    harness.step(steps[0])  # the prompts: layer by layer
    with pytest.raises(KernelArgumentError, match="needs dot_linear"):
        harness.step(steps[1])  # a decode step: the binding checks the table before the kernel runs

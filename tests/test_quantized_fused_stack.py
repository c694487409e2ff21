"""Decode steps over quantized weights in the fused layer stack: int8-activation weights (w8a8_int8 /
w4a8_int8, GGUF with --gguf-int8-activations) and exact int8 / int4 ones (int8 / int4, GGUF files).

The fused stack calls kvq_dot_linear / kvq_linear with the codes, scales, offsets, format value and
group each weight's own matmul passes, and the other kernels in the per-op path's order, so a decode
step gives the per-op path's logits and KV bit for bit; steps the per-op path would send elsewhere
(weights capped at different kernel paths) stay layer by layer. A projection stacked from row parts of
different formats (gguf_packed.RowStack, as a Q4_K_M file's q/k/v) runs there too, one call per part.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_model_equivalence import PagedHarness, _prompts, _spy_fused_calls, assert_fused_steps_equal_per_op

from kvpager.model import load_model
from kvpager.model.backends.fused_stack import FusedLayerStack, build_layer_table, has_quantized_weights
from kvpager.model.backends.kernels.binding import KernelArgumentError
from kvpager.model.backends.quant_dot import Int4DotWeight, Int8DotWeight
from kvpager.model.backends.quant_kernels import LEVEL_PORTABLE, quant_kernels_or_none
from kvpager.model.backends.quant_weights import Int4Weight, Int8Weight, PackedWeight
from kvpager.model.gguf_packed import AffineInt8Weight, RowStack

GGUF = Path(__file__).parent / "data" / "gguf"


def _load(path: Path, quantization: str, group: int | None) -> object:
    model = load_model(
        path, dtype=torch.float32, device="cpu", quantization=quantization, quantization_group_size=group
    )
    if model.ops.name != "cpu" or quant_kernels_or_none() is None:
        pytest.skip("no C++ compiler here: no kernels, no fused layer stack")
    return model


def _steps(path: Path) -> list[list[tuple[str, list[int]]]]:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab, [5, 12, 9], seed=3)
    extra = _prompts(vocab, [3, 3, 3], seed=4)
    steps = [[(str(i), p) for i, p in enumerate(prompts)]]
    return steps + [[(str(i), [extra[i][t]]) for i in range(3)] for t in range(2)] + [[("0", [extra[0][2]])]]


@pytest.mark.parametrize(
    ("quantization", "group"),
    [("w4a8_int8", 32), ("w4a8_int8", 64), ("w8a8_int8", None), ("int4", 32), ("int8", None), ("int8", 32)],
)
@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_quantized_decode_steps_run_fused_and_equal_the_per_op_path(
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


# kinds of row part: "4" / "8" int4 / int8 with int8 activations (group 32), "i" / "j" exact int4 / int8
# (group 32), "a" exact int8 with per-group offsets (GGUF Q5_K's form, which the layer kernel lacks)
def _part(kind: str, rows: torch.Tensor) -> PackedWeight:
    if kind == "4":
        return Int4DotWeight.from_float(rows, 32)
    if kind == "8":
        return Int8DotWeight.from_float(rows, 32)
    if kind == "i":
        return Int4Weight.from_float(rows, 32)
    if kind == "j":
        return Int8Weight.from_float(rows, 32)
    return AffineInt8Weight(Int8Weight.from_float(rows, 32), torch.zeros(rows.shape[0], rows.shape[1] // 32))


def _row_stack(weight: PackedWeight, cuts: list[int], kinds: str) -> RowStack:
    """The weight's values requantized as row parts [0, cuts[0]), [cuts[0], cuts[1]), ..., one per kind."""
    dense = weight.dequantize()
    bounds = [0, *cuts, dense.shape[0]]
    return RowStack([_part(k, dense[a:b]) for k, a, b in zip(kinds, bounds[:-1], bounds[1:], strict=True)])


def _restack(model: object, qkv: tuple[list[int], str], gate_up: tuple[list[int], str] | None = None) -> None:
    """Every layer's q/k/v (and gate/up) as a RowStack of the given row cuts and part kinds."""
    for layer in model.layers:  # type: ignore[attr-defined]
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj.weight = _row_stack(attn.qkv_proj.weight, *qkv)
        if gate_up is not None:
            mlp.gate_up_proj.weight = _row_stack(mlp.gate_up_proj.weight, *gate_up)


def _qkv_cuts(model: object) -> tuple[int, int]:
    spec = model.spec  # type: ignore[attr-defined]
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return q, q + kv


@pytest.mark.parametrize(
    ("quantization", "parts"), [("w4a8_int8", "48"), ("w4a8_int8", "484"), ("int4", "ij"), ("int4", "iji")]
)
@pytest.mark.parametrize("case", ["llama", "qwen2"])
def test_row_stacks_of_quantized_parts_run_fused_and_equal_the_per_op_path(
    llama_checkpoint: Path,
    qwen2_checkpoint: Path,
    case: str,
    quantization: str,
    parts: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = llama_checkpoint if case == "llama" else qwen2_checkpoint  # qwen2: the biases split per part
    model = _load(path, quantization, 32)
    q, qk = _qkv_cuts(model)
    if len(parts) == 2:  # a Q4_K_M file's q/k/v: 4-bit q and k, 6-bit (int8 here) v
        _restack(model, ([qk], parts))
    else:  # three parts, and the MLP's gate/up split too (int8 gate, int4 up)
        _restack(model, ([q, qk], parts), ([model.spec.intermediate_size], parts[1] + parts[0]))
    assert not has_quantized_weights(model.layers)
    taken = assert_fused_steps_equal_per_op(model, _steps(path), monkeypatch)
    assert taken == [False, True, True, True]  # prefill layer by layer; 3 rows (parts copied), 3, 1 fused


@pytest.mark.parametrize("kinds", ["ia", "4848"])
def test_row_stacks_the_layer_kernel_cannot_read_run_layer_by_layer(
    llama_checkpoint: Path, kinds: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _load(llama_checkpoint, "int4", 32)
    q, qk = _qkv_cuts(model)
    # a part with per-group offsets (no kernel of the layer stack), or four parts (more than the table holds)
    _restack(model, ([qk], kinds) if kinds == "ia" else ([q // 2, q, qk], kinds))
    assert has_quantized_weights(model.layers)
    assert build_layer_table(model.layers, model.spec.rms_norm_eps) is None
    fused_calls = _spy_fused_calls(model, monkeypatch)
    harness = PagedHarness(model, block_size=4)
    for batch in _steps(llama_checkpoint)[:2]:
        harness.step(batch)
    assert fused_calls == [False, False]


@pytest.mark.parametrize(
    "name", ["tiny-llama-Q8_0.gguf", "tiny-llama-Q4_0.gguf", "tiny-llama-Q4_K_M.gguf", "tiny-llama-Q5_K_M.gguf"]
)
@pytest.mark.parametrize("int8_activations", [False, True])
def test_gguf_decode_steps_run_fused_and_equal_the_per_op_path(
    name: str, int8_activations: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(GGUF / name, dtype=torch.float32, device="cpu", gguf_int8_activations=int8_activations)
    if model.ops.name != "cpu" or quant_kernels_or_none() is None:
        pytest.skip("no C++ compiler here: no kernels, no fused layer stack")
    stacks = [layer.self_attn.qkv_proj.weight for layer in model.layers]
    mixed = name in ("tiny-llama-Q4_K_M.gguf", "tiny-llama-Q5_K_M.gguf")  # a 6-bit attn_v beside q and k
    assert any(isinstance(w, RowStack) for w in stacks) == mixed
    # exact Q5_K (int8 codes with offsets, applied in Python) has no layer-kernel form: layer by layer
    fused = int8_activations or name != "tiny-llama-Q5_K_M.gguf"
    assert has_quantized_weights(model.layers) == (not fused)
    vocab = model.spec.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in (8, 5, 3)]
    steps = [[(str(i), p) for i, p in enumerate(prompts)]]
    steps += [[(str(i), [(11 * t + i + 2) % vocab]) for i in range(3)] for t in range(2)] + [[("0", [42 % vocab])]]
    taken = assert_fused_steps_equal_per_op(model, steps, monkeypatch)
    assert taken == [False, fused, fused, fused]  # prefill layer by layer; 3 rows, 3 rows, 1 row fused


@pytest.mark.parametrize(("part", "entry", "value"), [(1, 6, 10_000), (0, 0, 7), (1, 0, 0)])
def test_the_layer_kernel_refuses_row_parts_that_do_not_describe_their_weight(
    llama_checkpoint: Path, part: int, entry: int, value: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _load(llama_checkpoint, "w4a8_int8", 32)
    _restack(model, ([_qkv_cuts(model)[1]], "48"))
    harness = PagedHarness(model, block_size=4)
    steps = _steps(llama_checkpoint)
    harness.step(steps[0])
    built = build_layer_table(model.layers, model.spec.rms_norm_eps)
    assert built is not None
    # too many rows for q/k/v's width, an unknown kind, the v part left out (its rows missing)
    built.weight_parts[0, 0, part, entry] = value
    monkeypatch.setattr(FusedLayerStack, "_layer_table", lambda self, layers, eps: built)
    before = harness.kv_cache.clone()
    with pytest.raises(KernelArgumentError, match="row parts of known kinds"):
        harness.step(steps[1])
    assert torch.equal(harness.kv_cache, before)  # refused before the kernel wrote anything


def test_the_layer_kernel_refuses_an_exact_quantized_weight_without_the_packed_kernel(
    llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _load(llama_checkpoint, "int4", 32)
    monkeypatch.setattr(FusedLayerStack, "_packed_linear", lambda self, built: (0, 0))
    harness = PagedHarness(model, block_size=4)
    steps = _steps(llama_checkpoint)
    harness.step(steps[0])
    with pytest.raises(KernelArgumentError, match="needs packed_linear"):
        harness.step(steps[1])

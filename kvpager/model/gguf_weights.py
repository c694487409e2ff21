"""GGUF tensors -> the model's weights, one tensor at a time, straight from the memory-mapped file.

Linear weights (the projections, an untied lm_head) of the quantized types kvpager executes in packed
form (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K; kvpager/model/gguf_packed.py) keep their blocks' own codes and
scales: no requantization, the matmul sees exactly the values gguf-py's dequantizer gives. Everything
else (embedding, norms, biases; every tensor off the CPU or without the packed-weight kernels, or
with --quantization, which requantizes from these floats) is converted or dequantized, with the
`gguf` package's block decoders, to the model's dtype. Each tensor is read from its mapped bytes
when the loader asks for it and handed over, so loading holds one copy of the weights (the model's)
plus one tensor in flight.

llama.cpp's converter permutes the rows of a llama model's q/k projections (its RoPE pairs adjacent
elements, transformers' rotates halves); that permutation is undone here (rows reordered, for packed
weights together with their scales), so the weights are transformers'. qwen2/qwen3 files are not
permuted.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvpager.gguf.blocks import unpack_blocks
from kvpager.gguf.config import ROPE_FREQS_TENSOR
from kvpager.gguf.executed import (
    FLOAT_TYPES,
    INT8_DOT_TYPES,
    LINEAR_SUFFIXES,
    SUPPORTED_TENSOR_TYPES,
    checkpoint_name,
    is_linear_weight,
    packed_form,
    tied_lm_head_form,
)
from kvpager.gguf.reader import GGUFError, GGUFModel, GGUFTensor
from kvpager.model.backends.quant_weights import PackedWeight
from kvpager.model.gguf_packed import packed_from_blocks
from kvpager.model.spec import ModelSpec

# Tensors the config already consumed (the rope divisors become the spec's rope scaling).
_CONSUMED = (ROPE_FREQS_TENSOR,)


class GGUFWeights:
    """The file's tensors under the loader's checkpoint names, each read on demand from the memory map.

    `read(name)`: the tensor as floats in `dtype` (dequantized when quantized). `packer(name)`: for a
    linear weight (projections, an untied lm_head) of a type kvpager executes in packed form
    (kvpager.gguf.executed.packed_form: the decision the planner counts bytes by), a callable
    building that packed weight from the blocks, else None. `native`
    False (not a CPU with the packed-weight kernels, or floats asked for) and `quantization` set
    (requantize from the dequantized floats) both disable packers. What happened to each ggml type
    is counted for the start-up log (`report_lines`).
    """

    def __init__(
        self,
        model: GGUFModel,
        spec: ModelSpec,
        dtype: torch.dtype,
        *,
        native: bool,
        not_native_reason: str = "no packed-weight kernels here",
        quantization: str | None = None,
        quantization_group_size: int | None = None,
        vector_dtype: torch.dtype | None = None,
        int8_activations: bool = False,
    ) -> None:
        self.model, self.spec, self.dtype = model, spec, dtype
        # NOTE: norms and biases (1-D) are read straight into the dtype they compute in (float32 on the
        # CPU), so llama.cpp's F32 norms are not rounded through a 16-bit model dtype on the way
        self.vector_dtype = vector_dtype or dtype
        self.native = native and quantization is None
        self.not_native_reason = not_native_reason
        self.int8_activations = int8_activations
        self.requantize = None
        if quantization is not None:
            self.requantize = f"{quantization} g{quantization_group_size or ('channel' if quantization in ('int8', 'w8a8_int8') else '128')}"
        self._tensors: dict[str, GGUFTensor] = {}
        for gguf_name, tensor in model.tensors.items():
            if gguf_name in _CONSUMED:
                continue
            name = checkpoint_name(gguf_name, model)
            if spec.tie_word_embeddings and name == "lm_head.weight":
                continue
            _check_type(tensor, model)
            self._tensors[name] = tensor
        self._counts: dict[tuple[str, str], int] = {}
        self._exact_dot_types: set[str] = set()  # types the integer dot reads, packed exact here

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: t.shape for name, t in self._tensors.items()}

    def read(self, name: str) -> torch.Tensor:
        """The tensor as a new CPU tensor in the model's dtype (q/k rows in transformers' order)."""
        tensor = self._tensors[name]
        dtype = self.dtype_of(name)
        weights = tensor_to_torch(tensor, dtype, self.model)
        rows = self._row_order(name)
        if rows is not None:
            weights = weights[torch.from_numpy(rows)]
        dtype_name = str(dtype).removeprefix("torch.")
        if tensor.type_name in FLOAT_TYPES:
            how = f"as {dtype_name}"
        elif self.requantize is not None and name.endswith(LINEAR_SUFFIXES):
            how = f"dequantized, requantized to {self.requantize} (--quantization)"
        else:
            how = f"dequantized to {dtype_name} at load ({self._why_float(name)})"
        self._count(tensor.type_name, how)
        return weights

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype `read(name)` gives: vector_dtype for norms and biases, else the model dtype."""
        return self.vector_dtype if len(self._tensors[name].shape) == 1 else self.dtype

    def packer(self, name: str) -> Callable[[], PackedWeight] | None:
        """How to build `name`'s packed weight from its blocks, or None (then it is read as floats)."""
        if packed_form(name, self._tensors[name].type_name, packed_kernels=self.native) is None:
            return None
        return lambda: self._packed(name)

    def tied_lm_head(self) -> PackedWeight | None:
        """A tied model's lm_head as a packed copy of the embedding's blocks (tied_lm_head_form), or None
        (the lm_head multiplies the embedding table)."""
        if not self.spec.tie_word_embeddings:
            return None
        tensor = self._tensors["embed_tokens.weight"]
        form = tied_lm_head_form(tensor.type_name, packed_kernels=self.native, int8_activations=self.int8_activations)
        if form is None:
            return None
        weight = packed_from_blocks(unpack_blocks(tensor.type_name, tensor.data, tensor.shape), tensor.type_name,
                                    int8_activations=True)  # fmt: skip
        if weight.nbytes != form.num_bytes(*tensor.shape):  # NOTE: the planner counts form.num_bytes
            raise AssertionError(
                f"tied lm_head: {tensor.type_name} packed into {weight.nbytes} bytes, not {form.name}'s"
            )
        self._count(tensor.type_name, f"copied for the tied lm_head, executed as {form.name} x int8 activations")
        return weight

    def report_lines(self) -> list[str]:
        lines = [f"{kind}: {n} tensor(s) {how}" for (kind, how), n in sorted(self._counts.items())]
        if self._exact_dot_types:  # what a llama.cpp user expects from these types, one flag away
            types = ", ".join(sorted(self._exact_dot_types))
            lines.append(
                f"{types} computed exactly (--no-gguf-int8-activations); the default computes them as llama.cpp "
                "does (activations quantized to int8: faster, not exact; docs/precision.md)"
            )
        return lines

    def _packed(self, name: str) -> PackedWeight:
        tensor = self._tensors[name]
        dynamic = self.int8_activations and tensor.type_name in INT8_DOT_TYPES
        form = packed_form(name, tensor.type_name, packed_kernels=self.native, int8_activations=dynamic)
        assert form is not None, name
        blocks = unpack_blocks(tensor.type_name, tensor.data, tensor.shape)
        rows = self._row_order(name)
        if rows is not None:
            blocks = blocks.rows(rows)
        weight = packed_from_blocks(blocks, tensor.type_name, int8_activations=dynamic)
        if weight.nbytes != form.num_bytes(*tensor.shape):  # NOTE: the planner counts form.num_bytes
            raise AssertionError(f"{name}: {tensor.type_name} packed into {weight.nbytes} bytes, not {form.name}'s")
        if dynamic:
            how = (
                f"executed as {form.name} x int8 activations per block of 32 (llama.cpp's arithmetic, not exact; "
                "--no-gguf-int8-activations: exact)"
            )
        else:
            how = f"executed as {form.name} (exact, no requantization)"
            if tensor.type_name in INT8_DOT_TYPES:
                self._exact_dot_types.add(tensor.type_name)
        self._count(tensor.type_name, how)
        return weight

    def _why_float(self, name: str) -> str:
        if name == "embed_tokens.weight":
            return "embedding"
        if name == "lm_head.weight" and self.requantize is not None:
            return "lm_head, not quantized by --quantization"
        if is_linear_weight(name):
            return self.not_native_reason if not self.native else "fused with float parts"
        return "not a linear layer"

    def _row_order(self, name: str) -> np.ndarray | None:
        """llama.cpp permutes a llama model's q/k rows; the row order that undoes it (None: as stored)."""
        if self.model.architecture != "llama" or not (".q_proj." in name or ".k_proj." in name):
            return None
        heads = self.spec.num_heads if ".q_proj." in name else self.spec.num_kv_heads
        return rope_row_order(self._tensors[name].shape[0], heads)

    def _count(self, kind: str, how: str) -> None:
        self._counts[kind, how] = self._counts.get((kind, how), 0) + 1


def tensor_to_torch(tensor: GGUFTensor, dtype: torch.dtype, model: GGUFModel) -> torch.Tensor:
    """One tensor's values as a new CPU tensor of `tensor.shape` in `dtype` (dequantized when quantized)."""
    kind = tensor.type_name
    _check_type(tensor, model)
    if kind == "BF16":
        raw = np.ascontiguousarray(tensor.data).view(np.int16).reshape(tensor.shape)
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).to(dtype)
    if kind in ("F32", "F16"):
        # NOTE: np.array copies out of the read-only memory map (torch wants writable memory).
        values = np.array(tensor.data, copy=True).reshape(tensor.shape)
    else:
        from gguf import GGMLQuantizationType, dequantize

        # dequantize returns a new float32 array: no further copy
        values = dequantize(np.asarray(tensor.data), GGMLQuantizationType[kind]).reshape(tensor.shape)
    out = torch.from_numpy(np.ascontiguousarray(values))
    return out if out.dtype == dtype else out.to(dtype)


def rope_row_order(rows: int, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, stored rows (0, d/2, 1, d/2+1, ...) -> (0, 1, ..., d-1).
    new[h, j, i] = stored[h, i, j] over the view [heads, d/2, 2]."""
    head_dim = rows // num_heads
    return np.arange(rows).reshape(num_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


def _check_type(tensor: GGUFTensor, model: GGUFModel) -> None:
    if tensor.type_name not in SUPPORTED_TENSOR_TYPES:
        raise GGUFError(
            f"GGUF file {str(model.path)!r}: tensor {tensor.name!r} has ggml type {tensor.type_name}, which kvpager "
            f"cannot load (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
        )

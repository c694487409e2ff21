"""A GGUF model's weight bytes twice: as the file stores them, and as kvpager holds them when it runs.

The two differ: kvpager executes quantized linear weights from their blocks' own codes, with the
file's float16 scales for Q8_0 / Q4_0 and float32 scales (and offsets) for the K-quants (Q5_K and Q6_K
codes in int8), and dequantizes the embedding to the model dtype
(kvpager.gguf.executed has the table). Which tensor runs in which form is decided by
`kvpager.gguf.executed.packed_form`, the function the loader packs by; floats follow the engine's
CPU precision rule (docs/precision.md, as `engine_weight_bytes`): matrices (embedding, float linear
weights) in the model dtype, norms and biases in float32. tests/test_calibration.py holds these bytes
to the engine's own count for every tensor type.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpager.gguf import GGUFModel
from kvpager.gguf.config import ROPE_FREQS_TENSOR
from kvpager.gguf.executed import checkpoint_name, packed_form, tied_lm_head_form
from kvpager.planner.weights import ENGINE_DTYPE_BYTES

COMPUTE_BYTES = ENGINE_DTYPE_BYTES["float32"]  # norms and biases: the compute dtype of every CPU model


@dataclass(frozen=True)
class GGUFResidentWeights:
    """What kvpager holds for a GGUF model in `dtype`, next to the file's own tensor bytes."""

    dtype: str
    num_bytes: int  # resident: what the engine's weights take in memory
    file_bytes: int  # the file's tensor data (quantized blocks with their scales)
    num_elements: int
    # (ggml type, how kvpager holds it, tensors, resident bytes), in type order
    by_type: tuple[tuple[str, str, int, int], ...]
    file_types: tuple[tuple[str, int], ...]  # (ggml type, tensors) as stored

    def describe(self) -> str:
        """One line: the file's types, then what each becomes."""
        stored = ", ".join(f"{kind} x{n}" for kind, n in self.file_types)
        held = "; ".join(f"{kind} x{n} {how}" for kind, how, n, _ in self.by_type)
        return (
            f"exact: GGUF tensor data {self.file_bytes:,} bytes ({stored}), {self.num_elements:,} elements; "
            f"kvpager holds (dtype {self.dtype}, a CPU with its packed-weight kernels): {held}"
        )


def gguf_resident_weights(
    model: GGUFModel, dtype: str, *, packed_kernels: bool = True, int8_activations: bool = False
) -> GGUFResidentWeights:
    """The bytes `kvpager serve --model FILE.gguf --dtype DTYPE` holds (no --quantization).

    `packed_kernels` False: every tensor dequantized to floats (a CPU without the kernels' compiler).
    `int8_activations`: --gguf-int8-activations (a tied model then holds a packed lm_head copy too)."""
    if dtype not in ENGINE_DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(ENGINE_DTYPE_BYTES)}, got {dtype!r}")
    element = (dtype, ENGINE_DTYPE_BYTES[dtype])
    compute = ("float32", COMPUTE_BYTES)
    names = {g: checkpoint_name(g, model) for g in model.tensors if g != ROPE_FREQS_TENSOR}
    rows: dict[tuple[str, str], list[int]] = {}
    num_elements = 0
    for gguf_name, name in names.items():
        tensor = model.tensors[gguf_name]
        numel = 1
        for dim in tensor.shape:
            numel *= dim
        num_elements += numel
        form = packed_form(name, tensor.type_name, packed_kernels=packed_kernels, int8_activations=int8_activations)
        if form is not None:
            how, num_bytes = f"executed as {form.name}", form.num_bytes(tensor.shape[0], tensor.shape[1])
        else:
            # matrices (embedding, float linear weights, a float part of a fused projection with packed
            # parts) in the model dtype; norms and biases (vectors) in the compute dtype
            held = element if len(tensor.shape) == 2 else compute
            verb = "as" if tensor.type_name in ("F32", "F16", "BF16") else "dequantized to"
            how, num_bytes = f"{verb} {held[0]}", numel * held[1]
        entry = rows.setdefault((tensor.type_name, how), [0, 0])
        entry[0] += 1
        entry[1] += num_bytes
    embedding = model.tensors.get("token_embd.weight")
    if embedding is not None and "output.weight" not in model.tensors:  # tied (kvpager.gguf.config's rule)
        head = tied_lm_head_form(embedding.type_name, packed_kernels=packed_kernels, int8_activations=int8_activations)
        if head is not None:
            how = f"copied for the tied lm_head, executed as {head.name} x int8 activations"
            rows[embedding.type_name, how] = [1, head.num_bytes(embedding.shape[0], embedding.shape[1])]
    by_type = tuple((kind, how, n, b) for (kind, how), (n, b) in sorted(rows.items()))
    return GGUFResidentWeights(
        dtype,
        sum(b for *_, b in by_type),
        model.tensor_bytes(),
        num_elements,
        by_type,
        tuple(model.type_counts().items()),
    )

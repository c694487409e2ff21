"""Weight bytes: exact from safetensors headers, or parameters × effective bits per weight.

Effective bits include the scales (and zero points) that quantised formats store beside the weights,
which is what the "a 4-bit 8B model is 4 GB" rule of thumb forgets.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from kvpager.core.config import ACTIVATION_BLOCK, DYNAMIC_ACTIVATION_QUANTIZATIONS, QUANTIZATION_WEIGHTS
from kvpager.planner.models import ModelFacts
from kvpager.planner.params import ParamCounts


@dataclass(frozen=True)
class WeightFormat:
    """How one weight format stores parameters."""

    name: str
    bits_per_weight: float  # effective, scales included
    whole_model: bool  # True: the figure covers every tensor (GGUF mixes); False: matrices only
    assumption: str


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("fp32", 32.0, True, "4 bytes per parameter"),
        WeightFormat("bf16", 16.0, True, "2 bytes per parameter"),
        WeightFormat("fp16", 16.0, True, "2 bytes per parameter"),
        WeightFormat(
            "fp8", 8.0, False, "linear layers e4m3 with one scale per tensor; embeddings, lm_head and norms stay 16-bit"
        ),
        WeightFormat(
            "int8",
            8.0,
            False,
            "linear layers int8 with one fp16 scale per output channel (< 0.01 bit/weight, not counted); embeddings, lm_head and norms stay 16-bit",
        ),
        WeightFormat(
            "int4",
            4.15625,
            False,
            "GPTQ/AWQ-style: linear layers 4-bit in groups of 128 with an fp16 scale and a 4-bit zero point per group (4 + 20/128 bits); embeddings, lm_head and norms stay 16-bit",
        ),
        WeightFormat("q8_0", 8.5, True, "GGUF Q8_0: blocks of 32 int8 + one fp16 scale = 34 bytes / 32 weights"),
        WeightFormat("q6_k", 6.5625, True, "GGUF Q6_K: super-blocks of 256 weights in 210 bytes"),
        WeightFormat(
            "q5_k_m",
            5.68,
            True,
            "GGUF Q5_K_M mix (mostly Q5_K at 5.5, some tensors Q6_K): 5.68 measured on Llama-2-7B, llama.cpp tools/quantize/README.md",
        ),
        WeightFormat(
            "q4_k_m",
            4.84,
            True,
            "GGUF Q4_K_M mix (mostly Q4_K at 4.5, attn_v/ffn_down halves and output Q6_K): 4.84 measured on Llama-2-7B, llama.cpp tools/quantize/README.md",
        ),
        WeightFormat(
            "q4_0", 4.5, True, "GGUF Q4_0: blocks of 32 4-bit weights + one fp16 scale = 18 bytes / 32 weights"
        ),
    )
}


def weight_bytes(counts: ParamCounts, fmt: WeightFormat) -> int:
    """Bytes of the weights in `fmt`; tied embeddings are one tensor and counted once."""
    if fmt.whole_model:
        return int(round(counts.total * fmt.bits_per_weight / 8))
    kept_16bit = counts.embedding + counts.lm_head + counts.other
    return int(round(counts.linear * fmt.bits_per_weight / 8 + kept_16bit * 2))


def parse_weight_format(name: str) -> WeightFormat:
    key = name.strip().lower().replace("-", "_")
    key = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8": "fp8"}.get(key, key)
    if key not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {name!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[key]


# --- safetensors -------------------------------------------------------------------------------

SAFETENSORS_DTYPE_BYTES: dict[str, float] = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75,
}  # fmt: skip


@dataclass(frozen=True)
class CheckpointWeights:
    """What the safetensors headers of a checkpoint say, without reading any tensor data."""

    num_bytes: int
    num_elements: int
    files: tuple[str, ...]


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shards: those named by model.safetensors.index.json, else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index ({exc}); fix or remove it") from exc
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def read_checkpoint_weights(model_dir: Path) -> CheckpointWeights | None:
    """Sum dtype size × shape over every tensor header; None when the directory has no safetensors
    (a GGUF model's bytes: kvpager.planner.gguf_bytes)."""
    if not model_dir.is_dir():
        return None
    files = safetensors_files(model_dir)
    if not files:
        return None
    total_bytes = total_elements = 0
    for path in files:
        for name, info in _read_header(path).items():
            if name == "__metadata__":
                continue
            numel = 1
            for dim in info["shape"]:
                numel *= dim
            total_elements += numel
            total_bytes += int(numel * SAFETENSORS_DTYPE_BYTES[info["dtype"]])
    return CheckpointWeights(total_bytes, total_elements, tuple(p.name for p in files))


def _read_header(path: Path) -> dict[str, dict]:
    """The JSON header only: 8-byte little-endian length, then that many bytes of JSON."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100_000_000:
                raise ValueError(f"header length {length} is implausible")
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name != "__metadata__" and info["dtype"] not in SAFETENSORS_DTYPE_BYTES:
                raise ValueError(f"tensor {name} has unknown dtype {info['dtype']!r}")
    except (OSError, struct.error, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({exc})") from exc
    return header


# --- kvpager's own formats (what the engine stores: --dtype / --quantization) ------------------

ENGINE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
INT4_SPAN = 16  # int4 weights per 8-byte span (kvpager.model.backends.quant_weights.INT4_SPAN)
SCALE_BYTES = 4  # float32 scales (and int4 offsets)


def engine_linear_shapes(facts: ModelFacts) -> list[tuple[int, int]]:
    """(out, in) of every quantized projection (q, k, v, o, gate, up, down per layer): dense Llama family."""
    if facts.moe is not None or facts.mla is not None:
        raise ValueError(f"{facts.name}: kvpager's quantization covers dense Llama-family models only")
    h, d, i = facts.hidden_size, facts.head_dim, facts.intermediate_size
    q, kv = facts.num_heads * d, facts.num_kv_heads * d
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)] * facts.num_layers


def quantized_matrix_bytes(out_features: int, in_features: int, method: str, group: int | None) -> int:
    """Bytes kvpager's Int8Weight / Int4Weight hold for one [out, in] matrix (w8a8_int8 / w4a8_int8
    store the same weights)."""
    if method in DYNAMIC_ACTIVATION_QUANTIZATIONS and group is not None and group % ACTIVATION_BLOCK != 0:
        raise ValueError(f"{method} group size must be a multiple of {ACTIVATION_BLOCK}, got {group}")
    method = QUANTIZATION_WEIGHTS.get(method, method)
    if method == "int8":
        groups = -(-in_features // (group or in_features))
        return out_features * (in_features + groups * SCALE_BYTES)
    if method == "int4":
        groups = -(-in_features // (group or 128))
        return out_features * (-(-in_features // INT4_SPAN) * (INT4_SPAN // 2) + 2 * groups * SCALE_BYTES)
    raise ValueError(f"unknown quantization {method!r}: choose one of {', '.join(QUANTIZATION_WEIGHTS)}")


def lm_head_int8_bytes(facts: ModelFacts) -> int:
    """Bytes of the quantized lm_head (kvpager.model.lm_head): int8 [vocab, hidden], one float32 scale
    per output channel, in every --quantization mode; for tied embeddings an extra copy of the table."""
    return quantized_matrix_bytes(facts.vocab_size, facts.hidden_size, "int8", None)


def engine_weight_bytes(
    facts: ModelFacts,
    counts: ParamCounts,
    dtype: str,
    quantization: str | None,
    group: int | None,
    quantize_lm_head: bool = True,
) -> int:
    """Exactly what `kvpager serve --dtype DTYPE --quantization Q [--no-quantize-lm-head]` holds on the
    CPU: the projections packed; with `quantize_lm_head` the lm_head int8 per output channel (tied: the
    embedding in `dtype` and an int8 copy for the lm_head), else in `dtype` (tied embeddings once);
    the embedding in `dtype`; norms and biases in float32, the compute dtype of every CPU model
    (kvpager.model.precision's rule, docs/precision.md). `quantize_lm_head` applies with a quantization only."""
    if dtype not in ENGINE_DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(ENGINE_DTYPE_BYTES)}, got {dtype!r}")
    element = ENGINE_DTYPE_BYTES[dtype]
    compute = ENGINE_DTYPE_BYTES["float32"]
    if quantization is None:
        return (counts.embedding + counts.lm_head + counts.linear) * element + counts.other * compute
    shapes = engine_linear_shapes(facts)
    packed = sum(quantized_matrix_bytes(n, k, quantization, group) for n, k in shapes)
    dense = counts.total - sum(n * k for n, k in shapes) - counts.other
    if quantize_lm_head:
        packed += lm_head_int8_bytes(facts)
        dense -= counts.lm_head  # untied: the lm_head is no longer in `dtype` (tied: 0, the table stays)
    return packed + dense * element + counts.other * compute


def engine_format(
    dtype: str,
    quantization: str | None,
    group: int | None,
    quantize_lm_head: bool = True,
    facts: ModelFacts | None = None,
) -> WeightFormat:
    """A WeightFormat describing the engine's storage (bits_per_weight filled in by the caller); `facts`
    (when known) says whether the embeddings are tied and what the lm_head's int8 copy costs."""
    if quantization is None:
        return WeightFormat(dtype, 8.0 * ENGINE_DTYPE_BYTES[dtype], True, f"kvpager --dtype {dtype}: every tensor")
    if QUANTIZATION_WEIGHTS.get(quantization) == "int8":
        rule = "per output channel" if group is None else f"groups of {group}"
        text = f"kvpager {quantization}: symmetric int8, one float32 scale {rule}"
    else:
        text = f"kvpager {quantization}: asymmetric int4, float32 scale + offset per group of {group or 128}"
    if quantization in DYNAMIC_ACTIVATION_QUANTIZATIONS:
        text += f" (activations quantized to int8 per block of {ACTIVATION_BLOCK} at run time)"
    if not quantize_lm_head:
        rest = f"embedding, lm_head, norms and biases in {dtype}"  # --no-quantize-lm-head, or a GGUF file
    elif facts is not None and facts.tie_word_embeddings:
        rest = (
            f"lm_head int8 per output channel: a copy of the tied embedding, {lm_head_int8_bytes(facts):,} bytes "
            f"more than an unquantized tied lm_head (--no-quantize-lm-head: no copy); embedding, norms and biases in {dtype}"
        )
    else:
        rest = f"lm_head int8 per output channel; embedding, norms and biases in {dtype}"
    return WeightFormat(f"{quantization}-kvpager", 0.0, False, f"{text}; {rest} (exact engine bytes)")

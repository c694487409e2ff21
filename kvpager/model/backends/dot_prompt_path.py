"""Which path the integer-dot formats' prompt-sized batches take where the integer dot has VNNI.

There `dot_kernel_max_rows` sends the integer-dot kernel every batch. Above KERNEL_MAX_ROWS input rows
the exact packed-weight path is a different algorithm (dequantize chunks of the weight to float32,
then torch's GEMM), and which of the two is faster for prompts depends on the CPU (BENCHMARKS.md, the
1b linears at 256 and 512 rows, group 32): on an AMD Zen 5 the integer dot was 1.6-1.8x faster; on
an Intel Xeon, whose float32 GEMM ran 1.7x Zen 5's, the GEMM path was 1.3-1.5x faster. Both compute
the same quantized activations times the same dequantized weight; they differ by float32 rounding.

The choice is a fixed rule on the CPU's vendor, not a timing at start-up: a timing taken while other
processes load (replicas started together) chose the slower path, and a choice that moves between
starts would move a prompt's logits in their last bits. On an Intel CPU every integer-dot weight
sends batches over KERNEL_MAX_ROWS rows to the GEMM path (`prompt_rows`); decode batches stay on the
integer dot. Elsewhere the integer dot takes every batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path

from kvpager.model.backends.quant_dot import DYNAMIC_METHODS, DynamicActivations
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.backends.quant_weights import KERNEL_MAX_ROWS, PackedWeight

logger = logging.getLogger("kvpager.kernels")

GEMM_PROMPT_VENDORS = frozenset({"GenuineIntel"})


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's vendor string (x86 `vendor_id`), None where /proc/cpuinfo does not say."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return None


def prompt_rows_for(vendor: str | None) -> int | None:
    """The most rows the integer dot takes where it could take every batch (None: every batch)."""
    return KERNEL_MAX_ROWS if vendor in GEMM_PROMPT_VENDORS else None


def dynamic_weights(weights: Iterable[PackedWeight]) -> Iterator[DynamicActivations]:
    """The integer-dot weights among `weights`, inside GGUF row stacks and affine wrappers too."""
    stack = list(weights)
    while stack:
        weight = stack.pop()
        if isinstance(weight, DynamicActivations):
            yield weight
        stack.extend(getattr(weight, "parts", ()))  # NOTE: a RowStack's parts (kvpager.model.gguf_packed)
        inner = getattr(weight, "inner", None)  # NOTE: an AffineInt8Weight's int8 weight
        if isinstance(inner, PackedWeight):
            stack.append(inner)


def route_prompts(weights: Iterable[PackedWeight], vendor: str | None) -> dict[str, int]:
    """Sets `prompt_rows` on the CPU integer-dot weights that take every batch, by `vendor`'s rule;
    returns {weight format: rows} where prompts leave the integer dot (for the start-up log)."""
    kernels = quant_kernels_or_none()
    rows = prompt_rows_for(vendor)
    if kernels is None or rows is None:
        return {}
    routed: dict[str, int] = {}
    for weight in dynamic_weights(weights):
        if weight.device.type == "cpu" and weight.dot_rows(kernels) is None:
            weight.prompt_rows = rows
            routed[DYNAMIC_METHODS[weight.method]] = rows
    for weight_format in sorted(routed):
        logger.info(
            "integer-dot %s weights: batches over %d rows take the dequantize + float32 GEMM path on this "
            "%s CPU (faster there for prompts than the VNNI integer dot)",
            weight_format,
            rows,
            vendor,
        )
    return routed

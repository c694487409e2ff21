"""Which path the integer-dot formats' prompt-sized batches take, measured once at load on this CPU.

Where the integer-dot kernel has AVX-512 VNNI, `dot_kernel_max_rows` sends it every batch. Above
KERNEL_MAX_ROWS input rows the exact packed-weight path is a different algorithm (dequantize chunks
of the weight to float32, then torch's GEMM), and which of the two is faster depends on the CPU:
the integer dot won at 128-512 rows on an AMD Zen 5, torch's float32 GEMM won there on an Intel Xeon
with twice the float throughput (BENCHMARKS.md). Both compute the same quantized activations times the
same dequantized weight; they differ by float32 rounding only. So at load the largest weight of each
dot format is timed both ways at PROBE_ROWS rows; where the GEMM path is faster by MARGIN, every weight
of that format sends batches over KERNEL_MAX_ROWS rows to it (`prompt_rows`). Smaller batches (decode)
always take the integer dot there. Weights under MIN_WEIGHTS elements are not timed (the choice is
then the rule's), so a small model's results do not depend on a measurement.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from kvpager.model.backends.quant_dot import DYNAMIC_METHODS, DynamicActivations, fake_quantize_activations
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.backends.quant_weights import KERNEL_MAX_ROWS, PackedWeight

logger = logging.getLogger("kvpager.kernels")

PROBE_ROWS = 256
MIN_WEIGHTS = 1 << 22  # out x in: below this a timing says little about a real model's prompts
MARGIN = 1.15  # the GEMM path must be this much faster (a near tie keeps the integer dot)
REPEATS = 2  # timed calls per path after one warm-up, best kept


@dataclass(frozen=True, slots=True)
class PromptPathChoice:
    """The measurement behind one format's choice."""

    weight_format: str  # "int8" | "int4"
    shape: tuple[int, int]
    dot_s: float
    gemm_s: float

    @property
    def gemm_wins(self) -> bool:
        return gemm_is_faster(self.dot_s, self.gemm_s)


def gemm_is_faster(dot_s: float, gemm_s: float) -> bool:
    """Whether prompts should leave the integer dot for the GEMM path (faster by MARGIN)."""
    return gemm_s * MARGIN < dot_s


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


def _best_time(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()  # NOTE: warm-up (first-touch of scratch buffers, the library's first call)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(weight: DynamicActivations, rows: int = PROBE_ROWS) -> tuple[float, float]:
    """(integer-dot seconds, GEMM-path seconds) for `rows` input rows through `weight`."""
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(0))
    xq = fake_quantize_activations(x)
    dot_s = _best_time(lambda: weight.dot_kernel(x))
    gemm_s = _best_time(lambda: weight.exact_matmul(xq, None))
    return dot_s, gemm_s


def choose_prompt_paths(weights: Iterable[PackedWeight], min_weights: int = MIN_WEIGHTS) -> list[PromptPathChoice]:
    """Times each dot format's largest weight (where the integer dot takes every batch here) and sets
    `prompt_rows` = KERNEL_MAX_ROWS on every weight of a format whose GEMM path won; the choices made."""
    kernels = quant_kernels_or_none()
    if kernels is None:
        return []
    by_format: dict[str, list[DynamicActivations]] = {}
    for weight in dynamic_weights(weights):
        if weight.device.type == "cpu" and weight.dot_rows(kernels) is None:
            by_format.setdefault(DYNAMIC_METHODS[weight.method], []).append(weight)
    choices = []
    for weight_format, group in sorted(by_format.items()):
        largest = max(group, key=lambda w: w.out_features * w.in_features)
        if largest.out_features * largest.in_features < min_weights:
            continue
        dot_s, gemm_s = measure(largest)
        choice = PromptPathChoice(weight_format, (largest.out_features, largest.in_features), dot_s, gemm_s)
        if choice.gemm_wins:
            for weight in group:
                weight.prompt_rows = KERNEL_MAX_ROWS
        logger.info(
            "integer-dot %s prompts: %d rows through a %dx%d weight took %.1f ms on the integer dot, %.1f ms "
            "dequantized + GEMM: batches over %d rows take the %s",
            weight_format,
            PROBE_ROWS,
            *choice.shape,
            dot_s * 1e3,
            gemm_s * 1e3,
            KERNEL_MAX_ROWS,
            "GEMM path" if choice.gemm_wins else "integer dot",
        )
        choices.append(choice)
    return choices

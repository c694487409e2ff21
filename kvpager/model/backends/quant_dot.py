"""w8a8_int8 / w4a8_int8: int8 / int4 packed weights times activations quantized to int8 per call (not exact).

The weights are exactly those of `int8` / `int4` (quant_weights.py: the same layout, group options and
round-to-nearest quantization at load); what changes is the matmul. Each call quantizes every input
row per block of ACTIVATION_BLOCK = 32 features (symmetric: d = max|x| / 127, q = round-half-even(x / d),
clamped to +-127; an all-zero block gets d = 0). Up to `dot_kernel_max_rows` rows the kernel
(kernels/quant_dot.cpp) then takes exact integer dot products of weight and activation blocks, scales
each by d and each group by the weight's scale, and accumulates in float32. int4's groups are
asymmetric (w = code * scale + offset, codes 0..15 unsigned: no sign handling needed); the offset term
is offset * (the group's sum of the quantized activations). So a layer computes
`F.linear(fake_quantize_activations(x), dequantize(w))` up to float32 rounding of the accumulation:
that is the torch reference (`reference_matmul`), and what larger batches, CUDA and a machine without
a compiler run (the quantized activations through the exact packed-weight path of quant_weights.py).
Group sizes must be multiples of 32 (a block never straddles two groups); int8 may also be per output
channel (one group of any width) or group 16 (two scales per block, one per half of 16: GGUF Q6_K; the
user-facing --quantization-group-size keeps multiples of 32).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpager.core.cpuinfo import PROC_CPUINFO, read_cpuinfo
from kvpager.model.backends.bf16_linear import native_bf16_matmul_available
from kvpager.model.backends.quant_kernels import (
    LEVEL_AVX2,
    LEVEL_AVX512,
    QuantKernels,
    load_quant_kernels,
    quant_kernels_or_none,
)
from kvpager.model.backends.quant_weights import (
    AMX_DEQUANT_MAX_ROWS,
    KERNEL_MAX_ROWS,
    Int4Weight,
    Int8Weight,
    PackedWeight,
)

ACTIVATION_BLOCK = 32
# Up to this many input rows the integer-dot kernel runs. Beyond, the quantized activations go through the
# exact kernel's shared L1 tile (dequantized once per call, float32 FMAs reused by every row). Where the
# exact kernels have AVX-512 but the integer dot only AVX2 (no VNNI: twice the float lanes against it),
# the integer kernel gains only where dequantizing dominates: a few rows.
DOT_KERNEL_MAX_ROWS = 4
# Where the exact kernels run AVX2 too, on Intel CPUs (GEMM_PROMPT_VENDORS) the integer dot stays faster up
# to these decode batches (measured on AMD Zen 1, before the panels: BENCHMARKS.md); int8's sign handling
# makes it fall behind sooner than int4. Elsewhere every batch stays on the dot (dot_kernel_max_rows).
DOT_KERNEL_MAX_ROWS_AVX2 = {"int8": 16, "int4": 32}
# Where the integer dot has AVX-512 VNNI (vpdpbusd; group 32 two blocks per 512-bit vector), it is
# faster than the exact kernel's L1 tile at every decode batch. Over KERNEL_MAX_ROWS rows the exact path
# is another algorithm (dequantized chunks, torch's float32 GEMM), and which is faster for prompts
# depends on the CPU (BENCHMARKS.md, the 1b linears at 256 and 512 rows, group 32): on an AMD Zen 5 the
# integer dot by 1.6-1.8x, on an Intel Xeon (float32 GEMM 1.7x Zen 5's) the GEMM path by 1.3-1.5x. So
# on these vendors' CPUs prompts take the GEMM path; elsewhere the integer dot takes every batch. A fixed
# rule, not a timing at start-up: a timing taken while other engines loaded chose the slower path, and a
# choice moving between starts would move logits (the two paths differ by float32 rounding).
GEMM_PROMPT_VENDORS = frozenset({"GenuineIntel"})
# On CPUs with native bfloat16 matmul (AVX512-BF16 / AMX: oneDNN's bf16 GEMM), batches of more than
# BF16_GEMM_AFTER_ROWS rows go to the dequantized weight rounded to bfloat16 times the activations
# rounded to bfloat16 in oneDNN (float32 accumulation, the result rounded to bfloat16: Bf16Weight's
# arithmetic), whatever the vendor: on an AMD Zen 4 that GEMM is 1.4-2.0x the integer dot at 128-512
# rows and level with it at 64 (BENCHMARKS.md). Not the integer-dot arithmetic: a prompt's rows carry
# bfloat16 rounding where decode rows carry the int8 activations' (both stated in docs/internals.md).
BF16_GEMM_AFTER_ROWS = 64
DYNAMIC_METHODS = {"w8a8_int8": "int8", "w4a8_int8": "int4"}  # method -> the packed weight format it stores


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, B, 32], d float32 [M, B]), B = ceil(K / 32), the last block zero-padded."""
    rows, k = x.shape
    blocks = F.pad(x.float(), (0, -k % ACTIVATION_BLOCK)).view(rows, -1, ACTIVATION_BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = (blocks / safe[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q, d


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 as the kernels see it: d * q per block of 32 (float32)."""
    x2 = x.reshape(-1, x.shape[-1])
    q, d = quantize_activations(x2)
    return (q.float() * d[..., None]).flatten(1)[:, : x.shape[-1]].view(x.shape)


def reference_matmul(weight: PackedWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of a dynamic weight's matmul: the quantized activations times the dequantized
    weight, in float64 (the kernels differ from it by their float32 accumulation only)."""
    xq = fake_quantize_activations(x.float()).double()
    out = xq @ weight.dequantize(torch.float64).T
    return out + bias.double() if bias is not None else out


def dot_kernel_max_rows(
    weight_format: str, exact_level: int, dot_level: int, vendor: str | None = None, native_bf16: bool = False
) -> int | None:
    """The most input rows the integer-dot kernel takes for a `weight_format` ("int8" | "int4") weight
    whose exact kernels run at `exact_level` and integer dot at `dot_level` (quant_kernels.LEVEL_*;
    LEVEL_AVX512 for the dot: its VNNI build) on a CPU of `vendor` (x86 `vendor_id`), with native
    bfloat16 matmul or not; more rows take the bfloat16 GEMM where `native_bf16`, else the exact path.
    None: every batch."""
    if bf16_gemm_prompts(dot_level, native_bf16):
        return BF16_GEMM_AFTER_ROWS
    if dot_level == LEVEL_AVX512:
        return KERNEL_MAX_ROWS if vendor in GEMM_PROMPT_VENDORS else None
    if exact_level != LEVEL_AVX2:
        return DOT_KERNEL_MAX_ROWS
    if vendor not in GEMM_PROMPT_VENDORS:
        # off Intel (whose float32 GEMM is faster: GEMM_PROMPT_VENDORS), batches of kvq_dot_panel_rows (12)
        # rows or more take the integer dot's 8-row panels (kernels/quant_dot_gemm.inc), ahead of the exact
        # path on AMD Zen 2 (BENCHMARKS.md: int4 1.3-1.5x at 1024 rows; 512-token prompts of a Q8_0 file
        # 1.16-1.22x; the one-row int8 tiles also lead it below the panels): every batch stays on the dot
        return None
    return DOT_KERNEL_MAX_ROWS_AVX2[weight_format]


def bf16_gemm_prompts(dot_level: int, native_bf16: bool) -> bool:
    """Whether batches past dot_kernel_max_rows take the bfloat16 GEMM (else the exact path): where the
    integer dot runs its VNNI build (every CPU with AVX512-BF16 or AMX has VNNI) and native_bf16."""
    return native_bf16 and dot_level == LEVEL_AVX512


def read_cpu_vendor(cpuinfo: Path) -> str | None:
    """The vendor `cpuinfo` (a /proc/cpuinfo) names (x86 `vendor_id`), None where it names none."""
    return read_cpuinfo(cpuinfo).get("vendor_id")


@functools.cache
def cpu_vendor() -> str | None:
    """This machine's CPU vendor, read once (dot_rows asks on every call)."""
    return read_cpu_vendor(PROC_CPUINFO)


@functools.cache
def native_bf16() -> bool:
    """Whether oneDNN has native bfloat16 matmul here (AVX512-BF16 / AMX), asked once."""
    return native_bf16_matmul_available()


def check_dynamic_group(method: str, group: int, in_features: int) -> None:
    """Refuse a group size the integer-dot kernels cannot run (not a multiple of the activation block)."""
    per_channel = method == "w8a8_int8" and group == in_features
    # int8 at group 16: two scales per activation block, one per half (GGUF Q6_K's blocks)
    halves = method == "w8a8_int8" and group == ACTIVATION_BLOCK // 2
    if group % ACTIVATION_BLOCK != 0 and not per_channel and not halves:
        raise ValueError(
            f"{method}: the quantization group size must be a multiple of {ACTIVATION_BLOCK} (the activation "
            f"block), got {group}"
        )


class _DynamicActivations(PackedWeight):
    """The matmul of the dynamic formats (mixed into Int8Weight / Int4Weight)."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernels = quant_kernels_or_none() if x.device.type == "cpu" and self.device.type == "cpu" else None
        x2 = x.reshape(-1, self.in_features)
        limit = self.dot_rows(kernels) if kernels is not None else 0
        if kernels is not None and limit is not None and x2.shape[0] > limit and self.bf16_prompts(kernels):
            out = self.prompt_matmul(x2, bias, kernels)
            return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if kernels is None or (limit is not None and x2.shape[0] > limit):
            # the same quantized activations (float32) through the exact packed-weight path (L1 tile / GEMM)
            out = self.exact_matmul(fake_quantize_activations(x.float()), bias)
            return out.to(x.dtype)
        return self.dot_kernel(x2, bias).to(x.dtype).view(*x.shape[:-1], self.out_features)

    def prompt_matmul(self, x2: torch.Tensor, bias: torch.Tensor | None, kernels: QuantKernels) -> torch.Tensor:
        """A batch past dot_rows in bfloat16 arithmetic: up to AMX_DEQUANT_MAX_ROWS rows in AMX tiles on
        the weight dequantized in cache (tiled_bf16_matmul) where they run, else oneDNN's GEMM on it
        dequantized in chunks (bf16_matmul)."""
        if x2.shape[0] <= AMX_DEQUANT_MAX_ROWS:
            out = self.tiled_bf16_matmul(x2, bias, kernels)
            if out is not None:
                return out
        return self.bf16_matmul(x2, bias)

    def exact_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x through the exact packed-weight path of the stored format (quant_weights.py)."""
        return super().matmul(x, bias)

    def dot_rows(self, kernels: QuantKernels) -> int | None:
        """The most input rows this weight sends to the integer-dot kernel here (dot_kernel_max_rows;
        None: every batch)."""
        level = self._level(kernels)
        return dot_kernel_max_rows(
            DYNAMIC_METHODS[self.method], level, int(kernels.dot_level(level)), cpu_vendor(), native_bf16()
        )

    def bf16_prompts(self, kernels: QuantKernels) -> bool:
        """Whether batches past dot_rows take the bfloat16 GEMM here (bf16_gemm_prompts), else the exact path."""
        return bf16_gemm_prompts(int(kernels.dot_level(self._level(kernels))), native_bf16())

    def dot_kernel(self, x2: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x2 [M, in] through the integer-dot kernel at any M (its path: `max_level`) -> float32 [M, out]."""
        kernels = load_quant_kernels()
        xf = x2.float().contiguous()
        rows = xf.shape[0]
        out = torch.empty((rows, self.out_features), dtype=torch.float32)
        b = bias.float().contiguous() if bias is not None else None  # NOTE: held while the kernel reads it
        w, scales, offsets = self._pointers()
        rc = kernels.dot_linear(
            self.kernel_fmt(), xf.data_ptr(), rows, self.in_features, w, scales, offsets, self.out_features,
            self.group_size, b.data_ptr() if b is not None else None, out.data_ptr(), torch.get_num_threads(),
            self._level(kernels),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(
                f"{self.method}: the integer-dot kernel refused format {self.kernel_fmt()} with group size "
                f"{self.group_size} (groups must be multiples of 32 or the whole row)"
            )
        return out


class Int8DotWeight(_DynamicActivations, Int8Weight):
    """int8 weights (symmetric, as Int8Weight) times int8 activations quantized per block of 32."""

    method = "w8a8_int8"
    # rows four at a time (kernels/int4_rows.h), as Int4DotWeight, where the integer dot's path is AVX2 or
    # portable: the VNNI build reads int8 blocks in 512-bit pairs of plain rows and has no interleaved form
    INTERLEAVE = True

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, interleave: bool | None = None
    ) -> None:
        check_dynamic_group(self.method, group_size, qweight.shape[1])
        if interleave is None:
            interleave = self.INTERLEAVE and _int8_rows_interleave_here()
        super().__init__(qweight, scales, group_size, interleave)


class Int4DotWeight(_DynamicActivations, Int4Weight):
    """int4 weights (asymmetric, as Int4Weight) times int8 activations quantized per block of 32."""

    method = "w4a8_int8"
    # rows four at a time (kernels/int4_rows.h): the integer-dot tile of four output rows (decode) reads
    # one stream of memory instead of four
    INTERLEAVE = True

    def __init__(
        self,
        packed: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        group_size: int,
        in_features: int,
        interleave: bool | None = None,
    ) -> None:
        check_dynamic_group(self.method, group_size, in_features)
        super().__init__(packed, scales, offsets, group_size, in_features, interleave)


def _int8_rows_interleave_here() -> bool:
    """Whether interleaved int8 rows pay on this CPU: the integer dot's default path is below VNNI."""
    kernels = quant_kernels_or_none()
    return kernels is not None and int(kernels.dot_level(kernels.default_level)) < LEVEL_AVX512


def quantize_dynamic(weight: torch.Tensor, method: str, group_size: int | None) -> PackedWeight:
    """`weight` [N, K] for `method` ("w8a8_int8" | "w4a8_int8"): the int8 / int4 round-to-nearest weights."""
    if method == "w8a8_int8":
        return Int8DotWeight.from_float(weight, group_size)
    if method == "w4a8_int8":
        return Int4DotWeight.from_float(weight, group_size or 128)
    raise ValueError(f"unknown dynamic quantization {method!r}")

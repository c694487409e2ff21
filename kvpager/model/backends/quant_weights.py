"""Linear weights stored packed: bfloat16, float16, int8 and int4 (weight-only quantization), each with its matmul.

A packed weight replaces an `nn.Linear`'s weight tensor after loading; the ops (ops.py) hand any
weight that is not a tensor to its own `matmul(x, bias)`. Formats (docs/internals.md):

- `Bf16Weight`, `F16Weight` (`HalfWeight`s): the bfloat16 / float16 tensor itself (no copy), read by
  the kernel (widened in registers). `DenseWeight`, their base: any float tensor, multiplied in torch.
- `Int8Weight`: symmetric, w = q * scale, q in [-127, 127] int8, one scale per output channel and group
  of `group_size` input features (per output channel: group_size = in_features).
  GGUF Q8_0 (blocks of 32 int8 with an fp16 scale) is `Int8Weight(qs, d, 32)` exactly, d float16.
  Rows may be stored interleaved as int4's are (below; `qweight`-taking APIs and `plain_qweight` use
  the plain layout).
- `Int4Weight`: asymmetric, w = code * scale + offset, code in [0, 15], a scale and a float32 offset per
  output channel and group (group_size a multiple of 16); or symmetric (offsets None), w = (code - 8) *
  scale, which holds no offsets. GGUF Q4_0 (w = (q - 8) * d) is `Int4Weight.from_codes(q, d, None, 32)`
  exactly, d float16; Q4_1 and Q4_K (w = q * d + m) the asymmetric form. Rows may be stored
  interleaved four at a time (`interleave`, the integer-dot classes' default: kernels/int4_rows.h), so a
  kernel tile of four output rows reads one stream of memory instead of four; the codes and results
  are the same, and `packed`-taking APIs (the constructor, `plain_packed`, the digest) use the plain layout.

Scales are float32, or float16 when given as float16 (GGUF Q8_0 / Q4_0 hold the file's float16 scales,
which widen to float32 exactly: the same values in fewer bytes, so fewer bytes read per token); the
kernels take the format with FMT_HALF_SCALES set. Round-to-nearest quantization at load gives float32.

`matmul`: on the CPU with the kernels (kernels/quant.cpp) up to KERNEL_MAX_ROWS input rows read the
packed bytes directly (1-2 rows: dequantize in registers; more: an L1 tile dequantized once and used
by every row; float32 accumulation); larger batches (prefill) dequantize DEQUANT_CHUNK_ROWS output
rows at a time into float32 and run torch's GEMM (the dequantization cost is shared by every row). Elsewhere (CUDA, no compiler) the whole weight is dequantized per call: correct,
not fast. `dequantize()` is the torch reference the tests hold the kernels to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from kvpager.model.backends.quant_kernels import (
    FMT_BF16,
    FMT_F16,
    FMT_HALF_SCALES,
    FMT_INT4,
    FMT_INT8,
    FMT_ROWS4,
    LEVEL_AVX512,
    QuantKernels,
    load_quant_kernels,
    quant_kernels_or_none,
)

# up to this many input rows the kernel's shared L1 tile beat dequantize + torch's float32 GEMM (2048 x 2048,
# every format, 32-128 rows); beyond it the GEMM path amortises the dequantization over the rows
KERNEL_MAX_ROWS = 128
# batches of more than this many rows over a bfloat16 weight go to oneDNN's bf16 GEMM (AMX / AVX512-BF16):
# the packed-weight kernel (float32 activations, the weight widened in registers) streams one or two rows
# at the weight's read speed, but its arithmetic grows with every row, while oneDNN's stays near the read
# (BENCHMARKS.md, "bfloat16 decode steps in oneDNN")
NATIVE_BF16_AFTER_ROWS = 2
# batches of more than NATIVE_BF16_AFTER_ROWS and up to this many rows over a bfloat16 weight run in the AMX
# tile kernel where the CPU has it (kernels/amx_bf16.cpp: the plain weight read once per 32 rows, no reorder);
# larger batches in oneDNN's GEMM, whose blocked kernels reuse each weight tile across more rows and
# overtook the tiles between 384 and 512 rows (1b shapes, 2 threads)
AMX_MAX_ROWS = 256
AMX_TILE = 32  # the AMX kernels' weights: dimensions in whole tiles of 32
# prompt batches of a packed weight (past the integer dot's rows) up to this many rows run in AMX tiles on the
# weight dequantized 32 rows at a time in cache (tiled_bf16_matmul); larger ones dequantize it in chunks for
# oneDNN's GEMM (bf16_matmul), whose round trip through memory the larger batch amortizes
AMX_DEQUANT_MAX_ROWS = 512
DEQUANT_CHUNK_ROWS = 512  # output rows dequantized at a time for the GEMM path (a bounded scratch)
BF16_CHUNK_BYTES = 4 << 20  # bytes of bfloat16 weight rows dequantized at a time for bf16_matmul
INT4_SPAN = 16  # weights per 8-byte span of the int4 layout (byte j: weight j low nibble, j + 8 high)
ROW_GROUP, ROW_CHUNK = 4, 32  # interleaved int4 / int8: rows per group, bytes of a row per turn (int4_rows.h)
QUANTIZE_CHUNK_ROWS = 256  # rows quantized at a time (bounds the float32 scratch while loading)


class PackedWeight:
    """A linear weight [out_features, in_features] in a packed format; see the module docstring."""

    fmt: int
    out_features: int
    in_features: int
    group_size: int
    method: str

    def __init__(self) -> None:
        # the highest kernel path to take (quant_kernels.LEVEL_*); None: the default (CPU, $KVPAGER_KERNEL_ISA)
        self.max_level: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.tensors()[0].device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The stored tensors, weights first: what nbytes and the digest cover."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a dense [out, in] tensor (the reference the kernels are tested against)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def digest_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the digest covers: the stored ones, in a layout that does not depend on how the
        kernels read them."""
        return self.tensors()

    def update_digest(self, h: hashlib._Hash) -> None:
        """Feed the method, shape and stored bytes to `h` (the KV fingerprint commits to them)."""
        h.update(f"{self.method}:{self.out_features}x{self.in_features}:g{self.group_size}".encode())
        for t in self.digest_tensors():
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] @ w.T (+ bias) -> [..., out] in x's dtype."""
        kernels = quant_kernels_or_none() if x.device.type == "cpu" and self.device.type == "cpu" else None
        if kernels is None:
            return F.linear(x, self.dequantize(x.dtype).to(x.device), bias)
        x2 = x.reshape(-1, self.in_features)
        rows = x2.shape[0]
        if rows > KERNEL_MAX_ROWS:
            out = self._gemm(x2, kernels)
            if bias is not None:
                out += bias.float()
        else:
            xf = x2.float().contiguous()
            out = torch.empty((rows, self.out_features), dtype=torch.float32)
            b = bias.float().contiguous() if bias is not None else None  # NOTE: held while the kernel reads it
            w, scales, offsets = self._pointers()
            kernels.linear(
                self.kernel_fmt(),
                xf.data_ptr(),
                rows,
                self.in_features,
                w,
                scales,
                offsets,
                self.out_features,
                self.group_size,
                b.data_ptr() if b is not None else None,
                out.data_ptr(),
                torch.get_num_threads(),
                self._level(kernels),
            )
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def kernel_fmt(self) -> int:
        """The format value the kernels take for this weight (quant_kernels.FMT_*)."""
        return self.fmt

    def _level(self, kernels: QuantKernels) -> int:
        return kernels.default_level if self.max_level is None else self.max_level

    def _gemm(self, x2: torch.Tensor, kernels: QuantKernels) -> torch.Tensor:
        """Large batches: dequantize DEQUANT_CHUNK_ROWS output rows at a time, torch's GEMM on each."""
        chunk = min(DEQUANT_CHUNK_ROWS, self.out_features)
        return self._chunked_gemm(x2.float().contiguous(), kernels.dequant, chunk, kernels)

    def bf16_matmul(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x2 [M, in] @ w.T (+ bias) -> float32 [M, out] in bfloat16 arithmetic: the weight dequantized
        and rounded to bfloat16 (kernels.dequant_bf16) BF16_CHUNK_BYTES at a time, x2 rounded to
        bfloat16, oneDNN's bf16 GEMM on each chunk (float32 accumulation, the result rounded to
        bfloat16), the bias added after in float32. The large-batch path where the CPU has native
        bfloat16 matmul (AVX512-BF16 / AMX); on any other CPU torch computes the same, slowly. The
        reference: F.linear(x2.bfloat16(), dequantize(torch.bfloat16)) in float32."""
        kernels = load_quant_kernels()
        chunk = max(16, min(self.out_features, BF16_CHUNK_BYTES // (2 * self.in_features)))
        out = self._chunked_gemm(x2.to(torch.bfloat16).contiguous(), kernels.dequant_bf16, chunk, kernels)
        if bias is not None:
            out += bias.float()
        return out

    def tiled_bf16_matmul(
        self, x2: torch.Tensor, bias: torch.Tensor | None, kernels: QuantKernels
    ) -> torch.Tensor | None:
        """x2 [M, in] @ w.T (+ bias) -> float32 [M, out] in AMX tiles, each thread dequantizing the 32
        weight rows it multiplies next into a scratch of its own (kvq_amx_dequant_linear): the weight
        dequant_bf16 writes and x2 rounded to bfloat16, as bf16_matmul multiplies them, accumulated in
        float32 and not rounded after; the bfloat16 weight is never written out whole. None where the
        kernel does not take it: no AMX here, capped below AVX-512, dimensions not multiples of 32."""
        if not kernels.amx_bf16 or self._level(kernels) < LEVEL_AVX512 or x2.device.type != "cpu":
            return None
        if self.in_features % AMX_TILE or self.out_features % AMX_TILE:
            return None
        rows = x2.shape[0]
        xf = x2.float().contiguous()
        out = torch.empty((rows, self.out_features), dtype=torch.float32)
        w, scales, offsets = self._pointers()
        rc = kernels.amx_dequant_linear(
            self.kernel_fmt(), w, scales, offsets, self.out_features, self.in_features, self.group_size,
            self._level(kernels), xf.data_ptr(), rows, out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:  # no memory for its scratch: the caller's GEMM instead
            return None
        if bias is not None:
            out += bias.float()
        return out

    def _chunked_gemm(self, x: torch.Tensor, dequant: Any, chunk: int, kernels: QuantKernels) -> torch.Tensor:
        """float32 x @ w.T, `chunk` output rows of the weight dequantized at a time by `dequant` (a
        kernels entry writing x's dtype) into one scratch, torch's GEMM on each."""
        out = torch.empty((x.shape[0], self.out_features), dtype=torch.float32)
        scratch = torch.empty((chunk, self.in_features), dtype=x.dtype)
        w, scales, offsets = self._pointers()
        for n0 in range(0, self.out_features, chunk):
            n1 = min(self.out_features, n0 + chunk)
            buf = scratch[: n1 - n0]
            dequant(
                self.kernel_fmt(), w, scales, offsets, self.out_features, self.in_features, self.group_size,
                n0, n1, buf.data_ptr(), torch.get_num_threads(), self._level(kernels),
            )  # fmt: skip
            out[:, n0:n1] = F.linear(x, buf)
        return out

    def _pointers(self) -> tuple[int, int | None, int | None]:
        raise NotImplementedError


class DenseWeight(PackedWeight):
    """A float tensor as a packed weight (the tensor itself, no copy), multiplied in torch: the float
    part of a fused GGUF projection whose other parts are packed, and the base of the 16-bit weights."""

    method = "dense"

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if weight.dim() != 2 or not weight.dtype.is_floating_point:
            raise ValueError(
                f"{type(self).__name__} needs a 2-D float tensor, got {weight.dtype} {tuple(weight.shape)}"
            )
        self.weight = weight.contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.group_size = self.in_features

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.weight,)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


class HalfWeight(DenseWeight):
    """A 16-bit float weight (bfloat16 or float16) read by the packed-weight kernel: widened to float32
    in registers, float32 accumulation (not a quantization: KV fingerprints do not commit to it)."""

    dtype: torch.dtype

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype != self.dtype or weight.dim() != 2:
            raise ValueError(
                f"{type(self).__name__} needs a 2-D {self.method} tensor, got {weight.dtype} {tuple(weight.shape)}"
            )
        super().__init__(weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return PackedWeight.matmul(self, x, bias)  # the kernels (DenseWeight's torch matmul is the fallback)

    def _pointers(self) -> tuple[int, int | None, int | None]:
        return self.weight.data_ptr(), None, None


class Bf16Weight(HalfWeight):
    """A bfloat16 weight; batches of more than NATIVE_BF16_AFTER_ROWS rows on CPUs with AMX / AVX512-BF16
    in bfloat16 arithmetic (activations rounded to bfloat16, float32 accumulation): up to AMX_MAX_ROWS in
    the AMX tile kernel where it runs, otherwise in oneDNN's bf16 GEMM."""

    fmt, method, dtype = FMT_BF16, "bfloat16", torch.bfloat16

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).shape[0]
        if rows > NATIVE_BF16_AFTER_ROWS and _native_bf16():
            kernels = self._amx_kernels(rows) if x.device.type == "cpu" else None
            if kernels is not None:
                out = self._amx_matmul(x, rows, kernels).to(x.dtype)
            else:
                out = self.bf16_product(x).to(x.dtype)  # oneDNN's bf16 GEMM (AMX)
            # the bias (Qwen2's) stays in the compute dtype: added after, in float32
            return out + bias.to(out.dtype) if bias is not None else out
        return super().matmul(x, bias)

    def onednn_takes(self, rows: int) -> bool:
        """Whether `matmul` of `rows` CPU rows runs oneDNN's bf16 GEMM (a bfloat16 product, widened after)."""
        return rows > NATIVE_BF16_AFTER_ROWS and _native_bf16() and self._amx_kernels(rows) is None

    def bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's bf16 GEMM as `matmul` runs it, its bfloat16 result kept (no bias): for a caller whose
        next step reads bfloat16 (CpuKernelOps.mlp)."""
        return F.linear(x.to(torch.bfloat16), self.weight)

    def _amx_kernels(self, rows: int) -> QuantKernels | None:
        """The kernels where the AMX tile kernel takes a CPU batch of `rows`, else None: up to
        AMX_MAX_ROWS rows, AMX usable here and not capped below AVX-512 (max_level, $KVPAGER_KERNEL_ISA),
        a CPU weight whose dimensions are multiples of 32 (whole tiles)."""
        if rows > AMX_MAX_ROWS or self.weight.device.type != "cpu":
            return None
        if self.in_features % AMX_TILE or self.out_features % AMX_TILE:
            return None
        kernels = quant_kernels_or_none()
        if kernels is None or not kernels.amx_bf16 or self._level(kernels) < LEVEL_AVX512:
            return None
        return kernels

    def _amx_matmul(self, x: torch.Tensor, rows: int, kernels: QuantKernels) -> torch.Tensor:
        xf = x.reshape(rows, self.in_features).float().contiguous()
        out = torch.empty((rows, self.out_features), dtype=torch.float32)
        done = kernels.amx_bf16_linear(
            xf.data_ptr(), rows, self.weight.data_ptr(), self.out_features, self.in_features, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if done != 0:  # the kernel refused (no memory for the packed rows): oneDNN's GEMM instead
            out = self.bf16_product(xf).float()
        return out.view(*x.shape[:-1], self.out_features)


class F16Weight(HalfWeight):
    """A float16 weight (F16C's vcvtph2ps widens it exactly); large batches dequantize in chunks."""

    fmt, method, dtype = FMT_F16, "float16", torch.float16


HALF_WEIGHTS: dict[torch.dtype, type[HalfWeight]] = {torch.bfloat16: Bf16Weight, torch.float16: F16Weight}


class _ScaledWeight(PackedWeight):
    """A quantized weight with per-group scales, float32 or float16 (see the module docstring)."""

    scales: torch.Tensor

    def kernel_fmt(self) -> int:
        return self.fmt | FMT_HALF_SCALES if self.scales.dtype == torch.float16 else self.fmt


def _stored_scales(scales: torch.Tensor) -> torch.Tensor:
    """Scales as held: float16 kept (GGUF's own, exact), any other dtype as float32."""
    return (scales if scales.dtype == torch.float16 else scales.float()).contiguous()


class Int8Weight(_ScaledWeight):
    """Symmetric int8, group-wise along the input (group_size = in_features: per output channel).

    `qweight` is given in the plain layout; `interleave` (None: the class's INTERLEAVE) stores its rows
    interleaved four at a time where they are whole 32-byte chunks, as Int4Weight does."""

    fmt, method = FMT_INT8, "int8"
    INTERLEAVE = False
    # longer rows stay plain whatever `interleave` says: four rows of 8 KB (K = 8192) are streams long
    # enough for the hardware prefetcher, and interleaved they read slower at batch 1 (rows of 2 KB, faster)
    INTERLEAVE_MAX_ROW_BYTES = 4096

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, interleave: bool | None = None
    ) -> None:
        super().__init__()
        out_features, in_features = qweight.shape
        _check_groups(qweight, scales, group_size, in_features, "Int8Weight")
        if qweight.dtype != torch.int8:
            raise ValueError(f"Int8Weight needs int8 values, got {qweight.dtype}")
        self.interleave = self.INTERLEAVE if interleave is None else interleave
        short = in_features <= self.INTERLEAVE_MAX_ROW_BYTES
        self.interleaved = self.interleave and short and _interleavable(qweight)
        self.qweight = interleave_rows(qweight) if self.interleaved else qweight.contiguous()
        self.scales = _stored_scales(scales)
        self.out_features, self.in_features, self.group_size = out_features, in_features, group_size

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, group_size: int | None = None, interleave: bool | None = None
    ) -> Int8Weight:
        """Round-to-nearest: scale = max|w| / 127 per group (a zero group gets scale 1)."""
        out_features, in_features = weight.shape
        group = group_size or in_features
        num_groups = -(-in_features // group)
        q = torch.empty((out_features, in_features), dtype=torch.int8, device=weight.device)
        scales = torch.empty((out_features, num_groups), dtype=torch.float32, device=weight.device)
        for r0 in range(0, out_features, QUANTIZE_CHUNK_ROWS):
            w = _grouped(
                weight[r0 : r0 + QUANTIZE_CHUNK_ROWS].to(torch.float32, copy=True), group
            )  # NOTE: a copy: scratch edited in place
            s = w.abs().amax(-1) / 127.0
            s = torch.where(s > 0, s, torch.ones_like(s))
            q[r0 : r0 + QUANTIZE_CHUNK_ROWS] = (
                w.div_(s[..., None]).round_().clamp_(-127, 127).flatten(1)[:, :in_features].to(torch.int8)
            )
            scales[r0 : r0 + QUANTIZE_CHUNK_ROWS] = s
        return cls(q, scales, group, interleave)

    def kernel_fmt(self) -> int:
        return super().kernel_fmt() | (FMT_ROWS4 if self.interleaved else 0)

    def plain_qweight(self) -> torch.Tensor:
        """The values [N, K] int8 in the plain layout (a copy where stored interleaved)."""
        return plain_rows(self.qweight) if self.interleaved else self.qweight

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.qweight, self.scales)

    def digest_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.plain_qweight(), self.scales)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scales = self.scales.float().repeat_interleave(self.group_size, dim=1)[:, : self.in_features]
        return (self.plain_qweight().float() * scales).to(dtype)

    def _pointers(self) -> tuple[int, int | None, int | None]:
        return self.qweight.data_ptr(), self.scales.data_ptr(), None


SYMMETRIC_OFFSET = -8.0  # a symmetric group's offset per unit of its scale: codes 0..15 stand for -8..7


class Int4Weight(_ScaledWeight):
    """int4, group-wise along the input, two codes per byte: w = code * scale + offset (asymmetric), or
    w = (code - 8) * scale (symmetric: offsets None, none stored; the kernels take -8 * scale).

    `packed` is given in the plain layout; `interleave` (None: the class's INTERLEAVE) stores its rows
    interleaved four at a time where they are whole 32-byte chunks (`interleaved` says whether it did)."""

    fmt, method = FMT_INT4, "int4"
    INTERLEAVE = False

    def __init__(
        self,
        packed: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        group_size: int,
        in_features: int,
        interleave: bool | None = None,
    ) -> None:
        super().__init__()
        out_features = packed.shape[0]
        if packed.dtype != torch.uint8 or packed.shape[1] != -(-in_features // INT4_SPAN) * (INT4_SPAN // 2):
            raise ValueError(f"Int4Weight: packed must be uint8 [N, ceil(K / 16) * 8], got {tuple(packed.shape)}")
        if group_size % INT4_SPAN != 0:
            raise ValueError(f"int4 group size must be a multiple of {INT4_SPAN}, got {group_size}")
        _check_groups(packed, scales, group_size, in_features, "Int4Weight")
        if offsets is not None and offsets.shape != scales.shape:
            raise ValueError(f"Int4Weight: offsets {tuple(offsets.shape)} must match scales {tuple(scales.shape)}")
        self.interleave = self.INTERLEAVE if interleave is None else interleave
        self.interleaved = self.interleave and _interleavable(packed)
        self.packed = interleave_rows(packed) if self.interleaved else packed.contiguous()
        self.scales = _stored_scales(scales)
        self.offsets = None if offsets is None else offsets.float().contiguous()
        self.out_features, self.in_features, self.group_size = out_features, in_features, group_size

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        group_size: int,
        interleave: bool | None = None,
    ) -> Int4Weight:
        """From unpacked codes [N, K] (integers 0..15, any integer dtype) and per-group scales/offsets
        (offsets None: symmetric)."""
        if codes.dim() != 2 or codes.dtype.is_floating_point:
            raise ValueError(f"Int4Weight.from_codes needs 2-D integer codes, got {codes.dtype} {tuple(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
            raise ValueError("Int4Weight.from_codes: codes must lie in 0..15")
        return cls(_pack_int4(codes.to(torch.uint8)), scales, offsets, group_size, codes.shape[1], interleave)

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = 128, interleave: bool | None = None) -> Int4Weight:
        """Round-to-nearest between each group's min and max: scale = (max - min) / 15, offset = min."""
        out_features, in_features = weight.shape
        num_groups = -(-in_features // group_size)
        span_bytes = -(-in_features // INT4_SPAN) * (INT4_SPAN // 2)
        packed = torch.empty((out_features, span_bytes), dtype=torch.uint8, device=weight.device)
        scales = torch.empty((out_features, num_groups), dtype=torch.float32, device=weight.device)
        offsets = torch.empty_like(scales)
        for r0 in range(0, out_features, QUANTIZE_CHUNK_ROWS):
            w = _grouped(
                weight[r0 : r0 + QUANTIZE_CHUNK_ROWS].to(torch.float32, copy=True), group_size
            )  # NOTE: a copy: scratch edited in place
            lo, hi = w.amin(-1), w.amax(-1)
            s = (hi - lo) / 15.0
            s = torch.where(s > 0, s, torch.ones_like(s))
            # NOTE: in place: the float32 scratch of one chunk is the only transient
            codes = w.sub_(lo[..., None]).div_(s[..., None]).round_().clamp_(0, 15).flatten(1)[:, :in_features]
            packed[r0 : r0 + QUANTIZE_CHUNK_ROWS] = _pack_int4(codes.to(torch.uint8))
            scales[r0 : r0 + QUANTIZE_CHUNK_ROWS], offsets[r0 : r0 + QUANTIZE_CHUNK_ROWS] = s, lo
        return cls(packed, scales, offsets, group_size, in_features, interleave)

    def kernel_fmt(self) -> int:
        return super().kernel_fmt() | (FMT_ROWS4 if self.interleaved else 0)

    def plain_packed(self) -> torch.Tensor:
        """The packed codes [N, ceil(K / 16) * 8] in the plain layout (a copy where stored interleaved)."""
        return plain_rows(self.packed) if self.interleaved else self.packed

    def codes(self) -> torch.Tensor:
        """The unpacked codes [N, K] uint8."""
        spans = self.plain_packed().view(self.out_features, -1, INT4_SPAN // 2)
        return torch.cat([spans & 0xF, spans >> 4], dim=-1).flatten(1)[:, : self.in_features]

    @property
    def symmetric(self) -> bool:
        return self.offsets is None

    def group_offsets(self) -> torch.Tensor:
        """The per-group offsets [N, groups] float32, stored or (symmetric) -8 * scale."""
        return self.scales.float() * SYMMETRIC_OFFSET if self.offsets is None else self.offsets

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed, self.scales) if self.offsets is None else (self.packed, self.scales, self.offsets)

    def digest_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.plain_packed(), *self.tensors()[1:])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scales = self.scales.float().repeat_interleave(self.group_size, dim=1)[:, : self.in_features]
        offsets = self.group_offsets().repeat_interleave(self.group_size, dim=1)[:, : self.in_features]
        return (self.codes().float() * scales + offsets).to(dtype)

    def _pointers(self) -> tuple[int, int | None, int | None]:
        offsets = None if self.offsets is None else self.offsets.data_ptr()
        return self.packed.data_ptr(), self.scales.data_ptr(), offsets


def cat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Row-wise concatenation (fused q/k/v, gate/up): quantization is per output row, so it commutes."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, Int8Weight):  # NOTE: type(first): a subclass (quant_dot.py's) stays itself
        i8 = [p for p in parts if isinstance(p, Int8Weight)]
        scales8, group8 = _cat_scales(i8), first.group_size
        return join_rows(i8, lambda codes, interleave: type(first)(codes, scales8, group8, interleave))
    if isinstance(first, Int4Weight):
        i4 = [p for p in parts if isinstance(p, Int4Weight)]
        # symmetric parts stay offset-free together; beside asymmetric ones they get their -8 * scale
        offsets = None if all(p.symmetric for p in i4) else torch.cat([p.group_offsets() for p in i4])
        scales, group, k = _cat_scales(i4), first.group_size, first.in_features
        return join_rows(i4, lambda codes, interleave: type(first)(codes, scales, offsets, group, k, interleave))
    raise TypeError(f"cannot concatenate {type(first).__name__}")


RowsWeight = TypeVar("RowsWeight", bound="Int8Weight | Int4Weight")


def join_rows(parts: Sequence[RowsWeight], build: Callable[[torch.Tensor, bool], RowsWeight]) -> RowsWeight:
    """The parts' rows as one weight, `build(codes, interleave)` given the joined codes: the stored codes
    as they are where the parts join interleaved (no plain copies while loading; the result is marked
    interleaved), else the plain codes, interleaved as the first part asks."""
    if _parts_join_interleaved(parts):
        joined = build(torch.cat([_stored_codes(p) for p in parts]), False)
        joined.interleave = joined.interleaved = True
        return joined
    return build(torch.cat([_plain_codes(p) for p in parts]), parts[0].interleave)


def _stored_codes(weight: Int8Weight | Int4Weight) -> torch.Tensor:
    return weight.qweight if isinstance(weight, Int8Weight) else weight.packed


def _plain_codes(weight: Int8Weight | Int4Weight) -> torch.Tensor:
    return weight.plain_qweight() if isinstance(weight, Int8Weight) else weight.plain_packed()


def _parts_join_interleaved(parts: Sequence[Int8Weight | Int4Weight]) -> bool:
    """Whether the stored parts, joined, are the joined rows interleaved: every part interleaved (the
    first asking for it) and every part's groups of four starting at a multiple of four in the joined
    rows, so loading makes no plain copies."""
    return (
        parts[0].interleave
        and all(p.interleaved for p in parts)
        and all(p.out_features % ROW_GROUP == 0 for p in parts[:-1])
    )


def _cat_scales(parts: list[Int8Weight] | list[Int4Weight]) -> torch.Tensor:
    """The parts' scales stacked: float16 where every part's is, else float32."""
    if all(p.scales.dtype == torch.float16 for p in parts):
        return torch.cat([p.scales for p in parts])
    return torch.cat([p.scales.float() for p in parts])


def quantize(weight: torch.Tensor, method: str, group_size: int | None) -> PackedWeight:
    """`weight` [N, K] (any float dtype) in `method` (core.config.QUANTIZATIONS) by round-to-nearest."""
    if method in ("w8a8_int8", "w4a8_int8"):  # the same weights, an integer-dot matmul (quant_dot.py)
        from kvpager.model.backends.quant_dot import quantize_dynamic

        return quantize_dynamic(weight, method, group_size)
    if method == "int8":
        return Int8Weight.from_float(weight, group_size)
    if method == "int4":
        return Int4Weight.from_float(weight, group_size or 128)
    raise ValueError(f"unknown quantization {method!r}")


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    """[rows, K] -> [rows, G, group], the last group padded with copies of the last column (which
    belongs to that group, so its min/max/absmax are unchanged)."""
    rows, k = w.shape
    pad = -k % group
    if pad:
        w = torch.cat([w, w[:, -1:].expand(rows, pad)], dim=1)
    return w.view(rows, -1, group)


def _interleavable(packed: torch.Tensor) -> bool:
    """Whether rows `packed` [N, row_bytes] (int4 bytes or int8 values) can interleave: whole 32-byte
    chunks, a group of four."""
    return packed.shape[1] % ROW_CHUNK == 0 and packed.shape[0] >= ROW_GROUP


def interleave_rows(packed: torch.Tensor) -> torch.Tensor:
    """Plain rows [N, row_bytes] of one-byte elements (row_bytes a multiple of 32) -> the same shape, rows interleaved
    (kernels/int4_rows.h): per group of four rows their 32-byte chunks in turn; rows past the last full
    group stay plain. One new tensor, written in place (no intermediate copies while loading)."""
    return _regroup(packed, to_interleaved=True)


def plain_rows(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of interleave_rows."""
    return _regroup(packed, to_interleaved=False)


def _regroup(packed: torch.Tensor, to_interleaved: bool) -> torch.Tensor:
    rows, row_bytes = packed.shape
    whole, chunks = rows // ROW_GROUP * ROW_GROUP, row_bytes // ROW_CHUNK
    out = torch.empty_like(packed, memory_format=torch.contiguous_format)
    plain_view = (-1, ROW_GROUP, chunks, ROW_CHUNK)  # [group, row, chunk, byte]
    mixed_view = (-1, chunks, ROW_GROUP, ROW_CHUNK)  # [group, chunk, row, byte]
    src, dst = (plain_view, mixed_view) if to_interleaved else (mixed_view, plain_view)
    out[:whole].view(dst).copy_(packed[:whole].reshape(src).transpose(1, 2))
    out[whole:] = packed[whole:]
    return out


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    rows, k = codes.shape
    pad = -k % INT4_SPAN
    if pad:
        codes = torch.cat([codes, codes.new_zeros((rows, pad))], dim=1)
    spans = codes.view(rows, -1, INT4_SPAN)
    half = INT4_SPAN // 2
    return (spans[..., :half] | (spans[..., half:] << 4)).flatten(1).contiguous()


def _check_groups(values: torch.Tensor, scales: torch.Tensor, group: int, in_features: int, cls: str) -> None:
    if values.dim() != 2 or group < 1:
        raise ValueError(f"{cls}: 2-D values and a positive group size needed, got {tuple(values.shape)}, {group}")
    expected = (values.shape[0], -(-in_features // group))
    if tuple(scales.shape) != expected:
        raise ValueError(f"{cls}: scales must be {expected} for group size {group}, got {tuple(scales.shape)}")


def _native_bf16() -> bool:
    from kvpager.model.backends.bf16_linear import native_bf16_matmul_available

    return native_bf16_matmul_available()

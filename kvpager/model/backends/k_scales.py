"""GGUF Q4_K and Q6_K weights on the integer-dot kernels holding the file's super-block factors.

Q4_K's group scale d * sc and offset -dmin * m (kvpager.gguf.blocks) held as float32 cost 8 bytes per
group of 32: 0.75 bytes a weight with the codes, a third more than the file's 0.5625, read on every
decode step. KScaledInt4DotWeight holds instead, per row and super-block of 256, the file's float16
d and dmin and the 8 six-bit scales and mins a byte each (K_RECORD_BYTES = 20): 0.578 bytes a weight.
The integer-dot kernel (kernels/quant_dot.cpp, kKScales) widens the records of the rows it multiplies
to float32 (the products are exact there, so they are the float32 form's values bit for bit): its
decode tiles super-block by super-block in registers, its prompt panels through a buffer. Everything else that needs the float32 scales (the exact path a
CPU hands large batches to, the bfloat16 GEMM, dequantize) goes through `float_form()`, an
Int4DotWeight sharing the codes with the factors expanded for that call.

Q6_K likewise (Q6ScaledInt8DotWeight): its scale d * sc per group of 16 held as float32 costs 0.25
bytes a weight beside the int8 codes; per row and super-block of 256 the file's float16 d and 16 int8
sc (Q6_RECORD_BYTES = 18) cost 0.07 (kQ6Scales in the kernel).
"""

from __future__ import annotations

import torch

from kvpager.gguf.blocks import K_RECORD_BYTES, Q6_RECORD_BYTES, QK_K
from kvpager.model.backends.quant_dot import (
    Int4DotWeight,
    Int8DotWeight,
    _int8_rows_interleave_here,
    check_dynamic_group,
)
from kvpager.model.backends.quant_kernels import FMT_INT4, FMT_INT8, FMT_ROWS4
from kvpager.model.backends.quant_weights import (
    PackedWeight,
    _interleavable,
    _pack_int4,
    interleave_rows,
    join_rows,
)

K_SUPER = QK_K  # weights per super-block
K_GROUPS = K_SUPER // 32  # groups of 32 per super-block
FMT_K_SCALES = 1024  # or'ed into FMT_INT4: `scales` holds the records (kKScales in kernels/quant_dot.cpp)
Q6_GROUP = 16  # weights per Q6_K scale
Q6_GROUPS = QK_K // Q6_GROUP  # scales per super-block
FMT_Q6_SCALES = 2048  # or'ed into FMT_INT8: `scales` holds Q6_K's records (kQ6Scales in kernels/quant_dot.cpp)


def expand_k_records(records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """records uint8 [N, S, K_RECORD_BYTES] -> (scales, offsets) float32 [N, S * K_GROUPS]: d * sc and
    -(dmin * m), the values kvpager.gguf.blocks computes (exact in float32)."""
    n, supers, _ = records.shape
    halves = records[..., :4].contiguous().view(torch.float16).float()  # [N, S, 2]: d, dmin
    sc, mins = records[..., 4 : 4 + K_GROUPS].float(), records[..., 4 + K_GROUPS :].float()
    scales = halves[..., :1] * sc
    offsets = -(halves[..., 1:] * mins)
    return scales.reshape(n, supers * K_GROUPS), offsets.reshape(n, supers * K_GROUPS)


def _check_records(owner: str, records: torch.Tensor, rows: int, in_features: int, record_bytes: int) -> None:
    """ValueError unless in_features is a multiple of K_SUPER and records is uint8 [rows, in_features /
    K_SUPER, record_bytes]."""
    if in_features % K_SUPER != 0:
        raise ValueError(f"{owner}: in_features must be a multiple of {K_SUPER}, got {in_features}")
    expected = (rows, in_features // K_SUPER, record_bytes)
    if records.dtype != torch.uint8 or tuple(records.shape) != expected:
        raise ValueError(f"{owner}: records must be uint8 {expected}, got {tuple(records.shape)}")


class _FileScales:
    """The paths other than the integer-dot kernel (the exact fallback a CPU hands large batches to, the
    bfloat16 GEMM, dequantize) on `float_form()`: the weight with its records expanded for that call."""

    def float_form(self) -> Int4DotWeight | Int8DotWeight:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.float_form().dequantize(dtype)

    def exact_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.float_form().exact_matmul(x, bias)

    def bf16_matmul(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.float_form().bf16_matmul(x2, bias)


class KScaledInt4DotWeight(_FileScales, Int4DotWeight):
    """int4 codes (group 32, as Int4DotWeight) with Q4_K's super-block records for scales and offsets.

    `packed` [N, K / 2] in the plain layout (interleaved here as Int4DotWeight does), `records`
    [N, K / 256, K_RECORD_BYTES] uint8; K a multiple of 256."""

    def __init__(
        self, packed: torch.Tensor, records: torch.Tensor, in_features: int, interleave: bool | None = None
    ) -> None:
        PackedWeight.__init__(self)
        out_features = packed.shape[0]
        _check_records("KScaledInt4DotWeight", records, out_features, in_features, K_RECORD_BYTES)
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (out_features, in_features // 2):
            raise ValueError(f"KScaledInt4DotWeight: packed must be uint8 [N, K / 2], got {tuple(packed.shape)}")
        check_dynamic_group(self.method, 32, in_features)
        self.interleave = self.INTERLEAVE if interleave is None else interleave
        self.interleaved = self.interleave and _interleavable(packed)
        self.packed = interleave_rows(packed) if self.interleaved else packed.contiguous()
        self.records = records.contiguous()
        self.out_features, self.in_features, self.group_size = out_features, in_features, 32

    @classmethod
    def from_k_codes(
        cls, codes: torch.Tensor, records: torch.Tensor, interleave: bool | None = None
    ) -> KScaledInt4DotWeight:
        """From unpacked codes [N, K] (integers 0..15) and the records."""
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
            raise ValueError("KScaledInt4DotWeight.from_k_codes: codes must lie in 0..15")
        return cls(_pack_int4(codes.to(torch.uint8)), records, codes.shape[1], interleave)

    @classmethod
    def cat(cls, parts: list[KScaledInt4DotWeight]) -> KScaledInt4DotWeight:
        """Row-wise concatenation (fused q/k/v, gate/up), keeping the parts' interleaved rows where they join."""
        records, k = torch.cat([p.records for p in parts]), parts[0].in_features
        return join_rows(parts, lambda packed, interleave: cls(packed, records, k, interleave))

    def float_form(self) -> Int4DotWeight:
        """The same weight as Int4DotWeight (float32 scales and offsets, expanded now; the codes shared)."""
        scales, offsets = expand_k_records(self.records)
        weight = Int4DotWeight(self.packed, scales, offsets, 32, self.in_features, interleave=False)
        weight.interleave, weight.interleaved = self.interleave, self.interleaved
        weight.max_level = self.max_level
        return weight

    def kernel_fmt(self) -> int:
        return FMT_INT4 | FMT_K_SCALES | (FMT_ROWS4 if self.interleaved else 0)

    @property
    def symmetric(self) -> bool:
        return False

    def group_offsets(self) -> torch.Tensor:
        return expand_k_records(self.records)[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed, self.records)

    def digest_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.plain_packed(), self.records)

    def _pointers(self) -> tuple[int, int | None, int | None]:
        return self.packed.data_ptr(), self.records.data_ptr(), None


def expand_q6_records(records: torch.Tensor) -> torch.Tensor:
    """records uint8 [N, S, Q6_RECORD_BYTES] -> scales float32 [N, S * Q6_GROUPS]: d * sc, the values
    kvpager.gguf.blocks computes (exact in float32)."""
    n, supers, _ = records.shape
    d = records[..., :2].contiguous().view(torch.float16).float()  # [N, S, 1]
    sc = records[..., 2:].contiguous().view(torch.int8).float()
    return (d * sc).reshape(n, supers * Q6_GROUPS)


class Q6ScaledInt8DotWeight(_FileScales, Int8DotWeight):
    """int8 codes (group 16, as Int8DotWeight holds GGUF Q6_K) with Q6_K's super-block records for scales.

    `qweight` [N, K] int8 in the plain layout (interleaved here as Int8DotWeight does), values within
    CODES (the kernel's prompt panels sum them in int16 on that promise), `records` [N, K / 256,
    Q6_RECORD_BYTES] uint8; K a multiple of 256."""

    CODES = (-32, 31)  # the file's 6-bit codes minus 32

    def __init__(self, qweight: torch.Tensor, records: torch.Tensor, interleave: bool | None = None) -> None:
        out_features, in_features = qweight.shape
        _check_records("Q6ScaledInt8DotWeight", records, out_features, in_features, Q6_RECORD_BYTES)
        if qweight.dtype != torch.int8:
            raise ValueError(f"Q6ScaledInt8DotWeight: codes must be int8, got {qweight.dtype}")
        low, high = self.CODES
        if qweight.numel() and (int(qweight.min()) < low or int(qweight.max()) > high):
            raise ValueError(f"Q6ScaledInt8DotWeight: codes must lie in {low}..{high}")
        PackedWeight.__init__(self)
        check_dynamic_group(self.method, Q6_GROUP, in_features)
        if interleave is None:
            interleave = self.INTERLEAVE and _int8_rows_interleave_here()
        self.interleave = interleave
        short = in_features <= self.INTERLEAVE_MAX_ROW_BYTES
        self.interleaved = interleave and short and _interleavable(qweight)
        self.qweight = interleave_rows(qweight) if self.interleaved else qweight.contiguous()
        self.out_features, self.in_features, self.group_size = out_features, in_features, Q6_GROUP
        self.records = records.contiguous()

    @classmethod
    def cat(cls, parts: list[Q6ScaledInt8DotWeight]) -> Q6ScaledInt8DotWeight:
        """Row-wise concatenation (fused q/k/v, gate/up), keeping the parts' interleaved rows where they join."""
        records = torch.cat([p.records for p in parts])
        return join_rows(parts, lambda qweight, interleave: cls(qweight, records, interleave))

    def float_form(self) -> Int8DotWeight:
        """The same weight as Int8DotWeight (float32 scales, expanded now; the codes shared)."""
        weight = Int8DotWeight(self.qweight, expand_q6_records(self.records), Q6_GROUP, interleave=False)
        weight.interleave, weight.interleaved = self.interleave, self.interleaved
        weight.max_level = self.max_level
        return weight

    def kernel_fmt(self) -> int:
        return FMT_INT8 | FMT_Q6_SCALES | (FMT_ROWS4 if self.interleaved else 0)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.qweight, self.records)

    def digest_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.plain_qweight(), self.records)

    def _pointers(self) -> tuple[int, int | None, int | None]:
        return self.qweight.data_ptr(), self.records.data_ptr(), None


__all__ = [
    "FMT_K_SCALES",
    "FMT_Q6_SCALES",
    "KScaledInt4DotWeight",
    "Q6ScaledInt8DotWeight",
    "expand_k_records",
    "expand_q6_records",
]

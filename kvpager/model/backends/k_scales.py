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

Q6_K likewise (Q6PackedDotWeight): its scale d * sc per group of 16 held as float32 would cost 0.25
bytes a weight, its 6-bit codes as int8 1; it holds per row and super-block of 256 the file's float16
d and 16 int8 sc (Q6_RECORD_BYTES = 18: 0.07 bytes a weight), the codes' low 4 bits as int4 codes and
their high two in a plane (kQ6Scales with kHiPlane in the kernel): 0.82 bytes a weight, the file's.
"""

from __future__ import annotations

from typing import Self

import torch

from kvpager.gguf.blocks import K_RECORD_BYTES, Q6_RECORD_BYTES, QK_K
from kvpager.model.backends.quant_dot import (
    Int4DotWeight,
    Int8DotWeight,
    check_dynamic_group,
)
from kvpager.model.backends.quant_kernels import FMT_INT4, FMT_ROWS4, QuantKernels, quant_kernels_or_none
from kvpager.model.backends.quant_weights import (
    Int4Weight,
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
# or'ed into FMT_INT4 | FMT_HI_PLANE: `scales` holds Q6_K's records (kQ6Scales in kernels/quant_dot.cpp)
FMT_Q6_SCALES = 2048
# or'ed into FMT_INT4 | FMT_K_SCALES (GGUF Q5_K) or FMT_INT4 | FMT_Q6_SCALES (GGUF Q6_K): the `offsets`
# pointer is a plane of the codes' bits above the int4 codes (kHiPlane)
FMT_HI_PLANE = 4096
# Stored position j of an int4 block holds the code of natural position INT4_NATURAL[j] (the kernels'
# int4_natural: 8-code spans, low nibbles then high ones). The order is its own inverse.
INT4_NATURAL = [(0, 16, 8, 24)[j // 8] + j % 8 for j in range(32)]
# A Q6_K packed plane's block pair (blocks 2i, 2i + 1 of a row) is 16 bytes; byte j holds the two high
# bits of stored position j + 16h of the pair's block e at bit Q6_PLANE_SHIFTS[e][h] (kernels/quant_dot.cpp).
Q6_PLANE_SHIFTS = ((0, 4), (2, 6))
PACK_CHUNK_ROWS = 1024  # rows Q6PackedDotWeight.from_q6_values packs at a time


def expand_k_records(records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """records uint8 [N, S, K_RECORD_BYTES] -> (scales, offsets) float32 [N, S * K_GROUPS]: d * sc and
    -(dmin * m), the values kvpager.gguf.blocks computes (exact in float32). On the CPU the kernel library
    expands them (kvq_dot_expand_records: the same values), else expand_k_records_in_torch."""
    n, supers, _ = records.shape
    kernels = quant_kernels_or_none() if records.device.type == "cpu" else None
    if kernels is None:
        return expand_k_records_in_torch(records)
    scales = torch.empty((n, supers * K_GROUPS), dtype=torch.float32)
    offsets = torch.empty((n, supers * K_GROUPS), dtype=torch.float32)
    rec = records.contiguous()
    kernels.dot_expand_records(
        0, rec.data_ptr(), n * supers, scales.data_ptr(), offsets.data_ptr(), torch.get_num_threads()
    )
    return scales, offsets


def expand_k_records_in_torch(records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """expand_k_records by torch ops (off the CPU, or without the kernel library)."""
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

    def tiled_bf16_matmul(
        self, x2: torch.Tensor, bias: torch.Tensor | None, kernels: QuantKernels
    ) -> torch.Tensor | None:
        return self.float_form().tiled_bf16_matmul(x2, bias, kernels)


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
    kvpager.gguf.blocks computes (exact in float32); on the CPU by the kernel library, as expand_k_records."""
    n, supers, _ = records.shape
    kernels = quant_kernels_or_none() if records.device.type == "cpu" else None
    if kernels is None:
        return expand_q6_records_in_torch(records)
    scales = torch.empty((n, supers * Q6_GROUPS), dtype=torch.float32)
    rec = records.contiguous()
    kernels.dot_expand_records(1, rec.data_ptr(), n * supers, scales.data_ptr(), None, torch.get_num_threads())
    return scales


def expand_q6_records_in_torch(records: torch.Tensor) -> torch.Tensor:
    """expand_q6_records by torch ops (off the CPU, or without the kernel library)."""
    n, supers, _ = records.shape
    d = records[..., :2].contiguous().view(torch.float16).float()  # [N, S, 1]
    sc = records[..., 2:].contiguous().view(torch.int8).float()
    return (d * sc).reshape(n, supers * Q6_GROUPS)


class PlaneCodes(Int4DotWeight):
    """What the GGUF forms holding int4 codes (the low 4 bits), a plane of the codes' higher bits and the
    file's records share (Q5_K's K5PackedDotWeight, Q6_K's Q6PackedDotWeight): the stored tensors, the
    digest's, the kernel's pointers (the plane passed as `offsets`), row-wise joins and the codes' unpack.
    Listed first among a form's bases, so these take the place of its records class's."""

    plane: torch.Tensor
    records: torch.Tensor

    def __init__(
        self,
        packed: torch.Tensor,
        plane: torch.Tensor,
        records: torch.Tensor,
        in_features: int,
        interleave: bool | None = None,
    ) -> None:
        raise NotImplementedError  # (each form's own: the signature `cat` builds with)

    @classmethod
    def cat(cls, parts: list[Self]) -> Self:  # type: ignore[override]
        """Row-wise concatenation (fused q/k/v, gate/up), keeping the parts' interleaved rows where they join."""
        records, plane, k = (
            torch.cat([p.records for p in parts]),
            torch.cat([p.plane for p in parts]),
            parts[0].in_features,
        )
        return join_rows(parts, lambda packed, interleave: cls(packed, plane, records, k, interleave))

    def codes(self) -> torch.Tensor:
        """The codes [N, K] uint8 (natural order): unpacked by the kernel library on the CPU
        (kvq_dot_plane_codes; the exact and bfloat16 paths build the float form per batch), else
        codes_in_torch()."""
        kernels = quant_kernels_or_none() if self.device.type == "cpu" else None
        if kernels is None:
            return self.codes_in_torch()
        out = torch.empty((self.out_features, self.in_features), dtype=torch.uint8)
        rc = kernels.dot_plane_codes(
            self.kernel_fmt(), self.packed.data_ptr(), self.plane.data_ptr(), self.out_features, self.in_features,
            out.data_ptr(), torch.get_num_threads(), self._level(kernels),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"{type(self).__name__}: the kernel library refused format {self.kernel_fmt()}")
        return out

    def codes_in_torch(self) -> torch.Tensor:
        """codes() by torch ops (off the CPU, or without the kernel library)."""
        raise NotImplementedError

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.packed, self.plane, self.records)

    def digest_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.plain_packed(), self.plane, self.records)

    def _pointers(self) -> tuple[int, int | None, int | None]:
        return self.packed.data_ptr(), self.records.data_ptr(), self.plane.data_ptr()


class Q6PackedDotWeight(PlaneCodes, _FileScales, Int4DotWeight):
    """GGUF Q6_K times int8 activations in the file's 0.82 bytes a weight: the 6-bit codes' low 4 bits as
    int4 codes (Int4DotWeight's layout, interleaved as it does), their high two bits in a plane
    [N, K / 4] (Q6_PLANE_SHIFTS), Q6_K's records for the scales of the groups of 16; the values are
    code - 32. The kernel's Q6_K packed tiles and panels read them (kQ6Scales with kHiPlane on int4 codes
    in kernels/quant_dot.cpp). The exact and bfloat16 paths run float_form(), whose int8 codes hold the
    same values in 1.07 bytes a weight with the records."""

    def __init__(
        self,
        packed: torch.Tensor,
        plane: torch.Tensor,
        records: torch.Tensor,
        in_features: int,
        interleave: bool | None = None,
    ) -> None:
        PackedWeight.__init__(self)
        out_features = packed.shape[0]
        _check_records("Q6PackedDotWeight", records, out_features, in_features, Q6_RECORD_BYTES)
        if packed.dtype != torch.uint8 or tuple(packed.shape) != (out_features, in_features // 2):
            raise ValueError(f"Q6PackedDotWeight: packed must be uint8 [N, K / 2], got {tuple(packed.shape)}")
        if plane.dtype != torch.uint8 or tuple(plane.shape) != (out_features, in_features // 4):
            raise ValueError(f"Q6PackedDotWeight: plane must be uint8 [N, K / 4], got {tuple(plane.shape)}")
        self.interleave = self.INTERLEAVE if interleave is None else interleave
        self.interleaved = self.interleave and _interleavable(packed)
        self.packed = interleave_rows(packed) if self.interleaved else packed.contiguous()
        self.plane, self.records = plane.contiguous(), records.contiguous()
        self.out_features, self.in_features, self.group_size = out_features, in_features, Q6_GROUP

    @classmethod
    def from_q6_values(
        cls, values: torch.Tensor, records: torch.Tensor, interleave: bool | None = None
    ) -> Q6PackedDotWeight:
        """From Q6_K's values [N, K] (integers -32..31: the file's codes minus 32, kvpager.gguf.blocks's
        `codes`, natural order) and the records."""
        if values.numel() and (int(values.min()) < -32 or int(values.max()) > 31):
            raise ValueError("Q6PackedDotWeight.from_q6_values: values must lie in -32..31")
        n, k = values.shape
        if k % K_SUPER:
            raise ValueError(f"Q6PackedDotWeight.from_q6_values: K must be a multiple of {K_SUPER}, got {k}")
        packed = torch.empty((n, k // 2), dtype=torch.uint8)
        plane = torch.empty((n, k // 4), dtype=torch.uint8)
        shifts = torch.tensor(Q6_PLANE_SHIFTS, dtype=torch.uint8).view(2, 2, 1)
        for r0 in range(0, n, PACK_CHUNK_ROWS):  # chunks of rows: a lm_head's temporaries stay small
            chunk = (values[r0 : r0 + PACK_CHUNK_ROWS].to(torch.int16) + 32).to(torch.uint8)  # the codes
            rows = chunk.shape[0]
            high = (chunk >> 4).view(rows, k // 32, 32)[..., INT4_NATURAL]  # stored order
            pairs = high.view(rows, k // 64, 2, 2, 16) << shifts
            plane[r0 : r0 + rows] = pairs.sum((2, 3), dtype=torch.uint8).view(rows, k // 4)
            packed[r0 : r0 + rows] = _pack_int4(chunk & 15)
        return cls(packed, plane, records, k, interleave)

    def codes_in_torch(self) -> torch.Tensor:
        """The 6-bit codes by torch ops: the plane's pairs of bits in stored order, then natural."""
        n, k = self.out_features, self.in_features
        pairs = self.plane.view(n, k // 64, 1, 1, 16) >> torch.tensor(Q6_PLANE_SHIFTS, dtype=torch.uint8).view(2, 2, 1)
        high = (pairs & 3).view(n, k // 32, 32)[..., INT4_NATURAL].reshape(n, k)
        return Int4Weight.codes(self) + (high << 4)  # (the low 4 bits)

    def values(self) -> torch.Tensor:
        """The values [N, K] int8 (code - 32, natural order)."""
        return self.codes().view(torch.int8).sub_(32)  # (codes() is a new tensor; 0..63 fit int8)

    def float_form(self) -> Int8DotWeight:
        """The same weight as Int8DotWeight (int8 values code - 32, float32 scales, expanded now)."""
        weight = Int8DotWeight(self.values(), expand_q6_records(self.records), Q6_GROUP, interleave=False)
        weight.max_level = self.max_level
        return weight

    def kernel_fmt(self) -> int:
        return FMT_INT4 | FMT_Q6_SCALES | FMT_HI_PLANE | (FMT_ROWS4 if self.interleaved else 0)


__all__ = [
    "FMT_HI_PLANE",
    "FMT_K_SCALES",
    "FMT_Q6_SCALES",
    "INT4_NATURAL",
    "KScaledInt4DotWeight",
    "PlaneCodes",
    "Q6PackedDotWeight",
    "expand_k_records",
    "expand_k_records_in_torch",
    "expand_q6_records",
    "expand_q6_records_in_torch",
]

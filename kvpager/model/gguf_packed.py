"""GGUF quantized blocks executed as they are: kvpager packed weights built from the blocks' own codes.

kvpager.gguf.blocks turns a tensor's blocks into codes with per-group scales (and offsets); here they
become the packed formats of kvpager.model.backends.quant_weights without requantization, so the
matmul computes with exactly the values gguf-py's dequantizer gives:

- Q8_0 -> Int8Weight group 32, the file's float16 scales; Q6_K -> Int8Weight group 16 (codes q - 32,
  scale d*sc, float32); with int8 activations Q6PackedDotWeight (q's low 4 bits as int4 codes, its high
  two in a plane, the file's d and sc, expanded by the kernel).
- Q4_0 -> Int4Weight group 32, symmetric (codes q, the file's float16 scale d; the offset -8d is not
  stored).
- Q4_K -> Int4Weight group 32 (codes q, scale d*sc, offset -dmin*m); with int8 activations
  KScaledInt4DotWeight (the same codes, the file's d, dmin, sc and m, expanded by the kernel).
- Q5_K -> AffineInt8Weight group 32: Int8Weight over the 5-bit codes plus a per-group offset
  (-dmin*m), which the exact int8 kernels do not have; the offset term is offset[n, g] * sum of x over
  group g, one small matmul on the group sums. With int8 activations K5PackedDotWeight: the codes' low
  4 bits as int4 codes, their fifth bits in a plane, the file's d, dmin, sc and m (expanded by the
  kernel, which adds the offset term itself, as for int4's asymmetric groups).

Which tensors run packed, and the bytes each form holds, is kvpager.gguf.executed's (torch-free, so
the planner counts the same bytes). A fused projection (q/k/v, gate/up) whose parts are of different
types (Q4_K_M files keep attn_v and ffn_down at 6 bits) is a RowStack: each part runs its own matmul
on the same input.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.nn.functional as F

from kvpager.gguf.blocks import BlockCodes
from kvpager.gguf.executed import INT8_DOT_TYPES, PACKED_FORMS
from kvpager.model.backends.k_scales import (
    FMT_HI_PLANE,
    INT4_NATURAL,
    KScaledInt4DotWeight,
    PlaneCodes,
    Q6PackedDotWeight,
    expand_k_records,
)
from kvpager.model.backends.quant_dot import Int4DotWeight, Int8DotWeight
from kvpager.model.backends.quant_weights import (
    Int4Weight,
    Int8Weight,
    PackedWeight,
    _pack_int4,
    cat_rows,
    join_rows,
)

__all__ = [
    "FMT_HI_PLANE",
    "INT4_NATURAL",
    "INT8_DOT_TYPES",
    "AffineInt8DotWeight",
    "AffineInt8Weight",
    "K5PackedDotWeight",
    "packed_from_blocks",
]


def packed_from_blocks(blocks: BlockCodes, type_name: str, *, int8_activations: bool = False) -> PackedWeight:
    """The packed weight holding exactly `blocks`' values (see the module docstring per type).

    int8_activations (types in INT8_DOT_TYPES only): the same codes and scales in the integer-dot
    classes, which quantize activations to int8 per block of 32 (llama.cpp's arithmetic, not exact).
    """
    if int8_activations and type_name not in INT8_DOT_TYPES:
        raise ValueError(f"{type_name} has no int8-activation form (only {', '.join(INT8_DOT_TYPES)})")
    codes = torch.from_numpy(np.ascontiguousarray(blocks.codes))
    scales = torch.from_numpy(np.ascontiguousarray(blocks.scales))
    form = PACKED_FORMS.get(type_name)
    if form is not None and form.half_scales:  # float16 in the file: the float32 values narrow back exactly
        scales = scales.to(torch.float16)
    if type_name == "Q4_K" and int8_activations and blocks.k_records is not None:
        return KScaledInt4DotWeight.from_k_codes(codes, torch.from_numpy(np.ascontiguousarray(blocks.k_records)))
    if type_name == "Q6_K" and int8_activations and blocks.q6_records is not None:
        records = torch.from_numpy(np.ascontiguousarray(blocks.q6_records))
        return Q6PackedDotWeight.from_q6_values(codes, records)
    if type_name in ("Q4_0", "Q4_K"):
        assert blocks.offsets is not None
        int4 = Int4DotWeight if int8_activations else Int4Weight
        # Q4_0's offsets are -8 * d by construction (kvpager.gguf.blocks): the symmetric form holds none
        offsets = None if type_name == "Q4_0" else torch.from_numpy(np.ascontiguousarray(blocks.offsets))
        return int4.from_codes(codes, scales, offsets, blocks.group)
    if type_name == "Q5_K" and int8_activations and blocks.k_records is not None:
        return K5PackedDotWeight.from_q5_codes(codes, torch.from_numpy(np.ascontiguousarray(blocks.k_records)))
    if int8_activations and blocks.offsets is not None:
        offsets = torch.from_numpy(np.ascontiguousarray(blocks.offsets))
        return AffineInt8DotWeight(codes.to(torch.int8), scales, offsets, blocks.group)
    int8 = Int8DotWeight if int8_activations else Int8Weight
    inner = int8(codes.to(torch.int8), scales, blocks.group)
    if blocks.offsets is None:
        return inner
    return AffineInt8Weight(inner, torch.from_numpy(np.ascontiguousarray(blocks.offsets)))


class AffineInt8Weight(PackedWeight):
    """w = q * scale + offset per group: an Int8Weight plus float32 offsets [N, K / group]."""

    method = "int8-affine"

    def __init__(self, inner: Int8Weight, offsets: torch.Tensor) -> None:
        super().__init__()
        if inner.in_features % inner.group_size != 0:
            raise ValueError(f"AffineInt8Weight: in_features {inner.in_features} not a multiple of the group")
        if tuple(offsets.shape) != tuple(inner.scales.shape):
            raise ValueError(
                f"AffineInt8Weight: offsets {tuple(offsets.shape)} must match scales {tuple(inner.scales.shape)}"
            )
        self.inner, self.offsets = inner, offsets.float().contiguous()
        self.fmt = inner.fmt
        self.out_features, self.in_features, self.group_size = inner.out_features, inner.in_features, inner.group_size

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.inner.tensors(), self.offsets)

    def digest_tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.inner.digest_tensors(), self.offsets)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        offsets = self.offsets.repeat_interleave(self.group_size, dim=1)
        return (self.inner.dequantize() + offsets).to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.inner.max_level = self.max_level
        out = self.inner.matmul(x.float(), bias).reshape(-1, self.out_features)
        sums = x.reshape(-1, self.in_features // self.group_size, self.group_size).float().sum(-1)
        out += sums @ self.offsets.to(sums.device).T
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


class AffineInt8DotWeight(Int8DotWeight):
    """w = q * scale + offset per group (GGUF Q5_K) times int8 activations: Int8DotWeight plus float32
    offsets [N, K / group], which the integer-dot kernel applies (offset times the group's activation
    sum). Groups of whole activation blocks (32)."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor,
        group_size: int,
        interleave: bool | None = None,
    ) -> None:
        if group_size % 32 != 0:
            raise ValueError(f"AffineInt8DotWeight: groups must be multiples of 32, got {group_size}")
        super().__init__(qweight, scales, group_size, interleave)
        if tuple(offsets.shape) != tuple(self.scales.shape):
            raise ValueError(
                f"AffineInt8DotWeight: offsets {tuple(offsets.shape)} must match scales {tuple(self.scales.shape)}"
            )
        self.offsets = offsets.float().contiguous()

    @classmethod
    def cat(cls, parts: list[AffineInt8DotWeight]) -> AffineInt8DotWeight:
        """Row-wise concatenation (fused q/k/v, gate/up), keeping the parts' interleaved rows where they
        join (no plain copies while loading)."""
        scales, offsets = torch.cat([p.scales.float() for p in parts]), torch.cat([p.offsets for p in parts])
        group = parts[0].group_size
        return join_rows(parts, lambda qweight, interleave: cls(qweight, scales, offsets, group, interleave))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*super().tensors(), self.offsets)

    def digest_tensors(self) -> tuple[torch.Tensor, ...]:
        return (*super().digest_tensors(), self.offsets)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        offsets = self.offsets.repeat_interleave(self.group_size, dim=1)[:, : self.in_features]
        return (super().dequantize() + offsets).to(dtype)

    def exact_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The codes times scales through the exact int8 path, plus the offsets on x's group sums (as
        AffineInt8Weight)."""
        out = super().exact_matmul(x.float(), bias).reshape(-1, self.out_features)
        sums = x.reshape(-1, self.in_features // self.group_size, self.group_size).float().sum(-1)
        out += sums @ self.offsets.to(sums.device).T
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def bf16_matmul(self, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The bfloat16 reference itself (x2 and the dequantized weight, offsets included, in bfloat16):
        the offsets have no place in the codes' bf16 dequantizer."""
        out = F.linear(x2.to(torch.bfloat16), self.dequantize(torch.bfloat16)).float()
        return out + bias.float() if bias is not None else out

    def _pointers(self) -> tuple[int, int | None, int | None]:
        return self.qweight.data_ptr(), self.scales.data_ptr(), self.offsets.data_ptr()


# Which of a block's plane bytes (byte i: stored positions 8i..8i+7) holds natural positions 8j..8j+7,
# and each byte value's 8 bits, little-endian, times 16.
PLANE_BYTE_ORDER = [INT4_NATURAL.index(8 * j) // 8 for j in range(4)]
FIFTH_BITS = ((torch.arange(256).view(256, 1) >> torch.arange(8)) & 1).to(torch.uint8) * 16


class K5PackedDotWeight(PlaneCodes, KScaledInt4DotWeight):  # type: ignore[misc]  # (cat joins K5 parts only)
    """GGUF Q5_K times int8 activations in 0.70 bytes a weight: the 5-bit codes' low 4 bits as int4 codes
    (KScaledInt4DotWeight's layout, interleaved as it does), their fifth bits in a plane [N, K / 8] (per
    block of 32, 4 bytes; bit j little-endian is the fifth bit of the block's stored position j, whose
    natural position is INT4_NATURAL[j]), and Q4_K's records for scales and offsets. The kernel's Q4_K
    tiles add 16 where a bit is set (kHiPlane in kernels/quant_dot.cpp); int8 codes would hold the same
    values in 1.08 bytes a weight with the records. The exact and bfloat16 paths run float_form()."""

    def __init__(
        self,
        packed: torch.Tensor,
        plane: torch.Tensor,
        records: torch.Tensor,
        in_features: int,
        interleave: bool | None = None,
    ) -> None:
        KScaledInt4DotWeight.__init__(self, packed, records, in_features, interleave)
        if plane.dtype != torch.uint8 or tuple(plane.shape) != (self.out_features, in_features // 8):
            raise ValueError(f"K5PackedDotWeight: plane must be uint8 [N, K / 8], got {tuple(plane.shape)}")
        self.plane = plane.contiguous()

    @classmethod
    def from_q5_codes(
        cls, codes: torch.Tensor, records: torch.Tensor, interleave: bool | None = None
    ) -> K5PackedDotWeight:
        """From Q5_K's codes [N, K] (integers 0..31, natural order) and the records."""
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 31):
            raise ValueError("K5PackedDotWeight.from_q5_codes: codes must lie in 0..31")
        n, k = codes.shape
        if k % 32:
            raise ValueError(f"K5PackedDotWeight.from_q5_codes: K must be a multiple of 32, got {k}")
        low = (codes & 15).to(torch.uint8)
        fifth = (codes >> 4).to(torch.uint8).view(n, k // 32, 32)[..., INT4_NATURAL]
        bits = fifth.view(n, k // 32, 4, 8) << torch.arange(8, dtype=torch.uint8)
        plane = bits.sum(-1, dtype=torch.uint8).view(n, k // 8)
        return cls(_pack_int4(low), plane, records, k, interleave)

    def codes_in_torch(self) -> torch.Tensor:
        """The 5-bit codes by torch ops, one gather: a block's plane bytes hold stored positions 0-7, 8-15, 16-23,
        24-31, i.e. natural 0-7, 16-23, 8-15, 24-31 (INT4_NATURAL), and each byte widens through a table
        to its 8 bits times 16."""
        n, k = self.out_features, self.in_features
        in_order = self.plane.view(n, k // 32, 4)[..., PLANE_BYTE_ORDER]
        return Int4Weight.codes(self) + FIFTH_BITS[in_order.long()].view(n, k)  # (the low 4 bits)

    def float_form(self) -> AffineInt8DotWeight:  # type: ignore[override]
        """The same weight as AffineInt8DotWeight (int8 codes, float32 scales and offsets, expanded now)."""
        scales, offsets = expand_k_records(self.records)
        weight = AffineInt8DotWeight(self.codes().to(torch.int8), scales, offsets, 32, interleave=False)
        weight.max_level = self.max_level
        return weight

    def kernel_fmt(self) -> int:
        return KScaledInt4DotWeight.kernel_fmt(self) | FMT_HI_PLANE


class RowStack(PackedWeight):
    """Row blocks in different formats, stacked: each part's matmul on the same input, outputs joined."""

    method = "rows"

    def __init__(self, parts: list[PackedWeight]) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("RowStack: parts must share in_features")
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.group_size = self.in_features

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for p in self.parts for t in p.tensors())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts])

    def update_digest(self, h: hashlib._Hash) -> None:
        h.update(f"rows:{len(self.parts)}".encode())
        for p in self.parts:
            p.update_digest(h)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        outs, row = [], 0
        for p in self.parts:
            b = None if bias is None else bias[row : row + p.out_features]
            outs.append(p.matmul(x, b))
            row += p.out_features
        return torch.cat(outs, dim=-1)


def stack_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Row-wise concatenation: neighbours of the same format and group merged (one kernel call), the
    rest a RowStack."""
    merged: list[list[PackedWeight]] = []
    for p in parts:
        if merged and _mergeable(merged[-1][-1], p):
            merged[-1].append(p)
        else:
            merged.append([p])
    blocks = [_merge(run) for run in merged]
    return blocks[0] if len(blocks) == 1 else RowStack(blocks)


def _mergeable(a: PackedWeight, b: PackedWeight) -> bool:
    same = type(a) is type(b) and a.group_size == b.group_size and a.in_features == b.in_features
    return same and isinstance(a, Int8Weight | Int4Weight | AffineInt8Weight)


def _merge(run: list[PackedWeight]) -> PackedWeight:
    if len(run) == 1:
        return run[0]
    if isinstance(run[0], K5PackedDotWeight):  # before its base class: its plane joins too
        return K5PackedDotWeight.cat([p for p in run if isinstance(p, K5PackedDotWeight)])
    if isinstance(run[0], KScaledInt4DotWeight):
        return KScaledInt4DotWeight.cat([p for p in run if isinstance(p, KScaledInt4DotWeight)])
    if isinstance(run[0], AffineInt8DotWeight):
        return AffineInt8DotWeight.cat([p for p in run if isinstance(p, AffineInt8DotWeight)])
    if isinstance(run[0], Q6PackedDotWeight):  # its plane joins too
        return Q6PackedDotWeight.cat([p for p in run if isinstance(p, Q6PackedDotWeight)])
    if isinstance(run[0], AffineInt8Weight):
        affine = [p for p in run if isinstance(p, AffineInt8Weight)]
        inner = cat_rows([p.inner for p in affine])
        assert isinstance(inner, Int8Weight)
        return AffineInt8Weight(inner, torch.cat([p.offsets for p in affine]))
    return cat_rows(run)


def layout_of(weight: PackedWeight) -> str:
    """The executed form of a packed weight (format, group, shape; a RowStack's parts in order)."""
    if isinstance(weight, RowStack):
        return "rows[" + ",".join(layout_of(p) for p in weight.parts) + "]"
    return f"{weight.method}:g{weight.group_size}:{weight.out_features}x{weight.in_features}"

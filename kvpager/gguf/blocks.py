"""ggml's quantized blocks -> integer codes with per-group scales (and offsets), exactly. Torch-free.

Every block type kvpager executes in packed form decodes to w = code * scale[g] + offset[g] for
groups g of `group` consecutive values along a row, where code, scale and offset come straight from
the block's bits (ggml-common.h; gguf-py's quants.py decodes the same layouts):

- Q8_0: 32 values, f16 d, int8 q:                     w = d * q                -> code q, group 32
- Q4_0: 32 values, f16 d, 4-bit q:                    w = d * (q - 8)          -> code q, scale d, offset -8d
- Q4_K: 256 values = 8 x 32, f16 d/dmin, 6-bit sc/m:  w = d*sc * q - dmin*m    -> code q (0..15), group 32
- Q5_K: as Q4_K with a fifth bit per value:           w = d*sc * q - dmin*m    -> code q (0..31), group 32
- Q6_K: 256 values = 16 x 16, f16 d, int8 sc:         w = d*sc * (q - 32)      -> code q - 32, group 16

The products d*sc and dmin*m are exact in float32 (an 11-bit mantissa times a 6- or 8-bit integer),
so a decoder computing code * scale + offset in float32 gives gguf-py's floats bit for bit.

Q4_K's and Q6_K's factors also come as the file holds them, for the kernels that expand them per
call instead of holding the float32 products: per row and super-block of 256, `BlockCodes.k_records`
(Q4_K, K_RECORD_BYTES bytes: f16 d, f16 dmin, the 8 sc, the 8 m, a byte each) and `q6_records` (Q6_K,
Q6_RECORD_BYTES bytes: f16 d, the 16 int8 sc).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK_K = 256
K_RECORD_BYTES = 20  # a Q4_K super-block's f16 d, f16 dmin, 8 six-bit scales, 8 six-bit mins
Q6_RECORD_BYTES = 18  # a Q6_K super-block's f16 d and 16 int8 scales
# ggml type -> (values per block, bytes per block)
BLOCK_SIZES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176), "Q6_K": (QK_K, 210)}


@dataclass(frozen=True)
class BlockCodes:
    """A quantized matrix [N, K]: w[n, k] = codes[n, k] * scales[n, k // group] (+ offsets[n, k // group])."""

    codes: np.ndarray  # [N, K]: int8 (Q8_0, Q5_K, Q6_K) or uint8 codes 0..15 (Q4_0, Q4_K)
    scales: np.ndarray  # [N, K // group] float32
    offsets: np.ndarray | None  # [N, K // group] float32; None: symmetric (w = code * scale)
    group: int
    k_records: np.ndarray | None = None  # Q4_K, Q5_K: [N, K // 256, K_RECORD_BYTES] uint8, the file's factors
    q6_records: np.ndarray | None = None  # Q6_K only: [N, K // 256, Q6_RECORD_BYTES] uint8, the file's factors

    def rows(self, order: np.ndarray) -> BlockCodes:
        """The same matrix with its rows in `order` (an index array)."""
        return BlockCodes(
            self.codes[order],
            self.scales[order],
            None if self.offsets is None else self.offsets[order],
            self.group,
            None if self.k_records is None else self.k_records[order],
            None if self.q6_records is None else self.q6_records[order],
        )

    def dequantize(self) -> np.ndarray:
        """The float32 values (code * scale + offset), what gguf-py's dequantize returns."""
        n, k = self.codes.shape
        w = self.codes.reshape(n, k // self.group, self.group).astype(np.float32) * self.scales[..., None]
        if self.offsets is not None:
            w += self.offsets[..., None]
        return w.reshape(n, k)


def unpack_blocks(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> BlockCodes:
    """The codes of a 2-D tensor of ggml type `type_name` from its raw bytes `data` (any shape)."""
    if type_name not in _UNPACKERS:
        raise ValueError(f"no block decoder for ggml type {type_name} (have {', '.join(_UNPACKERS)})")
    if len(shape) != 2:
        raise ValueError(f"{type_name} blocks: a 2-D tensor needed, got shape {shape}")
    values, size = BLOCK_SIZES[type_name]
    rows, cols = shape
    if cols % values != 0:
        raise ValueError(f"{type_name} rows hold blocks of {values} values; a row of {cols} is not a multiple")
    blocks = np.asarray(data).view(np.uint8).reshape(-1, size)
    if blocks.shape[0] != rows * cols // values:
        raise ValueError(f"{type_name}: {blocks.shape[0]} blocks for a {rows} x {cols} tensor")
    codes, scales, offsets, group = _UNPACKERS[type_name](blocks)
    return BlockCodes(
        codes.reshape(rows, cols),
        scales.reshape(rows, cols // group),
        None if offsets is None else offsets.reshape(rows, cols // group),
        group,
        _k_records(blocks).reshape(rows, cols // QK_K, K_RECORD_BYTES) if type_name in ("Q4_K", "Q5_K") else None,
        _q6_records(blocks).reshape(rows, cols // QK_K, Q6_RECORD_BYTES) if type_name == "Q6_K" else None,
    )


_Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray | None, int]


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte `start` of every block, as float32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _q8_0(blocks: np.ndarray) -> _Unpacked:
    return np.ascontiguousarray(blocks[:, 2:]).view(np.int8), _f16(blocks, 0), None, 32


def _q4_0(blocks: np.ndarray) -> _Unpacked:
    d = _f16(blocks, 0)
    qs = blocks[:, 2:]  # byte j: value j in the low nibble, value j + 16 in the high
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return codes, d, -8 * d, 32


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4: 12 bytes -> 8 six-bit scales and 8 six-bit mins per block."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _k_records(blocks: np.ndarray) -> np.ndarray:
    """Q4_K's (or Q5_K's: the same first 16 bytes) factors per block [n, K_RECORD_BYTES]: the f16 d and
    dmin bytes, the 8 sc, the 8 m."""
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    return np.concatenate([blocks[:, 0:4], sc, mn], axis=1).astype(np.uint8)


def _q6_records(blocks: np.ndarray) -> np.ndarray:
    """Q6_K's factors per block [n, Q6_RECORD_BYTES]: the f16 d bytes (the block's last two), the 16 sc."""
    return np.concatenate([blocks[:, 208:210], blocks[:, 192:208]], axis=1).astype(np.uint8)


def _k_affine(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's per-sub-block scale d*sc and offset -dmin*m [n, 8], and the 4-bit codes [n, 8, 32]."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    qs = blocks[:, -128:].reshape(-1, 4, 32)  # 64 values per 32 bytes: sub-block 2c low nibbles, 2c + 1 high
    low = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), low


def _q4_k(blocks: np.ndarray) -> _Unpacked:
    scales, offsets, codes = _k_affine(blocks)
    return codes, scales, offsets, 32


def _q5_k(blocks: np.ndarray) -> _Unpacked:
    scales, offsets, low = _k_affine(blocks)
    qh = blocks[:, 16:48]  # bit i of byte j: the fifth bit of sub-block i's value j
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    return (low | (high << 4)).astype(np.int8), scales, offsets, 32


def _q6_k(blocks: np.ndarray) -> _Unpacked:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128].reshape(n, 2, 64), blocks[:, 128:192].reshape(n, 2, 32)
    low = np.stack([ql & 0x0F, ql >> 4], axis=2).reshape(n, 256)
    high = ((qh[:, :, None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3).reshape(n, 256)
    codes = (low | (high << 4)).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    return codes, _f16(blocks, 208) * sc, None, 16


_UNPACKERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}

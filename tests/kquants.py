"""Encoders for ggml's K-quant blocks (Q4_K, Q5_K, Q6_K), for tests only.

gguf-py's quants module decodes K-quants but cannot encode them, and llama.cpp's quantizer is not
available here. These encoders write valid blocks of ggml's layout (ggml-common.h) with plain
round-to-nearest scales (not llama.cpp's searched ones: the error is larger, the format the same).
Each returns (block bytes, the values those bytes decode to), so a test can check the packing
against gguf-py's decoder before trusting it.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def _pack_scale_min_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block -> ggml's 12 bytes (get_scale_min_k4's inverse)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def _affine(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Per 32-value sub-block x ~ d*sc*q - dmin*m, q in [0, levels]; returns d, dmin, sc, m, q, values."""
    sub = blocks.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    hi = sub.max(axis=2)
    scale = (hi - lo) / levels
    d = _f16(scale.max(axis=1) / 63).astype(np.float32)
    dmin = _f16(-lo.min(axis=1) / 63).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_safe_div(-lo, dmin[:, None])), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    offset = dmin[:, None] * m
    q = np.clip(np.round(_safe_div(sub + offset[:, :, None], step[:, :, None] + 0 * sub)), 0, levels).astype(np.uint8)
    values = step[:, :, None] * q - offset[:, :, None]
    return d, dmin, sc, m, q, values.reshape(-1, QK_K)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 8, 32) 4-bit values -> (n, 128): sub-blocks 2c and 2c+1 share bytes c*32.. (low, high)."""
    pairs = q.reshape(-1, 4, 2, 32) & 0xF
    return (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(-1, 128).astype(np.uint8)


def encode_q4_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    blocks = x.reshape(-1, QK_K).astype(np.float32)
    d, dmin, sc, m, q, values = _affine(blocks, 15)
    head = np.concatenate([_f16(d)[:, None].view(np.uint8), _f16(dmin)[:, None].view(np.uint8)], axis=1)
    raw = np.concatenate([head, _pack_scale_min_k4(sc, m), _pack_nibbles(q)], axis=1)
    return _rows(raw, x), values.reshape(x.shape)


def encode_q5_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    blocks = x.reshape(-1, QK_K).astype(np.float32)
    d, dmin, sc, m, q, values = _affine(blocks, 31)
    high = (q >> 4) & 1  # (n, 8, 32): bit j of qh[l] is sub-block j's fifth bit of element l
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= (high[:, j, :] << j).astype(np.uint8)
    head = np.concatenate([_f16(d)[:, None].view(np.uint8), _f16(dmin)[:, None].view(np.uint8)], axis=1)
    raw = np.concatenate([head, _pack_scale_min_k4(sc, m), qh, _pack_nibbles(q)], axis=1)
    return _rows(raw, x), values.reshape(x.shape)


def encode_q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    blocks = x.reshape(-1, QK_K).astype(np.float32)
    sub = blocks.reshape(-1, 16, 16)
    amax = np.abs(sub).max(axis=2)
    scale = amax / 31
    d = _f16(scale.max(axis=1) / 127).astype(np.float32)
    sc = np.clip(np.round(_safe_div(scale, d[:, None])), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.clip(np.round(_safe_div(sub, step[:, :, None] + 0 * sub)), -32, 31).astype(np.int16)
    values = (step[:, :, None] * q).reshape(-1, QK_K)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # per half of 128: four rows of 32 (l, l+32, l+64, l+96)
    ql = np.concatenate(
        [(u[:, :, 0] & 0xF) | ((u[:, :, 2] & 0xF) << 4), (u[:, :, 1] & 0xF) | ((u[:, :, 3] & 0xF) << 4)], axis=2
    )
    qh = (u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4) | ((u[:, :, 3] >> 4) << 6)
    raw = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64).astype(np.uint8), sc.view(np.uint8), _f16(d)[:, None].view(np.uint8)],
        axis=1,
    )
    return _rows(raw, x), values.reshape(x.shape)


def _rows(raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Block bytes laid out per row, as gguf's writer wants quantized data: (rows, bytes per row)."""
    return np.ascontiguousarray(raw.astype(np.uint8)).reshape(x.shape[0], -1)


ENCODERS = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}

"""KV block codecs: a block tensor <-> bytes, lossless by default, lossy (fp16/bf16/int8/int4) opt-in.

A block is `kv_cache[:, :, block_id]`, shape [num_layers, 2, block_size, num_kv_heads, head_dim]; a
stack of blocks adds leading dims. Every codec only needs the last three dims to be
[block_size, num_kv_heads, head_dim]. `decode` is given the shape and dtype back (tiers and packs
store them next to the bytes), so the encoded bytes carry no header of their own.

Names: "lossless", "fp16", "bf16", "int8", "int4", each optionally with "+zstd" (needs `zstandard`).
All byte orders are little-endian (the layout of torch tensors on every supported host).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BASE_CODECS = ("lossless", "fp16", "bf16", "int8", "int4")
ZSTD_SUFFIX = "+zstd"
INT4_GROUP_SIZE = 32

Shape = Sequence[int]
Device = str | torch.device


def _to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes | memoryview, dtype: torch.dtype, shape: Shape) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(tuple(shape))


def _check_size(codec: str, data: bytes | memoryview, expected: int) -> None:
    if len(data) != expected:
        raise ValueError(f"codec {codec!r}: payload has {len(data)} bytes, the shape needs {expected}")


class Codec(ABC):
    """Encodes a KV block (or a stack of blocks) to bytes and back."""

    name: str
    is_lossless: bool

    @abstractmethod
    def encode(self, block: torch.Tensor) -> bytes:
        """Bytes for `block` ([..., block_size, num_kv_heads, head_dim])."""

    @abstractmethod
    def decode(
        self, data: bytes | memoryview, shape: Shape, dtype: torch.dtype, device: Device = "cpu"
    ) -> torch.Tensor:
        """The tensor of `shape`/`dtype` on `device`; ValueError when `data` does not fit the shape."""

    def __repr__(self) -> str:
        return f"<Codec {self.name}>"


class LosslessCodec(Codec):
    """Raw bytes in the engine's own dtype: bit-exact."""

    name = "lossless"
    is_lossless = True

    def encode(self, block: torch.Tensor) -> bytes:
        return _to_bytes(block)

    def decode(
        self, data: bytes | memoryview, shape: Shape, dtype: torch.dtype, device: Device = "cpu"
    ) -> torch.Tensor:
        _check_size(self.name, data, math.prod(shape) * dtype.itemsize)
        return _from_bytes(data, dtype, shape).to(device)


class CastCodec(Codec):
    """Downcast to a 16-bit float (fp16 or bf16); decoded back to the cache dtype."""

    is_lossless = False

    def __init__(self, name: str, storage_dtype: torch.dtype) -> None:
        self.name = name
        self.storage_dtype = storage_dtype

    def encode(self, block: torch.Tensor) -> bytes:
        return _to_bytes(block.to(self.storage_dtype))

    def decode(
        self, data: bytes | memoryview, shape: Shape, dtype: torch.dtype, device: Device = "cpu"
    ) -> torch.Tensor:
        _check_size(self.name, data, math.prod(shape) * self.storage_dtype.itemsize)
        return _from_bytes(data, self.storage_dtype, shape).to(device=device, dtype=dtype)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    # NOTE: an all-zero slice has scale 0; divide by 1 instead so it encodes as zeros, not NaN.
    return torch.where(scale > 0, scale, torch.ones_like(scale))


class Int8Codec(Codec):
    """Symmetric absmax int8, one fp32 scale per (block, layer, K/V, head).

    Layout: fp32 scales [..., 1, num_kv_heads, 1] then int8 values [..., block_size, heads, head_dim].
    Error bound: |x - decoded| <= scale / 2 with scale = absmax / 127 (in fp32 before the final cast).
    """

    name = "int8"
    is_lossless = False

    def encode(self, block: torch.Tensor) -> bytes:
        x = block.detach().to("cpu", torch.float32)  # [..., block_size, heads, head_dim]
        scale = x.abs().amax(dim=(-3, -1), keepdim=True) / 127.0  # [..., 1, heads, 1]
        q = torch.round(x / _safe(scale)).clamp_(-127, 127).to(torch.int8)
        return _to_bytes(scale) + _to_bytes(q)

    def decode(
        self, data: bytes | memoryview, shape: Shape, dtype: torch.dtype, device: Device = "cpu"
    ) -> torch.Tensor:
        scale_shape = (*shape[:-3], 1, shape[-2], 1)
        num_scale_bytes = math.prod(scale_shape) * 4
        _check_size(self.name, data, num_scale_bytes + math.prod(shape))
        view = memoryview(data)
        scale = _from_bytes(view[:num_scale_bytes], torch.float32, scale_shape)
        q = _from_bytes(view[num_scale_bytes:], torch.int8, shape)
        return (q.to(torch.float32) * scale).to(device=device, dtype=dtype)


class Int4Codec(Codec):
    """Symmetric absmax int4 in groups of 32 along head_dim (fewer when head_dim < 32).

    Layout: fp32 scales [..., num_groups] then nibbles (value + 8, in 1..15), two per byte, low nibble
    first. head_dim is zero-padded to whole groups (zeros never change a group's absmax).
    Error bound: |x - decoded| <= scale / 2 per group, scale = group absmax / 7.
    """

    name = "int4"
    is_lossless = False

    @staticmethod
    def _groups(head_dim: int) -> tuple[int, int]:
        group_size = min(INT4_GROUP_SIZE, head_dim)
        return group_size, -(-head_dim // group_size)

    def encode(self, block: torch.Tensor) -> bytes:
        x = block.detach().to("cpu", torch.float32)
        head_dim = x.shape[-1]
        group_size, num_groups = self._groups(head_dim)
        x = F.pad(x, (0, group_size * num_groups - head_dim))
        x = x.reshape(*x.shape[:-1], num_groups, group_size)  # [..., heads, num_groups, group_size]
        scale = x.abs().amax(dim=-1, keepdim=True) / 7.0  # [..., heads, num_groups, 1]
        q = (torch.round(x / _safe(scale)).clamp_(-7, 7) + 8).to(torch.uint8).reshape(-1)
        if q.numel() % 2:
            q = F.pad(q, (0, 1))
        packed = q[0::2] | (q[1::2] << 4)
        return _to_bytes(scale) + _to_bytes(packed)

    def decode(
        self, data: bytes | memoryview, shape: Shape, dtype: torch.dtype, device: Device = "cpu"
    ) -> torch.Tensor:
        group_size, num_groups = self._groups(shape[-1])
        grouped_shape = (*shape[:-1], num_groups, group_size)
        num_values = math.prod(grouped_shape)
        num_scale_bytes = math.prod(grouped_shape[:-1]) * 4
        _check_size(self.name, data, num_scale_bytes + (num_values + 1) // 2)
        view = memoryview(data)
        scale = _from_bytes(view[:num_scale_bytes], torch.float32, (*grouped_shape[:-1], 1))
        packed = _from_bytes(view[num_scale_bytes:], torch.uint8, ((num_values + 1) // 2,))
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(-1)[:num_values]
        x = (q.to(torch.float32) - 8.0).reshape(grouped_shape) * scale
        x = x.reshape(*shape[:-1], num_groups * group_size)[..., : shape[-1]]
        return x.to(device=device, dtype=dtype).contiguous()


class ZstdCodec(Codec):
    """Any base codec followed by zstd; decodes to exactly what the base codec decodes to."""

    def __init__(self, base: Codec, level: int = 3) -> None:
        try:
            import zstandard
        except ImportError as error:
            raise ValueError(
                f"codec '{base.name}{ZSTD_SUFFIX}' needs the zstandard package: "
                "pip install 'kvpager[zstd]', or choose a codec without '+zstd'"
            ) from error
        self.base = base
        self.name = base.name + ZSTD_SUFFIX
        self.is_lossless = base.is_lossless
        self._compressor = zstandard.ZstdCompressor(level=level)
        self._decompressor = zstandard.ZstdDecompressor()
        self._zstd_error = zstandard.ZstdError

    def encode(self, block: torch.Tensor) -> bytes:
        return self._compressor.compress(self.base.encode(block))

    def decode(
        self, data: bytes | memoryview, shape: Shape, dtype: torch.dtype, device: Device = "cpu"
    ) -> torch.Tensor:
        # NOTE: the output is capped so a hostile frame cannot decompress into unbounded memory.
        limit = math.prod(shape) * max(dtype.itemsize, 4) + 4096
        try:
            raw = self._decompressor.decompress(bytes(data), max_output_size=limit)
        except self._zstd_error as error:
            raise ValueError(f"codec {self.name!r}: zstd payload is invalid: {error}") from error
        return self.base.decode(raw, shape, dtype, device)


def available_codecs() -> list[str]:
    """Every valid codec name (zstd variants included whether or not zstandard is installed)."""
    return [*BASE_CODECS, *(name + ZSTD_SUFFIX for name in BASE_CODECS)]


def get_codec(name: str) -> Codec:
    """The codec called `name`; ValueError listing the valid names otherwise."""
    base_name, zstd = (name[: -len(ZSTD_SUFFIX)], True) if name.endswith(ZSTD_SUFFIX) else (name, False)
    bases: dict[str, Codec] = {
        "lossless": LosslessCodec(),
        "fp16": CastCodec("fp16", torch.float16),
        "bf16": CastCodec("bf16", torch.bfloat16),
        "int8": Int8Codec(),
        "int4": Int4Codec(),
    }
    base = bases.get(base_name)
    if base is None:
        raise ValueError(f"unknown KV codec {name!r}; valid codecs: {', '.join(available_codecs())}")
    return ZstdCodec(base) if zstd else base


@dataclass(frozen=True)
class CodecReport:
    """What a codec did to some blocks: compression ratio and the error it introduced."""

    codec: str
    num_blocks: int
    raw_bytes: int
    encoded_bytes: int
    max_abs_error: float
    mean_abs_error: float

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else math.inf


def measure(codec: Codec, blocks: torch.Tensor | Sequence[torch.Tensor]) -> CodecReport:
    """Encode and decode every block; report ratio (raw / encoded bytes) and absolute errors.

    `blocks` is a list of block tensors or a stacked tensor whose first dim indexes blocks.
    """
    raw = encoded = count = 0
    max_error = total_error = 0.0
    for block in blocks:
        data = codec.encode(block)
        decoded = codec.decode(data, block.shape, block.dtype, block.device)
        error = (decoded.to(torch.float64) - block.to(torch.float64)).abs()
        raw += block.numel() * block.element_size()
        encoded += len(data)
        count += block.numel()
        if error.numel():
            max_error = max(max_error, error.max().item())
            total_error += error.sum().item()
    return CodecReport(
        codec=codec.name,
        num_blocks=len(blocks),
        raw_bytes=raw,
        encoded_bytes=encoded,
        max_abs_error=max_error,
        mean_abs_error=total_error / count if count else 0.0,
    )

"""safetensors files memory-mapped, read tensor by tensor without materialising the whole file.

`MappedSafetensors(path)` parses the header (8-byte little-endian length, then JSON) and maps the file
copy-on-write. `view(name)` is a zero-copy tensor over the mapped bytes (its pages are read from disk
as they are touched); `release(name)` tells the kernel those pages are no longer needed, so they leave
the process's resident set once the loader has converted the tensor into its own storage. Together:
peak RSS while loading stays near the final weights plus one tensor, whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


class MappedSafetensors:
    """One safetensors file, mapped; ValueError naming the file for anything malformed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.infos: dict[str, TensorInfo] = {}
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                (length,) = struct.unpack("<Q", f.read(8))
                if length > min(MAX_HEADER_BYTES, size - 8):
                    raise ValueError(f"header length {length} is implausible for a {size}-byte file")
                header = json.loads(f.read(length))
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + length else None
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read safetensors file {str(path)!r}: {exc}") from exc
        if not isinstance(header, dict):
            raise ValueError(f"cannot read safetensors file {str(path)!r}: the header is not a JSON object")
        base = 8 + length
        for name, info in header.items():
            if name != "__metadata__":
                self.infos[name] = self._parse(name, info, base, size)

    def _parse(self, name: str, info: object, base: int, size: int) -> TensorInfo:
        try:
            assert isinstance(info, dict)
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(v) for v in info["data_offsets"])
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"cannot read safetensors file {str(self.path)!r}: bad entry for {name!r} ({exc})"
            ) from exc
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if begin < 0 or end != begin + numel * itemsize or base + end > size:
            raise ValueError(f"cannot read safetensors file {str(self.path)!r}: {name!r} lies outside the file")
        return TensorInfo(dtype, shape, base + begin, base + end)

    def view(self, name: str) -> torch.Tensor:
        """The tensor over the mapped bytes (no copy); valid until `close`."""
        info = self.infos[name]
        count = (info.end - info.start) // torch.empty((), dtype=info.dtype).element_size()
        if count == 0 or self._mm is None:
            return torch.empty(info.shape, dtype=info.dtype)
        return torch.frombuffer(self._mm, dtype=info.dtype, count=count, offset=info.start).view(info.shape)

    def release(self, name: str, fraction: tuple[int, int] | None = None) -> None:
        """Drop the tensor's pages (or its rows' share `fraction` = (first, end) of dim 0) from the resident
        set; they are re-read from disk if touched again."""
        info = self.infos[name]
        if self._mm is None or info.end <= info.start or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, end = info.start, info.end
        if fraction is not None and info.shape:
            row_bytes = (end - start) // max(1, info.shape[0])
            start, end = info.start + fraction[0] * row_bytes, info.start + fraction[1] * row_bytes
        page = mmap.PAGESIZE
        start -= start % page
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # NOTE: a view is still alive; the mapping goes when it does
                pass
            self._mm = None

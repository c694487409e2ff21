"""Find and open the GGUF file(s) of a model; metadata decoded, tensors as memory-mapped numpy views.

A model is one `.gguf` file, a directory holding one, or llama.cpp's split parts
`NAME-00001-of-0000N.gguf` (any part, or their directory, names the whole set). Reading goes through
the `gguf` package's GGUFReader, which memory-maps each file: nothing is copied until a tensor is
converted (kvpager/model/gguf_weights.py). Every failure is a GGUFError (a ValueError) naming the file
and what is wrong with it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SPLIT_PATTERN = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# NOTE: the reader's own bookkeeping fields (header counts, tensor infos), not file metadata.
_READER_FIELD_PREFIX = "GGUF."


class GGUFError(ValueError):
    """A GGUF file that cannot be used, with the file and the reason in the message."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in torch order (rows first), `data` the file's bytes (memory-mapped view)."""

    name: str
    type_name: str  # ggml type: "F32", "F16", "BF16", "Q8_0", "Q4_K", ...
    shape: tuple[int, ...]
    n_bytes: int
    data: np.ndarray = field(repr=False, compare=False)


@dataclass(frozen=True)
class GGUFModel:
    """The metadata (first part's, for split files) and every tensor of every part, by name."""

    files: tuple[Path, ...]
    metadata: dict[str, Any] = field(repr=False)
    tensors: dict[str, GGUFTensor] = field(repr=False)

    @property
    def path(self) -> Path:
        return self.files[0]

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"GGUF file {str(self.path)!r} has no 'general.architecture' metadata")
        return arch

    def tensor_bytes(self) -> int:
        """Exact bytes of all tensor data as stored (quantized blocks with their scales)."""
        return sum(t.n_bytes for t in self.tensors.values())

    def type_counts(self) -> dict[str, int]:
        """How many tensors of each ggml type the file holds."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return dict(sorted(counts.items()))

    def digest(self) -> str:
        """sha256 over the tensor data (names sorted, with type and shape) and the architecture's
        hyper-parameters (`<arch>.*` metadata): what makes two files' KV interchangeable."""
        h = hashlib.sha256()
        for name in sorted(self.tensors):
            t = self.tensors[name]
            h.update(json.dumps([name, t.type_name, list(t.shape)]).encode())
            h.update(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).data)
        arch = self.metadata.get("general.architecture", "")
        hyper = {k: v for k, v in self.metadata.items() if k.startswith(f"{arch}.")}
        h.update(json.dumps(hyper, sort_keys=True, default=str).encode())
        return h.hexdigest()


def is_gguf_path(path: str | Path) -> bool:
    """True for a .gguf file, or a directory holding .gguf files and no config.json."""
    p = Path(path).expanduser()
    if p.is_file():
        return p.suffix.lower() == ".gguf" or _has_magic(p)
    return p.is_dir() and not (p / "config.json").is_file() and any(p.glob("*.gguf"))


def find_gguf_files(path: str | Path) -> list[Path]:
    """The model's file(s): one file, or every part of a split set, in part order."""
    p = Path(path).expanduser()
    if p.is_dir():
        candidates = sorted(p.glob("*.gguf"))
        models = sorted({_set_key(c) for c in candidates})
        if not models:
            raise GGUFError(f"no .gguf file in directory {str(p)!r}")
        if len(models) > 1:
            raise GGUFError(
                f"directory {str(p)!r} holds {len(models)} GGUF models ({', '.join(models)}); pass the file itself"
            )
        p = next(c for c in candidates if _set_key(c) == models[0])
    if not p.is_file():
        raise GGUFError(f"GGUF file {str(p)!r} does not exist")
    match = SPLIT_PATTERN.match(p.name)
    if match is None:
        return [p]
    count = int(match["count"])
    parts = [p.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [q.name for q in parts if not q.is_file()]
    if missing:
        raise GGUFError(f"split GGUF model {str(p)!r} lacks part(s) {', '.join(missing)} of {count}")
    return parts


def open_gguf(path: str | Path) -> GGUFModel:
    """Open every part; metadata of the first, tensors of all (a name in two parts is an error)."""
    files = find_gguf_files(path)
    metadata: dict[str, Any] = {}
    tensors: dict[str, GGUFTensor] = {}
    for index, file in enumerate(files):
        part_metadata, part_tensors = _read_file(file)
        if index == 0:
            metadata = part_metadata
        for t in part_tensors:
            if t.name in tensors:
                raise GGUFError(f"tensor {t.name!r} appears in more than one part of {str(files[0])!r}")
            tensors[t.name] = t
    return GGUFModel(tuple(files), metadata, tensors)


def _read_file(file: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    try:
        from gguf import GGUFReader  # imported here: the package takes a second to import
    except ImportError as e:
        raise GGUFError(f"reading GGUF file {str(file)!r} needs the 'gguf' package (pip install gguf==0.19.0)") from e

    if not _has_magic(file):
        with file.open("rb") as f:
            head = f.read(4)
        raise GGUFError(f"{str(file)!r} is not a GGUF file: it starts with {head!r}, a GGUF file with {GGUF_MAGIC!r}")
    try:
        reader = GGUFReader(file, "r")
    except ValueError as e:
        if "GGMLQuantizationType" in str(e):
            raise GGUFError(f"GGUF file {str(file)!r} holds a tensor of unknown ggml type ({e})") from e
        raise GGUFError(f"cannot read GGUF file {str(file)!r}: {e} (is it truncated or corrupt?)") from e
    except (IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
        raise GGUFError(f"cannot read GGUF file {str(file)!r}: {e} (is it truncated or corrupt?)") from e
    size = file.stat().st_size
    tensors = []
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(
                f"GGUF file {str(file)!r} is truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes}, "
                f"the file has {size}"
            )
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors.append(GGUFTensor(t.name, t.tensor_type.name, shape, int(t.n_bytes), t.data))
    metadata = {name: f.contents() for name, f in reader.fields.items() if not name.startswith(_READER_FIELD_PREFIX)}
    return metadata, tensors


def _has_magic(file: Path) -> bool:
    try:
        with file.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _set_key(file: Path) -> str:
    """The name a file's model goes by: split parts share their stem."""
    match = SPLIT_PATTERN.match(file.name)
    return match["stem"] if match else file.stem

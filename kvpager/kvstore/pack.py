"""KV packs: a self-describing file (or HTTP payload) of KV blocks for one token prefix. No pickle.

Layout (docs/kv-pack-format.md has the full description; integers little-endian):

    magic          8 bytes   b"KVPACK\\x00\\x01"
    header_len     uint64
    header         UTF-8 JSON (format version, model fingerprint + facts, token ids, codec, blocks)
    header_sha256  32 bytes  sha256 of the header bytes
    payloads       the blocks' encoded bytes, concatenated in header order

Reading checks, in order: magic, header length (bounded by the token count the reader allows),
header checksum, format version, the expected model (every differing field is named), the token
count, the file's size, then each block's sha256 (the bad block is named) and that every decoded
value is finite (NaN/Inf K/V would poison every request that reuses the block). Pack files must be
regular files: a device, FIFO or directory is refused before anything is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import struct
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvpager import __version__
from kvpager.core.hashing import BlockHash
from kvpager.kvstore.codec import Codec, Device, available_codecs, get_codec
from kvpager.model.dtypes import dtype_from_name, dtype_name

PACK_MAGIC = b"KVPACK\x00\x01"
PACK_FORMAT = "kvpager-kv-pack"
PACK_FORMAT_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024 * 1024
_PREFIX = struct.Struct("<8sQ")  # magic, header_len
_DIGEST_BYTES = 32
_INT_FACTS = ("block_size", "num_layers", "num_kv_heads", "head_dim")
# Header bytes a reader allows per token id (digits, comma) and per block entry (hash, sha256, size),
# plus the fixed part, when it bounds the token count (`max_tokens`); the JSON is parsed only then.
_HEADER_BYTES_PER_TOKEN = 12
_HEADER_BYTES_PER_BLOCK = 256
_HEADER_FIXED_BYTES = 64 * 1024


@dataclass(frozen=True)
class PackModel:
    """What makes KV bytes interchangeable between engines (plain strings and ints)."""

    architecture: str
    dtype: str  # KV cache dtype: "float32" | "float16" | "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokenizer_digest: str
    weights_digest: str

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        # [num_layers, 2, block_size, num_kv_heads, head_dim]: kv_cache[:, :, block_id]
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class PackHeader:
    """The model-level part of a pack header; codec and per-block entries are added on write."""

    model_fingerprint: str  # hex of the fingerprint bytes that seed the block hash chain
    model: PackModel
    token_ids: tuple[int, ...]
    created_at: float = field(default_factory=time.time)
    kvpager_version: str = __version__
    format_version: int = PACK_FORMAT_VERSION


@dataclass(frozen=True)
class PackExpectation:
    """What the loading engine is: a pack is refused unless every field matches.

    `max_tokens` (the engine's max_model_len) bounds the token ids a pack may carry; None: unbounded.
    """

    model_fingerprint: str
    model: PackModel
    max_tokens: int | None = None


@dataclass
class Pack:
    """A decoded pack: its header, codec name and (hash, block tensor) pairs in prefix order."""

    header: PackHeader
    codec: str
    blocks: list[tuple[BlockHash, torch.Tensor]]

    @property
    def block_hashes(self) -> list[BlockHash]:
        return [block_hash for block_hash, _ in self.blocks]

    @property
    def num_cached_tokens(self) -> int:
        """Token positions the blocks cover (full blocks only)."""
        return len(self.blocks) * self.header.model.block_size


def encode_payload(header: PackHeader, blocks: Sequence[tuple[bytes, torch.Tensor]], codec: Codec | str) -> bytes:
    """The pack bytes for `blocks` (the prefix's full blocks, in order) encoded with `codec`."""
    codec = get_codec(codec) if isinstance(codec, str) else codec
    facts = header.model
    if len(blocks) > len(header.token_ids) // facts.block_size:
        raise ValueError(
            f"{len(blocks)} blocks need at least {len(blocks) * facts.block_size} token ids, "
            f"the header has {len(header.token_ids)}"
        )
    payloads = []
    for index, (_, block) in enumerate(blocks):
        if tuple(block.shape) != facts.block_shape or dtype_name(block.dtype) != facts.dtype:
            raise ValueError(
                f"block {index} is {tuple(block.shape)} {block.dtype}; the header's model facts "
                f"need {facts.block_shape} {facts.dtype}"
            )
        payloads.append(codec.encode(block))
    fields = asdict(header)
    fields["token_ids"] = list(header.token_ids)
    fields.update(
        format=PACK_FORMAT,
        codec=codec.name,
        block_shape=list(facts.block_shape),
        blocks=[
            {"hash": block_hash.hex(), "size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
            for (block_hash, _), payload in zip(blocks, payloads, strict=True)
        ],
    )
    header_bytes = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")
    prefix = _PREFIX.pack(PACK_MAGIC, len(header_bytes)) + header_bytes + hashlib.sha256(header_bytes).digest()
    return b"".join([prefix, *payloads])


def write_pack(
    path: str | os.PathLike[str], header: PackHeader, blocks: Sequence[tuple[bytes, torch.Tensor]], codec: Codec | str
) -> int:
    """Write a pack file atomically (temporary file + rename); returns its size in bytes."""
    data = encode_payload(header, blocks, codec)
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix="." + target.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return len(data)


def decode_payload(
    data: bytes,
    expected: PackExpectation | None = None,
    max_bytes: int | None = None,
    device: Device = "cpu",
    source: str = "payload",
    max_tokens: int | None = None,
) -> Pack:
    """Check and decode pack bytes (ValueError naming the problem: size, model field, bad block).

    `max_tokens` bounds the header's token ids (an importing engine passes its max_model_len); the
    header length is bounded accordingly before any JSON is parsed.
    """
    if max_bytes is not None and len(data) > max_bytes:
        raise ValueError(f"KV {source} is {len(data)} bytes, over the limit of {max_bytes} bytes")
    if max_tokens is None and expected is not None:
        max_tokens = expected.max_tokens
    fields, payload_start = _read_header(data, source, _max_header_bytes(expected, max_tokens))
    header, codec_name, entries = _parse_header(fields, source)
    if max_tokens is not None and len(header.token_ids) > max_tokens:
        raise ValueError(
            f"KV {source} covers {len(header.token_ids)} token ids, more than this model's maximum context "
            f"length of {max_tokens}"
        )
    if expected is not None:
        check_expectation(header, expected, source)
    total = sum(entry["size"] for entry in entries)
    if payload_start + total != len(data):
        raise ValueError(
            f"KV {source} is truncated or padded: header says {payload_start + total} bytes, found {len(data)}"
        )
    codec = get_codec(codec_name)
    shape, dtype = header.model.block_shape, dtype_from_name(header.model.dtype)
    blocks: list[tuple[BlockHash, torch.Tensor]] = []
    offset = payload_start
    for index, entry in enumerate(entries):
        payload = memoryview(data)[offset : offset + entry["size"]]
        offset += entry["size"]
        if hashlib.sha256(payload).hexdigest() != entry["sha256"]:
            raise ValueError(f"KV {source}: block {index} of {len(entries)} failed its sha256 checksum (corrupted)")
        try:
            block = codec.decode(payload, shape, dtype, device)
        except ValueError as error:
            raise ValueError(f"KV {source}: block {index} cannot be decoded: {error}") from error
        if block.is_floating_point() and not bool(torch.isfinite(block).all()):
            raise ValueError(f"KV {source}: block {index} holds NaN or Inf values and is refused")
        blocks.append((BlockHash(bytes.fromhex(entry["hash"])), block))
    return Pack(header=header, codec=codec_name, blocks=blocks)


def read_pack(
    path: str | os.PathLike[str],
    expected: PackExpectation | None = None,
    device: Device = "cpu",
    max_bytes: int | None = None,
) -> Pack:
    """Read, check and decode a pack file (see `decode_payload`)."""
    size = regular_file_size(path)
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"KV pack {path} is {size} bytes, over the limit of {max_bytes} bytes")
    with open(path, "rb") as file:
        data = file.read(size + 1)  # NOTE: bounded by the size seen, should the file grow meanwhile
    if len(data) != size:
        raise ValueError(f"KV pack {path} changed size while it was read ({size} -> {len(data)}+ bytes)")
    return decode_payload(data, expected, None, device, source=f"pack {path}")


def regular_file_size(path: str | os.PathLike[str]) -> int:
    """The size of a regular file; ValueError for a missing path, a directory, a device, a FIFO, ...

    NOTE: checked with stat before opening: opening a FIFO blocks, and /dev/zero never ends.
    """
    try:
        info = os.stat(path)
    except OSError as error:
        raise ValueError(f"KV pack {path} cannot be read: {error.strerror or error}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, FIFO or socket)"
        raise ValueError(f"KV pack {path} is {kind}; pass a pack file written by `kvpager kv save`")
    return info.st_size


def inspect_pack(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The header of a pack file plus its sizes, without reading or decoding the payloads."""
    size = regular_file_size(path)
    with open(path, "rb") as file:
        prefix = file.read(_PREFIX.size)
        header_len = _check_prefix(prefix, size, f"pack {path}")
        rest = file.read(header_len + _DIGEST_BYTES)
    fields, payload_start = _read_header(prefix + rest, f"pack {path}")
    _parse_header(fields, f"pack {path}")
    return {**fields, "file_size": size, "payload_bytes": size - payload_start, "num_blocks": len(fields["blocks"])}


def check_expectation(header: PackHeader, expected: PackExpectation, source: str = "pack") -> None:
    """ValueError naming every field where the pack's model differs from the expected one."""
    found, wanted = asdict(header.model), asdict(expected.model)
    diffs = [f"{key}: expected {wanted[key]!r}, found {found[key]!r}" for key in wanted if wanted[key] != found[key]]
    if header.model_fingerprint != expected.model_fingerprint:
        diffs.append(f"model_fingerprint: expected {expected.model_fingerprint!r}, found {header.model_fingerprint!r}")
    if diffs:
        raise ValueError(f"KV {source} was made for a different model and is refused; " + "; ".join(diffs))


def _max_header_bytes(expected: PackExpectation | None, max_tokens: int | None) -> int:
    if max_tokens is None:
        return MAX_HEADER_BYTES
    block_size = expected.model.block_size if expected is not None else 1
    per_blocks = (max_tokens // block_size + 1) * _HEADER_BYTES_PER_BLOCK
    return min(MAX_HEADER_BYTES, _HEADER_FIXED_BYTES + max_tokens * _HEADER_BYTES_PER_TOKEN + per_blocks)


def _check_prefix(prefix: bytes, size: int, source: str, max_header_bytes: int = MAX_HEADER_BYTES) -> int:
    if len(prefix) < _PREFIX.size or prefix[:8] != PACK_MAGIC:
        raise ValueError(f"KV {source} is not a kvpager KV pack (bad magic)")
    (header_len,) = struct.unpack_from("<Q", prefix, 8)
    if header_len > max_header_bytes:
        raise ValueError(f"KV {source}: header of {header_len} bytes is over the limit of {max_header_bytes} bytes")
    if _PREFIX.size + header_len + _DIGEST_BYTES > size:
        raise ValueError(f"KV {source} is truncated or its header length {header_len} is invalid")
    return int(header_len)


def _read_header(data: bytes, source: str, max_header_bytes: int = MAX_HEADER_BYTES) -> tuple[dict[str, Any], int]:
    header_len = _check_prefix(data[: _PREFIX.size], len(data), source, max_header_bytes)
    end = _PREFIX.size + header_len
    header_bytes, digest = data[_PREFIX.size : end], data[end : end + _DIGEST_BYTES]
    if hashlib.sha256(header_bytes).digest() != digest:
        raise ValueError(f"KV {source}: header failed its sha256 checksum (corrupted)")
    try:
        fields = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"KV {source}: header is not valid JSON: {error}") from error
    except RecursionError:  # a deeply nested header: json recurses once per level
        raise ValueError(f"KV {source}: header is nested too deeply to be a KV pack header") from None
    if not isinstance(fields, dict):
        raise ValueError(f"KV {source}: header is not a JSON object")
    return fields, end + _DIGEST_BYTES


def _field(fields: dict[str, Any], key: str, kind: type | tuple[type, ...], source: str) -> Any:
    value = fields.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"KV {source}: header field {key!r} is missing or has the wrong type")
    return value


def _parse_header(fields: dict[str, Any], source: str) -> tuple[PackHeader, str, list[dict[str, Any]]]:
    """Typed header, codec name and block entries; ValueError naming the first bad field."""
    if fields.get("format") != PACK_FORMAT:
        raise ValueError(f"KV {source}: header format is {fields.get('format')!r}, expected {PACK_FORMAT!r}")
    version = _field(fields, "format_version", int, source)
    if version != PACK_FORMAT_VERSION:
        raise ValueError(
            f"KV {source}: format version {version} is not supported (this kvpager reads {PACK_FORMAT_VERSION})"
        )
    model = _field(fields, "model", dict, source)
    facts = PackModel(
        **{
            name: _field(model, name, int if name in _INT_FACTS else str, f"{source} model")
            for name in PackModel.__dataclass_fields__
        }
    )
    token_ids = _field(fields, "token_ids", list, source)
    if not all(isinstance(token, int) and not isinstance(token, bool) and 0 <= token < 2**32 for token in token_ids):
        raise ValueError(f"KV {source}: header field 'token_ids' must hold ints in [0, 2**32)")
    header = PackHeader(
        model_fingerprint=_field(fields, "model_fingerprint", str, source),
        model=facts,
        token_ids=tuple(token_ids),
        created_at=_finite_float(_field(fields, "created_at", (int, float), source), "created_at", source),
        kvpager_version=_field(fields, "kvpager_version", str, source),
        format_version=version,
    )
    codec_name = _field(fields, "codec", str, source)
    if codec_name not in available_codecs():
        raise ValueError(f"KV {source}: unknown codec {codec_name!r}; valid codecs: {', '.join(available_codecs())}")
    if _field(fields, "block_shape", list, source) != list(facts.block_shape):
        raise ValueError(f"KV {source}: block_shape {fields['block_shape']} disagrees with the model facts")
    entries = [_block_entry(entry, index, source) for index, entry in enumerate(_field(fields, "blocks", list, source))]
    if len(entries) > len(token_ids) // facts.block_size:
        raise ValueError(f"KV {source}: {len(entries)} blocks but only {len(token_ids)} token ids")
    return header, codec_name, entries


def _finite_float(value: int | float, key: str, source: str) -> float:
    try:
        result = float(value)
    except OverflowError:
        result = float("inf")
    if result != result or result in (float("inf"), float("-inf")):
        raise ValueError(f"KV {source}: header field {key!r} is not a finite number")
    return result


def _block_entry(entry: Any, index: int, source: str) -> dict[str, Any]:
    where = f"{source} block {index}"
    if not isinstance(entry, dict):
        raise ValueError(f"KV {where}: entry is not a JSON object")
    block_hash, digest = _field(entry, "hash", str, where), _field(entry, "sha256", str, where)
    if _field(entry, "size", int, where) < 0 or len(digest) != 64 or not _is_hex(block_hash) or not _is_hex(digest):
        raise ValueError(f"KV {where}: entry has a bad size, hash or sha256")
    return entry


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True

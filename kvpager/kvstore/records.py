"""The on-disk record of one encoded KV block, with a checksum. Torch-free.

Layout (all integers little-endian):

    magic        8 bytes   b"KVBLOCK\\x00"
    version      uint32    RECORD_VERSION
    header_len   uint32    length of the JSON header
    header       UTF-8 JSON {"fingerprint": hex, "block_hash": hex, "codec": str,
                             "shape": [int, ...], "dtype": str, "payload_len": int}
    payload      payload_len bytes (the codec's output)
    checksum     32 bytes  sha256 over every byte before it

`decode_record` checks every field and raises `RecordError` (a ValueError) naming what is wrong, so a
tier can skip and remove a bad file and say why.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

RECORD_MAGIC = b"KVBLOCK\x00"
RECORD_VERSION = 1
CHECKSUM_BYTES = 32
MAX_HEADER_BYTES = 64 * 1024
_PREFIX = struct.Struct("<8sII")  # magic, version, header_len


@dataclass(frozen=True, slots=True)
class EncodedBlock:
    """A block as a codec wrote it: enough to decode it again without any other context."""

    codec_name: str
    shape: tuple[int, ...]  # [num_layers, 2, block_size, num_kv_heads, head_dim] for one block
    dtype: str  # the cache dtype it decodes to: "float32" | "float16" | "bfloat16"
    payload: bytes

    @property
    def nbytes(self) -> int:
        return len(self.payload)


class RecordError(ValueError):
    """A block record that must not be loaded; the message says why."""


def encode_record(fingerprint: bytes, block_hash: bytes, block: EncodedBlock) -> bytes:
    """The full record bytes for `block` stored under `block_hash` in the `fingerprint` namespace."""
    header = {
        "fingerprint": fingerprint.hex(),
        "block_hash": block_hash.hex(),
        "codec": block.codec_name,
        "shape": list(block.shape),
        "dtype": block.dtype,
        "payload_len": len(block.payload),
    }
    header_bytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    body = _PREFIX.pack(RECORD_MAGIC, RECORD_VERSION, len(header_bytes)) + header_bytes + block.payload
    return body + hashlib.sha256(body).digest()


def decode_record(data: bytes, fingerprint: bytes, block_hash: bytes) -> EncodedBlock:
    """The block in `data`, after checking magic, version, length, checksum, fingerprint and hash."""
    if len(data) < _PREFIX.size + CHECKSUM_BYTES:
        raise RecordError(f"truncated: {len(data)} bytes is shorter than any record")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != RECORD_MAGIC:
        raise RecordError(f"bad magic {magic!r} (not a kvpager block record)")
    if version != RECORD_VERSION:
        raise RecordError(f"record version {version} is not supported (expected {RECORD_VERSION})")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len + CHECKSUM_BYTES > len(data):
        raise RecordError(f"truncated or bad header length {header_len} for a {len(data)}-byte file")
    header = _parse_header(data[_PREFIX.size : _PREFIX.size + header_len])
    expected_len = _PREFIX.size + header_len + header["payload_len"] + CHECKSUM_BYTES
    if expected_len != len(data):
        raise RecordError(f"truncated or padded: header says {expected_len} bytes, file has {len(data)}")
    if hashlib.sha256(data[:-CHECKSUM_BYTES]).digest() != data[-CHECKSUM_BYTES:]:
        raise RecordError("checksum mismatch (corrupted bytes)")
    if header["fingerprint"] != fingerprint.hex():
        raise RecordError(
            f"record belongs to model fingerprint {header['fingerprint'][:16]}…, expected {fingerprint.hex()[:16]}…"
        )
    if header["block_hash"] != block_hash.hex():
        raise RecordError(f"record holds block {header['block_hash'][:16]}…, expected {block_hash.hex()[:16]}…")
    payload = data[_PREFIX.size + header_len : -CHECKSUM_BYTES]
    return EncodedBlock(header["codec"], tuple(header["shape"]), header["dtype"], payload)


def _parse_header(raw: bytes) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RecordError(f"unreadable header: {error}") from error
    if not isinstance(header, dict):
        raise RecordError("unreadable header: not a JSON object")
    for key, kind in (("fingerprint", str), ("block_hash", str), ("codec", str), ("dtype", str)):
        if not isinstance(header.get(key), kind):
            raise RecordError(f"header field {key!r} is missing or not a {kind.__name__}")
    shape, payload_len = header.get("shape"), header.get("payload_len")
    if not isinstance(shape, list) or not all(isinstance(dim, int) and dim >= 0 for dim in shape):
        raise RecordError("header field 'shape' is not a list of non-negative ints")
    if not isinstance(payload_len, int) or payload_len < 0:
        raise RecordError("header field 'payload_len' is not a non-negative int")
    return header

"""KV pack files and payloads: self-describing, no pickle, refused with exact reasons when wrong."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpager.core.hashing import hash_prompt_blocks, model_fingerprint
from kvpager.kvstore.pack import (
    PACK_MAGIC,
    PackExpectation,
    PackHeader,
    PackModel,
    decode_payload,
    encode_payload,
    inspect_pack,
    read_pack,
    write_pack,
)

torch.set_num_threads(1)

FACTS = PackModel(
    architecture="LlamaForCausalLM",
    dtype="float32",
    block_size=4,
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    tokenizer_digest="tok-1",
    weights_digest="weights-1",
)
TOKEN_IDS = tuple(range(100, 114))  # 14 tokens: 3 full blocks of 4 and a partial tail


def fingerprint(facts: PackModel = FACTS) -> bytes:
    return model_fingerprint(
        [
            ("architecture", facts.architecture),
            ("weights", facts.weights_digest),
            ("kv_cache_dtype", facts.dtype),
            ("block_size", str(facts.block_size)),
            ("tokenizer", facts.tokenizer_digest),
        ]
    )


def make_header(facts: PackModel = FACTS) -> PackHeader:
    return PackHeader(model_fingerprint=fingerprint(facts).hex(), model=facts, token_ids=TOKEN_IDS, created_at=1234.5)


def make_blocks(facts: PackModel = FACTS) -> list[tuple[bytes, torch.Tensor]]:
    hashes = hash_prompt_blocks(fingerprint(facts), TOKEN_IDS, facts.block_size)
    generator = torch.Generator().manual_seed(0)
    return [(h, torch.randn(facts.block_shape, generator=generator)) for h in hashes]


def expectation(facts: PackModel = FACTS) -> PackExpectation:
    return PackExpectation(model_fingerprint=fingerprint(facts).hex(), model=facts)


@pytest.fixture
def pack_path(tmp_path: Path) -> Path:
    path = tmp_path / "prefix.kvpack"
    write_pack(path, make_header(), make_blocks(), "lossless")
    return path


def test_pack_roundtrips_blocks_bit_exactly_with_its_header(pack_path: Path) -> None:
    pack = read_pack(pack_path, expectation())
    assert pack.header == make_header() and pack.codec == "lossless"
    assert pack.block_hashes == [h for h, _ in make_blocks()]
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(pack.blocks, make_blocks(), strict=True))
    assert pack.num_cached_tokens == 12


def test_pack_file_is_magic_length_and_json_header_no_pickle(pack_path: Path) -> None:
    data = pack_path.read_bytes()
    assert data[:8] == PACK_MAGIC
    (header_len,) = struct.unpack_from("<Q", data, 8)
    header = json.loads(data[16 : 16 + header_len])
    assert header["format_version"] == 1 and header["codec"] == "lossless"
    assert header["token_ids"] == list(TOKEN_IDS) and header["model"]["block_size"] == 4
    assert [entry["hash"] for entry in header["blocks"]] == [h.hex() for h, _ in make_blocks()]
    payload_bytes = sum(entry["size"] for entry in header["blocks"])
    assert len(data) == 16 + header_len + 32 + payload_bytes
    assert b"\x80\x04\x95" not in data[: 16 + header_len]  # no pickle protocol-4 frame in the header


@pytest.mark.parametrize("codec, tolerance", [("int8", 0.05), ("int4+zstd", 0.6), ("fp16", 1e-2)])
def test_lossy_pack_roundtrips_within_the_codec_error(tmp_path: Path, codec: str, tolerance: float) -> None:
    path = tmp_path / "lossy.kvpack"
    write_pack(path, make_header(), make_blocks(), codec)
    pack = read_pack(path, expectation())
    assert pack.codec == codec
    for (_, got), (_, want) in zip(pack.blocks, make_blocks(), strict=True):
        assert got.dtype == torch.float32 and 0 < (got - want).abs().max().item() < tolerance


def test_inspect_reports_header_and_sizes_without_decoding_payloads(pack_path: Path) -> None:
    data = bytearray(pack_path.read_bytes())
    data[-1] ^= 0xFF  # a corrupted payload does not stop inspect (it never reads payloads)
    pack_path.write_bytes(bytes(data))
    info = inspect_pack(pack_path)
    assert info["file_size"] == len(data) and info["num_blocks"] == 3
    assert info["payload_bytes"] == 3 * 2 * 2 * 4 * 2 * 8 * 4
    assert info["model_fingerprint"] == fingerprint().hex() and info["codec"] == "lossless"


@pytest.mark.parametrize(
    "field, value",
    [("dtype", "bfloat16"), ("block_size", 8), ("tokenizer_digest", "tok-2"), ("weights_digest", "w-2")],
)
def test_pack_for_another_model_is_refused_naming_the_field(pack_path: Path, field: str, value: Any) -> None:
    engine_facts = dataclasses.replace(FACTS, **{field: value})
    with pytest.raises(ValueError) as info:
        read_pack(pack_path, expectation(engine_facts))
    message = str(info.value)
    assert f"{field}: expected {value!r}, found {getattr(FACTS, field)!r}" in message
    other_fields = [name for name in ("dtype", "block_size", "tokenizer_digest", "weights_digest") if name != field]
    assert not any(f"{name}:" in message for name in other_fields)


def test_pack_with_only_a_different_fingerprint_is_refused_naming_it(pack_path: Path) -> None:
    expected = PackExpectation(model_fingerprint="00" * 32, model=FACTS)
    with pytest.raises(ValueError, match="model_fingerprint: expected '0000"):
        read_pack(pack_path, expected)


def test_corrupted_block_is_refused_naming_its_index(pack_path: Path) -> None:
    data = bytearray(pack_path.read_bytes())
    block_bytes = 2 * 2 * 4 * 2 * 8 * 4
    data[len(data) - block_bytes - 5] ^= 0x01  # inside block 1 of 3
    pack_path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="block 1 of 3 failed its sha256 checksum"):
        read_pack(pack_path, expectation())


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data[:-7], "truncated"),
        (lambda data: data + b"extra", "truncated or padded"),
        (lambda data: data[:20], "truncated"),
        (lambda data: b"NOTAPACK" + data[8:], "bad magic"),
        (lambda data: data[:30] + bytes([data[30] ^ 1]) + data[31:], "header failed its sha256 checksum"),
    ],
)
def test_damaged_pack_is_refused_with_the_reason(pack_path: Path, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    pack_path.write_bytes(damage(pack_path.read_bytes()))
    with pytest.raises(ValueError, match=message):
        read_pack(pack_path, expectation())


def test_payload_is_the_same_encoding_as_the_file_and_respects_the_size_limit(pack_path: Path) -> None:
    payload = encode_payload(make_header(), make_blocks(), "lossless")
    assert payload == pack_path.read_bytes()
    pack = decode_payload(payload, expectation(), max_bytes=len(payload))
    assert pack.block_hashes == [h for h, _ in make_blocks()]
    with pytest.raises(ValueError, match=f"over the limit of {len(payload) - 1} bytes"):
        decode_payload(payload, expectation(), max_bytes=len(payload) - 1)
    with pytest.raises(ValueError, match="over the limit"):
        read_pack(pack_path, expectation(), max_bytes=100)


def test_header_from_a_newer_format_version_is_refused(pack_path: Path) -> None:
    data = pack_path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", data, 8)
    header = json.loads(data[16 : 16 + header_len])
    header["format_version"] = 2
    payload = encode_payload(make_header(), make_blocks(), "lossless")  # reuse the real payloads
    new_header = json.dumps(header).encode()
    rebuilt = PACK_MAGIC + struct.pack("<Q", len(new_header)) + new_header + hashlib.sha256(new_header).digest()
    rebuilt += payload[16 + header_len + 32 :]
    with pytest.raises(ValueError, match="format version 2 is not supported"):
        decode_payload(rebuilt)


def test_writing_blocks_that_do_not_match_the_model_facts_is_refused(tmp_path: Path) -> None:
    blocks = make_blocks()
    blocks[1] = (blocks[1][0], blocks[1][1].to(torch.float16))
    with pytest.raises(ValueError, match="block 1"):
        write_pack(tmp_path / "bad.kvpack", make_header(), blocks, "lossless")
    too_many = make_blocks() * 2
    with pytest.raises(ValueError, match="token ids"):
        write_pack(tmp_path / "bad.kvpack", make_header(), too_many, "lossless")
    assert list(tmp_path.iterdir()) == []


def test_write_pack_leaves_no_temporary_file(pack_path: Path) -> None:
    assert [path.name for path in pack_path.parent.iterdir()] == [pack_path.name]

"""The model fingerprint covers everything that changes KV contents, and pack files are read only
when they are regular files of sane size (issue 16 items 4, 8, 9 and 10).

Regression: a copy of a model with only `rope_theta` changed used to accept the original's KV pack
and disk records (12/12 greedy outputs differed from cold); all dummy-weight models shared the digest
"dummy"; /dev/zero as --kv-pack read until memory ran out and a FIFO hung start-up; a nested header
raised RecursionError; a --kv-cache-dir that is a file started anyway.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from engine_helpers import TINY_BLOCK, run_greedy, tiny_llama_config

from kvpager.core.config import EngineConfig
from kvpager.engine.engine import Engine
from kvpager.engine.loading import base_fingerprint_components, model_fingerprint
from kvpager.kvstore.pack import PACK_MAGIC, decode_payload, read_pack

PROMPT = list(range(5, 5 + 6 * TINY_BLOCK + 2))


def with_rope_theta(src: Path, dst: Path, theta: float) -> Path:
    shutil.copytree(src, dst)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    if isinstance(cfg.get("rope_parameters"), dict):
        cfg["rope_parameters"]["rope_theta"] = theta
    else:
        cfg["rope_theta"] = theta
    cfg["transformers_version"] = "0.0-not-fingerprinted"  # metadata only: must not matter
    cfg_path.write_text(json.dumps(cfg))
    return dst


def test_a_model_differing_only_in_rope_theta_refuses_the_originals_pack_and_disk_records(
    llama_checkpoint: Path, tmp_path: Path
) -> None:
    twin = with_rope_theta(llama_checkpoint, tmp_path / "twin", 123.0)
    kv_dir = tmp_path / "kv"
    original = Engine(tiny_llama_config(llama_checkpoint, 64, host_kv_cache_memory=1 << 20, kv_cache_dir=str(kv_dir)))
    payload = original.export_kv(PROMPT)
    run_greedy(original, PROMPT, 4)
    original.shutdown()  # the disk tier now holds the original's blocks
    assert list(kv_dir.rglob("*.kvb"))

    changed = Engine(tiny_llama_config(twin, 64, host_kv_cache_memory=1 << 20, kv_cache_dir=str(kv_dir)))
    assert changed.loaded.fingerprint != original.loaded.fingerprint
    with pytest.raises(ValueError, match="model_fingerprint"):
        changed.import_kv(payload)
    cold = Engine(tiny_llama_config(twin, 64, enable_prefix_caching=False))
    tokens, cached = run_greedy(changed, PROMPT, 6)
    assert cached == 0  # nothing of the original's was reused
    assert tokens == run_greedy(cold, PROMPT, 6)[0]


def test_metadata_only_config_changes_keep_the_fingerprint(llama_checkpoint: Path, tmp_path: Path) -> None:
    twin = tmp_path / "meta"
    shutil.copytree(llama_checkpoint, twin)
    cfg = json.loads((twin / "config.json").read_text())
    cfg["transformers_version"] = "9.9.9"
    (twin / "config.json").write_text(json.dumps(cfg, indent=4))
    a = Engine(tiny_llama_config(llama_checkpoint, 8))
    b = Engine(tiny_llama_config(twin, 8))
    assert a.loaded.fingerprint == b.loaded.fingerprint


def test_dummy_weights_are_fingerprinted_by_seed_and_shape(llama_checkpoint: Path, qwen2_checkpoint: Path) -> None:
    def dummy(checkpoint: Path, **kw: object) -> bytes:
        return Engine(tiny_llama_config(checkpoint, 8, load_format="dummy", **kw)).loaded.fingerprint

    llama, qwen = dummy(llama_checkpoint), dummy(qwen2_checkpoint)
    assert llama != qwen
    assert llama == dummy(llama_checkpoint)  # deterministic
    assert llama != dummy(llama_checkpoint, kv_cache_dtype="bfloat16", dtype="float32")


def test_fingerprint_takes_named_components_and_each_one_counts(llama_checkpoint: Path) -> None:
    engine = Engine(tiny_llama_config(llama_checkpoint, 8))
    components = base_fingerprint_components(
        engine.config, engine.model_spec, engine.loaded.model_dir, engine.loaded.weights_digest, "tok"
    )
    names = [name for name, _ in components]
    assert {"architecture", "config", "weights", "kv_cache_dtype", "block_size", "tokenizer"} <= set(names)
    base = model_fingerprint(components)
    assert model_fingerprint(list(reversed(components))) == base  # order does not matter
    for i, (name, value) in enumerate(components):
        changed = [*components[:i], (name, value + "x"), *components[i + 1 :]]
        assert model_fingerprint(changed) != base, name
    assert model_fingerprint([*components, ("quantization", "q4")]) != base  # a helper's extra component
    with pytest.raises(ValueError, match="distinct"):
        model_fingerprint([*components, components[0]])


# -- pack files -----------------------------------------------------------------------------------
def engine_with_pack(checkpoint: Path, pack: str) -> Engine:
    return Engine(replace(tiny_llama_config(checkpoint, 64), kv_packs=(pack,)))


def test_dev_zero_and_directories_as_kv_pack_are_refused_at_once(llama_checkpoint: Path, tmp_path: Path) -> None:
    for path, what in (("/dev/zero", "not a regular file"), (str(tmp_path), "a directory")):
        with pytest.raises(ValueError, match=what):
            engine_with_pack(llama_checkpoint, path)
    with pytest.raises(ValueError, match="cannot be read"):
        engine_with_pack(llama_checkpoint, str(tmp_path / "missing.kvpack"))


def test_a_fifo_as_kv_pack_is_refused_without_blocking(llama_checkpoint: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "pack.fifo"
    os.mkfifo(fifo)
    result: list[BaseException] = []

    def load() -> None:
        try:
            read_pack(fifo)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive():  # unblock the reader so the test process can exit
        with open(fifo, "wb"):
            pass
        pytest.fail("reading a FIFO as a KV pack blocked")
    assert isinstance(result[0], ValueError) and "not a regular file" in str(result[0])


def test_deeply_nested_or_oversized_pack_header_is_a_clear_error(llama_checkpoint: Path) -> None:
    import hashlib
    import struct

    header = b'{"format": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    data = PACK_MAGIC + struct.pack("<Q", len(header)) + header + hashlib.sha256(header).digest()
    with pytest.raises(ValueError, match="nested too deeply"):
        decode_payload(data)
    engine = Engine(tiny_llama_config(llama_checkpoint, 8))
    with pytest.raises(ValueError, match="over the limit"):  # bounded by max_model_len before parsing
        engine.import_kv(data)


def test_kv_cache_dir_that_is_a_file_is_refused_at_start(llama_checkpoint: Path, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        Engine(EngineConfig(model=str(llama_checkpoint), kv_cache_memory=1 << 20, kv_cache_dir=str(not_a_dir)))

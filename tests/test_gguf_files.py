"""GGUF files that cannot be used fail with an error naming the problem; `kvpager plan file.gguf` reads
the same metadata with the file's exact tensor bytes (and the bytes kvpager holds: tests/test_calibration.py),
without importing torch."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from checkpoints import make_llama_checkpoint
from gguf_files import write_gguf

from kvpager.gguf import GGUFError, open_gguf
from kvpager.model import load_model, load_model_spec
from kvpager.planner import PlanOptions, load_model_facts, make_plan


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_llama_checkpoint(tmp_path_factory.mktemp("ck"))


@pytest.fixture(scope="module")
def q8_file(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(checkpoint, tmp_path_factory.mktemp("q8") / "model-q8_0.gguf", tensor_type="Q8_0")


def copy_of(path: Path, tmp_path: Path) -> Path:
    out = tmp_path / path.name
    out.write_bytes(path.read_bytes())
    return out


def test_truncated_file_is_refused_naming_the_truncation(q8_file: Path, tmp_path: Path) -> None:
    bad = copy_of(q8_file, tmp_path)
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size * 3 // 4])
    with pytest.raises(GGUFError, match="truncated"):
        load_model_spec(bad)
    header_only = tmp_path / "header-only.gguf"
    header_only.write_bytes(q8_file.read_bytes()[:200])
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        open_gguf(header_only)


def test_wrong_magic_is_refused_naming_the_magic(q8_file: Path, tmp_path: Path) -> None:
    bad = copy_of(q8_file, tmp_path)
    bad.write_bytes(b"GGML" + bad.read_bytes()[4:])
    with pytest.raises(GGUFError, match=r"is not a GGUF file: it starts with b'GGML'"):
        load_model(bad, dtype=torch.float32, device="cpu")


def test_unknown_tensor_type_id_is_refused(q8_file: Path, tmp_path: Path) -> None:
    bad = copy_of(q8_file, tmp_path)
    field = gguf.GGUFReader(q8_file).tensors[0].field
    type_offset = field.offset + sum(int(part.nbytes) for part in field.parts[:4])  # name len, name, n_dims, dims
    data = bytearray(bad.read_bytes())
    data[type_offset : type_offset + 4] = struct.pack("<I", 250)
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="unknown ggml type"):
        open_gguf(bad)


def test_tensor_type_kvpager_cannot_load_is_named(checkpoint: Path, tmp_path: Path) -> None:
    path = write_gguf(checkpoint, tmp_path / "q4_1.gguf", tensor_type="Q4_1")
    with pytest.raises(
        GGUFError, match=r"has ggml type Q4_1, which kvpager cannot load \(supported: F32, F16, BF16, Q8_0"
    ):
        load_model(path, dtype=torch.float32, device="cpu")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(path, "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"unsupported GGUF architecture 'phi2'.*supported: llama, qwen2, qwen3"):
        load_model_spec(path)


def test_directory_with_two_models_and_missing_split_part_are_refused(q8_file: Path, tmp_path: Path) -> None:
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(q8_file.read_bytes())
    with pytest.raises(GGUFError, match="holds 2 GGUF models"):
        open_gguf(tmp_path / "two")
    part = tmp_path / "m-00001-of-00002.gguf"
    part.write_bytes(q8_file.read_bytes())
    with pytest.raises(GGUFError, match="lacks part"):
        open_gguf(part)


def test_plan_reads_the_gguf_metadata_and_exact_tensor_bytes(checkpoint: Path, q8_file: Path) -> None:
    from_gguf, from_config = load_model_facts(str(q8_file)), load_model_facts(str(checkpoint))
    for field in (
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "hidden_size",
        "vocab_size",
        "tie_word_embeddings",
    ):
        assert getattr(from_gguf, field) == getattr(from_config, field), field
    plan = make_plan(from_gguf, PlanOptions(), None, q8_file)
    assert plan.weight_file_bytes == sum(t.n_bytes for t in gguf.GGUFReader(q8_file).tensors)
    assert plan.weight_format == "gguf" and "Q8_0 x16" in plan.weight_assumption
    # what kvpager holds: Q8_0 with float32 scales (34 -> 36 bytes per 32 weights), the embedding in 16 bits
    assert plan.weight_bytes > plan.weight_file_bytes


@pytest.mark.slow
def test_plan_cli_on_a_gguf_file_does_not_import_torch(q8_file: Path) -> None:
    code = (
        "import json, runpy, sys; sys.argv = ['kvpager', 'plan', sys.argv[1], '--json'];"
        "from kvpager.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"
    )
    out = subprocess.run([sys.executable, "-c", code, str(q8_file)], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("NO-TORCH"), out
    plan = json.loads(out[: out.rindex("}") + 1])
    assert plan["weight_file_bytes"] == open_gguf(q8_file).tensor_bytes()


TINY_Q4_0 = Path(__file__).resolve().parent / "data" / "gguf" / "tiny-llama-Q4_0.gguf"

_MEMORY_PROBE = """
import json, sys, torch
from kvpager.gguf import open_gguf
from kvpager.model import load_model
from kvpager.model.loader import model_weight_bytes
from kvpager.model.llama import CausalLM
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.spec import spec_from_gguf
def status(key):  # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's RSS at fork
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) * 1024
gguf_model = open_gguf(sys.argv[1])
with torch.device("meta"):  # torch's one-time meta-device set-up (~80 MB) is not the loader's
    CausalLM(spec_from_gguf(gguf_model))
quant_kernels_or_none()  # the packed-weight kernel library's one-time load (code, OpenMP) is not the loader's
def load(path, gguf_model):
    return load_model(
        path, dtype=torch.float32, device="cpu", kernel_backend="torch", gguf_model=gguf_model,
        gguf_dequantize=sys.argv[2] == "floats",
    )
# a warm-up load of a tiny file (same mode) takes the one-time costs of the load path (allocator
# arenas, first calls), which differ between environments and are not copies of the weights
del_me = load(sys.argv[3], open_gguf(sys.argv[3]))
del del_me
rss_before = status("VmRSS:")
model = load(sys.argv[1], gguf_model)
weights = model_weight_bytes(model)
print(json.dumps({"growth": status("VmHWM:") - rss_before, "weights": weights, "file": gguf_model.tensor_bytes()}))
"""


@pytest.mark.slow
def test_loading_a_quantized_file_holds_one_copy_of_the_weights(tmp_path: Path) -> None:
    """Peak memory growth while loading a Q8_0 file, dequantized to float32 or executed packed (int8):
    one copy of the model's weights plus the file's mapped pages (they count in RSS once read) plus one
    tensor in flight; two copies would need 2x + file."""
    shape = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 8}
    checkpoint = make_llama_checkpoint(tmp_path / "ck", **shape)
    path = write_gguf(checkpoint, tmp_path / "model-q8_0.gguf", tensor_type="Q8_0")
    for mode, min_weights in (("floats", 80 * 2**20), ("packed", 20 * 2**20)):
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_PROBE, str(path), mode, str(TINY_Q4_0)],
            capture_output=True,
            text=True,
            check=True,
        )
        probe = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"\n{mode}: load growth {probe['growth'] / 2**20:.0f} MiB for {probe['weights'] / 2**20:.0f} MiB of weights "
            f"(file {probe['file'] / 2**20:.0f} MiB)"
        )
        assert probe["weights"] > min_weights
        assert probe["growth"] < 1.4 * probe["weights"] + probe["file"]

"""Files made by llama.cpp's own tools (tests/data/gguf/, scripts/make_gguf_fixtures.py): kvpager reads
them as llama.cpp wrote them.

- the manifest's tensor types are the file's, and the K-quant files hold the types they cover
  (Q4_K_M: Q4_K + Q6_K; Q5_K_M: Q5_K + Q6_K; Q6_K);
- each packed tensor holds exactly what gguf-py's dequantizer decodes from the file (q/k rows in
  transformers' order) and its matmul equals dequantize-then-matmul to float32 rounding;
- the model's greedy output equals transformers' (which dequantizes the file to float32), and its
  logits equal transformers' and kvpager's own float model holding the dequantized weights, both
  to float32 rounding (the packed blocks are the dequantized values exactly);
- the rebuilt tokenizer gives llama-tokenize's ids (recorded by the script) for a mixed
  English/Chinese/code text, for every file whose ids were recorded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from engine_helpers import run_greedy
from test_model_equivalence import PagedHarness

from kvpager.core.config import EngineConfig
from kvpager.engine.engine import Engine
from kvpager.gguf import open_gguf
from kvpager.model import load_model
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.gguf_weights import GGUFWeights, checkpoint_name, rope_row_order
from kvpager.model.spec import spec_from_gguf
from kvpager.text.gguf_tokenizer import tokenizer_from_gguf

DATA = Path(__file__).parent / "data" / "gguf"
MANIFEST = json.loads((DATA / "manifest.json").read_text(encoding="utf-8"))
FILES = sorted(MANIFEST["files"])
TOKENIZED = [name for name in FILES if "llama_tokenize_ids" in MANIFEST["files"][name]]
PROMPT = [1, 40, 7, 99, 250, 13, 64, 300]
REL_TOL = 2e-6  # as tests/test_gguf_packed.py: float32 accumulation over K = 256..512 terms
# |logit| ~ 3. Packed vs kvpager's dequantized-float model: seen <= 2e-6 for every file. Against
# transformers (same float32 values, another summation order): seen <= 4e-6 (Q5_K_M, Q6_K included).
LOGIT_ATOL = 2e-5
# What each K-quant file is there to cover: the ggml types its linear weights must include.
COVERS = {
    "tiny-llama-Q4_K_M.gguf": {"Q4_K", "Q6_K"},
    "tiny-llama-Q5_K_M.gguf": {"Q5_K", "Q6_K"},
    "tiny-llama-Q6_K.gguf": {"Q6_K"},
}


@pytest.mark.parametrize("name", FILES)
def test_committed_file_is_the_one_the_script_made(name: str) -> None:
    assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == MANIFEST["files"][name]["sha256"]


@pytest.mark.parametrize("name", FILES)
def test_manifest_records_the_tensor_types_the_file_holds(name: str) -> None:
    model = open_gguf(DATA / name)
    entry = MANIFEST["files"][name]
    assert {n: t.type_name for n, t in model.tensors.items()} == entry["tensor_types"]
    assert model.type_counts() == entry["tensor_type_counts"]
    linear_types = {t.type_name for n, t in model.tensors.items() if n.startswith("blk.") and len(t.shape) == 2}
    assert COVERS.get(name, set()) <= linear_types


@pytest.mark.skipif(quant_kernels_or_none() is None, reason="the packed-weight C++ kernels do not build here")
@pytest.mark.parametrize("name", FILES)
def test_packed_tensors_equal_gguf_py_dequantize(name: str) -> None:
    model = open_gguf(DATA / name)
    spec = spec_from_gguf(model)
    weights = GGUFWeights(model, spec, torch.float32, native=True)
    by_gguf = {t.name: t for t in model.tensors.values()}
    seen: set[str] = set()
    gen = torch.Generator().manual_seed(0)
    for gguf_name, t in by_gguf.items():
        if t.type_name in ("F32", "F16", "BF16") or len(t.shape) != 2:
            continue
        ckpt = checkpoint_name(gguf_name, model)
        packer = weights.packer(ckpt)
        if packer is None:
            assert ckpt == "embed_tokens.weight", f"{gguf_name} ({t.type_name}) is not executed packed"
            continue
        packed = packer()
        ref = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType[t.type_name]).reshape(t.shape)
        if ".q_proj." in ckpt or ".k_proj." in ckpt:
            ref = ref[rope_row_order(t.shape[0], spec.num_heads if ".q_proj." in ckpt else spec.num_kv_heads)]
        w_ref = torch.from_numpy(np.ascontiguousarray(ref))
        assert torch.equal(packed.dequantize(), w_ref), gguf_name
        x = torch.randn(3, t.shape[1], generator=gen)
        err = (packed.matmul(x, None).double() - x.double() @ w_ref.double().T).abs()
        assert (err <= REL_TOL * (x.double().abs() @ w_ref.double().abs().T)).all(), gguf_name
        seen.add(t.type_name)
    assert seen, "no quantized linear tensor in the file"
    assert COVERS.get(name, set()) <= seen


@pytest.mark.parametrize("name", FILES)
def test_greedy_output_equals_the_dequantized_float_model(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    path = DATA / name
    hf = AutoModelForCausalLM.from_pretrained(DATA, gguf_file=name, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
        hf_logits = hf(torch.tensor([PROMPT])).logits[0]
    # the exact path (the CPU default, int8 activations, is measured against it in test_gguf_int8_activations)
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, kv_cache_memory=1 << 22)
    got, _ = run_greedy(Engine(replace(config, gguf_int8_activations=False)), PROMPT, 16)
    packed = PagedHarness(load_model(path, dtype=torch.float32, device="cpu"), block_size=4).step([("s", PROMPT)])[0]
    floats = load_model(path, dtype=torch.float32, device="cpu", gguf_dequantize=True)
    ref = PagedHarness(floats, block_size=4).step([("s", PROMPT)])[0]
    diff = (packed - ref).abs().max().item()
    hf_diff = (packed - hf_logits).abs().max().item()
    same = sum(a == b for a, b in zip(got, expected[0, len(PROMPT) :].tolist(), strict=True))
    with capsys.disabled():
        print(
            f"\n{name}: packed logits max |diff| vs kvpager's dequantized floats {diff:.2e}, vs transformers'"
            f" dequantized model {hf_diff:.2e} (tolerance {LOGIT_ATOL:.0e}); greedy {same}/16 tokens equal"
        )
    assert got == expected[0, len(PROMPT) :].tolist()
    assert diff < LOGIT_ATOL
    assert hf_diff < LOGIT_ATOL
    assert torch.equal(packed.argmax(-1), hf_logits.argmax(-1))


@pytest.mark.parametrize("name", TOKENIZED)
def test_tokenizer_ids_equal_llama_tokenize(name: str) -> None:
    tokenizer = tokenizer_from_gguf(open_gguf(DATA / name))
    assert tokenizer.encode(MANIFEST["text"]) == MANIFEST["files"][name]["llama_tokenize_ids"]

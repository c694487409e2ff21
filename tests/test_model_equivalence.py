"""The paged model's logits equal transformers' (fp32, atol 1e-4) for any batch composition.

Each case is a tiny random checkpoint saved with save_pretrained; the reference runs every
sequence alone through transformers, the engine runs them together through the paged cache
with shuffled, non-contiguous block ids.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import make_llama_checkpoint, make_mistral_checkpoint, make_qwen2_checkpoint, make_qwen3_checkpoint
from safetensors.torch import load_file, save_file

from kvpager.model import (
    ModelFileNotFoundError,
    ModelSpec,
    allocate_kv_cache,
    build_attention_metadata,
    load_model,
    load_model_spec,
)
from kvpager.model.backends.weight_layout import blocked_stride, logical_shape
from kvpager.model.llama import CausalLM
from kvpager.model.precision import fp32_matmul_precision

ATOL = 1e-4
BF16_KV_ATOL = 1e-3
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CASES: dict[str, tuple[Callable[..., Path], dict[str, Any]]] = {
    "llama_gqa": (make_llama_checkpoint, {}),
    "llama_mqa": (make_llama_checkpoint, {"num_key_value_heads": 1}),
    "llama_head_dim_24": (make_llama_checkpoint, {"head_dim": 24}),
    "llama3_rope_scaling": (make_llama_checkpoint, {"rope_parameters": LLAMA3_ROPE}),
    "llama_linear_rope": (
        make_llama_checkpoint,
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "qwen2_bias_tied": (make_qwen2_checkpoint, {}),
    "qwen3_qk_norm": (make_qwen3_checkpoint, {}),
    "mistral": (make_mistral_checkpoint, {}),
    "mistral_window_6": (make_mistral_checkpoint, {"sliding_window": 6}),
    # head_dim 64 and 128 take the kernels' AVX-512 decode attention (other head dims: the generic loop)
    "llama_head_dim_64": (make_llama_checkpoint, {"hidden_size": 128, "head_dim": 64}),
    "qwen3_head_dim_128": (
        make_qwen3_checkpoint,
        {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128},
    ),
}
KERNEL_BACKENDS = {"auto": "cpu", "torch": "torch"}  # load_model's kernel_backend -> the ops it picks here


class Pair:
    """A checkpoint loaded twice: by kvpager (with `kernel_backend`) and by transformers (the oracle)."""

    def __init__(self, path: Path, kernel_backend: str = "auto", hf: Any = None) -> None:
        from transformers import AutoModelForCausalLM

        self.path = path
        self.model = load_model(path, dtype=torch.float32, device="cpu", kernel_backend=kernel_backend)
        self.hf = hf if hf is not None else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.spec = self.model.spec

    def reference(self, token_ids: list[int]) -> torch.Tensor:
        """transformers logits at every position of one sequence: [len, vocab]."""
        with torch.inference_mode():
            return self.hf(torch.tensor([token_ids])).logits[0].float()


class PagedHarness:
    """A minimal runner: per-sequence block tables drawn from a shuffled pool, one forward per step."""

    def __init__(
        self,
        model: CausalLM,
        block_size: int,
        num_blocks: int = 96,
        seed: int = 0,
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model, self.block_size = model, block_size
        self.kv_cache = allocate_kv_cache(model.spec, num_blocks, block_size, kv_dtype, "cpu")
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, batch: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Compute each (seq, new tokens) entry in one forward; logits per entry [len, vocab]."""
        query_lens, seq_lens, tables, ids, positions = [], [], [], [], []
        for seq, tokens in batch:
            start = self.num_computed.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < start + len(tokens):
                table.append(self.free.pop())
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            tables.append(list(table))
            ids += tokens
            positions += range(start, start + len(tokens))
            self.num_computed[seq] = start + len(tokens)
        meta = build_attention_metadata(
            query_lens, seq_lens, tables, self.block_size, "cpu", sliding_window=self.model.spec.sliding_window
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_cache, meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Pair]:
    cache: dict[tuple[str, str], Pair] = {}
    paths: dict[str, Path] = {}

    def get(case: str, kernel_backend: str = "auto") -> Pair:
        if (case, kernel_backend) not in cache:
            if case not in paths:
                make, overrides = CASES[case]
                paths[case] = make(tmp_path_factory.mktemp(case), seed=len(paths), **overrides)
            loaded = next((p for (c, _), p in cache.items() if c == case), None)  # reuse its transformers model
            cache[case, kernel_backend] = Pair(paths[case], kernel_backend, loaded.hf if loaded else None)
        return cache[case, kernel_backend]

    return get


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    err = (actual - expected).abs().max().item()
    assert err <= ATOL, f"max |logit diff| {err:.2e} > {ATOL}"


@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_mixed_prefill_batch_logits_match_transformers_at_every_position(
    pairs: Callable[[str], Pair], case: str, block_size: int
) -> None:
    pair = pairs(case)
    prompts = _prompts(pair.spec.vocab_size, [9, 1, 23, 4, 16])
    harness = PagedHarness(pair.model, block_size)
    outs = harness.step([(f"s{i}", p) for i, p in enumerate(prompts)])
    for prompt, out in zip(prompts, outs, strict=True):
        _assert_close(out, pair.reference(prompt))


@pytest.mark.parametrize("case", ["llama_gqa", "qwen3_qk_norm", "llama3_rope_scaling", "mistral_window_6"])
def test_chunked_prefill_over_successive_forwards_matches_transformers(pairs: Callable[[str], Pair], case: str) -> None:
    pair = pairs(case)
    long, other = _prompts(pair.spec.vocab_size, [23, 12], seed=1)
    harness = PagedHarness(pair.model, block_size=5)
    chunks = [long[:8], long[8:18], long[18:]]
    got = [harness.step([("long", chunks[0]), ("other", other[:6])])[0]]
    got.append(harness.step([("other", other[6:]), ("long", chunks[1])])[1])
    got.append(harness.step([("long", chunks[2])])[0])
    _assert_close(torch.cat(got), pair.reference(long))


@pytest.mark.parametrize("kernel_backend", list(KERNEL_BACKENDS))
@pytest.mark.parametrize("case", list(CASES))
def test_decode_steps_mixed_with_prefill_chunk_match_transformers(
    pairs: Callable[..., Pair], case: str, kernel_backend: str
) -> None:
    pair = pairs(case, kernel_backend)
    assert pair.model.ops.name == KERNEL_BACKENDS[kernel_backend]
    a, b, c = _prompts(pair.spec.vocab_size, [7, 11, 14], seed=2)
    harness = PagedHarness(pair.model, block_size=5)
    harness.step([("a", a[:6]), ("b", b[:10])])
    # a and b decode one token each while c prefills in chunks; the chunk sits between the decodes.
    dec_a, chunk_c, dec_b = harness.step([("a", a[6:7]), ("c", c[:9]), ("b", b[10:11])])
    _assert_close(dec_a, pair.reference(a)[6:7])
    _assert_close(dec_b, pair.reference(b)[10:11])
    _assert_close(chunk_c, pair.reference(c)[:9])
    # decodes lead the batch (the contiguous fast path), then the rest of c's prompt
    (extra_a,) = _prompts(pair.spec.vocab_size, [1], seed=3)
    dec_a2, chunk_c2 = harness.step([("a", extra_a), ("c", c[9:])])
    _assert_close(dec_a2, pair.reference(a + extra_a)[7:8])
    _assert_close(chunk_c2, pair.reference(c)[9:])


def assert_fused_steps_equal_per_op(
    model: CausalLM,
    steps: list[list[tuple[str, list[int]]]],
    monkeypatch: pytest.MonkeyPatch,
    kv_dtype: torch.dtype = torch.float32,
) -> list[bool]:
    """Run `steps` twice on fresh paged caches, with the fused layer stack and with every op on its own;
    assert the decode steps' logits and the K/V written are the same bits. Returns, per forward of the
    fused run, whether the fused stack ran it."""
    fused_calls = _spy_fused_calls(model, monkeypatch)
    fused, per_op = (PagedHarness(model, block_size=4, kv_dtype=kv_dtype) for _ in range(2))
    got = [fused.step(batch) for batch in steps]
    taken = list(fused_calls)
    fused_layers = model.ops.decode_layers
    monkeypatch.setattr(model.ops, "decode_layers", lambda *args, **kwargs: None)  # every op on its own
    ref = [per_op.step(batch) for batch in steps]
    monkeypatch.setattr(model.ops, "decode_layers", fused_layers)
    for step_got, step_ref in zip(got[1:], ref[1:], strict=True):
        for a, b in zip(step_got, step_ref, strict=True):
            assert torch.equal(a, b), f"fused vs per-op: {(a - b).abs().max().item():.3e}"
    assert torch.equal(fused.kv_cache, per_op.kv_cache)  # the same K/V written, bit for bit
    return taken


def _spy_fused_calls(model: CausalLM, monkeypatch: pytest.MonkeyPatch, hook: str = "decode_layers") -> list[bool]:
    """Record, per call, whether `model.ops.<hook>` (decode_layers: the fused layer stack) ran the layers
    (returned something, not None)."""
    calls: list[bool] = []
    original = getattr(model.ops, hook)

    def spy(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(model.ops, hook, spy)
    return calls


@pytest.mark.parametrize("kernel_backend", list(KERNEL_BACKENDS))
@pytest.mark.parametrize("case", list(CASES))
def test_decode_only_steps_match_transformers_through_the_fused_layer_stack(
    pairs: Callable[..., Pair], case: str, kernel_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = pairs(case, kernel_backend)
    fused_calls = _spy_fused_calls(pair.model, monkeypatch)
    prompts = _prompts(pair.spec.vocab_size, [5, 12, 9], seed=7)
    extra = _prompts(pair.spec.vocab_size, [4, 4, 4], seed=8)
    harness = PagedHarness(pair.model, block_size=5)
    harness.step([(str(i), p) for i, p in enumerate(prompts)])
    for t in range(4):  # decode-only steps: every sequence one token, contexts of different lengths
        outs = harness.step([(str(i), [extra[i][t]]) for i in range(3)])
        for i, out in enumerate(outs):
            full = prompts[i] + extra[i][: t + 1]
            _assert_close(out, pair.reference(full)[-1:])
    # the prefill step runs layer by layer; the decode-only steps in one kernel call with the kernels
    assert fused_calls == [False] + [KERNEL_BACKENDS[kernel_backend] == "cpu"] * 4
    # with the kernels' AVX-512 linear the layers' weights are in column blocks (the fused stack read them so)
    blocked = KERNEL_BACKENDS[kernel_backend] == "cpu" and pair.model.ops._blocked
    for layer in pair.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert (blocked_stride(linear.weight) > 0) == (blocked and logical_shape(linear.weight)[0] % 16 == 0)


def test_fused_layer_stack_takes_up_to_64_decode_rows_over_blocked_weights(
    pairs: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = pairs("llama_gqa", "auto")
    if not (pair.model.ops.name == "cpu" and pair.model.ops._blocked):
        pytest.skip("needs the AVX-512 blocked linear (this CPU lacks AVX-512)")
    fused_calls = _spy_fused_calls(pair.model, monkeypatch)
    prompts = _prompts(pair.spec.vocab_size, [3] * 65, seed=11)
    extra = _prompts(pair.spec.vocab_size, [1] * 65, seed=12)
    harness = PagedHarness(pair.model, block_size=4, num_blocks=140)
    harness.step([(str(i), p) for i, p in enumerate(prompts)])
    outs = harness.step([(str(i), extra[i]) for i in range(40)])  # 40 decode rows: fused
    for i in (0, 17, 39):
        _assert_close(outs[i], pair.reference(prompts[i] + extra[i])[-1:])
    harness.step([(str(i), extra[i]) for i in range(40, 65)])  # catch the rest up
    (extra2,) = _prompts(pair.spec.vocab_size, [65], seed=13)
    harness.step([(str(i), [extra2[i]]) for i in range(65)])  # 65 rows: layer by layer
    with fp32_matmul_precision("medium"):  # 40 rows at medium: the bfloat16 linear, layer by layer
        harness.step([(str(i), [extra2[i]]) for i in range(40)])
    bf16 = pair.model.ops._bf16_linear is not None
    assert fused_calls == [False, True, True, False, not bf16]


@pytest.mark.parametrize("case", ["llama_gqa", "qwen3_qk_norm", "mistral_window_6"])
def test_bf16_kv_cache_decode_steps_agree_between_kernels_and_torch(
    pairs: Callable[..., Pair], case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels, torch_ops = pairs(case, "auto"), pairs(case, "torch")
    fused_calls = _spy_fused_calls(kernels.model, monkeypatch)
    prompts = _prompts(kernels.spec.vocab_size, [5, 12, 9], seed=9)
    extra = _prompts(kernels.spec.vocab_size, [3, 3, 3], seed=10)
    harnesses = [PagedHarness(p.model, block_size=5, kv_dtype=torch.bfloat16) for p in (kernels, torch_ops)]
    for h in harnesses:
        h.step([(str(i), p) for i, p in enumerate(prompts)])
    for t in range(3):
        got, ref = (h.step([(str(i), [extra[i][t]]) for i in range(3)]) for h in harnesses)
        for i in range(3):
            # NOTE: both round float32 K/V to bfloat16, but their projections sum in different orders:
            # a one-ulp float32 difference can flip a bfloat16 rounding (2^-8 relative), so 1e-3 here.
            assert (got[i] - ref[i]).abs().max().item() <= BF16_KV_ATOL
            full = prompts[i] + extra[i][: t + 1]
            assert (got[i] - kernels.reference(full)[-1:]).abs().max().item() < 5e-2
    assert harnesses[0].kv_cache.dtype == torch.bfloat16 and fused_calls == [False, True, True, True]
    assert torch.equal(harnesses[0].kv_cache.isnan(), harnesses[1].kv_cache.isnan())


def test_sequence_reads_a_block_another_sequence_writes_in_the_same_step(pairs: Callable[[str], Pair]) -> None:
    pair = pairs("llama_gqa")
    (prefix,) = _prompts(pair.spec.vocab_size, [10], seed=4)
    tail_a, tail_b = _prompts(pair.spec.vocab_size, [3, 4], seed=5)
    harness = PagedHarness(pair.model, block_size=5)
    harness.step([("a", prefix + tail_a)])
    # b shares a's two full prefix blocks (prefix caching) and computes only its tail
    harness.tables["b"] = harness.tables["a"][:2]
    harness.num_computed["b"] = 10
    (out_b,) = harness.step([("b", tail_b)])
    _assert_close(out_b, pair.reference(prefix + tail_b)[10:])
    # same step: c writes the shared prefix block while d (listed first) reads it
    shared = harness.free.pop()
    harness.tables["c"], harness.tables["d"] = [shared], [shared]
    harness.num_computed["d"] = 5
    out_d, _ = harness.step([("d", tail_b), ("c", prefix[:5])])
    _assert_close(out_d, pair.reference(prefix[:5] + tail_b)[5:])


def test_sliding_window_model_refuses_metadata_without_the_window(pairs: Callable[[str], Pair]) -> None:
    model = pairs("mistral_window_6").model
    kv = allocate_kv_cache(model.spec, 8, 4, torch.float32, "cpu")
    meta = build_attention_metadata([8], [8], [[0, 1]], 4, "cpu")
    with pytest.raises(ValueError, match="sliding window of 6"):
        model(torch.arange(8), torch.arange(8), kv, meta)


def test_bf16_kv_cache_with_fp32_compute_stays_close(pairs: Callable[[str], Pair]) -> None:
    pair = pairs("llama_gqa")
    (prompt,) = _prompts(pair.spec.vocab_size, [12], seed=6)
    kv = allocate_kv_cache(pair.spec, 8, 4, torch.bfloat16, "cpu")
    meta = build_attention_metadata([12], [12], [[5, 2, 7]], 4, "cpu")
    with torch.inference_mode():
        logits = pair.model.compute_logits(pair.model(torch.tensor(prompt), torch.arange(12), kv, meta))
    err = (logits - pair.reference(prompt)).abs().max().item()
    assert 0 < err < 5e-2


def test_medium_fp32_matmul_precision_stays_close_to_transformers(pairs: Callable[[str], Pair]) -> None:
    pair = pairs("llama_gqa")
    (prompt,) = _prompts(pair.spec.vocab_size, [40], seed=7)  # > 32 rows: the linear layers are torch's matmuls
    harness = PagedHarness(pair.model, 4)
    with fp32_matmul_precision("medium"):
        (logits,) = harness.step([("s", prompt)])
    assert torch.get_float32_matmul_precision() == "highest"
    err = (logits - pair.reference(prompt)).abs().max().item()
    assert err < 5e-2  # bf16-rounded matmul inputs (exact where the CPU has no bf16 matmul)


def test_sharded_checkpoint_with_index_loads_same_logits(tmp_path: Path, pairs: Callable[[str], Pair]) -> None:
    pair = pairs("llama_gqa")
    pair.hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = load_model(tmp_path, dtype=torch.float32, device="cpu")
    for name, tensor in pair.model.state_dict().items():
        assert torch.equal(tensor, sharded.state_dict()[name]), name


def test_dummy_load_needs_only_config_and_is_deterministic(tmp_path: Path, llama_checkpoint: Path) -> None:
    (tmp_path / "config.json").write_text((llama_checkpoint / "config.json").read_text())
    first = load_model(tmp_path, dtype=torch.float32, device="cpu", load_format="dummy")
    second = load_model(tmp_path, dtype=torch.float32, device="cpu", load_format="dummy")
    other_seed = load_model(tmp_path, dtype=torch.float32, device="cpu", load_format="dummy", seed=1)
    spec = first.spec
    qkv = first.layers[0].self_attn.qkv_proj.weight
    assert logical_shape(qkv) == (spec.q_size + 2 * spec.kv_size, spec.hidden_size)
    assert logical_shape(first.lm_head.weight) == (spec.vocab_size, spec.hidden_size)
    assert 0.015 < qkv.std().item() < 0.025
    assert torch.equal(first.norm.weight, torch.ones(spec.hidden_size))
    assert all(torch.equal(t, second.state_dict()[n]) for n, t in first.state_dict().items())
    assert not torch.equal(qkv, other_seed.layers[0].self_attn.qkv_proj.weight)
    kv = allocate_kv_cache(spec, 4, 4, torch.float32, "cpu")
    meta = build_attention_metadata([3], [3], [[1]], 4, "cpu")
    with torch.inference_mode():
        assert first.compute_logits(first(torch.tensor([1, 2, 3]), torch.arange(3), kv, meta)).shape == (
            3,
            spec.vocab_size,
        )


def _copy_checkpoint(src: Path, dst: Path, config_edit: dict[str, Any] | None = None) -> Path:
    dst.mkdir(exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **(config_edit or {})}))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return dst


def test_unsupported_architecture_is_named_with_the_supported_list(tmp_path: Path, llama_checkpoint: Path) -> None:
    path = _copy_checkpoint(llama_checkpoint, tmp_path, {"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(path, dtype=torch.float32, device="cpu")


def test_missing_directory_and_config_raise_file_errors_that_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelFileNotFoundError, match="does not exist"):
        load_model_spec(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path, dtype=torch.float32, device="cpu")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_spec(tmp_path)


def test_missing_weights_file_and_missing_tensor_are_named(tmp_path: Path, llama_checkpoint: Path) -> None:
    path = _copy_checkpoint(llama_checkpoint, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(path, dtype=torch.float32, device="cpu")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelFileNotFoundError, match="no \\*.safetensors"):
        load_model(path, dtype=torch.float32, device="cpu")


def test_tensor_shape_mismatch_names_the_tensor(tmp_path: Path, llama_checkpoint: Path) -> None:
    path = _copy_checkpoint(llama_checkpoint, tmp_path, {"vocab_size": 400})
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*\(384, 64\).*\(400, 64\)"):
        load_model(path, dtype=torch.float32, device="cpu")


def test_unknown_rope_type_is_rejected_with_the_supported_list() -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 384,
    }
    with pytest.raises(ValueError, match="'yarn'.*llama3"):
        ModelSpec.from_hf_config({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_spec_reads_legacy_rope_keys_and_merges_generation_eos_ids() -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 384, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "eos_token_id": 2, "torch_dtype": "bfloat16",
    }  # fmt: skip
    spec = ModelSpec.from_hf_config(config, {"eos_token_id": [2, 7, 9]})
    assert (spec.rope_theta, spec.rope_type, spec.head_dim) == (500000.0, "llama3", 16)
    assert spec.eos_token_ids == (2, 7, 9)
    assert spec.torch_dtype == "bfloat16"
    assert spec.kv_shape(2).bytes_per_token == 2 * 3 * 1 * 16 * 2


def test_spec_module_imports_no_torch() -> None:
    code = "import sys, kvpager.model, kvpager.model.spec; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_attention_metadata_rejects_a_block_table_too_short() -> None:
    with pytest.raises(ValueError, match="cannot hold 9 positions"):
        build_attention_metadata([9], [9], [[0, 1]], 4, "cpu")
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        build_attention_metadata([5], [4], [[0, 1]], 4, "cpu")


def test_only_whole_prompts_from_position_zero_use_the_plain_causal_prefill_path() -> None:
    meta = build_attention_metadata([6, 4, 5], [6, 9, 5], [[0, 1], [2, 3, 4], [5, 6]], 4, "cpu", sliding_window=None)
    assert [c.plain_causal for c in meta.prefills] == [True, False, True]  # the middle one has cached context
    windowed = build_attention_metadata([6, 5], [6, 5], [[0, 1], [2, 3]], 4, "cpu", sliding_window=5)
    assert [c.plain_causal for c in windowed.prefills] == [False, True]  # 6 positions exceed the window of 5

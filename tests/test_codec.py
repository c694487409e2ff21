"""KV codecs: lossless is bit-exact, lossy codecs stay inside their stated error bounds."""

from __future__ import annotations

import sys

import pytest
import torch

from kvpager.kvstore.codec import available_codecs, get_codec, measure

torch.set_num_threads(1)

# One block: [num_layers, 2, block_size, num_kv_heads, head_dim]
SHAPE = (2, 2, 4, 3, 64)


def random_block(shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 3).to(dtype)


def roundtrip(name: str, block: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    return codec.decode(codec.encode(block), block.shape, block.dtype, "cpu")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    as_int = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(as_int), b.view(as_int))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["lossless", "lossless+zstd"])
def test_lossless_roundtrip_is_bit_exact_including_special_values(name: str, dtype: torch.dtype) -> None:
    block = random_block(dtype=dtype)
    block[0, 0, 0, 0, :4] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")]).to(dtype)
    decoded = roundtrip(name, block)
    assert same_bits(decoded, block)
    assert get_codec(name).is_lossless


@pytest.mark.parametrize("name, storage", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_downcast_codecs_equal_a_cast_and_halve_an_fp32_cache(name: str, storage: torch.dtype) -> None:
    block = random_block()
    decoded = roundtrip(name, block)
    assert decoded.dtype == torch.float32
    assert torch.equal(decoded, block.to(storage).to(torch.float32))
    report = measure(get_codec(name), [block])
    assert report.ratio == 2.0
    assert 0 < report.max_abs_error and report.mean_abs_error <= report.max_abs_error
    assert not get_codec(name).is_lossless


def test_int8_error_is_at_most_half_its_own_scale_per_element() -> None:
    block = random_block()
    block[1, 0, :, 2] *= 1000.0  # one head is huge: the other heads must keep their own fine scale
    decoded = roundtrip("int8", block)
    num_layers, _, _, num_heads, _ = SHAPE
    for layer in range(num_layers):
        for kv in range(2):
            for head in range(num_heads):
                original = block[layer, kv, :, head]  # [block_size, head_dim]
                scale = original.abs().max().item() / 127.0
                error = (decoded[layer, kv, :, head] - original).abs()
                assert error.max().item() <= scale / 2 * (1 + 1e-5), (layer, kv, head)
    small_head_error = (decoded[0, 0, :, 0] - block[0, 0, :, 0]).abs().max().item()
    assert small_head_error < block[1, 0, :, 2].abs().max().item() / 127.0 / 2 / 100


@pytest.mark.parametrize("head_dim", [64, 16, 5])
def test_int4_error_is_at_most_half_its_own_scale_per_group_of_32(head_dim: int) -> None:
    block = random_block(shape=(2, 2, 4, 2, head_dim))
    if head_dim == 64:
        block[..., 32:] *= 0.001  # second group is tiny: it must not share the first group's scale
    decoded = roundtrip("int4", block)
    group_size = min(32, head_dim)
    for start in range(0, head_dim, group_size):
        original = block[..., start : start + group_size]  # [L, 2, bs, H, group]
        scale = original.abs().amax(dim=-1, keepdim=True) / 7.0
        error = (decoded[..., start : start + group_size] - original).abs()
        assert bool((error <= scale / 2 * (1 + 1e-5)).all()), start
    if head_dim == 64:
        assert (decoded[..., 32:] - block[..., 32:]).abs().max().item() < 0.01


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_zero_block_decodes_to_zeros_not_nan(name: str) -> None:
    block = torch.zeros(SHAPE)
    assert torch.equal(roundtrip(name, block), block)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_stack_of_blocks_is_quantized_per_block(name: str) -> None:
    blocks = [random_block(seed=seed) * (10.0**seed) for seed in range(3)]
    stacked = roundtrip(name, torch.stack(blocks))  # [3, L, 2, bs, H, D]
    for index, block in enumerate(blocks):
        assert torch.equal(stacked[index], roundtrip(name, block))


@pytest.mark.parametrize("base", ["lossless", "fp16", "bf16", "int8", "int4"])
def test_zstd_variant_decodes_identically_to_its_base_codec(base: str) -> None:
    block = random_block(dtype=torch.float32)
    assert same_bits(roundtrip(base + "+zstd", block), roundtrip(base, block))
    assert get_codec(base + "+zstd").is_lossless == get_codec(base).is_lossless


def test_compression_ratios_match_the_layouts() -> None:
    blocks = torch.stack([random_block(seed=seed) for seed in range(4)])
    numel = blocks[0].numel()
    num_layers, _, _, num_heads, head_dim = SHAPE
    int8_scales = num_layers * 2 * num_heads
    int4_scales = numel // 32
    assert measure(get_codec("lossless"), blocks).ratio == 1.0
    assert measure(get_codec("int8"), blocks).ratio == pytest.approx(4 * numel / (numel + 4 * int8_scales))
    assert measure(get_codec("int4"), blocks).ratio == pytest.approx(4 * numel / (numel / 2 + 4 * int4_scales))
    assert 3.5 < measure(get_codec("int8"), blocks).ratio < 4.0
    report = measure(get_codec("lossless"), blocks)
    assert (report.max_abs_error, report.mean_abs_error, report.num_blocks) == (0.0, 0.0, 4)


def test_lossy_reports_order_int4_worse_than_int8_worse_than_fp16() -> None:
    blocks = [random_block(seed=seed) for seed in range(2)]
    errors = [measure(get_codec(name), blocks).max_abs_error for name in ("fp16", "int8", "int4")]
    assert 0 < errors[0] < errors[1] < errors[2]


def test_unknown_codec_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError) as info:
        get_codec("int3")
    for name in available_codecs():
        assert name in str(info.value)


@pytest.mark.parametrize("name", ["lossless", "fp16", "int8", "int4", "int8+zstd"])
def test_decode_refuses_a_payload_that_does_not_fit_the_shape(name: str) -> None:
    codec = get_codec(name)
    data = codec.encode(random_block())
    with pytest.raises(ValueError):
        codec.decode(data[:-1] if "zstd" not in name else b"not zstd", SHAPE, torch.float32)
    with pytest.raises(ValueError):
        codec.decode(data, (2, 2, 8, 3, 64), torch.float32)


def test_zstd_without_the_package_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ValueError, match="zstandard"):
        get_codec("lossless+zstd")

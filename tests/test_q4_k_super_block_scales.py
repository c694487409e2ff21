"""GGUF Q4_K on the integer-dot kernels with the file's super-block factors (kvpager/model/backends/k_scales.py).

KScaledInt4DotWeight holds, per row and super-block of 256, the file's float16 d and dmin and the 8
six-bit scales and mins; the kernel widens d * sc and -(dmin * m) for the rows it multiplies (the
decode tiles super-block by super-block in registers, the panels through a buffer). Those products are
exact in float32, so the weight must give the float32 form's results (Int4DotWeight with the block
decoder's scales and offsets) bit for bit on every path: the decode tiles (one row, row pairs), the
8-row panels, the AVX2 and portable builds, the exact fallback and the bfloat16 GEMM; and hold 0.578
bytes a weight where the float32 form holds 0.75.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kquants import encode_q4_k, encode_q6_k

from kvpager.gguf.blocks import K_RECORD_BYTES, Q6_RECORD_BYTES, unpack_blocks
from kvpager.gguf.executed import DOT_FORMS, PACKED_FORMS
from kvpager.model.backends.k_scales import (
    FMT_K_SCALES,
    KScaledInt4DotWeight,
    expand_k_records,
    expand_k_records_in_torch,
    expand_q6_records,
    expand_q6_records_in_torch,
)
from kvpager.model.backends.quant_dot import Int4DotWeight
from kvpager.model.backends.quant_kernels import FMT_INT4, LEVEL_PORTABLE, quant_kernels_or_none
from kvpager.model.gguf_packed import RowStack, packed_from_blocks, stack_rows

pytestmark = pytest.mark.skipif(quant_kernels_or_none() is None, reason="packed-weight kernels did not build here")


def q4_k(rows: int, cols: int, seed: int) -> tuple[KScaledInt4DotWeight, Int4DotWeight]:
    """A random Q4_K tensor as the records form and as the float32 form."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q4_K", encode_q4_k(values)[0], (rows, cols))
    weight = packed_from_blocks(blocks, "Q4_K", int8_activations=True)
    assert isinstance(weight, KScaledInt4DotWeight)
    scales, offsets = torch.from_numpy(blocks.scales), torch.from_numpy(blocks.offsets)
    float_form = Int4DotWeight.from_codes(torch.from_numpy(blocks.codes), scales, offsets, 32)
    return weight, float_form


def test_records_expand_to_the_block_decoders_scales_and_offsets() -> None:
    values = np.random.default_rng(0).standard_normal((12, 768)).astype(np.float32) * 0.05
    blocks = unpack_blocks("Q4_K", encode_q4_k(values)[0], (12, 768))
    assert blocks.k_records is not None and blocks.k_records.shape == (12, 3, K_RECORD_BYTES)
    scales, offsets = expand_k_records(torch.from_numpy(blocks.k_records))
    assert torch.equal(scales, torch.from_numpy(blocks.scales))
    assert torch.equal(offsets, torch.from_numpy(blocks.offsets))
    weight = packed_from_blocks(blocks, "Q4_K", int8_activations=True)
    assert torch.equal(weight.dequantize(), torch.from_numpy(blocks.dequantize()))


@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
@pytest.mark.parametrize(("rows", "cols"), [(42, 768), (8, 256), (37, 512)])
def test_kernel_gives_the_float32_forms_bits(portable: bool, rows: int, cols: int) -> None:
    """42 rows: 40 interleaved and 2 plain; 37: a plain remainder of 1; batches under and over the
    panels' first row count (12), odd and even (row pairs and the single row)."""
    weight, float_form = q4_k(rows, cols, seed=rows)
    for w in (weight, float_form):
        w.max_level = LEVEL_PORTABLE if portable else None
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(rows, generator=gen)
    for m in (1, 2, 3, 11, 16, 33, 64):
        x = torch.randn(m, cols, generator=gen)
        b = bias if m % 2 else None
        assert torch.equal(weight.dot_kernel(x, b), float_form.dot_kernel(x, b)), m
        assert torch.equal(weight.matmul(x, b), float_form.matmul(x, b)), m


def test_exact_and_bf16_paths_take_the_expanded_factors() -> None:
    weight, float_form = q4_k(20, 512, seed=3)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    assert torch.equal(weight.exact_matmul(x, None), float_form.exact_matmul(x, None))
    assert torch.equal(weight.bf16_matmul(x, None), float_form.bf16_matmul(x, None))
    assert torch.equal(weight.dequantize(torch.bfloat16), float_form.dequantize(torch.bfloat16))


def test_holds_the_files_factors_in_fewer_bytes_than_float32() -> None:
    weight, float_form = q4_k(64, 2048, seed=4)
    assert weight.nbytes == DOT_FORMS["Q4_K"].num_bytes(64, 2048) == 64 * (1024 + 8 * K_RECORD_BYTES)
    assert float_form.nbytes == PACKED_FORMS["Q4_K"].num_bytes(64, 2048) == 64 * (1024 + 64 * 8)
    assert weight.nbytes / (64 * 2048) == pytest.approx(0.578, abs=1e-3)


def test_fused_q4_k_parts_join_with_their_records_beside_a_q6_k_part() -> None:
    """q/k in Q4_K and v in Q6_K (a Q4_K_M file): q and k join into one records weight (interleaved
    rows kept), v stays a Q6_K packed weight beside them."""
    (q, q_float), (k, k_float) = q4_k(32, 512, seed=5), q4_k(16, 512, seed=6)
    values = np.random.default_rng(7).standard_normal((16, 512)).astype(np.float32) * 0.05
    v = packed_from_blocks(unpack_blocks("Q6_K", encode_q6_k(values)[0], (16, 512)), "Q6_K", int8_activations=True)
    fused = stack_rows([q, k, v])
    assert isinstance(fused, RowStack) and isinstance(fused.parts[0], KScaledInt4DotWeight)
    joined = fused.parts[0]
    assert joined.out_features == 48 and joined.interleaved
    assert torch.equal(joined.records, torch.cat([q.records, k.records]))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(8))
    expected = torch.cat([q_float.dot_kernel(x), k_float.dot_kernel(x), v.matmul(x, None)], dim=-1)
    assert torch.equal(fused.matmul(x, None), expected)


def test_kernel_refuses_records_it_cannot_expand() -> None:
    """Records need int4, group 32, K a multiple of 256 and no separate offsets: anything else is -1,
    nothing written."""
    kernels = quant_kernels_or_none()
    assert kernels is not None
    weight, float_form = q4_k(8, 512, seed=9)
    x = torch.randn(1, 512)
    for k, group, offsets in ((512, 64, None), (480, 32, None), (512, 32, float_form.offsets)):
        y = torch.full((1, 8), 7.0)
        rc = kernels.dot_linear(
            FMT_INT4 | FMT_K_SCALES, x.data_ptr(), 1, k, weight.packed.data_ptr(), weight.records.data_ptr(),
            None if offsets is None else offsets.data_ptr(), 8, group, None, y.data_ptr(), 1,
            kernels.default_level,
        )  # fmt: skip
        assert rc == -1 and torch.equal(y, torch.full((1, 8), 7.0)), (k, group)


def test_a_row_count_other_than_the_records_is_refused() -> None:
    weight, _ = q4_k(8, 512, seed=10)
    with pytest.raises(ValueError, match="records must be uint8"):
        KScaledInt4DotWeight(weight.plain_packed(), weight.records[:4], 512)
    with pytest.raises(ValueError, match="multiple of 256"):
        KScaledInt4DotWeight(weight.plain_packed()[:, :64], weight.records[:, :1], 128)


def _random_records(rows: int, supers: int, record_bytes: int, halves: int, seed: int) -> torch.Tensor:
    """Records of random bytes whose leading `halves` float16 values are finite (every sign, zeros and
    subnormals included): the kernel and torch must agree on all of them."""
    gen = torch.Generator().manual_seed(seed)
    records = torch.randint(0, 256, (rows, supers, record_bytes), dtype=torch.uint8, generator=gen)
    head = records[..., : 2 * halves].contiguous().view(torch.float16)
    head[~torch.isfinite(head)] = 0.5
    head.view(-1)[:4] = torch.tensor([0.0, -0.0, 6e-8, -65504.0], dtype=torch.float16)
    records[..., : 2 * halves] = head.view(torch.uint8)
    return records


@pytest.mark.parametrize("rows", [1, 7, 700])  # 700 x 8 records: the threaded loop
def test_kernel_expansion_of_the_records_equals_torchs_bit_for_bit(rows: int) -> None:
    k_records = _random_records(rows, 8, K_RECORD_BYTES, 2, seed=rows)
    got, want = expand_k_records(k_records), expand_k_records_in_torch(k_records)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.equal(g.view(torch.int32), w.view(torch.int32))  # -0.0 too
    q6_records = _random_records(rows, 8, Q6_RECORD_BYTES, 1, seed=rows + 1)
    got_q6, want_q6 = expand_q6_records(q6_records), expand_q6_records_in_torch(q6_records)
    assert got_q6.shape == want_q6.shape and torch.equal(got_q6.view(torch.int32), want_q6.view(torch.int32))

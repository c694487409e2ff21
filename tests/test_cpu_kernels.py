"""The C++ CPU kernels (CpuKernelOps) equal the torch reference (TorchOps) on random float32 inputs.

Every comparison allows 1e-5 of the expected values' magnitude: far below what a wrong head mapping,
block, window or scale produces. `SpyOps` counts kernel calls, so a test also knows the kernel ran
(and did not silently fall back to torch) or that it fell back when it must. `kops` runs every test
against each build whose code differs on this CPU (native, and portable = no AVX-512 where the CPU has
it) and asserts the build took the instruction set this CPU should take.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kvpager.model.attention import AttentionMetadata, build_attention_metadata
from kvpager.model.backends import cpu_ops, quant_weights
from kvpager.model.backends.kernels.abi import KV_FORMATS
from kvpager.model.backends.kernels.build import KernelLibrary, expected_isa, load_cpu_kernels
from kvpager.model.backends.ops import (
    BLOCKED_KERNEL_MAX_ROWS,
    DECODE_PARTITION,
    PREFILL_AMX_MAX_CONTEXT,
    PREFILL_KERNEL_MAX_CONTEXT,
    SMALL_BATCH_LINEAR,
    CpuKernelOps,
    TorchOps,
    select_ops,
)
from kvpager.model.backends.quant_kernels import load_quant_kernels
from kvpager.model.backends.quant_weights import AMX_MAX_ROWS, NATIVE_BF16_AFTER_ROWS, Bf16Weight
from kvpager.model.backends.weight_layout import block_stride, blocked_stride, to_blocked

pytestmark = pytest.mark.slow  # C++ kernel builds


REL = 1e-5
REF = TorchOps()
KERNELS = (
    "_linear_small",
    "_linear_b",
    "_unblock",
    "_rms_norm",
    "_add_rms_norm",
    "_silu_mul",
    "_silu_mul_bf16",
    "_add_rms_norm_bf16",
    "_rope_and_cache_bf16",
    "_rope_and_cache",
    "_paged_decode",
    "_prefill_attention",
    "_prefill_attention_amx",
)


class SpyOps(CpuKernelOps):
    """CpuKernelOps that counts the calls of each kernel (by attribute name, e.g. "_paged_decode")
    and, for kernels that may decline (return 0), the calls that did the work ("_prefill_attention ran")."""

    def __init__(self, kernels: KernelLibrary) -> None:
        super().__init__(kernels)
        self.calls: Counter[str] = Counter()
        for name in KERNELS:
            if getattr(self, name) is not None:  # _prefill_attention_amx: None without AMX
                setattr(self, name, self._counted(name, getattr(self, name)))

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(**kwargs: Any) -> Any:
            self.calls[name] += 1
            result = fn(**kwargs)
            if result:
                self.calls[f"{name} ran"] += 1
            return result

        return call


# The builds whose code differs on this CPU: "portable" (-mno-avx512f) runs the portable branches,
# which a "native" build on an AVX-512 CPU never compiles; without AVX-512 the two are the same code.
BUILDS = ["native"] + (["portable"] if expected_isa("native") != expected_isa("portable") else [])


@pytest.fixture(params=BUILDS)
def kops(request: pytest.FixtureRequest) -> SpyOps:
    # NOTE: builds once per machine (cached), then loads once per process
    kernels = load_cpu_kernels(request.param)
    assert kernels.isa == expected_isa(request.param)  # the branches this CPU should run
    return SpyOps(kernels)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run under 1 and 2 torch (= OpenMP) threads; the kernels parallelise above a work threshold."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = REL) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.isfinite(actual).all(), "non-finite values"
    tol = rel * max(1.0, expected.abs().max().item())
    err = (actual - expected).abs().max().item()
    assert err <= tol, f"max |diff| {err:.2e} > {tol:.2e}"


# --- linear, norms, SiLU --------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("in_features,out_features", [(37, 7), (576, 130), (16, 4)])
@pytest.mark.parametrize("rows", range(1, SMALL_BATCH_LINEAR + 2))
def test_linear_matches_torch_for_small_batches_and_falls_back_above(
    kops: SpyOps, rows: int, in_features: int, out_features: int, bias: bool
) -> None:
    x, w = _randn(rows, in_features, seed=rows), _randn(out_features, in_features, seed=100)
    b = _randn(out_features, seed=200) if bias else None
    got = kops.linear(x, w, b)
    _assert_close(got, F.linear(x, w, b))
    assert kops.calls["_linear_small"] == (1 if rows <= SMALL_BATCH_LINEAR else 0)


def test_linear_with_a_non_contiguous_weight_or_bias_falls_back_to_torch(kops: SpyOps) -> None:
    x, w, b = _randn(2, 37, seed=1), _randn(37, 130, seed=2).t(), _randn(260, seed=3)[::2]  # w [130, 37] strided
    _assert_close(kops.linear(x, w, b), F.linear(x, w, b))
    assert kops.calls["_linear_small"] == 0
    assert kops.fallbacks.as_dict() == {"linear": {"weight is not contiguous": 1}}


def test_linear_with_a_3d_input_falls_back_to_torch(kops: SpyOps) -> None:
    x, w = _randn(1, 3, 37, seed=1), _randn(130, 37, seed=2)
    got = kops.linear(x, w, None)
    assert got.shape == (1, 3, 130)
    _assert_close(got, F.linear(x, w, None))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize(
    "in_features,out_features",
    [(37, 16), (64, 48), (576, 960), (100, 80), (33, 400)],
    ids=["one_vector", "one_panel", "qkv", "partial_panel", "wide_partial"],
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 33, 63, 64, 257])
def test_blocked_linear_matches_torch(
    kops: SpyOps, threads: int, rows: int, in_features: int, out_features: int, bias: bool
) -> None:
    # every panel shape (1-3, 4, 5-6, 7-15 rows and from 16), row tail and column tail (panels of 128 and
    # 48 columns, a last narrower panel), and a second row chunk (257 rows)
    x, w = _randn(rows, in_features, seed=rows), _randn(out_features, in_features, seed=100)
    b = _randn(out_features, seed=200) if bias else None
    wb = to_blocked(w)
    assert blocked_stride(wb) == block_stride(in_features)
    _assert_close(kops.linear(x, wb, b), F.linear(x, w, b))
    assert kops.calls["_linear_b"] == 1 and kops.calls["_linear_small"] == 0


def test_blocked_linear_takes_strided_and_batched_inputs(kops: SpyOps) -> None:
    w, b = _randn(96, 40, seed=1), _randn(96, seed=2)
    x = _randn(40, 6, seed=3).t()  # [6, 40], not contiguous
    _assert_close(kops.linear(x, to_blocked(w), b), F.linear(x, w, b))
    x3 = _randn(2, 3, 40, seed=4)
    _assert_close(kops.linear(x3, to_blocked(w), None), F.linear(x3, w))
    assert kops.calls["_linear_b"] == 2


def test_blocked_linear_above_the_row_limit_runs_in_torch_on_an_unblocked_copy(kops: SpyOps) -> None:
    rows = BLOCKED_KERNEL_MAX_ROWS + 1
    x, w, b = _randn(rows, 64, seed=1), _randn(96, 64, seed=2), _randn(96, seed=3)
    wb = to_blocked(w)
    _assert_close(kops.linear(x, wb, b), F.linear(x, w, b))
    _assert_close(
        kops.linear(x[:, :48].contiguous(), to_blocked(w[:48, :48].contiguous()), None),
        F.linear(x[:, :48], w[:48, :48]),
    )
    assert kops.calls["_linear_b"] == 0 and kops.calls["_unblock"] == 2


def test_a_weight_too_big_for_the_scratch_stays_in_the_kernel_at_any_row_count(
    kops: SpyOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvpager.model.backends.cpu_ops as ops_module

    monkeypatch.setattr(ops_module, "UNBLOCK_SCRATCH_MAX_BYTES", 96 * 64 * 4 - 1)
    rows = BLOCKED_KERNEL_MAX_ROWS + 1
    x, w = _randn(rows, 64, seed=1), _randn(96, 64, seed=2)
    _assert_close(kops.linear(x, to_blocked(w), None), F.linear(x, w))
    assert kops.calls["_linear_b"] == 1 and kops.calls["_unblock"] == 0


def test_row_major_linear_of_a_width_the_blocks_cannot_hold_runs_the_dot_product_kernel(kops: SpyOps) -> None:
    x, w, b = _randn(5, 33, seed=1), _randn(20, 33, seed=2), _randn(20, seed=3)
    _assert_close(kops.linear(x, w, b), F.linear(x, w, b))
    assert kops.calls["_linear_small"] == 1


def test_linear_threaded_path_matches_torch(kops: SpyOps, threads: int) -> None:
    x, w, b = _randn(5, 576, seed=1), _randn(130, 576, seed=2), _randn(130, seed=3)  # 130 * 576 > 2**15
    _assert_close(kops.linear(x, w, b), F.linear(x, w, b))
    assert kops.calls["_linear_small"] == 1


@pytest.mark.parametrize(
    "rows,dim,magnitude", [(1, 64, 3.0), (3, 37, 3.0), (7, 576, 3.0), (64, 600, 3.0), (4, 64, 1e-3)]
)
def test_rms_norm_matches_torch(kops: SpyOps, threads: int, rows: int, dim: int, magnitude: float) -> None:
    # magnitude 1e-3: mean(x^2) ~ eps, so a dropped or misplaced eps shows
    x, w = _randn(rows, dim, seed=1) * magnitude, 1 + 0.1 * _randn(dim, seed=2)
    _assert_close(kops.rms_norm(x, w, 1e-6), REF.rms_norm(x, w, 1e-6))
    assert kops.calls["_rms_norm"] == 1


def test_rms_norm_reads_a_strided_row_view(kops: SpyOps) -> None:
    base, w = _randn(12, 80, seed=3), 1 + 0.1 * _randn(64, seed=4)
    for view in (base[:, 5:69], base[::3, 10:74]):  # row strides 80 and 240, inner stride 1
        _assert_close(kops.rms_norm(view, w, 1e-5), REF.rms_norm(view.contiguous(), w, 1e-5))
    assert kops.calls["_rms_norm"] == 2
    transposed = base[:64, :12].t()  # inner stride 80: torch path, same values
    w12 = w[:12].contiguous()
    _assert_close(kops.rms_norm(transposed, w12, 1e-5), REF.rms_norm(transposed.contiguous(), w12, 1e-5))
    assert kops.calls["_rms_norm"] == 2


@pytest.mark.parametrize("rows,dim", [(1, 64), (5, 37), (64, 600)])
def test_add_rms_norm_returns_norm_of_sum_and_the_sum(kops: SpyOps, threads: int, rows: int, dim: int) -> None:
    x, residual, w = _randn(rows, dim, seed=5), _randn(rows, dim, seed=6), 1 + 0.1 * _randn(dim, seed=7)
    expected_out, expected_sum = REF.add_rms_norm(x, residual.clone(), w, 1e-6)
    out, new_residual = kops.add_rms_norm(x, residual.clone(), w, 1e-6)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(new_residual, expected_sum)
    _assert_close(out, expected_out)
    assert kops.calls["_add_rms_norm"] == 1


@pytest.mark.parametrize("rows,inter", [(1, 37), (4, 130), (8, 4096)])
def test_silu_mul_matches_torch(kops: SpyOps, threads: int, rows: int, inter: int) -> None:
    gate_up = _randn(rows, 2 * inter, seed=8) * 4
    _assert_close(kops.silu_mul(gate_up), REF.silu_mul(gate_up))
    assert kops.calls["_silu_mul"] == 1


@pytest.mark.parametrize("rows,inter", [(1, 37), (3, 1030)], ids=["tail", "chunks"])
def test_silu_mul_bf16_is_the_float32_kernel_rounded_to_bfloat16(
    kops: SpyOps, threads: int, rows: int, inter: int
) -> None:
    gate_up = (_randn(rows, 2 * inter, seed=10) * 4).bfloat16()
    gate_up[0, :5] = torch.tensor([float("nan"), float("inf"), float("-inf"), 1000.0, -1000.0])
    out = torch.empty(rows, inter, dtype=torch.bfloat16)
    kops._silu_mul_bf16(gate_up=gate_up, out=out)
    expected = kops.silu_mul(gate_up.float()).bfloat16()  # torch's rounding of the float32 kernel's results
    # the same values; a NaN is written as the canonical 0x7FC0 (torch keeps its sign and payload)
    torch.testing.assert_close(out.float(), expected.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("rows,dim", [(1, 40), (70, 1030)], ids=["one", "threaded"])
def test_add_rms_norm_bf16_is_the_float32_kernel_on_widened_rows_rounded(
    kops: SpyOps, threads: int, rows: int, dim: int
) -> None:
    # x as a bfloat16 GEMM hands it over, the residual stream float32: bit for bit the float32 kernel on
    # x widened (exact), its normed output rounded by torch; the residual updated in place the same way
    x = (_randn(rows, dim, seed=12) * 3).bfloat16()
    residual, w = _randn(rows, dim, seed=13), _randn(dim, seed=14)
    out = torch.empty(rows, dim, dtype=torch.bfloat16)
    res = residual.clone()
    kops._add_rms_norm_bf16(residual=res, x=x, w=w, out=out, eps=1e-5)
    expected, res_expected = kops.add_rms_norm(x.float(), residual.clone(), w, 1e-5)
    assert torch.equal(res, res_expected)
    assert torch.equal(out, expected.bfloat16())


def _bf16_mlp(seed: int, bias: bool = False) -> tuple[Bf16Weight, torch.Tensor | None, Bf16Weight]:
    gate_up = Bf16Weight((_randn(2 * 96, 64, seed=seed) * 0.1).bfloat16())
    down = Bf16Weight((_randn(64, 96, seed=seed + 1) * 0.1).bfloat16())
    return gate_up, (_randn(2 * 96, seed=seed + 2) if bias else None), down


def test_bf16_mlp_keeps_the_values_of_widening_between_the_projections(
    kops: SpyOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a prompt-sized batch, where oneDNN's bf16 GEMM runs (forced on CPUs without it: torch emulates it)
    monkeypatch.setattr(quant_weights, "_native_bf16", lambda: True)
    gate_up, _, down = _bf16_mlp(20)
    x = _randn(AMX_MAX_ROWS + 44, 64, seed=23)
    got = kops.mlp(x, gate_up, None, down, None)
    assert kops.calls["_silu_mul_bf16"] == 1 and kops.calls["_silu_mul"] == 0
    expected = kops.linear(kops.silu_mul(kops.linear(x, gate_up, None)), down, None)  # float32 between them
    assert got.dtype == torch.float32 and torch.equal(got, expected)


def test_bf16_mlp_widens_where_the_bfloat16_step_does_not_apply(kops: SpyOps, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant_weights, "_native_bf16", lambda: True)
    gate_up, bias, down = _bf16_mlp(30, bias=True)
    x = _randn(AMX_MAX_ROWS + 44, 64, seed=33)
    with_bias = kops.mlp(x, gate_up, bias, down, None)  # a biased projection: the generic path
    assert torch.equal(with_bias, kops.linear(kops.silu_mul(kops.linear(x, gate_up, bias)), down, None))
    kops.mlp(x[:NATIVE_BF16_AFTER_ROWS], gate_up, None, down, None)  # the packed-weight kernel's rows
    floats = (gate_up.dequantize(), down.dequantize())
    kops.mlp(x, floats[0], None, floats[1], None)  # float32 weights
    assert kops.calls["_silu_mul_bf16"] == 0 and kops.calls["_silu_mul"] == 4  # three MLPs, the expectation


def test_silu_mul_large_magnitudes_do_not_overflow_to_nan(kops: SpyOps) -> None:
    special = torch.tensor([90.0, -90.0, 1000.0, -1000.0, 88.5, -88.5, 0.0, 1e-3, -1e-3, 20.0, -20.0, 3.0])
    gate = torch.cat([special.repeat(4), special[:5]])[None]  # 53 wide: 3 vectors of 16 and a tail of 5
    up = _randn(1, gate.shape[1], seed=9)
    gate_up = torch.cat([gate, up], dim=1)
    got = kops.silu_mul(gate_up)
    _assert_close(got, REF.silu_mul(gate_up))
    for i in (2, 14, 50):  # gate 1000 (vector lanes and tail): silu = 1000
        assert got[0, i].item() == pytest.approx(1000.0 * up[0, i].item(), rel=1e-6)
    for i in (3, 15, 51):  # gate -1000: silu ~ -1000 * e^-1000, no NaN from 1 + exp(1000)
        assert abs(got[0, i].item()) < 1e-30


# --- RoPE + cache write ---------------------------------------------------------------------------


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("head_dim", [64, 128, 24])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_rope_and_cache_matches_torch_q_and_cache(
    kops: SpyOps, threads: int, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: bool
) -> None:
    num_tokens, num_blocks, block_size = 32, 13, 4
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=10) * 2
    angles = _randn(num_tokens, 1, head_dim // 2, seed=11) * 3
    cos, sin = angles.cos(), angles.sin()
    cache = _randn(2, num_blocks, block_size, num_kv_heads, head_dim, seed=12)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(13))[:num_tokens]
    norms = (1 + 0.1 * _randn(head_dim, seed=14), 1 + 0.1 * _randn(head_dim, seed=15)) if qk_norm else (None, None)
    cache_ref, cache_got = cache.clone(), cache.clone()
    q_ref = REF.rope_and_cache(qkv.clone(), cos, sin, cache_ref, slots, num_heads, num_kv_heads, *norms, 1e-6)
    q_got = kops.rope_and_cache(qkv.clone(), cos, sin, cache_got, slots, num_heads, num_kv_heads, *norms, 1e-6)
    assert kops.calls["_rope_and_cache"] == 1
    _assert_close(q_got, q_ref)
    flat_got, flat_ref = cache_got.view(2, -1, num_kv_heads, head_dim), cache_ref.view(2, -1, num_kv_heads, head_dim)
    _assert_close(flat_got[:, slots], flat_ref[:, slots])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_got[:, untouched], cache.view(2, -1, num_kv_heads, head_dim)[:, untouched])
    # V is stored as is; K is rotated (so it differs from the raw input)
    v_in = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    assert torch.equal(flat_got[1, slots], v_in)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_rope_and_cache_bf16_is_the_float32_kernel_on_the_widened_rows(
    kops: SpyOps, threads: int, qk_norm: bool, kv_dtype: torch.dtype
) -> None:
    # a bfloat16 qkv as the bf16 GEMM hands it over, rows wider than q + k + v (a strided view), left
    # untouched: q and the cache bit for bit what the float32 kernel writes from the widened rows
    num_heads, num_kv_heads, head_dim, num_tokens, num_blocks, block_size = 6, 2, 64, 40, 13, 4
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (_randn(num_tokens, width + 32, seed=20) * 2).bfloat16()[:, :width]
    angles = _randn(num_tokens, 1, head_dim // 2, seed=21) * 3
    cos, sin = angles.cos(), angles.sin()
    cache = _randn(2, num_blocks, block_size, num_kv_heads, head_dim, seed=22).to(kv_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(23))[:num_tokens]
    norms = (1 + 0.1 * _randn(head_dim, seed=24), 1 + 0.1 * _randn(head_dim, seed=25)) if qk_norm else (None, None)
    cache_ref, cache_got, qkv_in = cache.clone(), cache.clone(), qkv.clone()
    q_ref = kops.rope_and_cache(qkv.float(), cos, sin, cache_ref, slots, num_heads, num_kv_heads, *norms, 1e-6)
    q_got = torch.empty(num_tokens, num_heads * head_dim)
    kops._rope_and_cache_bf16(
        qkv=qkv,
        num_heads=num_heads,
        cos=cos.view(num_tokens, -1),
        sin=sin.view(num_tokens, -1),
        q_norm=norms[0],
        k_norm=norms[1],
        eps=1e-6,
        k_cache=cache_got[0],
        v_cache=cache_got[1],
        slots=slots,
        kv_format=KV_FORMATS[kv_dtype],
        q_out=q_got,
    )
    assert torch.equal(q_got.view(num_tokens, num_heads, head_dim), q_ref)
    assert torch.equal(cache_got, cache_ref)
    assert torch.equal(qkv, qkv_in)


@pytest.mark.parametrize("strided_cos", [False, True], ids=["kernel", "widened"])
def test_rope_and_cache_takes_a_bfloat16_qkv_as_the_widened_one(kops: SpyOps, strided_cos: bool) -> None:
    # the op reads a bfloat16 qkv with the bfloat16 kernel; where that kernel does not apply (here a
    # strided cos/sin) it widens the rows and takes the float32 route: the same q and cache either way
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 64, 9
    qkv = (_randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=30) * 2).bfloat16()
    angles = _randn(num_tokens, 1, head_dim // 2, seed=31)
    cos, sin = angles.cos(), angles.sin()
    if strided_cos:
        cos, sin = torch.stack([cos, cos], -1)[..., 0], torch.stack([sin, sin], -1)[..., 0]
    cache = _randn(2, 5, 4, num_kv_heads, head_dim, seed=32).bfloat16()
    slots = torch.randperm(20, generator=torch.Generator().manual_seed(33))[:num_tokens]
    cache_ref, cache_got = cache.clone(), cache.clone()
    q_ref = kops.rope_and_cache(qkv.float(), cos, sin, cache_ref, slots, num_heads, num_kv_heads, None, None, 1e-6)
    q_got = kops.rope_and_cache(qkv, cos, sin, cache_got, slots, num_heads, num_kv_heads, None, None, 1e-6)
    assert kops.calls["_rope_and_cache_bf16"] == (not strided_cos)
    assert q_got.dtype == torch.float32 and torch.equal(q_got, q_ref)
    assert torch.equal(cache_got, cache_ref)


# --- decode attention -----------------------------------------------------------------------------


def _attention_inputs(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    window: int | None = None,
    q_padding: int = 0,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q [T, H, hd] (a view into rows `q_padding` wider when > 0), a random cache whose unused slots
    hold random values too, and metadata with block tables drawn from a shuffled pool."""
    needed = [-(-s // block_size) for s in seq_lens]
    pool = list(range(sum(needed) + 3))
    random.Random(seed).shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in needed]
    cache = _randn(2, sum(needed) + 3, block_size, num_kv_heads, head_dim, seed=seed + 1)
    rows = _randn(sum(query_lens), num_heads * head_dim + q_padding, seed=seed + 2) * 2
    q = rows[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, "cpu", sliding_window=window)
    return q, cache, meta


def _compare_attention(kops: SpyOps, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5
    got = kops.attention(q, cache, meta, scale)
    _assert_close(got, REF.attention(q, cache, meta, scale))
    assert kops.calls["_paged_decode"] == (meta.decode is not None)
    # the prefill kernel takes head_dim 64 and 128; it declines the others (then SDPA runs)
    ran = bool(meta.prefills) and q.shape[-1] in (64, 128)
    amx = ran and cache.dtype == torch.bfloat16 and kops._prefill_attention_amx is not None
    # a bfloat16 cache goes to the AMX kernel where it runs; the float32-arithmetic kernel takes the rest
    assert kops.calls["_prefill_attention_amx ran"] == amx
    assert kops.calls["_prefill_attention"] == (bool(meta.prefills) and not amx)
    assert _prefill_ran(kops) == ran
    return got


def _prefill_ran(kops: SpyOps) -> int:
    """Prefill kernel calls that did the work, either kernel."""
    return kops.calls["_prefill_attention ran"] + kops.calls["_prefill_attention_amx ran"]


@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 1)], ids=["group1", "group3", "group8"])
@pytest.mark.parametrize("head_dim", [64, 128, 24, 32])
def test_decode_attention_matches_torch(
    kops: SpyOps, threads: int, head_dim: int, num_heads: int, num_kv_heads: int, block_size: int
) -> None:
    # contexts of 1 and 3, one within a partition, one over two partitions (merged); the last one
    # makes positions * heads * head_dim >= 2**18 for head_dim 128 with 8 or 9 heads: the threaded path
    seq_lens = [1, 3, 40, DECODE_PARTITION + 44]
    q, cache, meta = _attention_inputs([1] * 4, seq_lens, num_heads, num_kv_heads, head_dim, block_size)
    _compare_attention(kops, q, cache, meta)


@pytest.mark.parametrize("head_dim", [128, 24])
def test_long_context_split_into_partitions_matches_torch(kops: SpyOps, threads: int, head_dim: int) -> None:
    # 1100 positions = 5 partitions of 256; 1102 * 8 * 128 >= 2**18 takes the threaded path
    q, cache, meta = _attention_inputs([1, 1], [1100, 2], 8, 2, head_dim, 16, seed=3)
    _compare_attention(kops, q, cache, meta)


@pytest.mark.parametrize("block_size", [5, 32])
@pytest.mark.parametrize("window", [1, 7, 300])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_sliding_window_decode_matches_torch(
    kops: SpyOps, threads: int, head_dim: int, window: int, block_size: int
) -> None:
    # the window starts inside a block, so the first positions read start at a block offset
    seq_lens = [1, 5, 20, 700]
    q, cache, meta = _attention_inputs([1] * 4, seq_lens, 8, 2, head_dim, block_size, window=window, seed=4)
    got = _compare_attention(kops, q, cache, meta)
    full_meta = build_attention_metadata([1] * 4, seq_lens, _tables(meta), block_size, "cpu")
    full = REF.attention(q, cache, full_meta, q.shape[-1] ** -0.5)
    assert (got[3] - full[3]).abs().max().item() > 100 * REL  # the window changed the long sequence


def _tables(meta: AttentionMetadata) -> list[list[int]]:
    return [
        row[: -(-s // meta.block_size)] for row, s in zip(meta.block_tables.tolist(), meta.seq_lens_list, strict=True)
    ]


@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [([5, 1, 3, 1], [5, 9, 12, 300]), ([1, 1, 4], [7, 260, 4]), ([3, 1], [3, 1])],
    ids=["decodes_between_prefills", "decodes_leading", "single_decode_last"],
)
def test_mixed_batch_decode_and_prefill_rows_match_torch(
    kops: SpyOps, threads: int, head_dim: int, query_lens: list[int], seq_lens: list[int]
) -> None:
    # q is a view into wider rows (as the fused qkv output), so the kernel reads it with a row stride
    q, cache, meta = _attention_inputs(query_lens, seq_lens, 6, 2, head_dim, 5, q_padding=3 * head_dim, seed=5)
    assert meta.decode is not None and meta.decode.is_leading == (query_lens[0] == 1)
    _compare_attention(kops, q, cache, meta)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window", [None, 6, 100])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (9, 3), (4, 4), (8, 1)], ids=["g4", "g3", "g1", "g8"])
@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_prefill_chunks_after_cached_context_match_torch(
    kops: SpyOps,
    threads: int,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    window: int | None,
    kv_dtype: torch.dtype,
) -> None:
    # chunked prefill: queries start after 0, 7, 290 and 500 cached positions; 40 and 100 queries
    # span several query blocks of the kernel, and block_size 5 puts chunk edges inside blocks (and
    # inside the AMX kernel's 32-key chunks); g3 x 40 queries leaves a partial 16-row tile block
    query_lens, seq_lens = [5, 9, 40, 100], [5, 16, 330, 600]
    q, cache, meta = _attention_inputs(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, 5, window=window, q_padding=head_dim, seed=9
    )
    assert meta.decode is None and len(meta.prefills) == 4
    _compare_attention(kops, q, cache.to(kv_dtype), meta)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_matches_torch_when_later_keys_outscore_earlier_ones(kops: SpyOps, threads: int, head_dim: int) -> None:
    # every key scores 0.4 more than the one before it (a component along the first dimension), so each
    # 32-key chunk of the AMX kernel beats the row's running maximum by ~13: weights taken against the
    # old maximum would overflow past e^8, and the output gathered so far must be rescaled each chunk
    query_lens, seq_lens = [60, 40, 1], [130, 40, 70]
    q, cache, meta = _attention_inputs(query_lens, seq_lens, 8, 2, head_dim, 16, seed=21)
    scale = head_dim**-0.5
    q[..., 0] = 1.0 / scale
    for seq, table in enumerate(_tables(meta)):
        for pos in range(seq_lens[seq]):
            cache[0, table[pos // 16], pos % 16, :, 0] = 0.4 * pos
    cache = cache.to(torch.bfloat16)
    # against float64, within 1e-4: the float32 kernel's products here reach ~600 (an ulp of 6e-5)
    expected = REF.attention(q.double(), cache.double(), meta, scale).float()
    _assert_close(kops.attention(q, cache, meta, scale), expected, rel=1e-4)
    assert _prefill_ran(kops) == 1


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())


def test_the_path_list_says_whether_prompt_steps_keep_bfloat16_between_the_gemms(
    kops: SpyOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    for native in (True, False):
        monkeypatch.setattr(cpu_ops, "native_bf16_matmul_available", lambda native=native: native)
        route = kops.paths()["prompt_layers"]
        assert route.startswith("bfloat16 between oneDNN's GEMMs") == native, route
        assert route.startswith("op by op") != native, route


def test_amx_prefill_kernel_is_taken_where_the_cpu_and_build_have_it(kops: SpyOps) -> None:
    # AMX tiles (the OS's permission asked as for the AMX linear kernel) + AVX512-BF16, native builds only
    amx = load_quant_kernels().amx_bf16 and "avx512_bf16" in _cpu_flags() and kops.kernels.isa == "avx512"
    assert (kops._prefill_attention_amx is not None) == amx
    assert ("AMX" in kops.paths()["prefill_attention"]) == amx


@pytest.mark.parametrize(
    "kv_dtype,head_dim", [(torch.float32, 64), (torch.float16, 128), (torch.bfloat16, 40)], ids=["f32", "f16", "hd40"]
)
def test_amx_prefill_kernel_declines_other_caches_and_head_dims_without_writing(
    kv_dtype: torch.dtype, head_dim: int
) -> None:
    kops = SpyOps(load_cpu_kernels("native"))
    if kops._prefill_attention_amx is None:
        pytest.skip("this CPU (or its OS) has no AMX-BF16 tiles or no AVX512-BF16: no AMX prefill kernel")
    q, cache, meta = _attention_inputs([6], [6], 4, 2, head_dim, 16, seed=11)
    starts, query_lens, seq_lens = (torch.tensor([v], dtype=torch.int64) for v in (0, 6, 6))
    out = torch.full_like(q, 7.0)
    done = kops._prefill_attention_amx(
        q=q,
        out=out,
        token_start=starts,
        query_len=query_lens,
        seq_len=seq_lens,
        k_cache=cache.to(kv_dtype)[0],
        v_cache=cache.to(kv_dtype)[1],
        block_tables=meta.block_tables,
        window=0,
        scale=head_dim**-0.5,
        kv_format=KV_FORMATS[kv_dtype],
    )
    assert done == 0 and bool((out == 7.0).all())


@pytest.mark.parametrize("over", [False, True], ids=["within", "beyond"])
def test_amx_prefill_kernel_takes_contexts_up_to_its_own_limit(kops: SpyOps, over: bool) -> None:
    # past the float32 kernel's limit; beyond the AMX kernel's own, SDPA (its reference is slow: 3 rows)
    context = PREFILL_AMX_MAX_CONTEXT + 1 if over else PREFILL_KERNEL_MAX_CONTEXT + 200
    q, cache, meta = _attention_inputs([3], [context], 4, 2, 64, 16, seed=13)
    cache = cache.to(torch.bfloat16)
    _assert_close(kops.attention(q, cache, meta, 0.125), REF.attention(q, cache, meta, 0.125))
    amx = kops._prefill_attention_amx is not None
    assert kops.calls["_prefill_attention_amx ran"] == (amx and not over)
    assert kops.calls["_prefill_attention"] == 0


def test_prefill_beyond_the_kernel_context_limit_runs_in_torch(kops: SpyOps) -> None:
    q, cache, meta = _attention_inputs([3, 2], [PREFILL_KERNEL_MAX_CONTEXT + 1, 2], 4, 2, 64, 16, seed=10)
    scale = 64**-0.5
    _assert_close(kops.attention(q, cache, meta, scale), REF.attention(q, cache, meta, scale))
    assert kops.calls["_prefill_attention"] == kops.calls["_prefill_attention_amx"] == 0


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 24, 40])
def test_16bit_kv_cache_is_written_with_torchs_rounding_and_read_by_the_kernels(
    kops: SpyOps, head_dim: int, kv_dtype: torch.dtype
) -> None:
    num_heads, num_kv_heads = 4, 2
    _, cache32, meta = _attention_inputs([3, 1], [3, 9], num_heads, num_kv_heads, head_dim, 4, seed=6)
    cache = cache32.to(kv_dtype)
    qkv = _randn(4, (num_heads + 2 * num_kv_heads) * head_dim, seed=7)
    angles = _randn(4, 1, head_dim // 2, seed=8)
    args = (angles.cos(), angles.sin())
    cache_ref, cache_got = cache.clone(), cache.clone()
    q_ref = REF.rope_and_cache(
        qkv.clone(), *args, cache_ref, meta.slot_mapping, num_heads, num_kv_heads, None, None, 0.0
    )
    q_got = kops.rope_and_cache(
        qkv.clone(), *args, cache_got, meta.slot_mapping, num_heads, num_kv_heads, None, None, 0.0
    )
    _assert_close(q_got, q_ref)
    # the write rounds the kernel's own float32 K/V exactly as torch's .to(kv_dtype) does ...
    cache_f32 = cache32.clone()
    kops.rope_and_cache(qkv.clone(), *args, cache_f32, meta.slot_mapping, num_heads, num_kv_heads, None, None, 0.0)
    assert torch.equal(cache_got, cache_f32.to(kv_dtype))
    # ... and stays within one 16-bit step of torch's (their RoPE sums may differ by a float32 ulp)
    _assert_close(cache_got.float(), cache_ref.float(), rel=2.0 ** -(8 if kv_dtype == torch.bfloat16 else 11))
    # the kernels read the 16-bit cache as torch's widening does (same q, same cache)
    out = kops.attention(q_ref, cache_ref, meta, head_dim**-0.5)
    _assert_close(out, REF.attention(q_ref, cache_ref, meta, head_dim**-0.5))
    assert kops.calls["_rope_and_cache"] == 2 and kops.calls["_paged_decode"] == 1
    # the 3-token prefill, from the 16-bit cache (head_dim 24 and 40 go to SDPA)
    assert _prefill_ran(kops) == (head_dim in (64, 128))


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_16bit_kv_cache_long_contexts_match_torch_in_decode_and_chunked_prefill(
    kops: SpyOps, head_dim: int, kv_dtype: torch.dtype
) -> None:
    """Decode over contexts split into several partitions and prefill chunks after cached context,
    both reading a 16-bit cache: the same values torch computes from the cache widened to float32."""
    q, cache, meta = _attention_inputs([1, 1, 1, 30], [1, 300, 700, 330], 8, 2, head_dim, 16, seed=12)
    _compare_attention(kops, q, cache.to(kv_dtype), meta)


# values at a rounding tie, overflowing, infinite, NaN, subnormal and -0 in each 16-bit format
_EDGES = {
    torch.bfloat16: [1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0e38, float("inf"), float("nan"), 1e-40, -0.0],
    torch.float16: [1.0 + 2**-11, 1.0 + 3 * 2**-11, -(1.0 + 2**-11), 7.0e4, float("inf"), float("nan"), 3e-6, -0.0],
}


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_cache_write_rounds_ties_to_even_and_keeps_nan_inf(kops: SpyOps, kv_dtype: torch.dtype) -> None:
    head_dim, num_kv_heads = 32, 1  # NOTE: 32: the float16 write's 8-wide F16C loop and its tail both run
    v = torch.tensor(_EDGES[kv_dtype] + [2**-24 * 1.5, 65519.0, 65520.0])
    v = torch.cat([v, _randn(head_dim - v.numel(), seed=3)])
    qkv = torch.cat([torch.zeros(1, head_dim), torch.zeros(1, head_dim), v[None]], dim=1)  # q, k, v of one token
    cache_ref = torch.zeros(2, 1, 1, num_kv_heads, head_dim, dtype=kv_dtype)
    cache_got = cache_ref.clone()
    args = (torch.ones(1, head_dim // 2), torch.zeros(1, head_dim // 2))
    slots = torch.zeros(1, dtype=torch.int64)
    REF.rope_and_cache(qkv.clone(), *args, cache_ref, slots, 1, num_kv_heads, None, None, 0.0)
    kops.rope_and_cache(qkv.clone(), *args, cache_got, slots, 1, num_kv_heads, None, None, 0.0)
    assert kops.calls["_rope_and_cache"] == 1
    nan = cache_ref.isnan()  # NOTE: torch's own NaN bits differ between its scalar and vector paths
    assert torch.equal(cache_got.isnan(), nan) and nan.sum() == 1
    assert torch.equal(cache_got.view(torch.int16)[~nan], cache_ref.view(torch.int16)[~nan])


# --- select_ops -----------------------------------------------------------------------------------


def test_select_ops_picks_the_backend_and_rejects_what_the_kernels_cannot_run() -> None:
    cpu = torch.device("cpu")
    assert type(select_ops("torch", torch.float32, torch.float32, cpu)) is TorchOps
    assert type(select_ops("auto", torch.float32, torch.float32, cpu)) is CpuKernelOps
    assert type(select_ops("cpu", torch.float32, torch.float32, cpu)) is CpuKernelOps
    # every CPU model computes in float32 (kvpager.model.precision), over a 32- or 16-bit KV cache
    assert type(select_ops("auto", torch.bfloat16, torch.bfloat16, cpu)) is CpuKernelOps
    assert type(select_ops("auto", torch.float16, torch.float16, cpu)) is CpuKernelOps
    assert type(select_ops("auto", torch.float32, torch.bfloat16, cpu)) is CpuKernelOps
    assert type(select_ops("auto", torch.float32, torch.float16, cpu)) is CpuKernelOps
    assert type(select_ops("auto", torch.float32, torch.float64, cpu)) is TorchOps
    with pytest.raises(ValueError, match=r"'cpu'.*float32.*KV cache torch\.float64"):
        select_ops("cpu", torch.float32, torch.float64, cpu)
    with pytest.raises(ValueError, match=r"kernel_backend must be one of .*'cuda'"):
        select_ops("cuda", torch.float32, torch.float32, cpu)


def test_build_without_a_compiler_is_a_clear_error(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpager.model.backends.kernels.build import KernelBuildError, build

    monkeypatch.setenv("KVPAGER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, g++ or clang++ here
    with pytest.raises(KernelBuildError, match="no C\\+\\+ compiler"):
        build()


def test_build_caches_the_library_per_source_flags_and_cpu(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpager.model.backends.kernels.build import build

    monkeypatch.setenv("KVPAGER_CACHE_DIR", str(tmp_path))
    first = build()
    assert first.is_file() and first.parent.parent == tmp_path / "kernels"
    mtime = first.stat().st_mtime_ns
    assert build() == first and first.stat().st_mtime_ns == mtime  # cached: not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary file left behind


def test_auto_falls_back_to_torch_when_the_kernels_cannot_build(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import kvpager.model.backends.ops as ops_module
    from kvpager.model.backends.kernels.build import KernelBuildError

    def fail() -> KernelLibrary:
        raise KernelBuildError("no C++ compiler found")

    monkeypatch.setattr(ops_module, "load_cpu_kernels", fail)
    cpu = torch.device("cpu")
    with caplog.at_level("WARNING"):
        assert type(select_ops("auto", torch.float32, torch.float32, cpu)) is TorchOps
    assert "CPU kernels unavailable" in caplog.text
    with pytest.raises(KernelBuildError):
        select_ops("cpu", torch.float32, torch.float32, cpu)


def test_kernels_follow_torch_thread_count_on_the_stepping_thread(kops: SpyOps) -> None:
    import threading

    max_threads = kops.kernels.fn("kvp_max_threads")
    seen: list[int] = []
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def step_on_another_thread() -> None:
            kops.begin_step()
            seen.append(max_threads())

        worker = threading.Thread(target=step_on_another_thread)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(previous)
    assert seen == [1]

"""The kernels' checked binding (kvpager/model/backends/kernels/abi.py, binding.py), their builds per
instruction set and CpuKernelOps' fallback counts.

A wrong argument (dtype, shape, layout, device, an index outside the pool, arguments swapped or
missing) must raise before the C function runs, leaving every output untouched.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch

from kvpager.model.backends.kernels import abi
from kvpager.model.backends.kernels.binding import (
    Float,
    Int,
    KernelArgumentError,
    KernelFunction,
    KernelSpec,
    Tensor,
    c_header,
)
from kvpager.model.backends.kernels.build import ISAS, expected_isa, load_cpu_kernels, requested_isa
from kvpager.model.backends.ops import CpuKernelOps

pytestmark = pytest.mark.slow  # C++ kernel builds


@pytest.fixture(scope="module")
def kernels() -> Any:
    return load_cpu_kernels()


def _linear_args() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 37, generator=gen), torch.randn(7, 37, generator=gen), torch.randn(7, generator=gen)
    return {"x": x, "w": w, "bias": b, "out": torch.full((3, 7), 123.0)}


def test_a_checked_call_computes_what_torch_does(kernels: Any) -> None:
    args = _linear_args()
    kernels.fn("kvp_linear_small")(**args)
    torch.testing.assert_close(args["out"], torch.nn.functional.linear(args["x"], args["w"], args["bias"]))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"x": torch.randn(3, 37, dtype=torch.float64)}, r"x must be torch\.float32, got torch\.float64"),
        ({"w": torch.randn(7, 36)}, r"w must have shape \['N', 'K=37'\], got \[7, 36\]"),
        ({"bias": torch.randn(8)}, r"bias must have shape \['N=7'\], got \[8\]"),
        ({"out": torch.zeros(3, 8)}, r"out must have shape \['M=3', 'N=7'\], got \[3, 8\]"),
        ({"x": torch.randn(37, 3).t()}, r"x must be contiguous"),
        ({"x": torch.empty(3, 37, device="meta")}, r"x must be on the CPU, got meta"),
        ({"x": [[0.0] * 37] * 3}, r"x must be a tensor, got list"),
        ({"x": None}, r"missing tensor argument 'x'"),
        ({"M": 3}, r"unexpected argument\(s\) \['M'\]"),
    ],
    ids=["dtype", "shape", "bias_shape", "out_shape", "strided", "device", "not_a_tensor", "missing", "a_size"],
)
@pytest.mark.parametrize("primed", [False, True], ids=["first_call", "after_a_cached_good_call"])
def test_a_wrong_argument_raises_and_writes_nothing(
    kernels: Any, change: dict[str, Any], message: str, primed: bool
) -> None:
    # a KernelFunction of its own: its cache of checked signatures starts empty
    linear = KernelFunction(kernels.lib, next(s for s in abi.SPECS if s.name == "kvp_linear_small"))
    if primed:
        linear(**_linear_args())
    args: dict[str, Any] = {**_linear_args(), **change}
    out = args["out"]
    before = out.clone() if out.device.type == "cpu" else None
    with pytest.raises(KernelArgumentError, match=r"^kvp_linear_small: " + message):
        linear(**args)
    if before is not None:
        assert torch.equal(out, before)
    assert linear.cached_signatures() == int(primed)  # a refused call caches nothing


def test_swapped_arguments_raise(kernels: Any) -> None:
    args = _linear_args()
    with pytest.raises(KernelArgumentError, match="shape"):
        kernels.fn("kvp_linear_small")(**{**args, "x": args["w"], "w": args["x"]})
    # decode attention with the block tables and the sequence lengths swapped
    q, out, cache = torch.randn(2, 4, 64), torch.zeros(2, 4, 64), torch.randn(2, 6, 4, 2, 64)
    tables, seq_lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([5, 8])
    decode = kernels.fn("kvp_paged_decode")
    common = {"q": q, "out": out, "rows": None, "k_cache": cache[0], "v_cache": cache[1], "window": 0}
    common["kv_format"] = 0
    with pytest.raises(KernelArgumentError, match="block_tables must have shape"):
        decode(**common, block_tables=seq_lens, seq_lens=tables, scale=0.125, partition=256)
    with pytest.raises(KernelArgumentError, match="partition must be an int, got float"):
        decode(**common, block_tables=tables, seq_lens=seq_lens, scale=0.125, partition=0.125)
    with pytest.raises(KernelArgumentError, match="v_cache must have the same dtype as the other kv tensors"):
        decode(
            **{**common, "k_cache": cache[0].bfloat16()}, block_tables=tables, seq_lens=seq_lens, scale=1.0, partition=1
        )
    with pytest.raises(KernelArgumentError, match="kv_format is the k_cache tensor's dtype"):
        decode(**{**common, "kv_format": 1}, block_tables=tables, seq_lens=seq_lens, scale=0.125, partition=256)
    assert not out.any()
    decode(**common, block_tables=tables, seq_lens=seq_lens, scale=0.125, partition=256)
    assert out.abs().sum() > 0  # the same arguments, in their places, run


def test_an_index_outside_the_pool_raises_before_anything_is_written(kernels: Any) -> None:
    num_heads, num_kv_heads, head_dim = 2, 1, 16
    qkv = torch.randn(3, (num_heads + 2 * num_kv_heads) * head_dim)
    cos, sin = torch.ones(3, 1, head_dim // 2), torch.zeros(3, 1, head_dim // 2)
    cache = torch.zeros(2, 2, 4, num_kv_heads, head_dim)  # 2 blocks of 4: slots 0..7
    call = kernels.fn("kvp_rope_and_cache")
    common = {"qkv": qkv, "num_heads": num_heads, "cos": cos.view(3, -1), "sin": sin.view(3, -1)}
    common |= {"q_norm": None, "k_norm": None, "eps": 1e-6, "k_cache": cache[0], "v_cache": cache[1]}
    common["kv_format"] = 0
    for bad in ([0, 1, 8], [-1, 0, 1]):
        with pytest.raises(KernelArgumentError, match=r"slots values must lie in \[0, 8\)"):
            call(**common, slots=torch.tensor(bad))
    assert not cache.any()
    with pytest.raises(KernelArgumentError, match="qkv rows hold num_heads q"):
        call(**{**common, "num_heads": 3}, slots=torch.tensor([0, 1, 7]))
    call(**common, slots=torch.tensor([0, 1, 7]))
    assert cache.view(2, 8, -1)[:, [0, 1, 7]].any() and not cache.view(2, 8, -1)[:, 2:7].any()


def test_prefill_chunks_must_lie_inside_q_and_their_context(kernels: Any) -> None:
    q, out, cache = torch.randn(5, 2, 64), torch.zeros(5, 2, 64), torch.randn(2, 4, 4, 1, 64)
    common = {"q": q, "out": out, "k_cache": cache[0], "v_cache": cache[1], "window": 0, "scale": 0.125}
    common |= {"kv_format": 0}
    common["block_tables"] = torch.tensor([[0, 1]])
    run = kernels.fn("kvp_prefill_attention")
    with pytest.raises(KernelArgumentError, match="each chunk's tokens lie in q"):
        run(**common, token_start=torch.tensor([2]), query_len=torch.tensor([5]), seq_len=torch.tensor([5]))
    with pytest.raises(KernelArgumentError, match=r"seq_len values must lie in \[1, 9\)"):
        run(**common, token_start=torch.tensor([0]), query_len=torch.tensor([5]), seq_len=torch.tensor([9]))
    assert not out.any()
    assert run(**common, token_start=torch.tensor([0]), query_len=torch.tensor([5]), seq_len=torch.tensor([7])) == 1


def test_the_c_prototypes_come_from_the_one_declaration() -> None:
    header = c_header(abi.SPECS)
    assert "void kvp_linear_small(const float* x, int64_t M, int64_t K, const float* w, int64_t N, " in header
    assert "void* k_cache, void* v_cache, const int64_t* slots, int64_t kv_format);" in header
    assert "int64_t kvp_prefill_attention(const float* q, int64_t q_stride, float* out," in header
    spec = KernelSpec("f", (("a", Tensor((torch.bfloat16,), (2,), writes=True)), ("n", Int()), ("e", Float())))
    assert "void f(uint16_t* a, int64_t n, float e);" in c_header((spec,))


def test_a_c_definition_that_differs_from_the_declaration_does_not_compile(tmp_path: Any) -> None:
    import subprocess

    from kvpager.model.backends.kernels.build import FLAGS, HEADER, KERNEL_DIR, _compiler

    def retype(spec: KernelSpec) -> KernelSpec:  # declare silu_mul's `out` as int64 instead of float
        if spec.name != "kvp_silu_mul":
            return spec
        params = tuple((n, Tensor(abi.I64, p.shape, writes=True)) if n == "out" else (n, p) for n, p in spec.params)
        return dataclasses.replace(spec, params=params)

    def compile_layers(specs: tuple[KernelSpec, ...]) -> subprocess.CompletedProcess[str]:
        (tmp_path / HEADER).write_text(c_header(specs))
        cmd = [_compiler(), *FLAGS, "-fsyntax-only", f"-I{tmp_path}", str(KERNEL_DIR / "layers.cpp")]
        return subprocess.run(cmd, capture_output=True, text=True, check=False)

    assert compile_layers(abi.SPECS).returncode == 0
    failed = compile_layers(tuple(retype(s) for s in abi.SPECS))
    assert failed.returncode != 0 and "conflicting declaration" in failed.stderr and "kvp_silu_mul" in failed.stderr


@pytest.mark.parametrize("isa", ISAS)
def test_each_build_runs_the_branches_this_cpu_should_take(isa: str) -> None:
    kernels = load_cpu_kernels(isa)
    flags = set(build_flags_line().split())
    assert kernels.isa == expected_isa(isa)
    assert (kernels.isa == "avx512") == ("avx512f" in flags and isa == "native")
    assert bool(kernels.fn("kvp_linear_b_fast")()) == (kernels.isa == "avx512")


def build_flags_line() -> str:
    from kvpager.model.backends.kernels.build import _cpu_features

    return _cpu_features()


def test_the_isa_comes_from_the_environment_and_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPAGER_KERNEL_ISA", "portable")
    assert requested_isa() == "portable" and requested_isa("native") == "native"
    monkeypatch.setenv("KVPAGER_KERNEL_ISA", "avx9")
    with pytest.raises(ValueError, match=r"KVPAGER_KERNEL_ISA.*\('native', 'portable'\).*'avx9'"):
        load_cpu_kernels()


def test_fallbacks_are_counted_per_op_and_reason_and_logged_once(
    kernels: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        ops = CpuKernelOps(kernels)
    stats = ops.kernel_stats()
    assert stats["backend"] == "cpu" and stats["isa"] == kernels.isa and stats["fallbacks"] == {}
    assert set(stats["paths"]) >= {"linear", "rms_norm", "decode_attention", "prefill_attention", "decode_layers"}
    assert f"CPU kernels ({kernels.isa} build" in caplog.text and "prefill_attention: kernel" in caplog.text
    caplog.clear()
    x, w = torch.randn(2, 16), torch.randn(16, 8)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            torch.testing.assert_close(ops.linear(x, w.t(), None), x @ w)
        ops.silu_mul(torch.randn(2, 8, dtype=torch.float64))
    fallbacks = ops.kernel_stats()["fallbacks"]
    assert fallbacks == {
        "linear": {"weight is not contiguous": 3},
        "silu_mul": {"gate_up is not float32 on the CPU": 1},
    }
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "linear runs in torch instead (weight is not contiguous)" in warnings[0]


def test_metrics_show_the_fallback_counts() -> None:
    from types import SimpleNamespace

    from kvpager.api.server.metrics import _COUNTERS, _GAUGES, ServerMetrics

    stats = SimpleNamespace(**{field: 0 for _, _, field in (*_GAUGES, *_COUNTERS)})
    metrics = ServerMetrics(lambda: stats, "m")
    metrics.kernel_fallbacks = {"linear": {"weight is not contiguous": 3}}
    line = 'kvpager:kernel_fallbacks_total{model_name="m",op="linear",reason="weight is not contiguous"} 3.0'
    assert line in metrics.render().decode().splitlines()

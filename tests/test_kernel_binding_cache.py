"""The checked binding's cache of call signatures (kvpager/model/backends/kernels/binding.py,
fastcall.py): once a signature has passed the full checks, a call that differs from it in anything
the checks read is checked in full again, and index values are checked on every call.

Every test first makes a valid call, so the signature it then varies is cached.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvpager.model.backends.kernels import abi
from kvpager.model.backends.kernels.binding import KernelArgumentError, KernelFunction
from kvpager.model.backends.kernels.build import load_cpu_kernels
from kvpager.model.backends.kernels.fastcall import CallLayout, method_source

pytestmark = pytest.mark.slow  # C++ kernel builds


@pytest.fixture(scope="module")
def kernels() -> Any:
    return load_cpu_kernels()


def _fresh(kernels: Any, name: str, cache_size: int = 256) -> KernelFunction:
    """A KernelFunction of its own, so each test starts with an empty cache."""
    spec = next(s for s in abi.SPECS if s.name == name)
    return KernelFunction(kernels.lib, spec, cache_size=cache_size)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def test_a_repeated_call_uses_the_cached_signature_and_still_computes(kernels: Any) -> None:
    norm = _fresh(kernels, "kvp_rms_norm")
    w = torch.randn(64)
    for _ in range(3):
        x, out = torch.randn(4, 64), torch.empty(4, 64)
        norm(x=x, w=w, out=out, eps=1e-6)
        torch.testing.assert_close(out, _rms(x, w))
    assert norm.cached_signatures() == 1


def test_another_shape_or_layout_is_not_served_by_a_cached_signature(kernels: Any) -> None:
    norm = _fresh(kernels, "kvp_rms_norm")
    w = torch.randn(64)
    norm(x=torch.randn(4, 64), w=w, out=torch.empty(4, 64), eps=1e-6)
    # more rows: a reused row count would leave rows 4.. unwritten
    x, out = torch.randn(7, 64), torch.full((7, 64), 5.0)
    norm(x=x, w=w, out=out, eps=1e-6)
    torch.testing.assert_close(out, _rms(x, w))
    # strided rows of the same shape: a reused row stride (64) would read the wrong rows
    wide = torch.randn(4, 100)
    out = torch.empty(4, 64)
    norm(x=wide[:, :64], w=w, out=out, eps=1e-6)
    torch.testing.assert_close(out, _rms(wide[:, :64], w))
    # one row whose stride is unusual (still contiguous): the cached entry is right for it
    one = torch.randn(1, 100)[:, :64]
    assert one.is_contiguous()
    out = torch.empty(1, 64)
    norm(x=one, w=w, out=out, eps=1e-6)
    torch.testing.assert_close(out, _rms(one, w))
    assert norm.cached_signatures() == 4


def test_an_omitted_argument_raises_after_a_good_call_was_cached(kernels: Any) -> None:
    # (tests/test_kernel_binding.py checks every other wrong argument after a cached call too)
    linear = _fresh(kernels, "kvp_linear_small")
    args = {"x": torch.randn(3, 37), "w": torch.randn(7, 37), "bias": None, "out": torch.empty(3, 7)}
    linear(**args)
    del args["out"]
    with pytest.raises(KernelArgumentError, match=r"missing tensor argument 'out'"):
        linear(**args)


def _decode_args(tables: list[list[int]], seq_lens: list[int]) -> dict[str, Any]:
    cache = torch.randn(2, 4, 4, 1, 16)  # 4 blocks of 4 positions
    return {
        "q": torch.randn(2, 2, 16),
        "out": torch.zeros(2, 2, 16),
        "rows": None,
        "k_cache": cache[0],
        "v_cache": cache[1],
        "block_tables": torch.tensor(tables),
        "seq_lens": torch.tensor(seq_lens),
        "window": 0,
        "scale": 0.25,
        "partition": 256,
        "kv_format": 0,  # float32 blocks
    }


def test_index_values_are_checked_on_every_call_of_a_cached_signature(kernels: Any) -> None:
    decode = _fresh(kernels, "kvp_paged_decode")
    decode(**_decode_args([[0, 1], [2, 3]], [5, 8]))
    assert decode.cached_signatures() == 1
    for tables, seq_lens, message in (
        ([[0, 1], [2, 4]], [5, 8], r"block_tables values must lie in \[0, 4\), got \[0, 4\]"),
        ([[0, 1], [-1, 3]], [5, 8], r"block_tables values must lie in \[0, 4\)"),
        ([[0, 1], [2, 3]], [5, 9], r"seq_lens values must lie in \[1, 9\), got \[5, 9\]"),
        ([[0, 1], [2, 3]], [0, 8], r"seq_lens values must lie in \[1, 9\)"),
    ):
        args = _decode_args(tables, seq_lens)
        with pytest.raises(KernelArgumentError, match=message):
            decode(**args)
        assert not args["out"].any()
    # token rows (an optional index tensor) are checked too once they are passed
    args = _decode_args([[0, 1], [2, 3]], [5, 8])
    decode(**{**args, "rows": torch.tensor([0, 1])})
    with pytest.raises(KernelArgumentError, match=r"rows values must lie in \[0, 2\)"):
        decode(**{**args, "rows": torch.tensor([0, 2])})
    assert decode.cached_signatures() == 2


def test_the_first_index_tensor_out_of_range_is_named_as_the_full_checks_name_it(kernels: Any) -> None:
    decode = _fresh(kernels, "kvp_paged_decode")
    decode(**_decode_args([[0, 1], [2, 3]], [5, 8]))
    both_bad = _decode_args([[0, 1], [2, 7]], [5, 9])  # block_tables and seq_lens out of range
    for call in (decode, decode.checked):  # cached, then in full
        with pytest.raises(KernelArgumentError, match=r"block_tables values must lie in \[0, 4\), got \[0, 7\]"):
            call(**both_bad)
    assert not both_bad["out"].any()
    args = _decode_args([[0, 1], [2, 3]], [5, 8])
    decode(**{**args, "rows": torch.tensor([1, 0])})
    with pytest.raises(KernelArgumentError, match=r"rows values must lie in \[0, 2\), got \[-1, 0\]"):
        decode(**{**_decode_args([[0, 9], [2, 3]], [5, 8]), "rows": torch.tensor([-1, 0])})


def test_each_of_the_prefill_kernels_four_index_tensors_is_checked_on_every_call(kernels: Any) -> None:
    prefill = _fresh(kernels, "kvp_prefill_attention")
    q, out, cache = torch.randn(5, 2, 64), torch.zeros(5, 2, 64), torch.randn(2, 4, 4, 1, 64)
    common = {"q": q, "out": out, "k_cache": cache[0], "v_cache": cache[1], "window": 0, "scale": 0.125}
    common["kv_format"] = 0
    ok = {"token_start": torch.tensor([0]), "query_len": torch.tensor([5]), "seq_len": torch.tensor([7])}
    ok["block_tables"] = torch.tensor([[0, 1]])
    assert prefill(**common, **ok) == 1
    out.zero_()
    for name, bad in (
        ("token_start", torch.tensor([5])),
        ("query_len", torch.tensor([0])),
        ("seq_len", torch.tensor([9])),
        ("block_tables", torch.tensor([[0, 4]])),
    ):
        with pytest.raises(KernelArgumentError, match=rf"{name} values must lie in"):
            prefill(**common, **{**ok, name: bad})
    assert not out.any() and prefill.cached_signatures() == 1


def test_more_than_four_index_tensors_are_checked_in_groups_of_four(kernels: Any) -> None:
    # kvp_check_ranges declared with five bounded tensors (it only reads them): the fifth is
    # checked by a second call of the cached path
    ten = (lambda s: 0, lambda s: 10)
    spec = abi.KernelSpec(
        "kvp_check_ranges",
        (("limits", abi.Tensor(abi.I64, ("m",), values=(lambda s: 0, lambda s: 1))),)
        + tuple((f"v{i}", abi.Tensor(abi.I64, (f"n{i}",), values=ten)) for i in range(4)),
        returns="int64_t",
    )
    ranges = KernelFunction(kernels.lib, spec)
    good = {"limits": torch.tensor([0]), **{f"v{i}": torch.arange(10) for i in range(4)}}
    assert ranges(**good) == 0 and ranges.cached_signatures() == 1
    for name in ("limits", "v0", "v3"):
        bad = good[name].clone()
        bad[-1] = 10
        with pytest.raises(KernelArgumentError, match=rf"{name} values must lie in \[0, (1|10)\)"):
            ranges(**{**good, name: bad})


def test_check_ranges_sets_a_bit_for_each_array_out_of_range_and_skips_absent_ones(kernels: Any) -> None:
    fn = kernels.lib.kvp_check_ranges
    inside, below, above = torch.tensor([0, 3]), torch.tensor([-1, 0]), torch.tensor([1, 4])
    limits = torch.tensor([4, 2, 0, 4, 2, 0, 4, 2, 0, 4, 2, 0, 4])
    arrays = (inside, below, above, inside)
    assert fn(limits.data_ptr(), *(a.data_ptr() for a in arrays)) == 0b0110
    assert fn(limits.data_ptr(), inside.data_ptr(), None, above.data_ptr(), None) == 0b0100
    limits[0] = 1  # only the first array is checked
    assert fn(limits.data_ptr(), inside.data_ptr(), below.data_ptr(), above.data_ptr(), None) == 0


def test_a_cached_int_is_not_reused_for_another_value_or_type(kernels: Any) -> None:
    decode = _fresh(kernels, "kvp_paged_decode")
    args = _decode_args([[0, 1], [2, 3]], [5, 8])
    decode(**args)
    with pytest.raises(KernelArgumentError, match="partition >= 1"):
        decode(**{**args, "partition": 0})
    with pytest.raises(KernelArgumentError, match="partition must be an int, got bool"):
        decode(**{**args, "partition": True})
    with pytest.raises(KernelArgumentError, match="scale must be a float, got str"):
        decode(**{**args, "scale": "0.25"})


def test_the_prefill_kernels_tensor_checks_run_on_every_call(kernels: Any) -> None:
    prefill = _fresh(kernels, "kvp_prefill_attention")
    q, out, cache = torch.randn(5, 2, 64), torch.zeros(5, 2, 64), torch.randn(2, 4, 4, 1, 64)
    common = {"q": q, "out": out, "k_cache": cache[0], "v_cache": cache[1], "window": 0, "scale": 0.125}
    common["kv_format"] = 0  # float32 blocks
    common["block_tables"] = torch.tensor([[0, 1]])
    ok = {"token_start": torch.tensor([0]), "query_len": torch.tensor([5]), "seq_len": torch.tensor([7])}
    assert prefill(**common, **ok) == 1
    out.zero_()
    with pytest.raises(KernelArgumentError, match="each chunk's tokens lie in q"):
        prefill(**common, **{**ok, "token_start": torch.tensor([2])})
    assert not out.any() and prefill.cached_signatures() == 1


def test_the_cache_keeps_at_most_its_size_of_signatures(kernels: Any) -> None:
    norm = _fresh(kernels, "kvp_rms_norm", cache_size=2)
    w = torch.randn(8)
    for rows in (1, 2, 3, 2, 1):
        x, out = torch.randn(rows, 8), torch.empty(rows, 8)
        norm(x=x, w=w, out=out, eps=1e-6)
        torch.testing.assert_close(out, _rms(x, w))
    assert norm.cached_signatures() == 2


def test_checked_runs_the_full_checks_and_caches_nothing(kernels: Any) -> None:
    norm = _fresh(kernels, "kvp_rms_norm")
    x, w, out = torch.randn(2, 8), torch.randn(8), torch.empty(2, 8)
    norm.checked(x=x, w=w, out=out, eps=1e-6)
    torch.testing.assert_close(out, _rms(x, w))
    assert norm.cached_signatures() == 0


def test_generated_methods_reject_parameter_names_they_could_shadow() -> None:
    layout = CallLayout("f", (("_e", "int"),), frozenset(), (), False)
    with pytest.raises(ValueError, match="'_e' must be an identifier without a leading _"):
        method_source(layout)

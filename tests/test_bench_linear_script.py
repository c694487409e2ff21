"""scripts/bench_linear.py times every weight format against its read probe and reports what it promises."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_linear.py"


@pytest.mark.slow
def test_bench_linear_reports_every_format_shape_and_batch(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_linear", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    out = tmp_path / "linear.json"
    assert module.main(["--quick", "--threads", "1", "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())
    names = {r["candidate"] for r in rows}
    assert names == {"f32", "bf16", "int8", "int4_g32", "w8a8_int8", "w4a8_int8_g32", "torch_int8", "torch_int4_g32"}
    assert {(r["K"], r["N"], r["M"]) for r in rows} == {(k, n, m) for k, n in ((256, 64), (96, 160)) for m in (1, 3)}
    assert all(r["GBps"] > 0 and r["GFLOPs"] > 0 and r["read_probe_GBps"] > 0 for r in rows)


def _load_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_linear", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # NOTE: its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_bench_linear_dot_candidates_run_the_integer_dot_past_the_row_rule() -> None:
    import torch

    from kvpager.model.backends.quant_dot import reference_matmul

    module = _load_script()
    torch.manual_seed(0)
    w = torch.randn(64, 96) * 0.02
    x = torch.randn(200, 96)  # past every dot_kernel_max_rows limit (128 at most)
    for fmt, name, weight in (
        ("w8a8_int8_dot", "w8a8_int8_dot", module.Int8DotWeight.from_float(w)),
        ("w4a8_int8_dot", "w4a8_int8_dot_g32", module.Int4DotWeight.from_float(w, 32)),
    ):
        cand = module.candidates(fmt, w, 32, 1)
        assert cand.name == name
        out = cand.call(x, 0)
        assert torch.equal(out, weight.dot_kernel(x))  # the integer-dot kernel's bits, not the exact path's
        assert torch.allclose(out.double(), reference_matmul(weight, x), rtol=1e-4, atol=1e-4)


def test_bench_linear_plain_candidate_stores_rows_plain_and_the_cap_reaches_the_weights() -> None:
    import torch

    module = _load_script()
    torch.manual_seed(1)
    w, x = torch.randn(64, 128) * 0.02, torch.randn(3, 128)
    for level in (None, module.LEVELS["avx2"], module.LEVELS["portable"]):
        mixed = module.candidates("w4a8_int8", w, 32, 1, level)
        plain = module.candidates("w4a8_int8_plain", w, 32, 1, level)
        assert plain.name == "w4a8_int8_plain_g32"
        weight = module.Int4DotWeight.from_float(w, 32, interleave=False)
        weight.max_level = level
        assert torch.equal(plain.call(x, 0), weight.matmul(x, None))
        assert torch.equal(mixed.call(x, 0), plain.call(x, 0))  # the layout changes no bit

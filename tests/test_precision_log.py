"""The start-up precision line names the bfloat16 path the CPU really has."""

from __future__ import annotations

import pytest
import torch

from kvpager.model import precision


def test_bf16_plan_says_emulated_where_the_cpu_has_no_bf16_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "bf16_isas", lambda: [])
    plan = precision.plan_precision(torch.bfloat16, "cpu")
    assert "no AVX512-BF16/AMX" in plan.reason  # the features text names both instruction sets...
    assert "emulated" in plan.reason and "oneDNN's bf16 GEMM" not in plan.reason  # ...without claiming them


def test_bf16_plan_names_onednn_where_the_cpu_has_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "bf16_isas", lambda: ["AMX"])
    plan = precision.plan_precision(torch.bfloat16, "cpu")
    assert "(AMX)" in plan.reason and "oneDNN's bf16 GEMM" in plan.reason

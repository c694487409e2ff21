"""Which dtype each part of the model computes and stores in, per device and CPU (the compute-dtype
rule), and float32 matmul precision, scoped.

The rule (`plan_precision`; docs/precision.md explains the measurements behind it):

- CUDA: everything in the model dtype (bfloat16/float16 compute in torch, as vLLM).
- CPU, float32 model: float32 everywhere (as before).
- CPU, bfloat16 model: the linear weights (projections, lm_head) and the embedding table stay
  bfloat16 in memory (half the bytes a decode step streams); activations, norms, RoPE, SiLU and
  attention compute in float32 (kvpager's fused kernels: bfloat16 is widened in registers, the
  products accumulate in float32, as vLLM's CPU kernels do); the KV cache is stored in bfloat16
  (or --kv-cache-dtype), widened when read. This holds with or without bf16 instructions: on a CPU
  with AVX512-BF16/AMX only the large-batch GEMM changes (oneDNN's bf16 GEMM on bf16-rounded
  activations, Bf16Weight.matmul); without them (AVX2) bfloat16 arithmetic in torch is emulated and
  several times slower than float32, so nothing but the weight/KV storage is bfloat16.
- CPU, float16 model: as bfloat16: the linear weights and the embedding stay float16 (half the
  bytes), widened exactly to float32 in registers (F16C's vcvtph2ps; the portable kernel by the bit
  layout) with float32 accumulation (F16Weight); large batches dequantize chunks of rows to float32
  for torch's GEMM. The KV cache is stored in float16 (vcvtph2ps/vcvtps2ph in the kernels).
  `--dtype auto` never picks float16 on the CPU (vLLM's rule: float16 checkpoints run in bfloat16
  there).

The norm weights and biases are small (hidden-size vectors) and kept in the compute dtype.

float32 matmul precision: "highest" multiplies float32 exactly; "high" allows TF32 on CUDA;
"medium" rounds the inputs of float32 matmuls to bfloat16 and accumulates in float32 (oneDNN with
AMX on recent Xeon CPUs). The setting reaches torch's matmuls only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger("kvpager")


@dataclass(frozen=True)
class PrecisionPlan:
    """What the model stores and computes in (see the module docstring)."""

    dtype: torch.dtype  # the model dtype asked for (--dtype, resolved)
    compute_dtype: torch.dtype  # activations, norms, RoPE, attention
    linear_weight_dtype: torch.dtype  # projections and lm_head as stored
    reason: str

    def describe(self) -> str:
        """One line for the start-up log."""
        return (
            f"compute {_name(self.compute_dtype)}, linear weights {_name(self.linear_weight_dtype)} "
            f"(model dtype {_name(self.dtype)}): {self.reason}"
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def bf16_isas() -> list[str]:
    """The bfloat16 instruction sets torch detects on this CPU: "AVX512-BF16", "AMX", or none."""
    cpu = getattr(torch, "cpu", None)
    return [
        name
        for name, probe in (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
        if cpu is not None and getattr(cpu, probe, lambda: False)()
    ]


def cpu_features() -> str:
    """The CPU's relevant instruction sets as torch detects them, e.g. "AVX2 (no AVX512-BF16/AMX)"."""
    bf16 = bf16_isas()
    return f"{torch.backends.cpu.get_cpu_capability()} ({'+'.join(bf16) if bf16 else 'no AVX512-BF16/AMX'})"


def plan_precision(dtype: torch.dtype, device: torch.device | str) -> PrecisionPlan:
    """The compute-dtype rule for a model of `dtype` on `device`."""
    device_type = torch.device(device).type
    if device_type != "cpu" or dtype == torch.float32:
        return PrecisionPlan(dtype, dtype, dtype, f"{device_type}: one dtype throughout")
    features = cpu_features()
    if dtype == torch.bfloat16:
        native = bool(bf16_isas())  # NOTE: not a substring test of `features`, which names both when absent
        reason = f"CPU {features}: bfloat16 weights and KV cache widened in registers, float32 kernels" + (
            "; large batches in oneDNN's bf16 GEMM" if native else "; bfloat16 arithmetic would be emulated"
        )
        return PrecisionPlan(dtype, torch.float32, torch.bfloat16, reason)
    if dtype == torch.float16:
        return PrecisionPlan(
            dtype,
            torch.float32,
            torch.float16,
            f"CPU {features}: float16 weights and KV cache widened in registers (exact), float32 kernels",
        )
    raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")


def compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype activations are computed in for a model of `dtype` on `device`."""
    return plan_precision(dtype, device).compute_dtype


def apply_precision(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> PrecisionPlan:
    """Plan, cast `model` (cast_for_compute) and log the plan once per model load."""
    plan = plan_precision(dtype, device)
    cast_for_compute(model, plan)
    logger.info("precision: %s", plan.describe())
    return plan


def cast_for_compute(model: nn.Module, plan: PrecisionPlan) -> None:
    """Cast `model`'s parameters in place for `plan`: Linear weights to plan.linear_weight_dtype (an
    Embedding sharing its weight, a tied lm_head, follows it; other Embeddings keep the model dtype),
    everything else (norm weights, biases) to the compute dtype. Packed weights are left alone."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    cast: dict[int, nn.Parameter] = {}  # NOTE: one new tensor per old one, so tied weights stay tied
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in linear_weights:
                target = plan.linear_weight_dtype
            elif isinstance(module, nn.Embedding):
                continue
            else:
                target = plan.compute_dtype
            if param.dtype == target or not param.is_floating_point():
                continue
            if id(param) not in cast:
                cast[id(param)] = nn.Parameter(param.detach().to(target), requires_grad=False)
            module._parameters[name] = cast[id(param)]


@contextmanager
def fp32_matmul_precision(precision: str) -> Iterator[None]:
    """Run the body with torch's float32 matmul precision set to `precision`, then restore it."""
    previous = torch.get_float32_matmul_precision()
    if previous == precision:
        yield
        return
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)

"""float32 matmul precision, scoped: torch's setting is process-wide, the engine's is per engine.

"highest" multiplies float32 exactly; "high" allows TF32 on CUDA; "medium" rounds the inputs of
float32 matmuls to bfloat16 and accumulates in float32 (oneDNN with AMX on recent Xeon CPUs: 3-5x
the float32 GEMM rate at 64-512 rows). kvpager's own CPU kernels (batch <= 32 linear layers,
attention) always compute in float32; the setting reaches torch's matmuls only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


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

"""What the CPU kernels take: their preconditions (dtype, device, contiguity of each argument) and the
row limits shared by the per-op path (cpu_ops.py) and the fused layer stack (fused_stack.py).

Each check returns None when the kernel applies, else the reason the ops record as a fallback
(fallbacks.py) before torch computes the same values.
"""

from __future__ import annotations

import torch

from kvpager.model.backends.kernels.abi import KV_FORMATS

# Decode attention splits a sequence's context into partitions of this many positions (merged
# afterwards), so one long sequence still spreads over every thread.
DECODE_PARTITION = 256
# Linear layers over torch's row-major weights (CPUs without AVX-512, widths not divisible by 16) with at most
# this many input rows run in the dot-product kernel (each weight row read once for all rows, next
# rows prefetched); larger batches go to torch's GEMM. Measured on llama-small's weights, 2 threads:
# 1.8x torch at 4-16 rows, 1.24x at 32, 1.07x at 48, 0.87x at 64. Decode-only steps of at most this
# many rows run the whole layer stack in one kernel call.
SMALL_BATCH_LINEAR = 32


def medium_precision() -> bool:
    return torch.get_float32_matmul_precision() == "medium"


def f32(t: torch.Tensor) -> bool:
    """float32 on the CPU: what the kernels read and write through raw pointers."""
    return t.dtype == torch.float32 and t.device.type == "cpu"


def kv_ok(t: torch.Tensor) -> bool:
    """A KV cache the kernels read and write: float32, bfloat16 or float16 on the CPU."""
    return t.dtype in KV_FORMATS and t.device.type == "cpu"


def unfit(**tensors: torch.Tensor | None) -> str | None:
    """None when every given tensor is float32, on the CPU and contiguous, else the first reason."""
    for name, t in tensors.items():
        if t is None:
            continue
        if not f32(t):
            return f"{name} is not float32 on the CPU"
        if not t.is_contiguous():
            return f"{name} is not contiguous"
    return None


def kv_unfit(kv: torch.Tensor) -> str | None:
    if not kv_ok(kv):
        return "KV cache is not float32, bfloat16 or float16 on the CPU"
    return None if kv.is_contiguous() else "KV cache is not contiguous"


def attention_unfit(q: torch.Tensor, kv_layer: torch.Tensor) -> str | None:
    """None for q [T, H, hd] and a KV layer the attention kernels read: float32 q with contiguous
    heads (rows may be strided), a contiguous float32, bfloat16 or float16 cache, on the CPU."""
    if not f32(q):
        return "q is not float32 on the CPU"
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        return "q heads are not contiguous"
    return kv_unfit(kv_layer)

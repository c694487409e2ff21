"""The per-layer operations of the decoder, behind one interface with two implementations.

`TorchOps` is the reference: plain torch, any device and dtype. `CpuKernelOps` runs the same math
in kvpager's C++ kernels (kvpager/model/backends/kernels/*.cpp, called with keyword arguments through
the binding checked against kernels/abi.py; a precondition that fails sends the call to torch and is
counted in `kernel_stats()`) for float32 activations on CPU (float32 models, and bfloat16/float16
models under kvpager.model.precision's rule), over a float32, bfloat16 or float16 KV cache: RMSNorm and residual-add
fused, SiLU·up fused, RoPE and the K/V cache write fused, decode and prefill attention that read
K/V blocks in place instead of gathering every sequence's context into a padded tensor (prefill
beyond PREFILL_KERNEL_MAX_CONTEXT in torch's SDPA), linear layers over weights it stores in column
blocks at load (`prepare_weights`, kvpager.model.backends.weight_layout); a decode-only step of at most
FUSED_MAX_ROWS rows runs every layer in one kernel call. Tests hold the two to each other and to transformers.

`select_ops(backend, dtype, kv_dtype, device)` picks one: "torch", "cpu" (kernels, error if they cannot be
built) or "auto" (kernels on CPU when a compiler is available,
torch otherwise): "auto" takes the kernels for every model on the CPU whose compute dtype is float32
(kvpager.model.precision: every CPU model) with a float32, bfloat16 or float16 KV cache.

Modules: torch_ops.py (`TorchOps`, the interface and reference), cpu_ops.py (`CpuKernelOps`, per op),
fused_stack.py (the one-call decode stack), kernel_checks.py (the kernels' preconditions and the row
limits both share); this one picks the ops (`select_ops`) and re-exports the names callers import.
"""

from __future__ import annotations

import logging

import torch

from kvpager.core.config import KERNEL_BACKENDS
from kvpager.model.backends.cpu_ops import (
    BLOCKED_KERNEL_MAX_ROWS,
    PREFILL_AMX_MAX_CONTEXT,
    PREFILL_KERNEL_MAX_CONTEXT,
    UNBLOCK_SCRATCH_MAX_BYTES,
    CpuKernelOps,
)
from kvpager.model.backends.fused_stack import FUSED_MAX_ROWS, LAYER_TABLE_ADDRESSES, LAYER_TABLE_WIDTH
from kvpager.model.backends.kernel_checks import DECODE_PARTITION, SMALL_BATCH_LINEAR
from kvpager.model.backends.kernels.abi import KV_FORMATS
from kvpager.model.backends.kernels.build import KernelBuildError, load_cpu_kernels
from kvpager.model.backends.torch_ops import TorchOps
from kvpager.model.precision import compute_dtype

__all__ = [
    "BLOCKED_KERNEL_MAX_ROWS",
    "DECODE_PARTITION",
    "FUSED_MAX_ROWS",
    "LAYER_TABLE_ADDRESSES",
    "LAYER_TABLE_WIDTH",
    "PREFILL_AMX_MAX_CONTEXT",
    "PREFILL_KERNEL_MAX_CONTEXT",
    "SMALL_BATCH_LINEAR",
    "UNBLOCK_SCRATCH_MAX_BYTES",
    "CpuKernelOps",
    "TorchOps",
    "select_ops",
]

logger = logging.getLogger(__name__)


def select_ops(backend: str, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> TorchOps:
    """The ops for `backend` ("auto", "torch", "cpu"), the model's dtype, the KV cache's dtype and the device."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return TorchOps()
    compute = compute_dtype(dtype, device)
    fits = device.type == "cpu" and compute == torch.float32 and kv_dtype in KV_FORMATS
    if not fits:
        if backend == "cpu":
            raise ValueError(
                "kernel_backend 'cpu' runs float32 compute (every model on the CPU) with a float32, bfloat16 or "
                f"float16 KV cache on the CPU only, got dtype {dtype} (compute {compute}), KV cache {kv_dtype} on "
                f"{device}; use 'auto' or 'torch'"
            )
        return TorchOps()
    try:
        return CpuKernelOps(load_cpu_kernels())
    except KernelBuildError as exc:
        if backend == "cpu":
            raise
        logger.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return TorchOps()

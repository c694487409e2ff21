"""The reference implementation of the decoder's per-layer operations: plain torch, any device and dtype.

`TorchOps` is the interface every backend implements (kvpager.model.backends.ops explains the two);
the C++ kernels' `CpuKernelOps` (cpu_ops.py) computes the same values and is tested against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvpager.model.attention import AttentionMetadata, paged_attention, write_kv
from kvpager.model.rope import apply_rope
from kvpager.model.spec import ModelSpec


class TorchOps:
    """Reference implementations in torch."""

    name = "torch"

    def begin_step(self) -> None:
        """Called once at the start of every forward, on the thread that runs it."""

    def kernel_stats(self) -> dict[str, Any]:
        """The backend, which path each op takes and the kernels' fallbacks ({op: {reason: calls}})."""
        return {"backend": self.name, "paths": {}, "fallbacks": {}}

    def prepare_weights(self, model: torch.nn.Module) -> None:
        """Called once after loading: rearrange the model's weights for these ops (values unchanged)."""

    def decode_layers(
        self,
        layers: Sequence[Any],
        spec: ModelSpec,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run every decoder layer at once, returning (last MLP output, residual stream); None means
        "not supported here, run the layers one by one" (always, for torch)."""
        return None

    def prompt_layers(
        self,
        layers: Sequence[Any],
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run every (unsharded) decoder layer of a step at once, as decode_layers, for the steps a
        backend has its own path for; None: run the layers one by one (always, for torch)."""
        return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, in] @ weight [out, in].T (+ bias). A packed weight (quant_weights.py) runs its own matmul."""
        if not isinstance(weight, torch.Tensor):
            return weight.matmul(x, bias)
        return mixed_linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim, computed in float32, scaled in x's dtype (as transformers)."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x). May update `residual` in place."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] -> silu(gate) * up [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def mlp(
        self,
        x: torch.Tensor,
        gate_up_weight: torch.Tensor,
        gate_up_bias: torch.Tensor | None,
        down_weight: torch.Tensor,
        down_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """SwiGLU: down(silu(gate) * up), gate and up one fused projection of x [T, hidden]."""
        return self.linear(self.silu_mul(self.linear(x, gate_up_weight, gate_up_bias)), down_weight, down_bias)

    def rope_and_cache(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """Normalise q/k per head when weights are given (Qwen3), rotate q and k, store K and V at
        `slot_mapping`; return q [T, num_heads, head_dim]. May modify `qkv` in place."""
        num_tokens = qkv.shape[0]
        head_dim = kv_layer.shape[-1]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
        if q_norm is not None and k_norm is not None:
            q = self.rms_norm(qkv[:, :q_size].reshape(num_tokens, num_heads, head_dim), q_norm, eps)
            k = self.rms_norm(
                qkv[:, q_size : q_size + kv_size].reshape(num_tokens, num_kv_heads, head_dim), k_norm, eps
            )
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            # q and k sit side by side in the fused output: rotate all their heads in one pass.
            qk = apply_rope(qkv[:, : q_size + kv_size].view(num_tokens, -1, head_dim), cos, sin)
            q, k = qk[:, :num_heads], qk[:, num_heads:]
        write_kv(kv_layer, k, v, slot_mapping)
        return q

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, hd] over each sequence's cached context -> [T, H, hd] (written K/V included)."""
        return paged_attention(q, kv_layer, meta, scale)


def mixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) in x's dtype, a weight of another dtype widened per call (the reference
    for 16-bit weights under float32 activations; the kernels read them without the copy)."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x, weight.to(x.dtype), bias.to(x.dtype) if bias is not None else None)

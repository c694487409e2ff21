"""Prompt-sized steps of a bfloat16 model with bfloat16 activations between oneDNN's GEMMs.

Where every projection of every layer runs oneDNN's bf16 GEMM (`Bf16Weight.onednn_takes`: batches past
the AMX tile kernel's rows on CPUs with native bfloat16 matmul), the per-op path widens each GEMM's
bfloat16 result to float32 and the next op narrows it back: the o_proj and down_proj outputs on their way
into the residual add, the normed activations on their way into qkv_proj and gate_up_proj. Each round trip
is exact (a bfloat16 value widens exactly, and the GEMM rounds its input to bfloat16 anyway), so
`Bf16PromptStack` skips them: `kvp_add_rms_norm_bf16` adds the bfloat16 output into the float32 residual
stream and writes the normed row in bfloat16, and the MLP's output stays bfloat16 into the next layer.
RoPE takes the bfloat16 qkv product (CpuKernelOps.rope_and_cache), the MLP is CpuKernelOps.bf16_mlp.
The same kernels in the same order otherwise: the values are the per-op path's, bit for bit (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvpager.model.attention import AttentionMetadata
from kvpager.model.backends.kernel_checks import unfit
from kvpager.model.backends.quant_weights import Bf16Weight


class Bf16PromptStack:
    """Every decoder layer of one step in bfloat16 hand-offs, or None where they do not apply."""

    def __init__(self, add_rms_norm_bf16: Callable[..., Any]) -> None:
        self._add_rms_norm_bf16 = add_rms_norm_bf16

    def run(
        self,
        ops: Any,
        layers: Sequence[Any],
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(last MLP output, residual stream) as DecoderLayer.forward layer after layer computes them
        (tensor parallelism aside: the caller passes no sharded layers); None where the hand-offs do
        not apply (then the layers run one by one)."""
        rows = x.shape[0]
        if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or not layers:
            return None
        if not all(self._fits(layer, rows) for layer in layers):
            return None
        residual = x
        first = layers[0].input_layernorm
        h = ops.rms_norm(x, first.weight, first.eps).to(torch.bfloat16)
        down = torch.empty(0)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            if i > 0:
                h = self._add_norm(down, residual, layer.input_layernorm)
            qkv = attn.qkv_proj.weight.bf16_product(h)  # RoPE reads it in bfloat16 (CpuKernelOps)
            if attn.qkv_proj.bias is not None:  # as Bf16Weight.matmul: added to the widened product
                qkv = qkv.float() + attn.qkv_proj.bias.float()
            q_norm = attn.q_norm.weight if attn.q_norm is not None else None
            k_norm = attn.k_norm.weight if attn.k_norm is not None else None
            eps = attn.q_norm.eps if attn.q_norm is not None else 0.0
            q = ops.rope_and_cache(
                qkv, cos, sin, kv_cache[i], meta.slot_mapping, attn.num_heads, attn.num_kv_heads, q_norm, k_norm, eps
            )
            out = ops.attention(q, kv_cache[i], meta, attn.scale)
            o = attn.o_proj.weight.bf16_product(out.reshape(rows, attn.q_size))
            h = self._add_norm(o, residual, layer.post_attention_layernorm)
            down = ops.bf16_mlp(h, mlp.gate_up_proj.weight, mlp.down_proj.weight)
        return down.float(), residual

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: Any) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        self._add_rms_norm_bf16(residual=residual, x=x, w=norm.weight, out=out, eps=norm.eps)
        return out

    @staticmethod
    def _fits(layer: Any, rows: int) -> bool:
        """Every projection a bfloat16 weight oneDNN takes at this many rows, no bias but qkv's (Qwen2),
        float32 norms the kernel reads."""
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(lin.weight, Bf16Weight) and lin.weight.onednn_takes(rows) for lin in linears):
            return False
        if any(lin.bias is not None for lin in linears[1:]):
            return False
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        return all(unfit(w=w) is None for w in norms)

"""`CpuKernelOps`: the decoder's per-layer operations in kvpager's C++ kernels (kernels/*.cpp), each
call checked against its declaration (kernels/abi.py); a decode-only step of a few rows runs the
fused layer stack (fused_stack.py). kvpager.model.backends.ops explains the routes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvpager.model.attention import AttentionMetadata, attend_decodes, attend_prefills
from kvpager.model.backends.bf16_linear import PackedBf16Linear, native_bf16_matmul_available
from kvpager.model.backends.bf16_prompt import Bf16PromptStack
from kvpager.model.backends.fallbacks import FallbackCounter
from kvpager.model.backends.fused_stack import FUSED_MAX_ROWS, FusedLayerStack
from kvpager.model.backends.kernel_checks import (
    DECODE_PARTITION,
    SMALL_BATCH_LINEAR,
    attention_unfit,
    f32,
    kv_unfit,
    medium_precision,
    unfit,
)
from kvpager.model.backends.kernels.abi import KV_FORMATS
from kvpager.model.backends.kernels.build import KernelLibrary
from kvpager.model.backends.quant_weights import NATIVE_BF16_AFTER_ROWS, Bf16Weight
from kvpager.model.backends.torch_ops import TorchOps, mixed_linear
from kvpager.model.backends.weight_layout import BLOCK, blocked_stride, convert_linear_weights, unblocked
from kvpager.model.spec import ModelSpec

logger = logging.getLogger(__name__)

# A linear layer over weights stored in column blocks (kvpager.model.backends.weight_layout) runs in the
# outer-product kernel up to this many input rows; beyond, the weight is copied out column-major
# into a scratch buffer (kvp_unblock) for torch's GEMM. Measured, 2 threads, 8 SmolLM2-shaped
# layers, time torch (copy included) / kernel: 1.92 at 64 rows, 1.44-1.54 at 128-192, 1.27 at 256,
# 1.07-1.10 at 384-512, 0.97-1.10 at 1,024, 0.89-0.91 at 2,048-4,096.
BLOCKED_KERNEL_MAX_ROWS = 1024
# ... as long as the copy is at most this big (the scratch buffer is kept for the next call): a larger
# weight (a big vocabulary's lm_head under prompt_logprobs, an 8B model's MLP) stays in the kernel,
# ~10 % slower than torch's GEMM at 2,048 rows.
UNBLOCK_SCRATCH_MAX_BYTES = 64 << 20
# Prefill chunks attend in the kernel when the step's longest prefill context is at most this long,
# else in torch's SDPA. Measured, 2 threads, per layer: six prompts of 130-512 tokens (8/4 heads)
# 9.4 vs 15.3 ms, one of 512 + 4 of 512 (9/3) 12.4 vs 18.1, Llama-3-8B heads at 500 39.2 vs 56.2;
# even at 1,024-1,500 tokens, slower beyond (2,000: 42.4 vs 34.2; 8B heads at 1,024: 75.0 vs 66.4).
PREFILL_KERNEL_MAX_CONTEXT = 768
# ... and the AMX kernel (a bfloat16 cache on CPUs with AMX) up to this long. Measured, 2 threads, one
# prompt, Llama-3.2-1B heads (32/8 x 64): 29 vs 71 ms at 1,000 tokens, 125 vs 271 at 2,000, 434 vs 699
# at 4,000; 28/4 x 128 heads at 3,000: 317 vs 636 (scripts/compare_attention_paths.py).
PREFILL_AMX_MAX_CONTEXT = 4096


class CpuKernelOps(TorchOps):
    """The C++ kernels, called through their checked binding (kvpager/model/backends/kernels/abi.py).

    Each method checks its kernel's preconditions first; where one fails, torch computes the same
    values and `fallbacks` counts the (op, reason), logged once (see fallbacks.py)."""

    name = "cpu"

    def __init__(self, kernels: KernelLibrary) -> None:
        self.kernels = kernels
        self.fallbacks = FallbackCounter()
        self._linear_small = kernels.fn("kvp_linear_small")
        self._linear_b = kernels.fn("kvp_linear_b")
        self._unblock = kernels.fn("kvp_unblock")
        self._blocked = bool(kernels.fn("kvp_linear_b_fast")())
        # Column-major copies of blocked weights for torch's GEMM (large batches), reused call to call.
        self._unblock_scratch = torch.empty(0, dtype=torch.float32)
        self._rms_norm = kernels.fn("kvp_rms_norm")
        self._add_rms_norm = kernels.fn("kvp_add_rms_norm")
        self._add_rms_norm_bf16 = kernels.fn("kvp_add_rms_norm_bf16")
        self._silu_mul = kernels.fn("kvp_silu_mul")
        self._silu_mul_bf16 = kernels.fn("kvp_silu_mul_bf16")
        self._rope_and_cache = kernels.fn("kvp_rope_and_cache")
        self._rope_and_cache_bf16 = kernels.fn("kvp_rope_and_cache_bf16")
        self._paged_decode = kernels.fn("kvp_paged_decode")
        self._set_num_threads = kernels.fn("kvp_set_num_threads")
        self._prefill_attention = kernels.fn("kvp_prefill_attention")
        # prefill chunks over a bfloat16 cache in AMX tiles where this CPU and build run them
        self._prefill_attention_amx = (
            kernels.fn("kvp_prefill_attention_amx") if kernels.fn("kvp_amx_attention_ready")() else None
        )
        self._bf16_linear = PackedBf16Linear() if native_bf16_matmul_available() else None
        self._fused = FusedLayerStack(kernels, self.fallbacks, self._bf16_linear is not None)
        self._bf16_prompt = Bf16PromptStack(self._add_rms_norm_bf16)
        # The prefill chunks' arrays for the prefill kernel, built once per step (the metadata object
        # identifies the step; holding it keeps its id from being reused).
        self._prefill_meta: AttentionMetadata | None = None
        self._prefill_arrays: tuple[torch.Tensor, ...] = ()
        logger.info(
            "CPU kernels (%s build, %s): %s",
            kernels.isa,
            kernels.path,
            "; ".join(f"{op}: {route}" for op, route in self.paths().items()),
        )

    def paths(self) -> dict[str, str]:
        """Which code each op runs (by design; fallbacks aside)."""
        if self._blocked:
            linear = f"column-block kernel up to {BLOCKED_KERNEL_MAX_ROWS} rows, torch GEMM beyond"
        else:
            linear = f"dot-product kernel up to {SMALL_BATCH_LINEAR} rows, torch GEMM beyond"
        if self._bf16_linear is not None:
            linear += f"; packed bfloat16 above {SMALL_BATCH_LINEAR} rows at 'medium' precision"
        fused = FUSED_MAX_ROWS if self._blocked else SMALL_BATCH_LINEAR
        return {
            "linear": linear,
            "rms_norm": "kernel",
            "add_rms_norm": "kernel",
            "silu_mul": "kernel",
            "rope_and_cache": "kernel (float32, bfloat16 or float16 cache)",
            "decode_attention": "paged kernel",
            "prefill_attention": f"kernel for head_dim 64 or 128 up to {PREFILL_KERNEL_MAX_CONTEXT} positions"
            + (
                f" (AMX bfloat16 tiles over a bfloat16 cache, up to {PREFILL_AMX_MAX_CONTEXT})"
                if self._prefill_attention_amx
                else ""
            )
            + ", torch SDPA beyond",
            "decode_layers": f"one kernel call per decode-only step up to {fused} rows over float32 weights, "
            f"up to {SMALL_BATCH_LINEAR} over packed 16-bit weights"
            + (
                f" ({NATIVE_BF16_AFTER_ROWS} over bfloat16: AMX tiles or oneDNN's bf16 GEMM beyond)"
                if self._bf16_linear
                else ""
            ),
            "prompt_layers": (
                "bfloat16 between oneDNN's GEMMs in steps whose every projection is a bfloat16 weight oneDNN "
                f"takes (past {NATIVE_BF16_AFTER_ROWS} rows, and past the AMX tile kernel's), else op by op"
                if native_bf16_matmul_available()
                else "op by op (no native bfloat16 matmul on this CPU)"
            ),
        }

    def kernel_stats(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "isa": self.kernels.isa,
            "paths": self.paths(),
            "fallbacks": self.fallbacks.as_dict(),
        }

    def prepare_weights(self, model: torch.nn.Module) -> None:
        # Linear weights in column blocks for the outer-product kernel (where it has its AVX-512 tiles).
        if self._blocked:
            convert_linear_weights(model)

    def begin_step(self) -> None:
        # NOTE: OpenMP's thread count belongs to the calling thread; follow torch's on whichever
        # thread steps the engine (the server steps on its own thread).
        self._set_num_threads(n=torch.get_num_threads())

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
        return self._fused.run(layers, spec, x, cos, sin, kv_cache, meta)

    def prompt_layers(
        self,
        layers: Sequence[Any],
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._bf16_prompt.run(self, layers, x, cos, sin, kv_cache, meta)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(weight, torch.Tensor):  # a packed weight (quant_weights.py): its own kernels
            return weight.matmul(x, bias)
        rows = x.shape[0]
        bs = blocked_stride(weight)
        if (
            rows > SMALL_BATCH_LINEAR
            and self._bf16_linear is not None
            and medium_precision()
            and x.dim() == 2
            and f32(x)
            and f32(weight)
        ):
            return self._bf16_linear(x, weight, bias)
        if bs:
            return self._blocked_linear(x, weight, bs, bias)
        if weight.dtype != x.dtype:  # a 16-bit weight the packed-weight kernels do not hold (no compiler)
            return mixed_linear(x, weight, bias)
        if rows > SMALL_BATCH_LINEAR:  # row-major weights: the dot-product kernel for small batches only
            return F.linear(x, weight, bias)
        reason = "x is not 2-D" if x.dim() != 2 else unfit(x=x, weight=weight, bias=bias)
        if reason is not None:
            self.fallbacks.record("linear", reason)
            return F.linear(x, weight, bias)
        out = torch.empty((rows, weight.shape[0]), dtype=x.dtype)
        self._linear_small(x=x, w=weight, bias=bias, out=out)
        return out

    def _blocked_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bs: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., K] @ w.T (+ bias) for a weight in column blocks: the outer-product kernel up to
        BLOCKED_KERNEL_MAX_ROWS rows (or for a weight above UNBLOCK_SCRATCH_MAX_BYTES), torch's GEMM on
        a column-major copy beyond."""
        blocks, in_features, _ = weight.shape
        out_features = blocks * BLOCK
        if not (f32(x) and (bias is None or f32(bias))):
            self.fallbacks.record("linear", "x or bias is not float32 on the CPU (the blocked weight is copied back)")
            return F.linear(x, unblocked(weight), bias)
        x2 = x.reshape(-1, in_features).contiguous()
        rows, size = x2.shape[0], in_features * out_features
        if rows > BLOCKED_KERNEL_MAX_ROWS and size * 4 <= UNBLOCK_SCRATCH_MAX_BYTES:
            if self._unblock_scratch.numel() < size:
                self._unblock_scratch = torch.empty(size, dtype=torch.float32)
            scratch = self._unblock_scratch[:size]
            self._unblock(wb=weight, out=scratch)
            return F.linear(x, scratch.view(in_features, out_features).t(), bias)
        out = torch.empty((rows, out_features), dtype=torch.float32)
        bias_c = bias.contiguous() if bias is not None else None
        self._linear_b(x=x2, wb=weight, bias=bias_c, out=out)
        return out.view(*x.shape[:-1], out_features)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1:
            reason: str | None = "x is not 2-D with contiguous rows"
        else:
            reason = unfit(weight=weight) or (None if f32(x) else "x is not float32 on the CPU")
        if reason is not None:
            self.fallbacks.record("rms_norm", reason)
            return super().rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rms_norm(x=x, w=weight, out=out, eps=eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        reason = unfit(x=x, residual=residual, weight=weight)
        if reason is not None:
            self.fallbacks.record("add_rms_norm", reason)
            return super().add_rms_norm(x, residual, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._add_rms_norm(residual=residual, x=x, w=weight, out=out, eps=eps)
        return out, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        reason = unfit(gate_up=gate_up)
        if reason is not None:
            self.fallbacks.record("silu_mul", reason)
            return super().silu_mul(gate_up)
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_mul(gate_up=gate_up, out=out)
        return out

    def mlp(
        self,
        x: torch.Tensor,
        gate_up_weight: torch.Tensor,
        gate_up_bias: torch.Tensor | None,
        down_weight: torch.Tensor,
        down_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        # Where oneDNN's bf16 GEMM runs both projections (bfloat16 weights, prompt-sized batches), the
        # gate/up product stays bfloat16 into the SwiGLU kernel, whose output is the down projection's
        # bfloat16 input: the same values as widening to float32 between them (the GEMM rounds its result
        # to bfloat16, the down projection its input), without the widest tensors in float32.
        if (
            isinstance(gate_up_weight, Bf16Weight)
            and isinstance(down_weight, Bf16Weight)
            and gate_up_bias is None
            and down_bias is None
            and x.dtype == torch.float32
            and gate_up_weight.onednn_takes(x.shape[0])
            and down_weight.onednn_takes(x.shape[0])
        ):
            return self.bf16_mlp(x, gate_up_weight, down_weight).float()
        return super().mlp(x, gate_up_weight, gate_up_bias, down_weight, down_bias)

    def bf16_mlp(self, x: torch.Tensor, gate_up_weight: Bf16Weight, down_weight: Bf16Weight) -> torch.Tensor:
        """SwiGLU through oneDNN's bf16 GEMMs, bfloat16 from the gate/up product to the result (no bias)."""
        gate_up = gate_up_weight.bf16_product(x)
        act = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=torch.bfloat16)
        self._silu_mul_bf16(gate_up=gate_up, out=act)
        return down_weight.bf16_product(act)

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
        # A bfloat16 qkv (a bf16 GEMM's output: Bf16PromptStack) goes to the bfloat16 kernel, which reads it
        # as it is and writes q to a float32 tensor of its own; where that kernel does not apply, widened.
        bf16 = qkv.dtype == torch.bfloat16 and qkv.is_cpu and qkv.dim() == 2 and qkv.stride(1) == 1
        reason = unfit(qkv=None if bf16 else qkv, cos=cos, sin=sin, q_norm=q_norm, k_norm=k_norm) or kv_unfit(kv_layer)
        if reason is None and slot_mapping.dtype != torch.int64:
            reason = "slot mapping not int64"
        if qkv.dtype == torch.bfloat16 and not (bf16 and reason is None):
            qkv, bf16 = qkv.float(), False
            reason = unfit(qkv=qkv) or reason
        if reason is not None:
            self.fallbacks.record("rope_and_cache", reason)
            return super().rope_and_cache(
                qkv, cos, sin, kv_layer, slot_mapping, num_heads, num_kv_heads, q_norm, k_norm, eps
            )
        num_tokens, head_dim = qkv.shape[0], kv_layer.shape[-1]
        args = dict(
            qkv=qkv,
            num_heads=num_heads,
            cos=cos.view(num_tokens, -1),  # [T, 1, hd / 2] or [T, hd / 2]: the kernel reads T rows
            sin=sin.view(num_tokens, -1),
            q_norm=q_norm,
            k_norm=k_norm,
            eps=eps,
            k_cache=kv_layer[0],
            v_cache=kv_layer[1],
            slots=slot_mapping,
            kv_format=KV_FORMATS[kv_layer.dtype],
        )
        if bf16:
            q = torch.empty((num_tokens, num_heads * head_dim), dtype=torch.float32)
            self._rope_and_cache_bf16(**args, q_out=q)
            return q.view(num_tokens, num_heads, head_dim)
        self._rope_and_cache(**args)
        return qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype)
        dec = meta.decode
        if dec is not None:
            reason = attention_unfit(q, kv_layer)
            indices = (
                (dec.block_tables, dec.seq_lens)
                if dec.is_leading
                else (dec.block_tables, dec.seq_lens, dec.token_indices)
            )
            if reason is None and any(t.dtype != torch.int64 for t in indices):
                reason = "block tables, sequence lengths or token rows not int64"
            if reason is not None:
                self.fallbacks.record("decode_attention", reason)
                attend_decodes(q, kv_layer, meta, scale, out)
            else:
                self._paged_decode(
                    q=q,
                    out=out,
                    rows=None if dec.is_leading else dec.token_indices,
                    k_cache=kv_layer[0],
                    v_cache=kv_layer[1],
                    block_tables=dec.block_tables,
                    seq_lens=dec.seq_lens,
                    window=meta.sliding_window or 0,
                    scale=scale,
                    partition=DECODE_PARTITION,
                    kv_format=KV_FORMATS[kv_layer.dtype],
                )
        if meta.prefills and not self._kernel_prefills(q, kv_layer, meta, scale, out):
            attend_prefills(q, kv_layer, meta, scale, out)
        return out

    def _kernel_prefills(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
    ) -> bool:
        """Write the prefill rows of `out` with the prefill kernel; False (nothing written) where it
        does not apply: then torch's SDPA runs."""
        reason = attention_unfit(q, kv_layer)
        if reason is None and meta.block_tables.dtype != torch.int64:
            reason = "block tables not int64"
        if reason is not None:
            self.fallbacks.record("prefill_attention", reason)
            return False
        if self._prefill_meta is not meta:
            seqs = [i for i, n in enumerate(meta.query_lens) if n > 1]
            self._prefill_meta, self._prefill_arrays = meta, ()
            limit = PREFILL_AMX_MAX_CONTEXT if self._amx_prefill(kv_layer) is not None else PREFILL_KERNEL_MAX_CONTEXT
            if max(meta.seq_lens_list[i] for i in seqs) > limit:
                return False  # by design: torch's SDPA is faster on long contexts
            index = torch.tensor(seqs, dtype=torch.int64)
            self._prefill_arrays = (
                meta.query_start_loc.index_select(0, index),
                torch.tensor([meta.query_lens[i] for i in seqs], dtype=torch.int64),
                torch.tensor([meta.seq_lens_list[i] for i in seqs], dtype=torch.int64),
                meta.block_tables.index_select(0, index),
            )
        if not self._prefill_arrays:
            return False
        starts, query_lens, seq_lens, tables = self._prefill_arrays
        args = dict(
            q=q,
            out=out,
            token_start=starts,
            query_len=query_lens,
            seq_len=seq_lens,
            k_cache=kv_layer[0],
            v_cache=kv_layer[1],
            block_tables=tables,
            window=meta.sliding_window or 0,
            scale=scale,
            kv_format=KV_FORMATS[kv_layer.dtype],
        )
        done = False
        amx = self._amx_prefill(kv_layer)
        if amx is not None:
            done = bool(amx(**args))
        if not done:
            done = bool(self._prefill_attention(**args))
        if not done:
            self.fallbacks.record("prefill_attention", "head_dim is not 64 or 128")
        return done

    def _amx_prefill(self, kv_layer: torch.Tensor) -> Any:
        """The AMX prefill kernel where chunks over this cache go to it first (a bfloat16 cache, AMX
        here), else None."""
        return self._prefill_attention_amx if kv_layer.dtype == torch.bfloat16 else None

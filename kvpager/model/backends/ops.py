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
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvpager.core.config import KERNEL_BACKENDS
from kvpager.model.attention import AttentionMetadata, attend_decodes, attend_prefills, paged_attention, write_kv
from kvpager.model.backends.bf16_linear import PackedBf16Linear, native_bf16_matmul_available
from kvpager.model.backends.fallbacks import FallbackCounter
from kvpager.model.backends.kernels.abi import KV_FORMATS
from kvpager.model.backends.kernels.build import KernelBuildError, KernelLibrary, load_cpu_kernels
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.backends.quant_weights import NATIVE_BF16_MIN_ROWS, Bf16Weight, HalfWeight
from kvpager.model.backends.weight_layout import BLOCK, blocked_stride, convert_linear_weights, unblocked
from kvpager.model.precision import compute_dtype
from kvpager.model.rope import apply_rope
from kvpager.model.spec import ModelSpec

logger = logging.getLogger(__name__)


# Decode attention splits a sequence's context into partitions of this many positions (merged
# afterwards), so one long sequence still spreads over every thread.
DECODE_PARTITION = 256
# Linear layers over torch's row-major weights (CPUs without AVX-512, widths not divisible by 16) with at most
# this many input rows run in the dot-product kernel (each weight row read once for all rows, next
# rows prefetched); larger batches go to torch's GEMM. Measured on llama-small's weights, 2 threads:
# 1.8x torch at 4-16 rows, 1.24x at 32, 1.07x at 48, 0.87x at 64. Decode-only steps of at most this
# many rows run the whole layer stack in one kernel call.
SMALL_BATCH_LINEAR = 32
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
# Decode-only steps of at most this many rows run the whole layer stack in one kernel call when every
# weight is in column blocks (SMALL_BATCH_LINEAR otherwise). Measured, 64 sequences, fused vs per
# layer (column-major weights then): 181.5 vs 200.4 ms (SmolLM2 shape), 58.4 vs 64.5 (llama-small).
FUSED_MAX_ROWS = 64
# kvp_decode_layers' table: per layer LAYER_TABLE_ADDRESSES tensor addresses, then the block strides
# of the four weights (0 = row-major); LAYER_TABLE_WIDTH in all (kLayerTableWidth in C++).
LAYER_TABLE_ADDRESSES = 12
LAYER_TABLE_WIDTH = 16
# Prefill chunks attend in the kernel when the step's longest prefill context is at most this long,
# else in torch's SDPA. Measured, 2 threads, per layer: six prompts of 130-512 tokens (8/4 heads)
# 9.4 vs 15.3 ms, one of 512 + 4 of 512 (9/3) 12.4 vs 18.1, Llama-3-8B heads at 500 39.2 vs 56.2;
# even at 1,024-1,500 tokens, slower beyond (2,000: 42.4 vs 34.2; 8B heads at 1,024: 75.0 vs 66.4).
PREFILL_KERNEL_MAX_CONTEXT = 768


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

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, in] @ weight [out, in].T (+ bias). A packed weight (quant_weights.py) runs its own matmul."""
        if not isinstance(weight, torch.Tensor):
            return weight.matmul(x, bias)
        return _mixed_linear(x, weight, bias)

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
        self._silu_mul = kernels.fn("kvp_silu_mul")
        self._rope_and_cache = kernels.fn("kvp_rope_and_cache")
        self._paged_decode = kernels.fn("kvp_paged_decode")
        self._set_num_threads = kernels.fn("kvp_set_num_threads")
        self._decode_layers = kernels.fn("kvp_decode_layers")
        self._prefill_attention = kernels.fn("kvp_prefill_attention")
        # NOTE: the layer table holds raw addresses: keep the modules alive alongside it.
        # id(layers) -> (layers, their table or None, whether every weight in it is in column blocks,
        # the packed 16-bit weights in it)
        self._tables: dict[int, tuple[Sequence[Any], torch.Tensor | None, bool, list[HalfWeight]]] = {}
        self._bf16_linear = PackedBf16Linear() if native_bf16_matmul_available() else None
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
            "prefill_attention": f"kernel for head_dim 64 or 128 up to {PREFILL_KERNEL_MAX_CONTEXT} positions, "
            "torch SDPA beyond",
            "decode_layers": f"one kernel call per decode-only step up to {fused} rows "
            f"(float32 or 16-bit weights; {SMALL_BATCH_LINEAR} over 16-bit weights)",
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
        # A decode-only step of at most SMALL_BATCH_LINEAR rows (FUSED_MAX_ROWS when every weight is
        # in column blocks): one kernel call for all layers instead of ~9 Python calls per layer
        # (measured: the calls cost more than the math at batch 1).
        dec, rows = meta.decode, x.shape[0]
        if dec is None or meta.prefills or not dec.is_leading or rows > FUSED_MAX_ROWS:
            return None
        reason = _unfit(x=x, cos=cos, sin=sin) or _kv_unfit(kv_cache)
        if reason is None and not all(
            t.dtype == torch.int64 for t in (dec.block_tables, dec.seq_lens, meta.slot_mapping)
        ):
            reason = "block tables, sequence lengths or slot mapping not int64"
        table = self._layer_table(layers, spec.rms_norm_eps) if reason is None else None
        if reason is None and table is None and _has_packed_weights(layers):
            return None  # by design: quantized (int8, int4) weights run layer by layer
        if reason is None and table is None:
            reason = "a layer's tensors are not float32 and contiguous on the CPU, or the norms' eps differ"
        if reason is not None or table is None:
            self.fallbacks.record("decode_layers", reason or "")
            return None
        if rows > self._fused_max_rows(layers):
            return None
        packed = self._packed_linear(layers)
        if packed is None:
            return None  # by design: 16-bit weights capped at different kernel paths run layer by layer
        num_layers, _, _, _, num_kv_heads, head_dim = kv_cache.shape
        if table.shape[0] != num_layers or (num_kv_heads, head_dim, x.shape[1]) != (
            spec.num_kv_heads,
            spec.head_dim,
            spec.hidden_size,
        ):
            self.fallbacks.record("decode_layers", "KV cache or hidden size differ from the model's spec")
            return None
        hidden, inter = x.shape[1], spec.intermediate_size
        q_size, kv_size = spec.num_heads * head_dim, num_kv_heads * head_dim
        scratch = torch.empty(rows * (2 * q_size + 2 * kv_size + 3 * inter + hidden), dtype=torch.float32)
        residual = torch.empty_like(x)
        self._decode_layers(
            x=x,
            residual=residual,
            layers=table,
            num_heads=spec.num_heads,
            inter=inter,
            eps=spec.rms_norm_eps,
            kv_cache=kv_cache,
            cos=cos.view(rows, -1),
            sin=sin.view(rows, -1),
            slots=meta.slot_mapping,
            block_tables=dec.block_tables,
            seq_lens=dec.seq_lens,
            window=meta.sliding_window or 0,
            scale=head_dim**-0.5,
            partition=DECODE_PARTITION,
            scratch=scratch,
            kv_format=KV_FORMATS[kv_cache.dtype],
            packed_linear=packed[0],
            packed_level=packed[1],
        )
        return x, residual

    def _fused_max_rows(self, layers: Sequence[Any]) -> int:
        """The most rows the fused stack takes over the weights of `layers` (after `_layer_table`):
        FUSED_MAX_ROWS when every weight is in column blocks, except at "medium" precision with the
        bfloat16 linear (faster above SMALL_BATCH_LINEAR rows); NATIVE_BF16_MIN_ROWS over bfloat16
        weights where Bf16Weight.matmul hands more rows to oneDNN's bf16 GEMM (so the fused step
        computes what the per-op path does); SMALL_BATCH_LINEAR otherwise."""
        _, _, all_blocked, halves = self._tables[id(layers)]
        if all_blocked and not (self._bf16_linear is not None and _medium_precision()):
            return FUSED_MAX_ROWS
        if any(isinstance(w, Bf16Weight) for w in halves) and native_bf16_matmul_available():
            return NATIVE_BF16_MIN_ROWS
        return SMALL_BATCH_LINEAR

    def _packed_linear(self, layers: Sequence[Any]) -> tuple[int, int] | None:
        """(kvq_linear's address, the kernel path cap) for the packed 16-bit weights of `layers`
        ((0, 0) when there are none); None when their caps (PackedWeight.max_level) differ."""
        halves = self._tables[id(layers)][3]
        if not halves:
            return 0, 0
        kernels = quant_kernels_or_none()
        assert kernels is not None  # NOTE: the table holds 16-bit weights only when the library loaded
        levels = {kernels.default_level if w.max_level is None else w.max_level for w in halves}
        if len(levels) != 1:
            return None
        address = ctypes.cast(kernels.linear, ctypes.c_void_p).value
        assert address is not None
        return address, levels.pop()

    def _layer_table(self, layers: Sequence[Any], eps: float) -> torch.Tensor | None:
        """[L, 16] int64 addresses of each layer's tensors and its weights' layouts (see kvp_decode_layers);
        None when a tensor is not float32 on the CPU, contiguous or (a weight) in column blocks or a
        packed 16-bit weight, or the norms' eps differ (then the layers run one by one)."""
        key = id(layers)
        if key not in self._tables:
            built = _build_layer_table(layers, eps)
            table, halves = built if built is not None else (None, [])
            all_blocked = table is not None and bool((table[:, LAYER_TABLE_ADDRESSES:] > 0).all())
            self._tables[key] = (layers, table, all_blocked, halves)
        return self._tables[key][1]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(weight, torch.Tensor):  # a packed weight (quant_weights.py): its own kernels
            return weight.matmul(x, bias)
        rows = x.shape[0]
        bs = blocked_stride(weight)
        if (
            rows > SMALL_BATCH_LINEAR
            and self._bf16_linear is not None
            and _medium_precision()
            and x.dim() == 2
            and _f32(x)
            and _f32(weight)
        ):
            return self._bf16_linear(x, weight, bias)
        if bs:
            return self._blocked_linear(x, weight, bs, bias)
        if weight.dtype != x.dtype:  # a 16-bit weight the packed-weight kernels do not hold (no compiler)
            return _mixed_linear(x, weight, bias)
        if rows > SMALL_BATCH_LINEAR:  # row-major weights: the dot-product kernel for small batches only
            return F.linear(x, weight, bias)
        reason = "x is not 2-D" if x.dim() != 2 else _unfit(x=x, weight=weight, bias=bias)
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
        if not (_f32(x) and (bias is None or _f32(bias))):
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
            reason = _unfit(weight=weight) or (None if _f32(x) else "x is not float32 on the CPU")
        if reason is not None:
            self.fallbacks.record("rms_norm", reason)
            return super().rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rms_norm(x=x, w=weight, out=out, eps=eps)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        reason = _unfit(x=x, residual=residual, weight=weight)
        if reason is not None:
            self.fallbacks.record("add_rms_norm", reason)
            return super().add_rms_norm(x, residual, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._add_rms_norm(residual=residual, x=x, w=weight, out=out, eps=eps)
        return out, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        reason = _unfit(gate_up=gate_up)
        if reason is not None:
            self.fallbacks.record("silu_mul", reason)
            return super().silu_mul(gate_up)
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_mul(gate_up=gate_up, out=out)
        return out

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
        reason = _unfit(qkv=qkv, cos=cos, sin=sin, q_norm=q_norm, k_norm=k_norm) or _kv_unfit(kv_layer)
        if reason is None and slot_mapping.dtype != torch.int64:
            reason = "slot mapping not int64"
        if reason is not None:
            self.fallbacks.record("rope_and_cache", reason)
            return super().rope_and_cache(
                qkv, cos, sin, kv_layer, slot_mapping, num_heads, num_kv_heads, q_norm, k_norm, eps
            )
        self._rope_and_cache(
            qkv=qkv,
            num_heads=num_heads,
            cos=cos.view(qkv.shape[0], -1),  # [T, 1, hd / 2] or [T, hd / 2]: the kernel reads T rows
            sin=sin.view(qkv.shape[0], -1),
            q_norm=q_norm,
            k_norm=k_norm,
            eps=eps,
            k_cache=kv_layer[0],
            v_cache=kv_layer[1],
            slots=slot_mapping,
            kv_format=KV_FORMATS[kv_layer.dtype],
        )
        num_tokens, head_dim = qkv.shape[0], kv_layer.shape[-1]
        return qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype)
        dec = meta.decode
        if dec is not None:
            reason = _attention_unfit(q, kv_layer)
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
        reason = _attention_unfit(q, kv_layer)
        if reason is None and meta.block_tables.dtype != torch.int64:
            reason = "block tables not int64"
        if reason is not None:
            self.fallbacks.record("prefill_attention", reason)
            return False
        if self._prefill_meta is not meta:
            seqs = [i for i, n in enumerate(meta.query_lens) if n > 1]
            self._prefill_meta, self._prefill_arrays = meta, ()
            if max(meta.seq_lens_list[i] for i in seqs) > PREFILL_KERNEL_MAX_CONTEXT:
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
        done = self._prefill_attention(
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
        if not done:
            self.fallbacks.record("prefill_attention", "head_dim is not 64 or 128")
        return bool(done)


def _build_layer_table(layers: Sequence[Any], eps: float) -> tuple[torch.Tensor, list[HalfWeight]] | None:
    """The layer table and the packed 16-bit weights it points into; None: the layers run one by one."""
    rows: list[list[int]] = []
    halves: list[HalfWeight] = []
    all_eps = {layer.input_layernorm.eps for layer in layers} | {layer.post_attention_layernorm.eps for layer in layers}
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights = [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
        layouts = [_table_layout(w) for w in weights]
        if any(code is None for code in layouts):  # quantized weights (or a kind the kernels lack): layer by layer
            return None
        halves.extend(w for w in weights if isinstance(w, HalfWeight))
        # the tensors the kernels read: a packed 16-bit weight's own 16-bit tensor
        dense = [w.weight if isinstance(w, HalfWeight) else w for w in weights]
        tensors = [
            layer.input_layernorm.weight,
            dense[0],
            attn.qkv_proj.bias,
            dense[1],
            attn.o_proj.bias,
            layer.post_attention_layernorm.weight,
            dense[2],
            mlp.gate_up_proj.bias,
            dense[3],
            mlp.down_proj.bias,
            attn.q_norm.weight if attn.q_norm is not None else None,
            attn.k_norm.weight if attn.k_norm is not None else None,
        ]
        if attn.q_norm is not None:
            all_eps.add(attn.q_norm.eps)
        # float32 weights row-major or in column blocks; a packed 16-bit weight contiguous by construction
        blocked = {id(t) for t, code in zip(dense, layouts, strict=True) if code and code > 0}
        half = {id(w.weight) for w in weights if isinstance(w, HalfWeight)}
        if any(
            t is not None and id(t) not in half and not (_f32(t) and (t.is_contiguous() or id(t) in blocked))
            for t in tensors
        ):
            return None
        rows.append([t.data_ptr() if t is not None else 0 for t in tensors] + [int(code or 0) for code in layouts])
        assert len(rows[-1]) == LAYER_TABLE_WIDTH and len(tensors) == LAYER_TABLE_ADDRESSES
    if halves and quant_kernels_or_none() is None:
        return None
    return (torch.tensor(rows, dtype=torch.int64), halves) if all_eps == {eps} else None


def _table_layout(weight: Any) -> int | None:
    """A weight's layout code in the layer table: its block stride (column blocks, kvp_linear_b), 0
    (row-major float32, kvp_linear_small), -(fmt + 1) (a packed 16-bit weight, kvq_linear), None
    (anything else: the layers run one by one)."""
    if isinstance(weight, HalfWeight):
        return -(weight.fmt + 1) if weight.device.type == "cpu" else None
    if isinstance(weight, torch.Tensor):
        return blocked_stride(weight)
    return None


def _medium_precision() -> bool:
    return torch.get_float32_matmul_precision() == "medium"


def _f32(t: torch.Tensor) -> bool:
    """float32 on the CPU: what the kernels read and write through raw pointers."""
    return t.dtype == torch.float32 and t.device.type == "cpu"


def _kv_ok(t: torch.Tensor) -> bool:
    """A KV cache the kernels read and write: float32, bfloat16 or float16 on the CPU."""
    return t.dtype in KV_FORMATS and t.device.type == "cpu"


def _mixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) in x's dtype, a weight of another dtype widened per call (the reference
    for 16-bit weights under float32 activations; the kernels read them without the copy)."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x, weight.to(x.dtype), bias.to(x.dtype) if bias is not None else None)


def _has_packed_weights(layers: Sequence[Any]) -> bool:
    """Whether a layer holds a quantized weight (the fused stack reads float32 and 16-bit weights)."""
    return any(
        not isinstance(w, torch.Tensor | HalfWeight)
        for layer in layers
        for w in (
            layer.self_attn.qkv_proj.weight,
            layer.self_attn.o_proj.weight,
            layer.mlp.gate_up_proj.weight,
            layer.mlp.down_proj.weight,
        )
    )


def _unfit(**tensors: torch.Tensor | None) -> str | None:
    """None when every given tensor is float32, on the CPU and contiguous, else the first reason."""
    for name, t in tensors.items():
        if t is None:
            continue
        if not _f32(t):
            return f"{name} is not float32 on the CPU"
        if not t.is_contiguous():
            return f"{name} is not contiguous"
    return None


def _kv_unfit(kv: torch.Tensor) -> str | None:
    if not _kv_ok(kv):
        return "KV cache is not float32, bfloat16 or float16 on the CPU"
    return None if kv.is_contiguous() else "KV cache is not contiguous"


def _attention_unfit(q: torch.Tensor, kv_layer: torch.Tensor) -> str | None:
    """None for q [T, H, hd] and a KV layer the attention kernels read: float32 q with contiguous
    heads (rows may be strided), a contiguous float32, bfloat16 or float16 cache, on the CPU."""
    if not _f32(q):
        return "q is not float32 on the CPU"
    if q.stride(2) != 1 or q.stride(1) != q.shape[2]:
        return "q heads are not contiguous"
    return _kv_unfit(kv_layer)


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

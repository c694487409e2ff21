"""The per-layer operations of the decoder, behind one interface with two implementations.

`TorchOps` is the reference: plain torch, any device and dtype. `CpuKernelOps` runs the same math
in kvpager's C++ kernels (kvpager/model/backends/kernels/*.cpp) for float32 on CPU: RMSNorm and residual-add
fused, SiLU·up fused, RoPE and the K/V cache write fused, decode and prefill attention that read
K/V blocks in place instead of gathering every sequence's context into a padded tensor (prefill
beyond PREFILL_KERNEL_MAX_CONTEXT in torch's SDPA), linear layers over weights it stores in column
blocks at load (`prepare_weights`, kvpager.model.backends.weight_layout); a decode-only step of at most
FUSED_MAX_ROWS rows runs every layer in one kernel call. Tests hold the two to each other and to transformers.

`select_ops(backend, dtype, kv_dtype, device)` picks one: "torch", "cpu" (kernels, error if they cannot be
built) or "auto" (kernels for a float32 model with a float32 or bfloat16 KV cache on CPU when a compiler is available,
torch otherwise).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvpager.core.config import KERNEL_BACKENDS
from kvpager.model.attention import AttentionMetadata, attend_decodes, attend_prefills, paged_attention, write_kv
from kvpager.model.backends.bf16_linear import PackedBf16Linear, native_bf16_matmul_available
from kvpager.model.backends.kernels.build import KernelBuildError, KernelLibrary, load_cpu_kernels
from kvpager.model.backends.weight_layout import BLOCK, blocked_stride, convert_linear_weights, unblocked
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
        """x [T, in] @ weight [out, in].T (+ bias)."""
        return F.linear(x, weight, bias)

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
    """The C++ kernels; float32 CPU tensors only (select_ops guarantees it)."""

    name = "cpu"

    def __init__(self, kernels: KernelLibrary) -> None:
        self.kernels = kernels
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
        # id(layers) -> (layers, their table or None, whether every weight in it is in column blocks)
        self._tables: dict[int, tuple[Sequence[Any], torch.Tensor | None, bool]] = {}
        self._bf16_linear = PackedBf16Linear() if native_bf16_matmul_available() else None
        # The prefill chunks' arrays for the prefill kernel, built once per step (the metadata object
        # identifies the step; holding it keeps its id from being reused).
        self._prefill_meta: AttentionMetadata | None = None
        self._prefill_arrays: tuple[torch.Tensor, ...] = ()

    def prepare_weights(self, model: torch.nn.Module) -> None:
        # Linear weights in column blocks for the outer-product kernel (where it has its AVX-512 tiles).
        if self._blocked:
            convert_linear_weights(model)

    def begin_step(self) -> None:
        # NOTE: OpenMP's thread count belongs to the calling thread; follow torch's on whichever
        # thread steps the engine (the server steps on its own thread).
        self._set_num_threads(torch.get_num_threads())

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
        # in column blocks): one kernel call for all layers instead of ~9 Python/ctypes calls per
        # layer (measured: the calls cost more than the math at batch 1).
        dec, rows = meta.decode, x.shape[0]
        if (
            dec is None
            or meta.prefills
            or not dec.is_leading
            or rows > FUSED_MAX_ROWS
            or not (_f32(x) and _f32(cos) and _f32(sin) and _kv_ok(kv_cache))
            or not (x.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and kv_cache.is_contiguous())
            or dec.block_tables.dtype != torch.int64
            or meta.slot_mapping.dtype != torch.int64
        ):
            return None
        table = self._layer_table(layers, spec.rms_norm_eps)
        num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        # NOTE: the kernel trusts these shapes with raw pointers: refuse anything inconsistent.
        if (
            table is None
            or rows > self._fused_max_rows(layers)
            or table.shape[0] != num_layers
            or (num_kv_heads, head_dim, x.shape[1]) != (spec.num_kv_heads, spec.head_dim, spec.hidden_size)
        ):
            return None
        hidden, inter = x.shape[1], spec.intermediate_size
        q_size, kv_size = spec.num_heads * head_dim, num_kv_heads * head_dim
        scratch = torch.empty(rows * (2 * q_size + 2 * kv_size + 3 * inter + hidden), dtype=torch.float32)
        residual = torch.empty_like(x)
        self._decode_layers(
            x.data_ptr(),
            residual.data_ptr(),
            rows,
            hidden,
            num_layers,
            table.data_ptr(),
            spec.num_heads,
            num_kv_heads,
            head_dim,
            inter,
            spec.rms_norm_eps,
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            cos.data_ptr(),
            sin.data_ptr(),
            meta.slot_mapping.data_ptr(),
            dec.block_tables.data_ptr(),
            dec.block_tables.shape[1],
            dec.seq_lens.data_ptr(),
            meta.sliding_window or 0,
            head_dim**-0.5,
            DECODE_PARTITION,
            scratch.data_ptr(),
            _bf16(kv_cache),
        )
        return x, residual

    def _fused_max_rows(self, layers: Sequence[Any]) -> int:
        """The most rows the fused stack takes over the weights of `layers` (after `_layer_table`):
        FUSED_MAX_ROWS when every weight is in column blocks, except at "medium" precision with the
        bfloat16 linear (faster above SMALL_BATCH_LINEAR rows); SMALL_BATCH_LINEAR otherwise."""
        if self._tables[id(layers)][2] and not (self._bf16_linear is not None and _medium_precision()):
            return FUSED_MAX_ROWS
        return SMALL_BATCH_LINEAR

    def _layer_table(self, layers: Sequence[Any], eps: float) -> torch.Tensor | None:
        """[L, 16] int64 addresses of each layer's tensors and its weights' layouts (see kvp_decode_layers);
        None when a tensor is not float32 on the CPU, contiguous or (a weight) in column blocks, or the
        norms' eps differ (then the layers run one by one)."""
        key = id(layers)
        if key not in self._tables:
            table = _build_layer_table(layers, eps)
            all_blocked = table is not None and bool((table[:, LAYER_TABLE_ADDRESSES:] > 0).all())
            self._tables[key] = (layers, table, all_blocked)
        return self._tables[key][1]

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
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
        # row-major weights: the dot-product kernel for small batches, else torch
        if (
            rows > SMALL_BATCH_LINEAR
            or x.dim() != 2
            or not (x.is_contiguous() and weight.is_contiguous() and (bias is None or bias.is_contiguous()))
            or not (_f32(x) and _f32(weight) and (bias is None or _f32(bias)))
        ):
            return F.linear(x, weight, bias)
        out_features, in_features = weight.shape
        out = torch.empty((rows, out_features), dtype=x.dtype)
        b = bias.data_ptr() if bias is not None else None
        self._linear_small(x.data_ptr(), rows, in_features, weight.data_ptr(), out_features, b, out.data_ptr())
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
            return F.linear(x, unblocked(weight), bias)
        x2 = x.reshape(-1, in_features).contiguous()
        rows, size = x2.shape[0], in_features * out_features
        if rows > BLOCKED_KERNEL_MAX_ROWS and size * 4 <= UNBLOCK_SCRATCH_MAX_BYTES:
            if self._unblock_scratch.numel() < size:
                self._unblock_scratch = torch.empty(size, dtype=torch.float32)
            scratch = self._unblock_scratch[:size]
            self._unblock(weight.data_ptr(), bs, out_features, in_features, scratch.data_ptr())
            return F.linear(x, scratch.view(in_features, out_features).t(), bias)
        out = torch.empty((rows, out_features), dtype=torch.float32)
        bias_c = bias.contiguous() if bias is not None else None  # NOTE: held while the kernel reads it
        b = bias_c.data_ptr() if bias_c is not None else None
        self._linear_b(x2.data_ptr(), rows, in_features, weight.data_ptr(), bs, out_features, b, out.data_ptr())
        return out.view(*x.shape[:-1], out_features)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1 or not (_f32(x) and _f32(weight)):
            return super().rms_norm(x, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rms_norm(
            x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.shape[1], x.shape[0], x.shape[1], eps
        )
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (_f32(x) and _f32(residual) and _f32(weight) and x.is_contiguous() and residual.is_contiguous()):
            return super().add_rms_norm(x, residual, weight, eps)
        out = torch.empty(x.shape, dtype=x.dtype)
        rows, dim = residual.shape
        self._add_rms_norm(residual.data_ptr(), x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, eps)
        return out, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not (_f32(gate_up) and gate_up.is_contiguous()):
            return super().silu_mul(gate_up)
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
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
        if not (
            _f32(qkv)
            and _f32(cos)
            and _f32(sin)
            and _kv_ok(kv_layer)
            and (q_norm is None or _f32(q_norm))
            and (k_norm is None or _f32(k_norm))
            and slot_mapping.dtype == torch.int64
            and qkv.is_contiguous()
            and cos.is_contiguous()
            and sin.is_contiguous()
            and kv_layer.is_contiguous()
        ):
            return super().rope_and_cache(
                qkv, cos, sin, kv_layer, slot_mapping, num_heads, num_kv_heads, q_norm, k_norm, eps
            )
        num_tokens = qkv.shape[0]
        head_dim = kv_layer.shape[-1]
        self._rope_and_cache(
            qkv.data_ptr(),
            qkv.stride(0),
            num_tokens,
            num_heads,
            num_kv_heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            q_norm.data_ptr() if q_norm is not None else None,
            k_norm.data_ptr() if k_norm is not None else None,
            eps,
            kv_layer[0].data_ptr(),
            kv_layer[1].data_ptr(),
            slot_mapping.data_ptr(),
            _bf16(kv_layer),
        )
        return qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)

    def attention(self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        _, num_heads, head_dim = q.shape
        out = torch.empty(q.shape, dtype=q.dtype)
        dec = meta.decode
        if dec is not None:
            if (
                not _kernel_reads(q, kv_layer)
                or dec.block_tables.dtype != torch.int64
                or dec.seq_lens.dtype != torch.int64
            ):
                attend_decodes(q, kv_layer, meta, scale, out)
            else:
                _, _, block_size, num_kv_heads, _ = kv_layer.shape
                self._paged_decode(
                    q.data_ptr(),
                    q.stride(0),
                    out.data_ptr(),
                    num_heads * head_dim,
                    None if dec.is_leading else dec.token_indices.data_ptr(),
                    dec.seq_lens.shape[0],
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    kv_layer[0].data_ptr(),
                    kv_layer[1].data_ptr(),
                    block_size,
                    dec.block_tables.data_ptr(),
                    dec.block_tables.shape[1],
                    dec.seq_lens.data_ptr(),
                    meta.sliding_window or 0,
                    scale,
                    DECODE_PARTITION,
                    _bf16(kv_layer),
                )
        if meta.prefills and not self._kernel_prefills(q, kv_layer, meta, scale, out):
            attend_prefills(q, kv_layer, meta, scale, out)
        return out

    def _kernel_prefills(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
    ) -> bool:
        """Write the prefill rows of `out` with the prefill kernel; False (nothing written) where it
        does not apply: then torch's SDPA runs."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        if not _kernel_reads(q, kv_layer) or meta.block_tables.dtype != torch.int64:
            return False
        if self._prefill_meta is not meta:
            seqs = [i for i, n in enumerate(meta.query_lens) if n > 1]
            self._prefill_meta, self._prefill_arrays = meta, ()
            if max(meta.seq_lens_list[i] for i in seqs) > PREFILL_KERNEL_MAX_CONTEXT:
                return False
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
        _, _, block_size, num_kv_heads, _ = kv_layer.shape
        done = self._prefill_attention(
            q.data_ptr(),
            q.stride(0),
            out.data_ptr(),
            num_heads * head_dim,
            starts.shape[0],
            starts.data_ptr(),
            query_lens.data_ptr(),
            seq_lens.data_ptr(),
            num_heads,
            num_kv_heads,
            head_dim,
            kv_layer[0].data_ptr(),
            kv_layer[1].data_ptr(),
            block_size,
            tables.data_ptr(),
            tables.shape[1],
            meta.sliding_window or 0,
            scale,
            _bf16(kv_layer),
        )
        return bool(done)


def _build_layer_table(layers: Sequence[Any], eps: float) -> torch.Tensor | None:
    rows: list[list[int]] = []
    all_eps = {layer.input_layernorm.eps for layer in layers} | {layer.post_attention_layernorm.eps for layer in layers}
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        tensors = [
            layer.input_layernorm.weight,
            attn.qkv_proj.weight,
            attn.qkv_proj.bias,
            attn.o_proj.weight,
            attn.o_proj.bias,
            layer.post_attention_layernorm.weight,
            mlp.gate_up_proj.weight,
            mlp.gate_up_proj.bias,
            mlp.down_proj.weight,
            mlp.down_proj.bias,
            attn.q_norm.weight if attn.q_norm is not None else None,
            attn.k_norm.weight if attn.k_norm is not None else None,
        ]
        if attn.q_norm is not None:
            all_eps.add(attn.q_norm.eps)
        weights = (attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight)
        # each weight row-major (0: kvp_linear_small) or in column blocks (its block stride: kvp_linear_b)
        strides = [blocked_stride(w) for w in weights]
        blocked = {id(w) for w, bs in zip(weights, strides, strict=True) if bs}
        if any(t is not None and not (_f32(t) and (t.is_contiguous() or id(t) in blocked)) for t in tensors):
            return None
        rows.append([t.data_ptr() if t is not None else 0 for t in tensors] + strides)
        assert len(rows[-1]) == LAYER_TABLE_WIDTH and len(tensors) == LAYER_TABLE_ADDRESSES
    return torch.tensor(rows, dtype=torch.int64) if all_eps == {eps} else None


def _medium_precision() -> bool:
    return torch.get_float32_matmul_precision() == "medium"


def _f32(t: torch.Tensor) -> bool:
    """float32 on the CPU: what the kernels read and write through raw pointers."""
    return t.dtype == torch.float32 and t.device.type == "cpu"


def _kv_ok(t: torch.Tensor) -> bool:
    """A KV cache the kernels read and write: float32 or bfloat16 on the CPU."""
    return t.dtype in (torch.float32, torch.bfloat16) and t.device.type == "cpu"


def _kernel_reads(q: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """q [T, H, hd] and a KV layer the attention kernels read through raw pointers: float32 q with
    contiguous heads (rows may be strided), a contiguous float32 or bfloat16 cache, on the CPU."""
    return _f32(q) and _kv_ok(kv_layer) and q.stride(2) == 1 and q.stride(1) == q.shape[2] and kv_layer.is_contiguous()


def _bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def select_ops(backend: str, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device) -> TorchOps:
    """The ops for `backend` ("auto", "torch", "cpu"), the model's dtype, the KV cache's dtype and the device."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return TorchOps()
    fits = device.type == "cpu" and dtype == torch.float32 and kv_dtype in (torch.float32, torch.bfloat16)
    if not fits:
        if backend == "cpu":
            raise ValueError(
                "kernel_backend 'cpu' runs float32 models with a float32 or bfloat16 KV cache on the CPU only, "
                "got dtype "
                f"{dtype}, KV cache {kv_dtype} on {device}; use 'auto' or 'torch'"
            )
        return TorchOps()
    try:
        return CpuKernelOps(load_cpu_kernels())
    except KernelBuildError as exc:
        if backend == "cpu":
            raise
        logger.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return TorchOps()

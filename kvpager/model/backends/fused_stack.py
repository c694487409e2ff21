"""The fused decode stack: a decode-only step of a few rows runs every decoder layer in one kernel call
(kvp_decode_layers, kernels/layers.cpp), the same kernels in the same order as the per-op path
(cpu_ops.py) without ~9 Python calls per layer (they cost more than the math at batch 1).

The kernel reads each layer's tensors through a table of raw addresses (`build_layer_table`): float32
weights row-major or in column blocks, and packed 16-bit weights (Bf16Weight / F16Weight), whose
multiplies call the packed-weight library's kvq_linear, the kernel their per-op matmul calls.
Quantized (int8, int4) weights run layer by layer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from kvpager.model.attention import AttentionMetadata
from kvpager.model.backends.bf16_linear import native_bf16_matmul_available
from kvpager.model.backends.fallbacks import FallbackCounter
from kvpager.model.backends.kernel_checks import (
    DECODE_PARTITION,
    SMALL_BATCH_LINEAR,
    f32,
    kv_unfit,
    medium_precision,
    unfit,
)
from kvpager.model.backends.kernels.abi import KV_FORMATS
from kvpager.model.backends.kernels.build import KernelLibrary
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.backends.quant_weights import NATIVE_BF16_MIN_ROWS, Bf16Weight, HalfWeight
from kvpager.model.backends.weight_layout import blocked_stride
from kvpager.model.spec import ModelSpec

# Decode-only steps of at most this many rows run the whole layer stack in one kernel call when every
# weight is in column blocks (SMALL_BATCH_LINEAR otherwise). Measured, 64 sequences, fused vs per
# layer (column-major weights then): 181.5 vs 200.4 ms (SmolLM2 shape), 58.4 vs 64.5 (llama-small).
FUSED_MAX_ROWS = 64
# kvp_decode_layers' table: per layer LAYER_TABLE_ADDRESSES tensor addresses, then the layouts of the
# four weights (`table_layout`); LAYER_TABLE_WIDTH in all (kLayerTableWidth in C++).
LAYER_TABLE_ADDRESSES = 12
LAYER_TABLE_WIDTH = 16


class FusedLayerStack:
    """kvp_decode_layers over the layers it is given, their tables built once (per `layers` object).

    `bf16_linear`: CpuKernelOps holds the packed bfloat16 linear for "medium" precision (then blocked
    weights take at most SMALL_BATCH_LINEAR rows here)."""

    def __init__(self, kernels: KernelLibrary, fallbacks: FallbackCounter, bf16_linear: bool) -> None:
        self._decode_layers = kernels.fn("kvp_decode_layers")
        self.fallbacks = fallbacks
        self._bf16_linear = bf16_linear
        # NOTE: the layer table holds raw addresses: keep the modules alive alongside it.
        # id(layers) -> (layers, their table or None, whether every weight in it is in column blocks,
        # the packed 16-bit weights in it)
        self._tables: dict[int, tuple[Sequence[Any], torch.Tensor | None, bool, list[HalfWeight]]] = {}

    def run(
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
        reason = unfit(x=x, cos=cos, sin=sin) or kv_unfit(kv_cache)
        if reason is None and not all(
            t.dtype == torch.int64 for t in (dec.block_tables, dec.seq_lens, meta.slot_mapping)
        ):
            reason = "block tables, sequence lengths or slot mapping not int64"
        table = self._layer_table(layers, spec.rms_norm_eps) if reason is None else None
        if reason is None and table is None and has_quantized_weights(layers):
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
        if all_blocked and not (self._bf16_linear and medium_precision()):
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
            built = build_layer_table(layers, eps)
            table, halves = built if built is not None else (None, [])
            all_blocked = table is not None and bool((table[:, LAYER_TABLE_ADDRESSES:] > 0).all())
            self._tables[key] = (layers, table, all_blocked, halves)
        return self._tables[key][1]


def build_layer_table(layers: Sequence[Any], eps: float) -> tuple[torch.Tensor, list[HalfWeight]] | None:
    """The layer table and the packed 16-bit weights it points into; None: the layers run one by one."""
    rows: list[list[int]] = []
    halves: list[HalfWeight] = []
    all_eps = {layer.input_layernorm.eps for layer in layers} | {layer.post_attention_layernorm.eps for layer in layers}
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights = [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
        layouts = [table_layout(w) for w in weights]
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
            t is not None and id(t) not in half and not (f32(t) and (t.is_contiguous() or id(t) in blocked))
            for t in tensors
        ):
            return None
        rows.append([t.data_ptr() if t is not None else 0 for t in tensors] + [int(code or 0) for code in layouts])
        assert len(rows[-1]) == LAYER_TABLE_WIDTH and len(tensors) == LAYER_TABLE_ADDRESSES
    if halves and quant_kernels_or_none() is None:
        return None
    return (torch.tensor(rows, dtype=torch.int64), halves) if all_eps == {eps} else None


def table_layout(weight: Any) -> int | None:
    """A weight's layout code in the layer table: its block stride (column blocks, kvp_linear_b), 0
    (row-major float32, kvp_linear_small), -(fmt + 1) (a packed 16-bit weight, kvq_linear), None
    (anything else: the layers run one by one)."""
    if isinstance(weight, HalfWeight):
        return -(weight.fmt + 1) if weight.device.type == "cpu" else None
    if isinstance(weight, torch.Tensor):
        return blocked_stride(weight)
    return None


def has_quantized_weights(layers: Sequence[Any]) -> bool:
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

"""The fused decode stack: a decode-only step of a few rows runs every decoder layer in one kernel call
(kvp_decode_layers, kernels/layers.cpp), the same kernels in the same order as the per-op path
(cpu_ops.py) without ~9 Python calls per layer (they cost more than the math at batch 1).

The kernel reads each layer's tensors through a table of raw addresses (`build_layer_table`): float32
weights row-major or in column blocks, packed 16-bit weights (Bf16Weight / F16Weight), whose
multiplies call the packed-weight library's kvq_linear, and int8 / int4 weights with int8 activations
(Int8DotWeight / Int4DotWeight: w8a8_int8, w4a8_int8, GGUF files with --gguf-int8-activations), whose
multiplies call its kvq_dot_linear, and exact int8 / int4 weights (Int8Weight / Int4Weight:
`--quantization int8|int4`, GGUF files without --gguf-int8-activations), whose multiplies of these few
rows call kvq_linear: in each case the kernel their per-op matmul calls. A GGUF projection whose row
parts differ in format (gguf_packed.RowStack: a Q4_K_M file's q/k at 4 bits, v at 6) runs there too,
one call per part into its columns. Other weights (exact GGUF Q5_K: int8 codes with a Python offset
term) run layer by layer.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
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
from kvpager.model.backends.kernels.abi import (
    KV_FORMATS,
    MAX_PARTS,
    PART_DOT,
    PART_PACKED,
    PART_WIDTH,
    PARTS_LAYOUT,
    decode_layers_scratch,
)
from kvpager.model.backends.kernels.build import KernelLibrary
from kvpager.model.backends.quant_dot import Int4DotWeight, Int8DotWeight
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.backends.quant_weights import (
    NATIVE_BF16_AFTER_ROWS,
    Bf16Weight,
    HalfWeight,
    Int4Weight,
    Int8Weight,
    PackedWeight,
)
from kvpager.model.backends.weight_layout import blocked_stride
from kvpager.model.gguf_packed import RowStack
from kvpager.model.spec import ModelSpec

# Decode-only steps of at most this many rows run the whole layer stack in one kernel call when every
# weight is in column blocks (SMALL_BATCH_LINEAR otherwise). Measured, 64 sequences, fused vs per
# layer (column-major weights then): 181.5 vs 200.4 ms (SmolLM2 shape), 58.4 vs 64.5 (llama-small).
FUSED_MAX_ROWS = 64
# kvp_decode_layers' table: per layer LAYER_TABLE_ADDRESSES tensor addresses, then the layouts of the
# four weights (`table_layout`); LAYER_TABLE_WIDTH in all (kLayerTableWidth in C++).
LAYER_TABLE_ADDRESSES = 12
LAYER_TABLE_WIDTH = 16
DotWeight = Int8DotWeight | Int4DotWeight
ExactWeight = Int8Weight | Int4Weight  # (not DotWeight: checked first)


class FusedLayerStack:
    """kvp_decode_layers over the layers it is given, their tables built once (per `layers` object).

    `bf16_linear`: CpuKernelOps holds the packed bfloat16 linear for "medium" precision (then blocked
    weights take at most SMALL_BATCH_LINEAR rows here)."""

    def __init__(self, kernels: KernelLibrary, fallbacks: FallbackCounter, bf16_linear: bool) -> None:
        self._decode_layers = kernels.fn("kvp_decode_layers")
        self.fallbacks = fallbacks
        self._bf16_linear = bf16_linear
        # NOTE: the layer tables hold raw addresses: keep the modules alive alongside them.
        # id(layers) -> (layers, their LayerTable or None)
        self._tables: dict[int, tuple[Sequence[Any], LayerTable | None]] = {}

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
        built = self._layer_table(layers, spec.rms_norm_eps) if reason is None else None
        table = built.table if built is not None else None
        if reason is None and table is None and has_quantized_weights(layers):
            return None  # by design: quantized weights weight_parts does not take run layer by layer
        if reason is None and table is None:
            reason = "a layer's tensors are not float32 and contiguous on the CPU, or the norms' eps differ"
        if reason is not None or table is None:
            self.fallbacks.record("decode_layers", reason or "")
            return None
        assert built is not None
        if rows > self._fused_max_rows(built):
            return None
        packed = self._packed_linear(built)
        dot = self._dot_linear(built, rows)
        if packed is None or dot is None:
            # by design: weights capped at different kernel paths, or int8-activation weights that send
            # this many rows to their exact path, run layer by layer
            return None
        num_layers, _, _, _, num_kv_heads, head_dim = kv_cache.shape
        if table.shape[0] != num_layers or (num_kv_heads, head_dim, x.shape[1]) != (
            spec.num_kv_heads,
            spec.head_dim,
            spec.hidden_size,
        ):
            self.fallbacks.record("decode_layers", "KV cache or hidden size differ from the model's spec")
            return None
        hidden, inter = x.shape[1], spec.intermediate_size
        sizes = {"M": rows, "H": hidden, "inter": inter, "num_heads": spec.num_heads}
        sizes |= {"num_kv_heads": num_kv_heads, "head_dim": head_dim}
        scratch = torch.empty(decode_layers_scratch(sizes), dtype=torch.float32)
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
            dot_linear=dot[0],
            dot_level=dot[1],
            weight_parts=built.weight_parts,
        )
        return x, residual

    def _fused_max_rows(self, built: LayerTable) -> int:
        """The most rows the fused stack takes over the weights of a layer table: FUSED_MAX_ROWS when
        every weight is in column blocks, except at "medium" precision with the bfloat16 linear (faster
        above SMALL_BATCH_LINEAR rows), or an int8-activation weight (whose own row limit `_dot_linear`
        applies); NATIVE_BF16_AFTER_ROWS over bfloat16 weights where Bf16Weight.matmul hands more rows to
        oneDNN's bf16 GEMM (so the fused step computes what the per-op path does); SMALL_BATCH_LINEAR
        otherwise."""
        halves = built.halves
        if built.all_dot:
            return FUSED_MAX_ROWS
        if built.all_blocked and not (self._bf16_linear and medium_precision()):
            return FUSED_MAX_ROWS
        if any(isinstance(w, Bf16Weight) for w in halves) and native_bf16_matmul_available():
            return NATIVE_BF16_AFTER_ROWS
        return SMALL_BATCH_LINEAR

    def _packed_linear(self, built: LayerTable) -> tuple[int, int] | None:
        """(kvq_linear's address, the kernel path cap) for the packed 16-bit weights and exact int8 / int4
        parts of a layer table ((0, 0) when there are none); None when their caps (PackedWeight.max_level)
        differ."""
        packed: list[PackedWeight] = [*built.halves, *built.exact]
        if not packed:
            return 0, 0
        kernels = quant_kernels_or_none()
        assert kernels is not None  # NOTE: the table holds such weights only when the library loaded
        levels = {kernels.default_level if w.max_level is None else w.max_level for w in packed}
        if len(levels) != 1:
            return None
        address = ctypes.cast(kernels.linear, ctypes.c_void_p).value
        assert address is not None
        return address, levels.pop()

    def _dot_linear(self, built: LayerTable, rows: int) -> tuple[int, int] | None:
        """(kvq_dot_linear's address, the kernel path cap) for the int8-activation weights of a layer
        table ((0, 0) when there are none); None when their caps differ or `rows` is more than one of
        them sends to the integer dot (its matmul would take its exact path: dot_rows)."""
        dots = built.dots
        if not dots:
            return 0, 0
        kernels = quant_kernels_or_none()
        assert kernels is not None  # NOTE: the table holds such weights only when the library loaded
        levels = {kernels.default_level if w.max_level is None else w.max_level for w in dots}
        if len(levels) != 1:
            return None
        # one weight per (method, cap) asks: dot_rows depends on nothing else (a ctypes call each)
        limits = {w.dot_rows(kernels) for w in {(w.method, w.max_level): w for w in dots}.values()}
        if any(limit is not None and rows > limit for limit in limits):
            return None
        address = ctypes.cast(kernels.dot_linear, ctypes.c_void_p).value
        assert address is not None
        return address, levels.pop()

    def _layer_table(self, layers: Sequence[Any], eps: float) -> LayerTable | None:
        """The layers' table (built once): see build_layer_table; None: the layers run one by one."""
        key = id(layers)
        if key not in self._tables:
            self._tables[key] = (layers, build_layer_table(layers, eps))
        return self._tables[key][1]


@dataclass(frozen=True)
class LayerTable:
    """kvp_decode_layers' tables for a stack of layers and the packed weights they point into.

    `table` [L, 16] int64: each layer's tensor addresses and its four weights' layout codes;
    `weight_parts` [L, 4, MAX_PARTS, PART_WIDTH] int64: per quantized weight (PARTS_LAYOUT), its row
    parts (`_part_rows`); zeros for the others."""

    table: torch.Tensor
    weight_parts: torch.Tensor
    halves: list[HalfWeight]
    dots: list[DotWeight]  # int8-activation parts (kvq_dot_linear)
    exact: list[ExactWeight]  # exact int8 / int4 parts (kvq_linear)
    all_blocked: bool  # every weight in column blocks
    all_dot: bool  # every weight's parts int8-activation ones


def build_layer_table(layers: Sequence[Any], eps: float) -> LayerTable | None:
    """The layer tables; None when a tensor is not float32 on the CPU, contiguous or (a weight) in
    column blocks, a packed 16-bit weight or a quantized weight `weight_parts` accepts, or the norms'
    eps differ (then the layers run one by one)."""
    rows: list[list[int]] = []
    part_rows: list[list[list[list[int]]]] = []
    halves: list[HalfWeight] = []
    dots: list[DotWeight] = []
    exact: list[ExactWeight] = []
    all_dot = True
    all_eps = {layer.input_layernorm.eps for layer in layers} | {layer.post_attention_layernorm.eps for layer in layers}
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights = [attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight]
        layouts = [table_layout(w) for w in weights]
        if any(code is None for code in layouts):  # quantized weights (or a kind the kernels lack): layer by layer
            return None
        halves.extend(w for w in weights if isinstance(w, HalfWeight))
        parts = [weight_parts(w) or [] for w in weights]
        dots.extend(p for w in parts for p in w if isinstance(p, DotWeight))
        exact.extend(p for w in parts for p in w if not isinstance(p, DotWeight))
        all_dot = all_dot and all(w and all(isinstance(p, DotWeight) for p in w) for w in parts)
        # the tensors the kernels read: a packed 16-bit weight's own 16-bit tensor, a quantized weight's
        # (first part's) codes (its parts, with their scales and offsets, go to weight_parts)
        dense = [_read_tensor(w) for w in weights]
        part_rows.append([_part_rows(w) for w in parts])
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
        # float32 weights row-major or in column blocks; packed and quantized weights contiguous by construction
        blocked = {id(t) for t, code in zip(dense, layouts, strict=True) if code and code > 0}
        packed = {id(t) for w, t in zip(weights, dense, strict=True) if isinstance(w, HalfWeight) or weight_parts(w)}
        if any(
            t is not None and id(t) not in packed and not (f32(t) and (t.is_contiguous() or id(t) in blocked))
            for t in tensors
        ):
            return None
        rows.append([t.data_ptr() if t is not None else 0 for t in tensors] + [int(code or 0) for code in layouts])
        assert len(rows[-1]) == LAYER_TABLE_WIDTH and len(tensors) == LAYER_TABLE_ADDRESSES
    if (halves or dots or exact) and quant_kernels_or_none() is None:
        return None
    if all_eps != {eps}:
        return None
    table, parts_table = torch.tensor(rows, dtype=torch.int64), torch.tensor(part_rows, dtype=torch.int64)
    all_blocked = bool((table[:, LAYER_TABLE_ADDRESSES:] > 0).all())
    return LayerTable(table, parts_table, halves, dots, exact, all_blocked, all_dot)


def weight_parts(weight: Any) -> list[DotWeight | ExactWeight] | None:
    """The quantized weights a weight multiplies with, in row order: itself (an int8-activation or exact
    int8 / int4 weight), or a RowStack's parts when every one is such a weight (at most MAX_PARTS);
    None otherwise (other weights, or a tensor)."""
    if isinstance(weight, DotWeight | ExactWeight):
        return [weight]
    if isinstance(weight, RowStack) and len(weight.parts) <= MAX_PARTS:
        parts = [p for p in weight.parts if isinstance(p, DotWeight | ExactWeight)]
        return parts if len(parts) == len(weight.parts) else None
    return None


def _read_tensor(weight: Any) -> Any:
    """The tensor of a weight that the kernels read through the layer table."""
    if isinstance(weight, HalfWeight):
        return weight.weight
    parts = weight_parts(weight)
    if parts is not None:
        return parts[0].tensors()[0]  # the codes (int8 values, or int4 pairs in their stored layout)
    return weight


def _part_rows(parts: list[DotWeight | ExactWeight]) -> list[list[int]]:
    """weight_parts' entries for a weight's parts (MAX_PARTS rows of PART_WIDTH): (kind, codes, scales,
    offsets or 0, kernel format value, group, rows, 0) each, what its own matmul hands its kernel;
    zeros after the last part."""
    entries = [[0] * PART_WIDTH for _ in range(MAX_PARTS)]
    for i, part in enumerate(parts):
        codes, scales, offsets = part._pointers()
        assert scales is not None
        kind = PART_DOT if isinstance(part, DotWeight) else PART_PACKED
        entries[i] = [kind, codes, scales, offsets or 0, part.kernel_fmt(), part.group_size, part.out_features, 0]
    return entries


def table_layout(weight: Any) -> int | None:
    """A weight's layout code in the layer table: its block stride (column blocks, kvp_linear_b), 0
    (row-major float32, kvp_linear_small), -(fmt + 1) (a packed 16-bit weight, kvq_linear), PARTS_LAYOUT
    (a quantized weight: its parts in weight_parts), None (anything else: the layers run one by one)."""
    if isinstance(weight, HalfWeight):
        return -(weight.fmt + 1) if weight.device.type == "cpu" else None
    parts = weight_parts(weight)
    if parts is not None:
        return PARTS_LAYOUT if all(part.device.type == "cpu" for part in parts) else None
    if isinstance(weight, torch.Tensor):
        return blocked_stride(weight)
    return None


def has_quantized_weights(layers: Sequence[Any]) -> bool:
    """Whether a layer holds a quantized weight the fused stack does not read (it reads float32, 16-bit,
    int8-activation and exact int8 / int4 weights, and row stacks of the last two)."""
    return any(
        not isinstance(w, torch.Tensor | HalfWeight) and weight_parts(w) is None
        for layer in layers
        for w in (
            layer.self_attn.qkv_proj.weight,
            layer.self_attn.o_proj.weight,
            layer.mlp.gate_up_proj.weight,
            layer.mlp.down_proj.weight,
        )
    )

"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, TinyLlama) over a paged KV cache.

Weights are stored fused: q/k/v in one linear (`qkv_proj`), gate/up in one (`gate_up_proj`); the
loader fuses the checkpoint's tensors. The forward takes a flattened batch of tokens from many
sequences and reads/writes the cache through `AttentionMetadata` (see attention.py). The per-layer
math (norms, RoPE + cache write, attention, SiLU·up) goes through a `TorchOps` (ops.py): torch
itself, or kvpager's fused C++ kernels on CPU; `finish_loading` chooses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from kvpager.model.attention import AttentionMetadata
from kvpager.model.backends.ops import TorchOps
from kvpager.model.backends.weight_layout import embedding_rows
from kvpager.model.parallel import TensorParallel
from kvpager.model.precision import apply_precision
from kvpager.model.rope import RopeCache
from kvpager.model.spec import ModelSpec


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as transformers does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TorchOps().rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Self-attention with GQA, optional qkv bias (Qwen2) and per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(spec.q_size, spec.hidden_size, bias=spec.o_proj_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        ops: TorchOps,
    ) -> torch.Tensor:
        # x: [T, hidden]; kv_layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        num_tokens = x.shape[0]
        qkv = ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        q_norm = self.q_norm.weight if self.q_norm is not None else None  # NOTE: Qwen3 norms q/k before RoPE
        k_norm = self.k_norm.weight if self.k_norm is not None else None
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        # NOTE: write every new token first, then read: a sequence may use blocks written this step.
        q = ops.rope_and_cache(
            qkv, cos, sin, kv_layer, meta.slot_mapping, self.num_heads, self.num_kv_heads, q_norm, k_norm, eps
        )
        out = ops.attention(q, kv_layer, meta, self.scale)  # [T, H, hd]
        return ops.linear(out.reshape(num_tokens, self.q_size), self.o_proj.weight, self.o_proj.bias)


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        up, down = self.gate_up_proj, self.down_proj
        return ops.mlp(x, up.weight, up.bias, down.weight, down.bias)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.parallel = parallel  # tensor parallel: o_proj and down_proj are row-parallel (sum over ranks)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        ops: TorchOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, residual stream before it); their sum is the layer's
        output. NOTE: carrying the residual apart lets the add fuse into the next norm (one kernel)."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, h = x, ops.rms_norm(x, norm1.weight, norm1.eps)
        else:
            h, residual = ops.add_rms_norm(x, residual, norm1.weight, norm1.eps)
        h = self.self_attn.forward(h, cos, sin, kv_layer, meta, ops)
        if self.parallel is not None:
            h = self.parallel.all_reduce(h)
        h, residual = ops.add_rms_norm(h, residual, norm2.weight, norm2.eps)
        h = self.mlp.forward(h, ops)
        if self.parallel is not None:
            h = self.parallel.all_reduce(h)
        return h, residual


class CausalLM(nn.Module):
    """The decoder plus lm_head. Build on the meta device and fill with `load_state_dict(..., assign=True)`.

    Parameter names are transformers' except the fused `qkv_proj` / `gate_up_proj`. With tied
    embeddings `lm_head.weight` is the embedding tensor itself (unless the loader gave the lm_head a packed
    weight of its own: a quantized model's int8 copy). With `parallel` (tensor parallelism)
    `spec` is this rank's shard (`parallel.shard_spec`): its heads, MLP features and vocabulary rows.
    """

    def __init__(self, spec: ModelSpec, parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.parallel = parallel
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, parallel) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rope: RopeCache | None = None
        self.ops: TorchOps = TorchOps()
        self.compute_dtype = torch.float32  # activations' dtype: kvpager.model.precision's rule
        self.requires_grad_(False)

    def finish_loading(self, dtype: torch.dtype, device: torch.device, ops: TorchOps | None = None) -> None:
        """Tie lm_head when asked, cast for the compute-dtype rule (kvpager.model.precision), build the
        RoPE table, set the ops (default: torch) and let them arrange the weights; call after weights
        are assigned."""
        # NOTE: a packed lm_head (the int8 copy a quantized model multiplies) is kept: the lookup keeps its table
        if self.spec.tie_word_embeddings and isinstance(self.lm_head.weight, torch.Tensor):
            self.lm_head.weight = self.embed_tokens.weight
        self.compute_dtype = apply_precision(self, dtype, device).compute_dtype
        self.rope = RopeCache.build(self.spec, self.compute_dtype, device)
        self.ops = ops if ops is not None else TorchOps()
        self.ops.prepare_weights(self)
        self.eval()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_cache: [L, 2, NB, bs, kvh, hd] -> hidden [T, hidden]."""
        if self.rope is None:
            raise RuntimeError("CausalLM.finish_loading() must run before forward (load_model does it)")
        self._check_window(attn_metadata)
        self.ops.begin_step()
        cos, sin = self.rope.lookup(positions)  # each [T, 1, head_dim // 2]
        if self.parallel is not None:
            x = self.parallel.embed(self.embed_tokens.weight, input_ids)
        else:
            x = embedding_rows(self.embed_tokens.weight, input_ids)  # NOTE: the ops may store the table in blocks
        x = x.to(self.compute_dtype)  # a bfloat16 table on the CPU: float32 activations (no copy when equal)
        residual: torch.Tensor | None = None
        layers = cast(Sequence[Any], self.layers)  # a ModuleList: indexable, iterable
        fused = None  # NOTE: the one-kernel decode has no all-reduce between layers
        if self.parallel is None:
            fused = self.ops.decode_layers(layers, self.spec, x, cos, sin, kv_cache, attn_metadata)
            if fused is None:
                fused = self.ops.prompt_layers(layers, x, cos, sin, kv_cache, attn_metadata)
        if fused is not None:
            x, residual = fused
        else:
            for i, layer in enumerate(self.layers):
                # NOTE: .forward, not __call__: module hooks are never used here and the call costs ~4 us.
                x, residual = layer.forward(x, residual, cos, sin, kv_cache[i], attn_metadata, self.ops)
        assert residual is not None  # num_layers >= 1
        return self.ops.add_rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (tensor parallel: gathered on every rank)."""
        logits = self.ops.linear(hidden, self.lm_head.weight, None).float()
        return self.parallel.gather_logits(logits) if self.parallel is not None else logits

    def _check_window(self, meta: AttentionMetadata) -> None:
        window = self.spec.sliding_window
        if window is not None and meta.sliding_window != window and meta.max_seq_len > window:
            raise ValueError(
                f"{self.spec.architecture} uses a sliding window of {window} positions and a sequence has "
                f"{meta.max_seq_len}: pass sliding_window=spec.sliding_window to build_attention_metadata"
            )

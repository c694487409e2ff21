"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, TinyLlama) over a paged KV cache.

Weights are stored fused: q/k/v in one linear (`qkv_proj`), gate/up in one (`gate_up_proj`); the
loader fuses the checkpoint's tensors. The forward takes a flattened batch of tokens from many
sequences and reads/writes the cache through `AttentionMetadata` (see attention.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvpager.model.attention import AttentionMetadata, paged_attention, write_kv
from kvpager.model.rope import RopeCache, apply_rope
from kvpager.model.spec import ModelSpec


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as transformers does)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # NOTE: one fused op instead of six; same math in fp32 (measured: identical to 1e-7).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        # x: [T, hidden]; kv_layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))  # NOTE: Qwen3 norms before RoPE
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            # q and k sit side by side in the fused output: rotate all their heads in one pass.
            qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim), cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        # NOTE: write every new token first, then read: a sequence may use blocks written this step.
        write_kv(kv_layer, k, v, meta.slot_mapping)
        out = paged_attention(q, kv_layer, meta, self.scale)  # [T, H, hd]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """The decoder plus lm_head. Build on the meta device and fill with `load_state_dict(..., assign=True)`.

    Parameter names are transformers' except the fused `qkv_proj` / `gate_up_proj`. With tied
    embeddings `lm_head.weight` is the embedding tensor itself.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rope: RopeCache | None = None
        self.requires_grad_(False)

    def finish_loading(self, dtype: torch.dtype, device: torch.device) -> None:
        """Tie lm_head when asked and build the RoPE table; call after weights are assigned."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RopeCache.build(self.spec, dtype, device)
        self.eval()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_cache: [L, 2, NB, bs, kvh, hd] -> hidden [T, hidden]."""
        if self.rope is None:
            raise RuntimeError("CausalLM.finish_loading() must run before forward (load_model does it)")
        self._check_window(attn_metadata)
        cos, sin = self.rope.lookup(positions)  # each [T, 1, head_dim // 2]
        x = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[i], attn_metadata)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def _check_window(self, meta: AttentionMetadata) -> None:
        window = self.spec.sliding_window
        if window is not None and meta.sliding_window != window and meta.max_seq_len > window:
            raise ValueError(
                f"{self.spec.architecture} uses a sliding window of {window} positions and a sequence has "
                f"{meta.max_seq_len}: pass sliding_window=spec.sliding_window to build_attention_metadata"
            )

"""Parameter counts recomputed from config fields.

Assumes the decoder layout of every shipped family: gated MLP (gate, up, down), RMSNorm-style norms
with one weight vector, rotary positions (no position-embedding table). Fused projections (Phi-3's
qkv_proj and gate_up_proj) have the same count as separate ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpager.planner.models import MLAFacts, ModelFacts


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by how they are stored once quantised: matrices shrink; embeddings and norms often do not."""

    embedding: int  # input token embedding
    lm_head: int  # 0 when tied to the embedding (counted once)
    linear: int  # attention and MLP matrices, routers
    other: int  # norms, biases
    expert_linear: int  # part of `linear` that sits in routed experts
    active_expert_linear: int  # routed-expert matrices one token reads (top-k of each sparse layer)

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.linear + self.other

    @property
    def active(self) -> int:
        """Parameters one token touches (MoE: only its top-k routed experts)."""
        return self.total - self.expert_linear + self.active_expert_linear


def count_parameters(facts: ModelFacts) -> ParamCounts:
    """Recompute the parameter count from the config fields."""
    h = facts.hidden_size
    linear = other = expert = active_expert = 0
    for layer in range(facts.num_layers):
        attn_linear, attn_other = _attention(facts)
        mlp_linear, mlp_expert, mlp_active, mlp_other = _mlp(facts, layer)
        linear += attn_linear + mlp_linear
        other += attn_other + mlp_other + facts.norms_per_layer * h
        expert += mlp_expert
        active_expert += mlp_active
    embedding = facts.vocab_size * h
    lm_head = 0 if facts.tie_word_embeddings else facts.vocab_size * h
    return ParamCounts(embedding, lm_head, linear, other + h, expert, active_expert)  # + h: final norm


def _attention(facts: ModelFacts) -> tuple[int, int]:
    """(matrix parameters, norm/bias parameters) of one attention block."""
    if facts.mla is not None:
        return _mla_attention(facts.hidden_size, facts.num_heads, facts.mla)
    h, d = facts.hidden_size, facts.head_dim
    q, kv = facts.num_heads * d, facts.num_kv_heads * d
    matrices = h * q + 2 * h * kv + q * h
    extra = (q + 2 * kv) if facts.attention_bias else 0
    extra += 2 * d if facts.qk_norm else 0
    return matrices, extra


def _mla_attention(h: int, heads: int, mla: MLAFacts) -> tuple[int, int]:
    qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank:
        q, norms = h * mla.q_lora_rank + mla.q_lora_rank * heads * qk_dim, mla.q_lora_rank
    else:
        q, norms = h * heads * qk_dim, 0
    kv_a = h * (mla.kv_lora_rank + mla.qk_rope_head_dim)
    kv_b = mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
    o = heads * mla.v_head_dim * h
    return q + kv_a + kv_b + o, norms + mla.kv_lora_rank


def _mlp(facts: ModelFacts, layer: int) -> tuple[int, int, int, int]:
    """(all matrices, routed-expert matrices, active routed-expert matrices, other) of one MLP block."""
    h, moe = facts.hidden_size, facts.moe
    if moe is None or layer in moe.dense_layers:
        return 3 * h * facts.intermediate_size, 0, 0, 0
    per_expert = 3 * h * moe.expert_intermediate_size
    routed = moe.num_experts * per_expert
    shared = 3 * h * moe.shared_intermediate_size
    router = moe.num_experts * h
    bias = moe.num_experts if moe.router_bias else 0
    return routed + shared + router, routed, moe.num_experts_per_tok * per_expert, bias


def expected_experts_read(facts: ModelFacts, batch: int) -> float:
    """Expected distinct routed experts per sparse layer read by one decode step of `batch` tokens.

    NOTE: assumes uniform, independent routing: E × (1 − (1 − k/E)^B). Exact at batch 1 (k experts);
    at larger batches a skewed router reads fewer distinct experts, so real decode can beat the
    speed bound built on this figure.
    """
    moe = facts.moe
    if moe is None:
        return 0.0
    e, k = moe.num_experts, moe.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** batch)

"""Which part of each checkpoint tensor a tensor-parallel rank loads (Megatron-style, as vLLM).

Column-parallel (output features split): the fused q/k/v (its heads; KV heads split or, when fewer
than the ranks, the one a rank's query heads share) and gate/up (intermediate features), weights and
biases. Row-parallel (input features split): o_proj and down_proj weights; their biases are added
once, so rank 0 loads them and the other ranks zeros (the all-reduce sums the ranks' outputs).
Vocab-parallel: embed_tokens and lm_head rows, the last rank padded with zero rows. Everything else
(norms) is loaded whole. The plan names global index ranges of the fused tensor; the loader slices
its memory-mapped sources by them before anything is materialised.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpager.core.tensor_parallel import TensorParallelLayout
from kvpager.model.spec import ModelSpec


@dataclass(frozen=True)
class ShardPlan:
    """Take `ranges` (global [start, end) along `dim`, in order) of the fused tensor; then `pad_rows` zero
    rows. `zero`: the rank loads zeros of the full shape (a row-parallel bias off rank 0)."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    pad_rows: int = 0
    zero: bool = False


WHOLE = None  # the rank loads the tensor as it is


def shard_plan(name: str, spec: ModelSpec, layout: TensorParallelLayout, rank: int) -> ShardPlan | None:
    """The slice of model tensor `name` (fused names, no "model." prefix) that `rank` holds, or WHOLE."""
    hd = spec.head_dim
    q0, q1 = layout.head_start(rank) * hd, (layout.head_start(rank) + layout.heads_per_rank) * hd
    k0 = layout.kv_head_start(rank) * hd
    k1 = k0 + layout.kv_heads_per_rank * hd
    i0 = rank * layout.intermediate_per_rank
    i1 = i0 + layout.intermediate_per_rank
    q_size, kv_size, inter = spec.q_size, spec.kv_size, spec.intermediate_size
    if name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
        return ShardPlan(0, ((q0, q1), (q_size + k0, q_size + k1), (q_size + kv_size + k0, q_size + kv_size + k1)))
    if name.endswith(("mlp.gate_up_proj.weight", "mlp.gate_up_proj.bias")):
        return ShardPlan(0, ((i0, i1), (inter + i0, inter + i1)))
    if name.endswith("self_attn.o_proj.weight"):
        return ShardPlan(1, ((q0, q1),))
    if name.endswith("mlp.down_proj.weight"):
        return ShardPlan(1, ((i0, i1),))
    if name.endswith(("self_attn.o_proj.bias", "mlp.down_proj.bias")):
        return WHOLE if rank == 0 else ShardPlan(zero=True)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        v0, v1 = layout.vocab_range(rank)
        return ShardPlan(0, ((v0, v1),) if v1 > v0 else (), pad_rows=layout.vocab_per_rank - (v1 - v0))
    return WHOLE

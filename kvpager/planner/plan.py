"""The plan: every answer of `kvpager plan` for one model, one weight format and one device.

`make_plan` is pure given its inputs (the CPU measurement happens before, in the CLI), so the same
inputs always print the same numbers — the docs depend on that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpager.core.config import resolve_dtype, resolve_gguf_int8_activations
from kvpager.core.sizing import KVShape, pool_size
from kvpager.core.tensor_parallel import tensor_parallel_layout
from kvpager.gguf import hf_config_from_gguf, is_gguf_path, open_gguf
from kvpager.planner import kvmath
from kvpager.planner.devices import Device, Reserve, default_reserve
from kvpager.planner.gguf_bytes import gguf_resident_weights
from kvpager.planner.models import ModelFacts
from kvpager.planner.params import ParamCounts, count_parameters, expected_experts_read
from kvpager.planner.weights import (
    WEIGHT_FORMATS,
    WeightFormat,
    engine_format,
    engine_weight_bytes,
    read_checkpoint_weights,
    weight_bytes,
)


@dataclass(frozen=True)
class PlanOptions:
    """What the user asked for. `weights=None`: the checkpoint's own bytes if MODEL is a directory, else bf16."""

    weights: WeightFormat | None = None
    kv_dtype: str = "bf16"
    context: int = 8192
    batch: int = 16
    num_prompt_tokens: int | None = None
    num_generated_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    reserve: Reserve | None = None  # None: the device's default reserve
    # kvpager's own storage (`kvpager serve --dtype/--quantization`): exact engine bytes when either is set
    dtype: str | None = None  # float32 | bfloat16 | float16 (None with quantization: bfloat16)
    quantization: str | None = None  # core.config.QUANTIZATIONS (int8 | int4 | w8a8_int8 | w4a8_int8)
    quantization_group_size: int | None = None
    quantize_lm_head: bool = True  # with quantization: the lm_head int8 per output channel (not for GGUF files)
    # GGUF: the file's blocks times int8 activations (their forms; a tied lm_head's packed copy of the
    # embedding's blocks); None: as `kvpager serve` resolves it on the CPU (resolve_gguf_int8_activations)
    gguf_int8_activations: bool | None = None
    tensor_parallel_size: int = 1  # engine_*: one rank's pool (its KV heads), as `serve --tensor-parallel-size`

    def __post_init__(self) -> None:
        if (self.dtype is not None or self.quantization is not None) and self.weights is not None:
            raise ValueError("--weights and --dtype/--quantization both name a weight format: give one")
        for name in ("context", "batch", "block_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if (self.num_prompt_tokens is None) != (self.num_generated_tokens is None):
            raise ValueError("--prompt and --generate go together: give both (e.g. --prompt 1000 --generate 200)")
        for name, value in (("--prompt", self.num_prompt_tokens), ("--generate", self.num_generated_tokens)):
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class WeightsAnswer:
    format: str
    bits_per_weight: float | None  # None: exact checkpoint bytes
    assumption: str
    num_bytes: int
    file_bytes: int | None = None  # a GGUF model: the file's tensor bytes (num_bytes: what kvpager holds)


@dataclass
class Plan:
    """All answers; `to_json()` is the `--json` document (keys documented in docs/kv-memory.md)."""

    model: str
    model_source: str
    num_parameters: int
    num_active_parameters: int
    published_parameters: int | None
    weight_format: str
    weight_bits_per_weight: float | None
    weight_assumption: str
    weight_bytes: int
    weight_file_bytes: int | None  # a GGUF model: the file's tensor bytes (weight_bytes: what kvpager holds)
    kv_dtype: str
    kv_bytes_per_token: int
    kv_bytes_per_token_per_layer: list[int]
    sliding_window_layers: int
    context: int
    kv_bytes_at_context: int
    max_model_len: int
    block_size: int
    batch: int
    device: dict[str, Any] | None = None
    reserve_bytes: int | None = None
    reserve_rule: str | None = None
    usable_kv_bytes: int | None = None
    fits: bool | None = None
    max_context_tokens: int | None = None
    max_context_tokens_by_memory: int | None = None
    max_concurrency: int | None = None
    max_concurrency_contiguous: int | None = None
    decode_tokens_per_s_bound: float | None = None
    decode_tokens_per_s_bound_batch: float | None = None
    attention_pairs_cached: int | None = None
    attention_pairs_uncached: int | None = None
    attention_pairs_ratio: float | None = None
    engine_num_blocks: int | None = None
    engine_max_concurrency: int | None = None
    tensor_parallel_size: int = 1
    engine_kv_heads_per_rank: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def resolve_weights(
    facts: ModelFacts,
    counts: ParamCounts,
    model_dir: Path | None,
    fmt: WeightFormat | None,
    options: PlanOptions | None = None,
) -> WeightsAnswer:
    """Checkpoint bytes when a directory with safetensors is given and no format is forced; for a GGUF
    model the bytes kvpager holds when it runs the file (its file bytes beside them)."""
    gguf_model = open_gguf(model_dir) if model_dir is not None and fmt is None and is_gguf_path(model_dir) else None
    quantization = options.quantization if options is not None else None
    if gguf_model is not None and quantization is None:
        dtype = options.dtype if options is not None and options.dtype is not None else None
        if dtype is None:  # `kvpager serve`'s --dtype auto on the CPU
            dtype = resolve_dtype("auto", str(hf_config_from_gguf(gguf_model)["torch_dtype"]), "cpu")
        int8_activations = resolve_gguf_int8_activations(
            options.gguf_int8_activations if options is not None else None,
            gguf=True,
            quantization=None,
            tensor_parallel_size=options.tensor_parallel_size if options is not None else 1,
            cpu_kernels=True,
        )
        resident = gguf_resident_weights(gguf_model, dtype, int8_activations=int8_activations)
        bits = round(8 * resident.num_bytes / counts.total, 3) if counts.total else 0.0
        return WeightsAnswer("gguf", bits, resident.describe(), resident.num_bytes, resident.file_bytes)
    if options is not None and (options.dtype is not None or options.quantization is not None):
        dtype = options.dtype or "bfloat16"
        group = options.quantization_group_size
        # NOTE: a GGUF file's lm_head keeps its own form under --quantization (kvpager.model.loader)
        head = options.quantize_lm_head and gguf_model is None
        fmt_e = engine_format(dtype, options.quantization, group, head, facts)
        num_bytes = engine_weight_bytes(facts, counts, dtype, options.quantization, group, head)
        bits = round(8 * num_bytes / counts.total, 3) if counts.total else 0.0
        file_bytes = gguf_model.tensor_bytes() if gguf_model is not None else None
        return WeightsAnswer(fmt_e.name, bits, fmt_e.assumption, num_bytes, file_bytes)
    if fmt is None and model_dir is not None:
        checkpoint = read_checkpoint_weights(model_dir)
        if checkpoint is not None:
            note = (
                f"exact: safetensors headers of {len(checkpoint.files)} file(s), {checkpoint.num_elements:,} elements"
            )
            return WeightsAnswer("checkpoint", None, note, checkpoint.num_bytes)
    chosen = fmt or WEIGHT_FORMATS["bf16"]
    return WeightsAnswer(chosen.name, chosen.bits_per_weight, chosen.assumption, weight_bytes(counts, chosen))


def make_plan(facts: ModelFacts, options: PlanOptions, device: Device | None, model_dir: Path | None = None) -> Plan:
    """Compute every answer. ValueError on inconsistent inputs."""
    counts = count_parameters(facts)
    weights = resolve_weights(facts, counts, model_dir, options.weights, options)
    kv_name, kv_bytes = kvmath.parse_kv_dtype(options.kv_dtype)
    per_layer = kvmath.kv_bytes_per_token_per_layer(facts, kv_bytes)
    max_model_len = options.max_model_len or facts.max_position_embeddings or options.context
    plan = Plan(
        model=facts.name,
        model_source=facts.source,
        num_parameters=counts.total,
        num_active_parameters=counts.active,
        published_parameters=facts.published_parameters,
        weight_format=weights.format,
        weight_bits_per_weight=weights.bits_per_weight,
        weight_assumption=weights.assumption,
        weight_bytes=weights.num_bytes,
        weight_file_bytes=weights.file_bytes,
        kv_dtype=kv_name,
        kv_bytes_per_token=sum(per_layer),
        kv_bytes_per_token_per_layer=per_layer,
        sliding_window_layers=sum(w is not None for w in facts.layer_windows),
        context=options.context,
        kv_bytes_at_context=kvmath.kv_bytes_at_context(facts, kv_bytes, options.context),
        max_model_len=max_model_len,
        block_size=options.block_size,
        batch=options.batch,
    )
    _add_attention_pairs(plan, options)
    _add_capacity(plan, facts, options, device, kv_bytes, counts)
    _add_engine(plan, facts, options, kv_bytes)
    return plan


def _add_attention_pairs(plan: Plan, options: PlanOptions) -> None:
    if options.num_prompt_tokens is None or options.num_generated_tokens is None:
        return
    n, m = options.num_prompt_tokens, options.num_generated_tokens
    plan.attention_pairs_cached = kvmath.attention_pairs_cached(n, m)
    plan.attention_pairs_uncached = kvmath.attention_pairs_uncached(n, m)
    plan.attention_pairs_ratio = (
        plan.attention_pairs_uncached / plan.attention_pairs_cached if plan.attention_pairs_cached else None
    )


def _add_capacity(
    plan: Plan, facts: ModelFacts, options: PlanOptions, device: Device | None, kv_bytes: int, counts: ParamCounts
) -> None:
    """Budget → max context, concurrency (paged and contiguous), decode bound."""
    if device is not None:
        reserve = options.reserve or default_reserve(device)
        plan.device = {
            "name": device.name,
            "kind": device.kind,
            "memory_bytes": device.memory_bytes,
            "bandwidth_bytes_per_s": device.bandwidth_bytes_per_s,
            "source": device.source,
        }
        plan.reserve_bytes, plan.reserve_rule = reserve.num_bytes, reserve.rule
        plan.usable_kv_bytes = device.memory_bytes - reserve.num_bytes - plan.weight_bytes
        _add_decode_bound(plan, facts, device, counts)
    if options.kv_cache_memory is not None:
        plan.usable_kv_bytes = options.kv_cache_memory
        plan.notes.append("KV budget is --kv-cache-memory (the engine's pool), not derived from the device")
    if plan.usable_kv_bytes is None:
        return
    budget = plan.usable_kv_bytes
    by_memory = kvmath.max_context_by_memory(facts, kv_bytes, budget)
    plan.max_context_tokens_by_memory = by_memory
    plan.max_context_tokens = plan.max_model_len if by_memory is None else min(by_memory, plan.max_model_len)
    plan.fits = budget >= kvmath.kv_bytes_paged(facts, kv_bytes, 1, options.block_size)
    if options.context > plan.max_model_len:
        plan.notes.append(
            f"--context {options.context} exceeds max_model_len {plan.max_model_len}: no concurrency at that context"
        )
    else:
        plan.max_concurrency = kvmath.max_concurrency_paged(
            facts, kv_bytes, budget, options.context, options.block_size
        )
    plan.max_concurrency_contiguous = kvmath.max_concurrency_contiguous(facts, kv_bytes, budget, plan.max_model_len)


def _add_decode_bound(plan: Plan, facts: ModelFacts, device: Device, counts: ParamCounts) -> None:
    """tokens/s ≤ B × bandwidth / (weight bytes read + B × KV bytes read) per decode step."""
    bytes_per_param = plan.weight_bytes / counts.total
    for batch in (1, plan.batch):
        read_params: float = counts.total
        if facts.moe is not None:
            sparse_layers = facts.num_layers - len(facts.moe.dense_layers)
            per_expert = 3 * facts.hidden_size * facts.moe.expert_intermediate_size
            read_params += expected_experts_read(facts, batch) * per_expert * sparse_layers - counts.expert_linear
        step_bytes = read_params * bytes_per_param + batch * plan.kv_bytes_at_context
        rate = batch * device.bandwidth_bytes_per_s / step_bytes
        if batch == 1:
            plan.decode_tokens_per_s_bound = rate
        if batch == plan.batch:
            plan.decode_tokens_per_s_bound_batch = rate
    if facts.moe is not None:
        plan.notes.append(
            "MoE decode reads only the routed experts: top-k at batch 1, uniform routing assumed at batch B"
        )


def _add_engine(plan: Plan, facts: ModelFacts, options: PlanOptions, kv_bytes: int) -> None:
    """The kvpager engine's pool for this budget: same function, same numbers (kvpager.core.sizing)."""
    if options.kv_cache_memory is None:
        return
    if facts.mla is not None:
        plan.notes.append("the kvpager engine does not run MLA models: no engine block count")
        return
    # NOTE: the engine's own layout rule: a rank holds its share of the KV heads (or one, replicated)
    layout = tensor_parallel_layout(
        facts.num_heads, facts.num_kv_heads, facts.intermediate_size, facts.vocab_size, options.tensor_parallel_size
    )
    shape = KVShape(facts.num_layers, layout.kv_heads_per_rank, facts.head_dim, kv_bytes)
    pool = pool_size(shape, options.block_size, options.kv_cache_memory)
    plan.tensor_parallel_size = options.tensor_parallel_size
    plan.engine_kv_heads_per_rank = layout.kv_heads_per_rank
    plan.engine_num_blocks = pool.num_blocks
    plan.engine_max_concurrency = pool.max_concurrency(plan.max_model_len)
    if plan.sliding_window_layers:
        plan.notes.append(
            "the engine caches every layer in full (no sliding-window savings); engine_* figures reflect that"
        )

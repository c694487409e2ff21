"""Plain-text rendering of one plan, for people (the JSON document is for programs)."""

from __future__ import annotations

from kvpager.core.units import format_bandwidth, format_bytes, format_count
from kvpager.planner.plan import Plan


def render_text(plan: Plan) -> str:
    """The report `kvpager plan MODEL` prints."""
    lines = [_title(plan), *_model_lines(plan), *_kv_lines(plan), *_capacity_lines(plan), *_speed_lines(plan)]
    lines += _pairs_lines(plan) + _engine_lines(plan) + [f"note       {n}" for n in plan.notes]
    return "\n".join(lines) + "\n"


def _title(plan: Plan) -> str:
    if plan.device is None:
        return f"kvpager plan: {plan.model}"
    d = plan.device
    return f"kvpager plan: {plan.model} on {d['name']} ({format_bytes(d['memory_bytes'])}, {format_bandwidth(d['bandwidth_bytes_per_s'])})"


def _model_lines(plan: Plan) -> list[str]:
    published = f" (published {format_count(plan.published_parameters)})" if plan.published_parameters else ""
    active = (
        f", {format_count(plan.num_active_parameters)} active per token"
        if plan.num_active_parameters != plan.num_parameters
        else ""
    )
    bits = f"{plan.weight_bits_per_weight:g} bits/weight" if plan.weight_bits_per_weight is not None else "checkpoint"
    lines = [
        f"model      {plan.model_source}",
        f"params     {plan.num_parameters:,} = {format_count(plan.num_parameters)}{published}{active}",
        f"weights    {plan.weight_format} ({bits}): {format_bytes(plan.weight_bytes)} = {plan.weight_bytes:,} bytes",
    ]
    if plan.weight_file_bytes is not None:
        lines.append(
            f"           held in memory by kvpager; the GGUF file's tensors are {format_bytes(plan.weight_file_bytes)}"
            f" = {plan.weight_file_bytes:,} bytes"
        )
    return [*lines, f"           {plan.weight_assumption}"]


def _kv_lines(plan: Plan) -> list[str]:
    layers = len(plan.kv_bytes_per_token_per_layer)
    per_layer = plan.kv_bytes_per_token_per_layer[0] if layers else 0
    lines = [
        f"KV cache   {plan.kv_dtype}: {plan.kv_bytes_per_token:,} bytes ({format_bytes(plan.kv_bytes_per_token)}) per token"
        f" = {layers} layers × {per_layer:,} bytes",
    ]
    if plan.sliding_window_layers:
        lines.append(
            f"           {plan.sliding_window_layers} of {layers} layers use a sliding window: they stop growing at the window"
        )
    lines.append(f"           one sequence at {plan.context:,} tokens: {format_bytes(plan.kv_bytes_at_context)}")
    return lines


def _capacity_lines(plan: Plan) -> list[str]:
    if plan.usable_kv_bytes is None:
        return ["capacity   give --device, --memory/--bandwidth or --kv-cache-memory for capacity answers"]
    lines = []
    if plan.reserve_bytes is not None and plan.device is not None:
        lines.append(
            f"memory     {format_bytes(plan.device['memory_bytes'])} − reserve {format_bytes(plan.reserve_bytes)} ({plan.reserve_rule})"
            f" − weights {format_bytes(plan.weight_bytes)} = {format_bytes(plan.usable_kv_bytes)} for KV"
        )
    else:
        lines.append(f"memory     {format_bytes(plan.usable_kv_bytes)} for KV")
    limit = (
        "no memory limit: every layer is windowed"
        if plan.max_context_tokens_by_memory is None
        else f"memory allows {plan.max_context_tokens_by_memory:,}"
    )
    lines.append(
        f"context    longest single sequence: {_num(plan.max_context_tokens)} tokens ({limit}; model limit {plan.max_model_len:,})"
    )
    lines.append(
        f"concurrency at {plan.context:,} tokens: paged ({plan.block_size}-token blocks) {_num(plan.max_concurrency)} sequences"
    )
    lines.append(
        f"           contiguous slots of max_model_len {plan.max_model_len:,} (llama.cpp/Ollama style): {_num(plan.max_concurrency_contiguous)} sequences"
    )
    return lines


def _speed_lines(plan: Plan) -> list[str]:
    if plan.decode_tokens_per_s_bound is None:
        return []
    return [
        f"decode     ≤ {plan.decode_tokens_per_s_bound:,.1f} tok/s at batch 1; ≤ {plan.decode_tokens_per_s_bound_batch:,.1f} tok/s in total at batch {plan.batch}"
        f" (bandwidth / bytes read per step, each sequence at {plan.context:,} tokens)"
    ]


def _pairs_lines(plan: Plan) -> list[str]:
    if plan.attention_pairs_cached is None:
        return []
    ratio = f" ({plan.attention_pairs_ratio:,.1f}× more)" if plan.attention_pairs_ratio else ""
    return [
        f"attention  query–key pairs: {plan.attention_pairs_cached:,} with a KV cache, {plan.attention_pairs_uncached:,} without{ratio}"
    ]


def _engine_lines(plan: Plan) -> list[str]:
    if plan.engine_num_blocks is None:
        return []
    per_rank = ""
    if plan.tensor_parallel_size > 1:
        per_rank = f" per rank of {plan.tensor_parallel_size} ({plan.engine_kv_heads_per_rank} KV heads each)"
    return [
        f"engine     {plan.engine_num_blocks:,} KV blocks of {plan.block_size} tokens{per_rank};"
        f" max concurrency at max_model_len {plan.max_model_len:,}: {plan.engine_max_concurrency:,}"
    ]


def _num(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"

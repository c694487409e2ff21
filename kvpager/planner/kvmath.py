"""KV-cache arithmetic: bytes per token, bytes at a context, capacity, concurrency, attention pairs.

The general formula is 2 (K and V) × layers × KV heads × head_dim × bytes per element per token.
Sliding-window layers stop growing at their window; MLA layers cache one latent of
kv_lora_rank + qk_rope_head_dim elements instead of K and V per head.
"""

from __future__ import annotations

from kvpager.planner.models import ModelFacts

KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
_KV_ALIASES = {
    "float32": "fp32",
    "float16": "fp16",
    "bfloat16": "bf16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
}


def parse_kv_dtype(name: str) -> tuple[str, int]:
    """`bf16` → ("bf16", 2). Accepts the engine's names too (float32, float16, bfloat16)."""
    key = _KV_ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in KV_DTYPE_BYTES:
        raise ValueError(
            f"unknown KV dtype {name!r}: choose one of {', '.join(KV_DTYPE_BYTES)} (or float32/float16/bfloat16)"
        )
    return key, KV_DTYPE_BYTES[key]


def kv_bytes_per_token_per_layer(facts: ModelFacts, dtype_bytes: int) -> list[int]:
    """Bytes one token position adds to each layer's cache (before any window cap)."""
    if facts.mla is not None:
        per_layer = (facts.mla.kv_lora_rank + facts.mla.qk_rope_head_dim) * dtype_bytes
    else:
        per_layer = 2 * facts.num_kv_heads * facts.head_dim * dtype_bytes
    return [per_layer] * facts.num_layers


def kv_bytes_at_context(facts: ModelFacts, dtype_bytes: int, context: int) -> int:
    """Bytes one sequence of `context` positions holds, every sliding layer capped at its window."""
    per_layer = kv_bytes_per_token_per_layer(facts, dtype_bytes)
    return sum(
        min(context, w if w is not None else context) * b for w, b in zip(facts.layer_windows, per_layer, strict=True)
    )


def kv_bytes_paged(facts: ModelFacts, dtype_bytes: int, context: int, block_size: int) -> int:
    """Bytes one sequence holds in whole blocks of `block_size` positions.

    NOTE: a window that has slid past the start straddles block boundaries, so a windowed layer
    holds one block more than its window needs once the context exceeds the window.
    """
    per_layer = kv_bytes_per_token_per_layer(facts, dtype_bytes)
    total = 0
    for window, per_token in zip(facts.layer_windows, per_layer, strict=True):
        held = context if window is None else min(context, window)
        blocks = -(-held // block_size) + (1 if window is not None and context > window else 0)
        total += blocks * block_size * per_token
    return total


def max_context_by_memory(facts: ModelFacts, dtype_bytes: int, budget: int) -> int | None:
    """Longest single sequence whose KV fits in `budget` bytes; None when windows cap it below the budget."""
    if budget <= 0:
        return 0
    if all(w is not None for w in facts.layer_windows):
        widest = max(w for w in facts.layer_windows if w is not None)
        if kv_bytes_at_context(facts, dtype_bytes, widest) <= budget:
            return None  # every layer is windowed: the cache stops growing
    low, high = 0, 1
    while kv_bytes_at_context(facts, dtype_bytes, high) <= budget:
        low, high = high, high * 2
    while high - low > 1:  # invariant: kv(low) <= budget < kv(high)
        mid = (low + high) // 2
        low, high = (mid, high) if kv_bytes_at_context(facts, dtype_bytes, mid) <= budget else (low, mid)
    return low


def max_concurrency_paged(facts: ModelFacts, dtype_bytes: int, budget: int, context: int, block_size: int) -> int:
    """Sequences of `context` positions that fit in `budget` when each holds only the blocks it uses."""
    per_seq = kv_bytes_paged(facts, dtype_bytes, context, block_size)
    return max(0, budget) // per_seq if per_seq else 0


def max_concurrency_contiguous(facts: ModelFacts, dtype_bytes: int, budget: int, max_model_len: int) -> int:
    """Sequences that fit when each preallocates a contiguous region for `max_model_len` positions.

    This is how llama.cpp server slots and Ollama (num_ctx × num_parallel) allocate: whatever the
    real conversation length, every slot costs the whole window.
    """
    per_seq = kv_bytes_at_context(facts, dtype_bytes, max_model_len)
    return max(0, budget) // per_seq if per_seq else 0


def attention_pairs_cached(num_prompt: int, num_generated: int) -> int:
    """Query–key pairs when every position is computed once: n(n+1)/2 + m·n + m(m+1)/2."""
    n, m = num_prompt, num_generated
    return n * (n + 1) // 2 + m * n + m * (m + 1) // 2


def attention_pairs_uncached(num_prompt: int, num_generated: int) -> int:
    """Query–key pairs when each new token reruns the whole sequence: Σ_{k=n}^{n+m} k(k+1)/2.

    The prompt pass (length n), then one full causal pass over n+1, …, n+m positions, one per
    generated token. With n=6, m=2: 21 + 28 + 36 = 85, against 36 with a cache.
    """
    n, m = num_prompt, num_generated
    return sum(k * (k + 1) // 2 for k in range(n, n + m + 1))

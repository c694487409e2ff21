"""Planner formulas against hand-computed values, and the shipped model facts against their sources."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvpager.core.sizing import KVShape, pool_size
from kvpager.planner import kvmath
from kvpager.planner.devices import Device, default_reserve
from kvpager.planner.models import (
    ModelFacts,
    facts_from_config,
    facts_from_entry,
    load_model_facts,
    shipped_model_entries,
)
from kvpager.planner.params import count_parameters
from kvpager.planner.plan import PlanOptions, make_plan
from kvpager.planner.weights import WEIGHT_FORMATS, weight_bytes

GIB = 1024**3
ISSUE_MODELS = [
    "Llama-2-7B", "Llama-3.1-8B", "Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-70B", "Mistral-7B", "Qwen2.5-0.5B",
    "Qwen2.5-1.5B", "Qwen2.5-7B", "Qwen2.5-14B", "Qwen2.5-32B", "Qwen2.5-72B", "Qwen3-0.6B", "Qwen3-8B", "Qwen3-32B",
    "Gemma-2-9B", "Gemma-3-4B", "Gemma-3-27B", "Phi-3-mini", "SmolLM2-135M", "SmolLM2-360M", "SmolLM2-1.7B",
    "TinyLlama-1.1B", "DeepSeek-V3",
]  # fmt: skip


def dense_facts(num_layers: int = 32, num_kv_heads: int = 8, head_dim: int = 128, **overrides: object) -> ModelFacts:
    config = {
        "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": num_layers, "num_attention_heads": 32,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "intermediate_size": 14336, "vocab_size": 128256,
        "tie_word_embeddings": False, "max_position_embeddings": 131072,
    }  # fmt: skip
    config.update(overrides)
    return facts_from_config(config, name="test", source="test")


@pytest.mark.parametrize(
    ("num_kv_heads", "context", "expected"),
    [(8, 8192, 1 * GIB), (8, 65536, 8 * GIB), (32, 8192, 4 * GIB), (32, 65536, 32 * GIB)],
)
def test_kv_bytes_at_context_matches_hand_computed_gib(num_kv_heads: int, context: int, expected: int) -> None:
    facts = dense_facts(num_kv_heads=num_kv_heads)
    assert kvmath.kv_bytes_at_context(facts, 2, context) == expected


def test_kv_bytes_per_token_is_two_times_layers_heads_head_dim_bytes() -> None:
    facts = dense_facts()
    assert kvmath.kv_bytes_per_token_per_layer(facts, 2) == [2 * 8 * 128 * 2] * 32
    assert sum(kvmath.kv_bytes_per_token_per_layer(facts, 1)) == 2 * 32 * 8 * 128


def test_attention_pairs_six_prompt_two_generated_is_36_cached_85_uncached() -> None:
    assert kvmath.attention_pairs_cached(6, 2) == 36
    assert kvmath.attention_pairs_uncached(6, 2) == 85


def test_attention_pairs_cached_equals_one_causal_pass_over_all_positions() -> None:
    for n, m in [(0, 5), (100, 0), (1000, 200)]:
        assert kvmath.attention_pairs_cached(n, m) == (n + m) * (n + m + 1) // 2


def test_sliding_window_layers_are_capped_at_the_window() -> None:
    gemma2 = load_model_facts("Gemma-2-9B")
    per_layer = 2 * 8 * 256 * 2
    assert gemma2.layer_windows[:4] == (4096, None, 4096, None)
    expected = 21 * per_layer * 4096 + 21 * per_layer * 8192
    assert kvmath.kv_bytes_at_context(gemma2, 2, 8192) == expected


def test_gemma3_has_five_local_layers_per_global_layer() -> None:
    facts = load_model_facts("Gemma-3-27B")
    globals_ = [i for i, w in enumerate(facts.layer_windows) if w is None]
    assert globals_ == list(range(5, 62, 6))
    assert set(w for w in facts.layer_windows if w is not None) == {1024}


def test_qwen2_window_is_ignored_when_use_sliding_window_is_false() -> None:
    assert all(w is None for w in load_model_facts("Qwen2.5-7B").layer_windows)


def test_mla_caches_one_latent_plus_rope_dims_per_layer() -> None:
    facts = load_model_facts("DeepSeek-V3")
    assert kvmath.kv_bytes_per_token_per_layer(facts, 2) == [(512 + 64) * 2] * 61
    assert sum(kvmath.kv_bytes_per_token_per_layer(facts, 2)) == 70_272


def test_max_context_is_the_largest_context_that_fits() -> None:
    facts = dense_facts()
    assert kvmath.max_context_by_memory(facts, 2, GIB) == 8192
    assert kvmath.max_context_by_memory(facts, 2, GIB - 1) == 8191


def test_max_context_is_unbounded_when_every_layer_is_windowed() -> None:
    mistral = load_model_facts("Mistral-7B")
    assert kvmath.max_context_by_memory(mistral, 2, GIB) is None
    assert kvmath.max_context_by_memory(mistral, 2, 100 * 131072) == 100


def test_paged_concurrency_beats_contiguous_preallocation() -> None:
    facts = dense_facts()
    budget = 10 * GIB
    assert kvmath.max_concurrency_paged(facts, 2, budget, 8192, 16) == 10
    assert kvmath.max_concurrency_contiguous(facts, 2, budget, 32768) == 2


def test_paged_rounds_each_sequence_up_to_whole_blocks() -> None:
    facts = dense_facts()
    assert kvmath.kv_bytes_paged(facts, 2, 17, 16) == 32 * 131072


@pytest.mark.parametrize("name", ISSUE_MODELS)
def test_shipped_parameter_count_is_within_one_percent_of_published(name: str) -> None:
    facts = load_model_facts(name)
    assert facts.published_parameters is not None and facts.published_parameters_source
    assert count_parameters(facts).total == pytest.approx(facts.published_parameters, rel=0.01)


def test_deepseek_v3_activates_about_37b_parameters() -> None:
    counts = count_parameters(load_model_facts("DeepSeek-V3"))
    assert counts.active == pytest.approx(37e9, rel=0.03)


def test_every_shipped_model_names_its_source_and_round_trips_through_config_json(tmp_path) -> None:
    entries = shipped_model_entries()
    assert sorted(e["name"] for e in entries) == sorted(ISSUE_MODELS)
    for entry in entries:
        assert entry["source"].startswith(entry["repo"]) and "config.json" in entry["source"]
        path = tmp_path / f"{entry['name']}.json"
        path.write_text(json.dumps(entry["config"]))
        from_file = load_model_facts(str(path))
        shipped = facts_from_entry(entry)
        assert (
            replace(
                from_file,
                name=shipped.name,
                source=shipped.source,
                published_parameters=shipped.published_parameters,
                published_parameters_source=shipped.published_parameters_source,
            )
            == shipped
        )


def test_tied_embeddings_are_counted_once() -> None:
    tied = count_parameters(dense_facts(tie_word_embeddings=True))
    untied = count_parameters(dense_facts(tie_word_embeddings=False))
    assert untied.total - tied.total == 128256 * 4096
    assert tied.lm_head == 0


def test_four_bit_weights_include_scales_and_keep_embeddings_16bit() -> None:
    counts = count_parameters(load_model_facts("Llama-3.1-8B"))
    int4 = weight_bytes(counts, WEIGHT_FORMATS["int4"])
    assert int4 == round(counts.linear * (4 + 20 / 128) / 8 + (counts.embedding + counts.lm_head + counts.other) * 2)
    assert weight_bytes(counts, WEIGHT_FORMATS["q4_0"]) == round(counts.total * 4.5 / 8)
    assert int4 > counts.total // 2  # the "4 bits = params / 2 bytes" rule of thumb undercounts


def test_engine_block_count_is_the_engine_sizing_function() -> None:
    facts = load_model_facts("SmolLM2-135M")
    options = PlanOptions(kv_dtype="float32", block_size=16, kv_cache_memory=100_000_000, max_model_len=2048)
    plan = make_plan(facts, options, device=None)
    pool = pool_size(KVShape(30, 3, 64, 4), 16, 100_000_000)
    assert (plan.engine_num_blocks, plan.engine_max_concurrency) == (pool.num_blocks, pool.max_concurrency(2048))
    assert plan.engine_num_blocks == 100_000_000 // (2 * 30 * 3 * 64 * 4 * 16)


def test_decode_bound_is_bandwidth_over_bytes_read_per_step() -> None:
    facts = dense_facts()
    device = Device("d", "custom", 80 * GIB, 1e12, "test")
    plan = make_plan(facts, PlanOptions(weights=WEIGHT_FORMATS["bf16"], context=8192, batch=4), device)
    assert plan.decode_tokens_per_s_bound == pytest.approx(1e12 / (plan.weight_bytes + GIB))
    assert plan.decode_tokens_per_s_bound_batch == pytest.approx(4e12 / (plan.weight_bytes + 4 * GIB))


def test_usable_kv_is_memory_minus_reserve_minus_weights() -> None:
    device = Device("d", "custom", 24 * GIB, 1e12, "test")
    plan = make_plan(dense_facts(), PlanOptions(weights=WEIGHT_FORMATS["bf16"]), device)
    assert default_reserve(device).num_bytes == 24 * GIB // 10 + GIB
    assert plan.usable_kv_bytes == 24 * GIB - (24 * GIB // 10 + GIB) - plan.weight_bytes

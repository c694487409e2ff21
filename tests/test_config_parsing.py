"""One config.json parser: the engine's ModelSpec is narrowed from the planner's ModelFacts."""

from __future__ import annotations

import pytest

from kvpager.model.spec import SUPPORTED_ARCHITECTURES, ModelSpec
from kvpager.planner.models import facts_from_config, shipped_model_entries

# shipped configs carry model_type only; the engine reads `architectures` as checkpoints write it
ARCH_OF_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ARCH_OF_TYPE["qwen3"] = "Qwen3ForCausalLM"
assert set(ARCH_OF_TYPE.values()) == set(SUPPORTED_ARCHITECTURES)
ENGINE_ENTRIES = [
    {**e, "config": {**e["config"], "architectures": [ARCH_OF_TYPE[e["config"]["model_type"]]]}}
    for e in shipped_model_entries()
    if e["config"].get("model_type") in ARCH_OF_TYPE
]


@pytest.mark.parametrize("entry", ENGINE_ENTRIES, ids=[e["name"] for e in ENGINE_ENTRIES])
def test_engine_spec_and_planner_facts_read_the_same_shapes(entry: dict) -> None:
    try:
        spec = ModelSpec.from_hf_config(entry["config"])
    except ValueError as e:  # a shipped model the engine refuses must say why (e.g. partial sliding window)
        assert "not supported" in str(e)
        return
    facts = facts_from_config(entry["config"], name=entry["name"], source="shipped")
    shapes = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")
    assert {k: getattr(spec, k) for k in shapes} == {k: getattr(facts, k) for k in shapes}
    assert spec.tie_word_embeddings == facts.tie_word_embeddings
    assert spec.num_parameters() > 0


def test_there_are_shipped_models_the_engine_runs() -> None:
    assert len(ENGINE_ENTRIES) >= 10


@pytest.mark.parametrize(("model_type", "tied"), [("llama", False), ("qwen2", False), ("gemma2", True)])
def test_missing_tie_word_embeddings_takes_transformers_default_for_the_family(model_type: str, tied: bool) -> None:
    config = {
        "model_type": model_type,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 100,
    }
    assert facts_from_config(config, name="x", source="x").tie_word_embeddings is tied

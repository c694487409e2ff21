"""Checkpoint directories for `--load-format dummy` benchmarks: config.json plus a synthetic tokenizer.

The weights are random (the engine builds them from config.json); the tokenizer is a WordLevel
vocabulary of placeholder tokens so any sampled id decodes. Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# SmolLM2-135M's published config.json (HuggingFaceTB/SmolLM2-135M), the benchmark shape.
SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}


def _llama3(
    hidden: int, inter: int, layers: int, heads: int, head_dim: int, tie: bool, factor: float
) -> dict[str, Any]:
    """A Llama 3.x config.json (meta-llama/Llama-3.1-8B, -3.2-1B, -3.2-3B as published)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": 8, "head_dim": head_dim, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": tie, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    }  # fmt: skip


def _qwen25(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int, tie: bool) -> dict[str, Any]:
    """A Qwen2.5 config.json (Qwen/Qwen2.5-0.5B, -1.5B, -7B as published): q/k/v bias, theta 1e6."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": tie, "hidden_act": "silu",
        "sliding_window": 32768, "use_sliding_window": False, "bos_token_id": 151643, "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    }  # fmt: skip


# Real shapes for `--load-format dummy` benchmarks (random weights, bfloat16 checkpoints as published;
# `--dtype auto` therefore runs them in bfloat16).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": SMOLLM2_135M,
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 64, True, 32.0),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 128, True, 32.0),
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32, 128, False, 8.0),
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2, 151936, True),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, 152064, False),
}


def make_dummy_model_dir(directory: str | Path, shape: str = "smollm2-135m", **overrides: Any) -> Path:
    """Write config.json and a placeholder tokenizer for `shape` into `directory`."""
    if shape not in SHAPES:
        raise ValueError(f"unknown dummy shape {shape!r}; known: {sorted(SHAPES)}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = {**SHAPES[shape], **overrides}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_placeholder_tokenizer(out, int(config["vocab_size"]))
    return out


def write_placeholder_tokenizer(out: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer whose token i is `<i>`; id 0 is the end-of-text special token."""
    vocab = {"<|endoftext|>": 0, **{f"<{i}>": i for i in range(1, vocab_size)}}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": 0,
                "content": "<|endoftext|>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<|endoftext|>"},
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "model_max_length": 8192})
    )

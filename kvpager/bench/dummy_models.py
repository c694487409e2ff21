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

SHAPES: dict[str, dict[str, Any]] = {"smollm2-135m": SMOLLM2_135M}


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

"""Tiny random-weight Hugging Face checkpoints for tests (saved with transformers' save_pretrained).

Each `make_*_checkpoint(path, **overrides)` writes config.json, model.safetensors,
generation_config.json, tokenizer.json and tokenizer_config.json into `path` and returns it.
`overrides` are config fields (e.g. num_key_value_heads=1, head_dim=24, tie_word_embeddings=True).
Weights are seeded; norm weights and biases are perturbed away from 1/0 so the tests see them.
The tokenizer is a byte-level BPE trained on a fixed text, padded with extra special tokens to
exactly `vocab_size`; special ids match the config's bos/eos.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 384,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.05,
}


def random_ids(n: int, seed: int) -> list[int]:
    """`n` token ids drawn (seeded) from 3..vocab_size-1 of the tiny checkpoints: past the bos/eos ids."""
    rng = random.Random(seed)
    return [rng.randrange(3, SMALL["vocab_size"]) for _ in range(n)]


LLAMA_SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 (bos 1, eos 2)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (eos 2)

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TEXT = """The quick brown fox jumps over the lazy dog. A paged KV cache stores keys and values in blocks.
Prefill writes the state for the prompt; decode appends one position per step. Hello, world! 0123456789
Memory management is the heart of serving: blocks are allocated on demand and freed at the end.
Identical prefixes map to identical block hashes, which gives prefix caching, tiering and transfer.
She sells sea shells by the sea shore. How much wood would a woodchuck chuck? Numbers: 3.14159 2.71828
"""


def make_llama_checkpoint(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """LlamaForCausalLM (GQA by default). Pass rope_parameters={...} for llama3 scaling."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**SMALL, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    return _save(Path(path), LlamaConfig(**cfg), LlamaForCausalLM, LLAMA_SPECIALS, LLAMA_TEMPLATE, True, seed)


def make_mistral_checkpoint(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """MistralForCausalLM (sliding_window defaults to 4096, larger than any test sequence)."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = {**SMALL, "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    return _save(Path(path), MistralConfig(**cfg), MistralForCausalLM, LLAMA_SPECIALS, LLAMA_TEMPLATE, True, seed)


def make_qwen2_checkpoint(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Qwen2ForCausalLM: q/k/v bias, tied embeddings by default."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = {**SMALL, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 2, **overrides}
    return _save(Path(path), Qwen2Config(**cfg), Qwen2ForCausalLM, QWEN_SPECIALS, CHATML_TEMPLATE, False, seed)


def make_qwen3_checkpoint(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Qwen3ForCausalLM: per-head q/k RMSNorm, head_dim 32 (not hidden/heads = 16)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = {**SMALL, "head_dim": 32, "bos_token_id": 0, "eos_token_id": 2, **overrides}
    return _save(Path(path), Qwen3Config(**cfg), Qwen3ForCausalLM, QWEN_SPECIALS, CHATML_TEMPLATE, False, seed)


def _save(
    path: Path, config: Any, model_cls: Any, specials: list[str], template: str, add_bos: bool, seed: int
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _perturb(model, seed)
    model.save_pretrained(path)
    write_tokenizer(path, config.vocab_size, specials, template, add_bos)
    return path


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Norm weights ~ 1 + 0.1 N(0, 1) and biases ~ 0.1 N(0, 1), so a bug that ignores them fails."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))


def write_tokenizer(path: Path, vocab_size: int, specials: list[str], chat_template: str, add_bos: bool) -> None:
    """Write tokenizer.json (byte-level BPE, exactly `vocab_size` tokens) and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT] * 4, trainer=trainer)
    extra = vocab_size - tok.get_vocab_size()
    if extra < 0:
        raise ValueError(f"vocab_size {vocab_size} is below the byte-level minimum ({tok.get_vocab_size()})")
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(extra)])
    bos, eos = specials[1], specials[2]
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 1)]
        )
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos if add_bos else None,
        "eos_token": eos,
        "unk_token": specials[0] if add_bos else None,
        "pad_token": specials[0],
        "add_bos_token": add_bos,
        "model_max_length": 256,
        "chat_template": chat_template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

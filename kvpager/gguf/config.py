"""GGUF metadata -> a Hugging Face config.json dict (what ModelSpec.from_hf_config and the planner parse).

Keys follow llama.cpp's converter: `<arch>.block_count`, `<arch>.embedding_length`,
`<arch>.attention.head_count[_kv]`, `<arch>.rope.freq_base`, `<arch>.context_length`, ... Facts the
metadata leaves out are read off the tensors, as llama.cpp does: a missing `output.weight` means tied
embeddings, `blk.0.attn_q.bias` means q/k/v bias, `token_embd.weight`'s rows are the vocabulary.
Llama 3 rope scaling: llama.cpp's converter stores it as the `rope_freqs.weight` tensor (one divisor
per frequency), mapped here to the rope type "freq_factors".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpager.gguf.reader import GGUFError, GGUFModel

# GGUF general.architecture -> the transformers class the engine runs it as. NOTE: llama.cpp files
# Mistral models under "llama" (same math; their sliding window is not in the metadata and llama.cpp
# does not apply it either).
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# general.file_type (llama_ftype) of the float files; quantized files compute in bfloat16 by default.
_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def hf_config_from_gguf(model: GGUFModel) -> dict[str, Any]:
    """The config.json a transformers checkpoint of this model would have. GGUFError when unsupported."""
    arch = model.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_GGUF_ARCHITECTURES)
        raise GGUFError(
            f"unsupported GGUF architecture {arch!r} in {str(model.path)!r}; supported: {supported} (Mistral files are 'llama')"
        )
    meta = model.metadata

    def required(key: str) -> int:
        value = meta.get(f"{arch}.{key}")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise GGUFError(
                f"GGUF file {str(model.path)!r}: metadata {arch}.{key} must be a positive integer, got {value!r}"
            )
        return value

    hidden = required("embedding_length")
    num_heads = required("attention.head_count")
    head_dim = (
        meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden // num_heads
    )
    config: dict[str, Any] = {
        "architectures": [SUPPORTED_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": required("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv") or num_heads,
        "head_dim": int(head_dim),
        "intermediate_size": required("feed_forward_length"),
        "vocab_size": _vocab_size(model),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "attention_bias": "blk.0.attn_q.bias" in model.tensors,
        "hidden_act": "silu",
        "torch_dtype": _FILE_TYPE_DTYPES.get(int(meta.get("general.file_type", -1)), "bfloat16"),
    }
    rope_scaling = _rope_scaling(model, arch, int(head_dim))
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    # NOTE: llama.cpp ends generation at eos, and also at eot/eom where a file names them (Llama 3).
    eos = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    config["eos_token_id"] = list(dict.fromkeys(int(e) for e in eos if e is not None))
    return config


def _vocab_size(model: GGUFModel) -> int:
    embd = model.tensors.get("token_embd.weight")
    if embd is not None:
        return embd.shape[0]
    tokens = model.metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and tokens:
        return len(tokens)
    raise GGUFError(f"GGUF file {str(model.path)!r} has no token_embd.weight tensor")


def _rope_scaling(model: GGUFModel, arch: str, head_dim: int) -> dict[str, Any] | None:
    meta = model.metadata
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    freqs = model.tensors.get(ROPE_FREQS_TENSOR)
    if freqs is not None:
        if freqs.type_name != "F32" or freqs.shape != (head_dim // 2,):
            raise GGUFError(
                f"GGUF file {str(model.path)!r}: {ROPE_FREQS_TENSOR} must be F32 of shape ({head_dim // 2},), "
                f"got {freqs.type_name} {freqs.shape}"
            )
        factors = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        return {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}
    if kind in ("none", None):
        return None
    if kind == "linear":
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if not isinstance(factor, float | int) or factor <= 0:
            raise GGUFError(
                f"GGUF file {str(model.path)!r}: linear rope scaling without a positive {arch}.rope.scaling.factor"
            )
        return {"rope_type": "linear", "factor": float(factor)}
    raise GGUFError(
        f"GGUF file {str(model.path)!r}: rope scaling type {kind!r} is not supported (supported: none, linear, "
        f"Llama 3 {ROPE_FREQS_TENSOR})"
    )

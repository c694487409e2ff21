"""Write GGUF files from the tiny transformers checkpoints of checkpoints.py, as llama.cpp's converter does.

`write_gguf(checkpoint_dir, out_file, tensor_type=...)` uses the `gguf` package's writer: the
metadata keys and tensor names of llama.cpp's convert_hf_to_gguf.py, llama q/k rows permuted for
llama.cpp's RoPE, Llama 3 rope scaling as the `rope_freqs.weight` tensor, 2-D weights in
`tensor_type` (F32, F16, BF16, Q8_0, Q4_0, Q4_1: what gguf-py's quants module can encode; Q4_K, Q5_K,
Q6_K and a Q4_K_M-like mix through tests/kquants.py) and 1-D tensors in F32. The tokenizer goes in as a gpt2 (byte-level BPE) vocabulary from the checkpoint's
tokenizer.json, or with `sentencepiece=True` as a llama SentencePiece-style vocabulary (byte
fallback, scores, no merges) trained here on a fixed text with Chinese in it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
FILE_TYPES = {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K_M": 15, "Q5_K": 17, "Q6_K": 18}
# A Q4_K_M-like mix: llama.cpp keeps these (and the output) at 6 bits, the rest at 4.
_Q4_K_M_SIX_BIT = ("attn_v.weight", "ffn_down.weight", "output.weight")
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
SPM_TEXT = (
    "The quick brown fox jumps over the lazy dog. def main(): return 42\n"
    "A paged KV cache stores keys and values in blocks. 你好，世界！缓存 块\n"
)


def write_gguf(
    checkpoint: Path,
    out: Path,
    *,
    tensor_type: str = "F32",
    sentencepiece: bool = False,
    name: str = "tiny test model",
    pre: str | None = None,
    split_max_tensors: int = 0,
) -> Path:
    import gguf

    config = json.loads((checkpoint / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    head_dim = _metadata(writer, config, arch, name, tensor_type)
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    if sentencepiece:
        _spm_vocab(writer, config["vocab_size"], tokenizer_config)
    else:
        _gpt2_vocab(writer, checkpoint, tokenizer_config, pre or ("qwen2" if arch != "llama" else "llama-bpe"))
    weights = load_file(str(checkpoint / "model.safetensors"))
    for hf_name, value in weights.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        gguf_name = _gguf_name(hf_name)
        value = value.astype(np.float32)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            value = permute_rope_rows(value, config["num_attention_heads"])
        if arch == "llama" and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            value = permute_rope_rows(value, config.get("num_key_value_heads") or config["num_attention_heads"])
        _add_tensor(writer, gguf_name, value, tensor_type if value.ndim == 2 else "F32")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim, float(rope["rope_theta"])))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def permute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows (halves -> interleaved pairs, per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict[str, Any], head_dim: int, base: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes for Llama 3 scaling."""
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _metadata(writer: Any, config: dict[str, Any], arch: str, name: str, tensor_type: str) -> int:
    import gguf

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config["vocab_size"])
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_file_type(FILE_TYPES[tensor_type])
    return int(head_dim)


def _gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "token_embd.weight"
    if name == "norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, index, rest = name.split(".", 2)
    return f"blk.{index}.{_LAYER[rest]}"


def _add_tensor(writer: Any, name: str, value: np.ndarray, tensor_type: str) -> None:
    import gguf
    from kquants import ENCODERS

    if tensor_type == "Q4_K_M":
        tensor_type = "Q6_K" if name.endswith(_Q4_K_M_SIX_BIT) else "Q4_K"
    if tensor_type in ENCODERS:
        raw, _ = ENCODERS[tensor_type](value)
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[tensor_type])
    elif tensor_type == "F32":
        writer.add_tensor(name, value)
    elif tensor_type == "F16":
        writer.add_tensor(name, value.astype(np.float16))
    else:
        qtype = gguf.GGMLQuantizationType[tensor_type]
        writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)


def _gpt2_vocab(writer: Any, checkpoint: Path, tokenizer_config: dict[str, Any], pre: str) -> None:
    data = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    for t in data["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    _specials(writer, tokens, tokenizer_config)


def _spm_vocab(writer: Any, vocab_size: int, tokenizer_config: dict[str, Any]) -> None:
    """A SentencePiece-BPE vocabulary of exactly `vocab_size`: <unk> <s> </s>, 256 byte tokens, learned pieces."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=specials, show_progress=False)
    tok.train_from_iterator([SPM_TEXT] * 8, trainer=trainer)
    learned = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]) if t not in specials]
    tokens = specials + byte_tokens + learned
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    assert len(tokens) == vocab_size, (len(tokens), vocab_size)
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned) + [4] * (vocab_size - 259 - len(learned))
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(tokenizer_config["chat_template"])


def _specials(writer: Any, tokens: list[str], tokenizer_config: dict[str, Any]) -> None:
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        if tokenizer_config.get(key):
            add(tokens.index(tokenizer_config[key]))
    writer.add_add_bos_token(bool(tokenizer_config.get("add_bos_token")))
    writer.add_chat_template(tokenizer_config["chat_template"])

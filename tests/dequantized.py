"""A float checkpoint holding a quantized model's dequantized weights: the reference a quantized model's
greedy tokens are held to (quantization changes the weights, nothing else)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from kvpager.model.backends.quant_weights import Int4Weight, Int8Weight
from kvpager.model.llama import CausalLM


def dequantized_checkpoint(model: CausalLM, src: Path, dst: Path) -> Path:
    """`src` with every projection and the lm_head replaced by the quantized model's dequantized weights
    (float32); a tied embedding stays the lookup table and the checkpoint gets an untied lm_head."""
    dst.mkdir()
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    assert isinstance(model.lm_head.weight, Int8Weight)  # --quantize-lm-head is the default
    tensors["lm_head.weight"] = model.lm_head.weight.dequantize().contiguous()
    config["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config))
    spec = model.spec
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.qkv_proj.weight, Int8Weight | Int4Weight)
        q, k, v = attn.qkv_proj.weight.dequantize().split([spec.q_size, spec.kv_size, spec.kv_size])
        gate, up = mlp.gate_up_proj.weight.dequantize().chunk(2)
        parts = {"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v, "mlp.gate_proj": gate}
        parts |= {"mlp.up_proj": up, "self_attn.o_proj": attn.o_proj.weight.dequantize()}
        parts["mlp.down_proj"] = mlp.down_proj.weight.dequantize()
        for part, tensor in parts.items():
            tensors[f"model.layers.{i}.{part}.weight"] = tensor.contiguous()
    save_file(tensors, dst / "model.safetensors")
    return dst

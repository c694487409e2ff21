"""Loading is lean: a bfloat16 checkpoint is memory-mapped and converted tensor by tensor, never held
in float32, so peak RSS during the load stays within the final RSS plus the largest tensor.

Measured in a fresh interpreter (subprocess) on a ~50 MB bfloat16 checkpoint: VmHWM (the peak
resident set) against VmRSS once the model is loaded, read from /proc/self/status.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvpager.bench.dummy_models import write_placeholder_tokenizer

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 16384,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
PROBE = """
import gc, json, sys, torch
from kvpager.model import load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)

torch.set_num_threads(1)
results = {}
for quantization in (None, "int4"):
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # NOTE: "5" resets VmHWM to the current RSS
        f.write("5")
    base = status("VmRSS")
    model = load_model(sys.argv[1], dtype=torch.bfloat16, device="cpu", kernel_backend="torch", quantization=quantization)
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.dim() > 1})  # matrices (norms: float32)
    results[str(quantization)] = {"base": base, "final": status("VmRSS"), "peak": status("VmHWM"), "dtypes": dtypes}
    del model
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A Llama-shaped bfloat16 checkpoint written tensor by tensor; returns (dir, largest tensor bytes)."""
    out = tmp_path_factory.mktemp("bf16_lean")
    h, i, v, layers = (
        CONFIG["hidden_size"],
        CONFIG["intermediate_size"],
        CONFIG["vocab_size"],
        CONFIG["num_hidden_layers"],
    )
    kv = h // CONFIG["num_attention_heads"] * CONFIG["num_key_value_heads"]
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes |= {f"{p}self_attn.q_proj.weight": (h, h), f"{p}self_attn.k_proj.weight": (kv, h)}
        shapes |= {f"{p}self_attn.v_proj.weight": (kv, h), f"{p}self_attn.o_proj.weight": (h, h)}
        shapes |= {
            f"{p}mlp.gate_proj.weight": (i, h),
            f"{p}mlp.up_proj.weight": (i, h),
            f"{p}mlp.down_proj.weight": (h, i),
        }
        shapes |= {f"{p}input_layernorm.weight": (h,), f"{p}post_attention_layernorm.weight": (h,)}
    tensors = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(CONFIG))
    write_placeholder_tokenizer(out, v)
    return out, max(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.slow
def test_bf16_checkpoint_loads_within_final_rss_plus_the_largest_tensor(bf16_checkpoint: tuple[Path, int]) -> None:
    path, largest = bf16_checkpoint
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, cwd=root, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    file_bytes = (path / "model.safetensors").stat().st_size
    assert results["None"]["final"] - results["None"]["base"] >= 0.9 * file_bytes  # the weights are resident
    for quantization, m in results.items():
        assert m["dtypes"] == ["torch.bfloat16"], quantization  # embedding, lm_head: bf16, no float32 matrix
        assert m["peak"] <= m["final"] + largest, (
            f"{quantization}: peak RSS {m['peak'] / 2**20:.1f} MiB > final {m['final'] / 2**20:.1f} MiB "
            f"+ largest tensor {largest / 2**20:.1f} MiB"
        )

"""Build a CausalLM from a Hugging Face checkpoint directory (safetensors), a GGUF model, or config alone (dummy).

The module tree is created on the meta device (no init cost), the checkpoint's tensors are fused
(q/k/v, gate/up), cast to the compute dtype, shape-checked and assigned.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kvpager.core.config import LOAD_FORMATS
from kvpager.gguf import GGUFModel, is_gguf_path, open_gguf
from kvpager.model.backends.ops import select_ops
from kvpager.model.gguf_weights import read_gguf_state
from kvpager.model.llama import CausalLM
from kvpager.model.spec import ModelFileNotFoundError, ModelSpec, load_model_spec, read_json, spec_from_gguf

logger = logging.getLogger("kvpager")

DUMMY_STD = 0.02
# NOTE: tensors older checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    kernel_backend: str = "auto",
    kv_dtype: torch.dtype | None = None,
    gguf_model: GGUFModel | None = None,
) -> CausalLM:
    """Load the model in `model_dir` onto `device` in `dtype`.

    kernel_backend: "auto" (C++ kernels for float32 on CPU when they build, else torch), "torch" or
    "cpu" (see kvpager.model.backends.ops.select_ops); kv_dtype: the KV cache's dtype (default: `dtype`).

    load_format: "auto"/"safetensors" read *.safetensors (sharded via model.safetensors.index.json or
    not); "dummy" draws random weights from config.json alone (normal(0, 0.02) from `seed`, norms at 1).
    "auto"/"gguf" read a GGUF model when `model_dir` is a .gguf file or a directory holding one (or pass
    the already opened `gguf_model`); quantized tensors are dequantized to `dtype` (logged per type).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    device = torch.device(device)
    if gguf_model is None and (load_format == "gguf" or (load_format != "safetensors" and is_gguf_path(model_dir))):
        gguf_model = open_gguf(model_dir)
    if gguf_model is not None and load_format == "safetensors":
        raise ValueError(f"{str(model_dir)!r} is a GGUF model; use load_format 'auto' or 'gguf', not 'safetensors'")
    spec = spec_from_gguf(gguf_model) if gguf_model is not None else load_model_spec(model_dir)
    with torch.device("meta"):
        model = CausalLM(spec)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if spec.tie_word_embeddings:
        expected.pop("lm_head.weight")
    if load_format == "dummy":
        state = dummy_state_dict(expected, seed, dtype, device)
    elif gguf_model is not None:
        tensors, report = read_gguf_state(gguf_model, spec, dtype)
        for line in report.lines():
            logger.info("GGUF weights %s", line)
        state = _fuse(spec, tensors, dtype, device)
    else:
        state = _fuse(spec, _read_checkpoint(Path(model_dir), spec), dtype, device)
    _check_state(state, expected, Path(model_dir))
    model.load_state_dict(state, strict=False, assign=True)
    # NOTE: the model holds the tensors now; dropping the dict lets finish_loading's ops free each
    # weight as they replace it (kernel layouts), instead of holding two copies of every weight.
    del state
    model.finish_loading(dtype, device, select_ops(kernel_backend, dtype, kv_dtype or dtype, device))
    return model


def dummy_state_dict(
    expected: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Deterministic random weights (drawn on CPU so every device gets the same values)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    state = {}
    for name, shape in expected.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.randn(shape, generator=gen) * DUMMY_STD
        state[name] = t.to(device=device, dtype=dtype)
    return state


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shard files, from the index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index)!r} has no 'weight_map'")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFileNotFoundError(
            f"no *.safetensors weights in {str(model_dir)!r} (pytorch_model.bin is not supported; use load_format='dummy' for random weights)"
        )
    for f in files:
        if not f.is_file():
            raise ModelFileNotFoundError(f"weight shard {str(f)!r} listed in the index is missing")
    return files


def _read_checkpoint(model_dir: Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """All checkpoint tensors on CPU, names without the "model." prefix, ignored ones dropped."""
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        for name, tensor in _iter_file(path):
            if name.endswith(_IGNORED_SUFFIXES) or (spec.tie_word_embeddings and name == "lm_head.weight"):
                continue
            tensors[name.removeprefix("model.")] = tensor
    return tensors


def _iter_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"cannot read safetensors file {str(path)!r}: {e}") from e


def _fuse(
    spec: ModelSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Map checkpoint names to the model's, fusing q/k/v and gate/up; leftovers stay for _check_state."""
    for i in range(spec.num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        for kind in ("weight", "bias"):
            _cat(tensors, [f"{attn}{p}_proj.{kind}" for p in "qkv"], f"{attn}qkv_proj.{kind}")
            _cat(tensors, [f"{mlp}{p}_proj.{kind}" for p in ("gate", "up")], f"{mlp}gate_up_proj.{kind}")
    return {name: t.to(device=device, dtype=dtype) for name, t in tensors.items()}


def _cat(tensors: dict[str, torch.Tensor], parts: list[str], fused: str) -> None:
    """Replace `parts` by their concatenation along dim 0 when all are present (else leave them)."""
    if all(p in tensors for p in parts):
        _check_same_width(tensors, parts)
        tensors[fused] = torch.cat([tensors.pop(p) for p in parts], dim=0)


def _check_same_width(tensors: dict[str, torch.Tensor], parts: list[str]) -> None:
    widths = {tuple(tensors[p].shape[1:]) for p in parts}
    if len(widths) > 1:
        shapes = ", ".join(f"{p}: {tuple(tensors[p].shape)}" for p in parts)
        raise ValueError(
            f"tensor shape mismatch between fused parts ({shapes}); config.json does not match the weights"
        )


def _check_state(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], model_dir: Path) -> None:
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(
            f"weights in {str(model_dir)!r} lack {len(missing)} tensor(s) the config needs, e.g. {_hf_names(missing[:5])}"
        )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ValueError(
            f"weights in {str(model_dir)!r} hold tensors this model does not use: {_hf_names(unexpected[:5])}"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"tensor {_hf_names([name])[0]!r} in {str(model_dir)!r} has shape {tuple(state[name].shape)}, config.json implies {shape}"
            )


def _hf_names(names: list[str]) -> list[str]:
    """Names as the checkpoint spells them (fused names kept: they say which projections)."""
    out = []
    for n in names:
        n = n.replace("qkv_proj", "{q,k,v}_proj").replace("gate_up_proj", "{gate,up}_proj")
        out.append(n if n.startswith("lm_head") else f"model.{n}")
    return out

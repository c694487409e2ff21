"""Build a CausalLM from a Hugging Face checkpoint directory (safetensors) or from config alone (dummy).

The module tree is created on the meta device (no init cost). Loading is lean: the safetensors files
are memory-mapped (safetensors_mmap.py) and each of the model's tensors is built on its own, straight
from the mapped bytes into its final dtype and device (q/k/v and gate/up written into their fused
tensor part by part), after which the source pages are released. A bfloat16 checkpoint is never held
in float32, and peak RSS stays near the final weights plus one tensor. With `quantization` the four
projections of every layer are quantized part by part as they are read (quant_weights.py) and, unless
`quantize_lm_head` is False, the lm_head is int8 per output channel in every mode (`lm_head_weight`; a
tied embedding keeps its table in `dtype` and the lm_head gets its own int8 copy of it); the embedding,
norms and biases stay in `dtype`. A GGUF file's lm_head keeps the form the file gives it (tied, with
--gguf-int8-activations: a packed copy of the embedding's blocks, GGUFWeights.tied_lm_head).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from kvpager.core.config import LOAD_FORMATS, QUANTIZATIONS
from kvpager.gguf import GGUFModel, is_gguf_path, open_gguf
from kvpager.model.backends.ops import select_ops
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.backends.quant_weights import HALF_WEIGHTS, DenseWeight, HalfWeight, PackedWeight, cat_rows, quantize
from kvpager.model.gguf_packed import layout_of, stack_rows
from kvpager.model.gguf_weights import GGUFWeights
from kvpager.model.llama import CausalLM
from kvpager.model.lm_head import lm_head_weight
from kvpager.model.parallel import TensorParallel, shard_spec
from kvpager.model.precision import compute_dtype
from kvpager.model.safetensors_mmap import MappedSafetensors
from kvpager.model.spec import ModelFileNotFoundError, ModelSpec, load_model_spec, read_json, spec_from_gguf
from kvpager.model.tp_shards import ShardPlan, shard_plan

logger = logging.getLogger("kvpager")

_T = TypeVar("_T")
DUMMY_STD = 0.02
COPY_CHUNK_BYTES = 4 << 20  # source bytes copied (then released) at a time
# NOTE: tensors older checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_PROJECTIONS = (
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
)


@dataclass(frozen=True)
class _Source:
    """One checkpoint tensor (or a dummy one): its shape, how to get its values, how to let them go."""

    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]
    release: Callable[[tuple[int, int] | None], None] = lambda rows: None  # rows (first, end) or all
    owned: bool = False  # read() is an in-memory tensor the model may keep as it is
    packed: Callable[[], PackedWeight] | None = None  # the tensor's own packed form (GGUF blocks), if any


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
    quantization: str | None = None,
    quantization_group_size: int | None = None,
    quantize_lm_head: bool = True,
    parallel: TensorParallel | None = None,
    gguf_dequantize: bool = False,
    gguf_int8_activations: bool = False,
) -> CausalLM:
    """Load the model in `model_dir` onto `device` in `dtype`.

    kernel_backend: "auto" (C++ kernels for float32 on CPU when they build, else torch), "torch" or
    "cpu" (see kvpager.model.backends.ops.select_ops); kv_dtype: the KV cache's dtype (default: `dtype`).
    quantization: None, "int8" (per output channel, or groups of `quantization_group_size`) or "int4"
    (groups of `quantization_group_size`, default 128); see kvpager.model.backends.quant_weights. With a
    quantization and `quantize_lm_head` the lm_head is int8 per output channel (`lm_head_weight`), tied or
    not (safetensors and dummy weights; a GGUF file's lm_head is left as the file has it).

    load_format: "auto"/"safetensors" read *.safetensors (sharded via model.safetensors.index.json or
    not); "dummy" draws random weights from config.json alone (normal(0, 0.02) from `seed`, norms at 1).
    "auto"/"gguf" read a GGUF model when `model_dir` is a .gguf file or a directory holding one (or pass
    the already opened `gguf_model`). Its quantized linear weights run in their packed form on a CPU with
    the packed-weight kernels (kvpager.model.gguf_packed), unless `gguf_dequantize`, `quantization`
    (which requantizes) or `parallel` (shards are sliced from floats); other tensors are dequantized to
    `dtype`. Logged per ggml type. `gguf_int8_activations`: the packed Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K weights
    multiply activations quantized to int8 per block of 32 (kvpager.model.backends.quant_dot).

    parallel: tensor parallelism; this rank loads only its shard (kvpager/model/tp_shards.py), sliced
    from the mapped tensors before it is copied, and runs torch's ops (the fused kernels do not
    all-reduce between layers).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {quantization!r}")
    device = torch.device(device)
    if gguf_model is None and (load_format == "gguf" or (load_format != "safetensors" and is_gguf_path(model_dir))):
        gguf_model = open_gguf(model_dir)
    if gguf_model is not None and load_format == "safetensors":
        raise ValueError(f"{str(model_dir)!r} is a GGUF model; use load_format 'auto' or 'gguf', not 'safetensors'")
    if gguf_int8_activations and gguf_model is None:
        raise ValueError(
            "--gguf-int8-activations applies to GGUF files; for a safetensors checkpoint use --quantization "
            "w8a8_int8 or w4a8_int8"
        )
    spec = spec_from_gguf(gguf_model) if gguf_model is not None else load_model_spec(model_dir)
    head_method = quantization if quantize_lm_head and gguf_model is None else None
    with torch.device("meta"):
        model = CausalLM(spec if parallel is None else shard_spec(spec, parallel.layout), parallel)
        whole = model if parallel is None else CausalLM(spec)
    expected, full_shapes = _expected_shapes(model, spec), _expected_shapes(whole, spec)
    files: list[MappedSafetensors] = []
    gguf: GGUFWeights | None = None
    try:
        if load_format == "dummy":
            sources = _dummy_sources(full_shapes, seed)
        elif gguf_model is not None:
            kernels = device.type == "cpu" and quant_kernels_or_none() is not None
            native = kernels and not gguf_dequantize and parallel is None
            not_native_reason = (
                f"no packed-weight kernels on {device.type}"
                if not kernels
                else "tensor parallelism slices float weights"
                if parallel is not None
                else "floats asked for"
            )
            if gguf_int8_activations and not native:
                # the flag would silently change nothing: the file's blocks are dequantized here
                raise ValueError(
                    "--gguf-int8-activations runs the file's blocks through the CPU integer-dot kernels, "
                    f"but here the GGUF weights are dequantized ({not_native_reason})"
                )
            gguf = GGUFWeights(
                gguf_model,
                spec,
                dtype,
                native=native,
                not_native_reason=not_native_reason,
                quantization=quantization,
                quantization_group_size=quantization_group_size,
                vector_dtype=compute_dtype(dtype, device),
                int8_activations=gguf_int8_activations,
            )
            sources = _fuse(spec, {n: _gguf_source(gguf, n, shape) for n, shape in gguf.shapes().items()})
        else:
            files = [MappedSafetensors(p) for p in safetensors_files(Path(model_dir))]
            sources = _fuse(spec, _checkpoint_sources(files, spec))
        _check_state({n: _fused_shape(s) for n, s in sources.items()}, full_shapes, Path(model_dir))
        state: dict[str, torch.Tensor] = {}
        packed: dict[str, PackedWeight] = {}
        for name in expected:  # NOTE: in the model's order (dummy weights draw from one generator)
            parts = sources[name]
            if parallel is not None:
                parts = _shard(parts, shard_plan(name, spec, parallel.layout, parallel.rank))
            if quantization is not None and name.endswith(_PROJECTIONS):
                packed[name] = cat_rows([_quantized(s, quantization, quantization_group_size, device) for s in parts])
            elif head_method is not None and name == "lm_head.weight":  # untied: the checkpoint's own lm_head
                packed[name] = cat_rows([_quantized_head(s, head_method, device) for s in parts])
            elif any(s.packed is not None for s in parts):  # GGUF blocks executed as they are
                packed[name] = stack_rows([s.packed() if s.packed else DenseWeight(s.read()) for s in parts])
            else:
                # NOTE: a GGUF model's norms and biases keep the dtype they were read in (GGUFWeights.dtype_of)
                target = compute_dtype(dtype, device) if gguf is not None and len(expected[name]) == 1 else dtype
                state[name] = _materialise(parts, expected[name], target, device)
        if head_method is not None and spec.tie_word_embeddings:
            # NOTE: tied: the lookup keeps the table in `dtype`; the lm_head multiplies an int8 copy of it
            packed["lm_head.weight"] = lm_head_weight(state["embed_tokens.weight"], head_method)
        elif gguf is not None and (tied_head := gguf.tied_lm_head()) is not None:
            packed["lm_head.weight"] = tied_head  # the embedding's own blocks (--gguf-int8-activations)
    finally:
        for f in files:
            f.close()
    if gguf is not None:
        for line in gguf.report_lines():
            logger.info("GGUF weights %s", line)
    model.load_state_dict(state, strict=False, assign=True)
    for name, weight in packed.items():
        set_linear_weight(model, name, weight)
    # NOTE: the model holds the tensors now; dropping the dict lets finish_loading's ops free each
    # weight as they replace it (kernel layouts), instead of holding two copies of every weight.
    del state, packed
    if parallel is not None:
        kernel_backend = "torch"  # NOTE: config validation refuses "cpu" with tensor parallelism
    model.finish_loading(dtype, device, select_ops(kernel_backend, dtype, kv_dtype or dtype, device))
    if dtype in HALF_WEIGHTS and device.type == "cpu" and quant_kernels_or_none() is not None:
        _wrap_half_linears(model)
    return model


def _expected_shapes(model: CausalLM, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    if spec.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def _shard(parts: list[_Source], plan: ShardPlan | None) -> list[_Source]:
    """The sources of this rank's shard: slices (views, nothing copied yet) of the fused tensor's parts.

    NOTE: each part is read once however many slices it gives (a dummy part draws its values when read).
    """
    if plan is None:
        return parts
    if plan.zero:
        shape = _fused_shape(parts)
        return [_Source(shape, lambda: torch.zeros(shape))]
    out: list[_Source] = []
    offset = 0  # global index of the part's first row (dim 0; a dim-1 plan has one part)
    for part in parts:
        read = _read_once(part)
        length = part.shape[plan.dim]
        for start, end in plan.ranges:
            a, b = max(start, offset) - offset, min(end, offset + length) - offset
            if b > a:
                out.append(_slice_source(part, read, plan.dim, a, b))
        offset += length if plan.dim == 0 else 0
    if plan.pad_rows:
        pad = (plan.pad_rows, *parts[0].shape[1:])
        out.append(_Source(pad, lambda: torch.zeros(pad)))
    return out


def _read_once(part: _Source) -> Callable[[], torch.Tensor]:
    memo: list[torch.Tensor] = []

    def read() -> torch.Tensor:
        if not memo:
            memo.append(part.read())
        return memo[0]

    return read


def _slice_source(part: _Source, read: Callable[[], torch.Tensor], dim: int, a: int, b: int) -> _Source:
    shape = tuple(b - a if d == dim else n for d, n in enumerate(part.shape))
    if dim == 0:
        return _Source(
            shape,
            lambda: read()[a:b],
            lambda rows: part.release(None if rows is None else (a + rows[0], a + rows[1])),
        )
    # NOTE: a column slice is copied on its own (the shard only) so quantizers get a contiguous tensor
    return _Source(shape, lambda: read()[:, a:b].contiguous(), part.release)


def set_linear_weight(model: nn.Module, name: str, weight: PackedWeight) -> None:
    """Replace the Linear weight `name` ("layers.0.mlp.down_proj.weight") by a packed weight object."""
    module = model.get_submodule(name.removesuffix(".weight"))
    if not isinstance(module, nn.Linear) or tuple(weight.shape) != (module.out_features, module.in_features):
        raise ValueError(f"{name}: a packed weight of shape {tuple(weight.shape)} does not fit {module}")
    if "weight" in module._parameters:
        del module._parameters["weight"]
    object.__setattr__(module, "weight", weight)


def packed_weights(model: nn.Module) -> dict[str, PackedWeight]:
    """The model's packed linear weights by parameter name, in module order."""
    return {
        f"{name}.weight": m.weight
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and isinstance(m.weight, PackedWeight)
    }


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds (elements x element size: a kernel layout's padding is not
    counted): parameters plus packed weights, a tensor shared by two modules (tied lm_head) once."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *(t for w in packed_weights(model).values() for t in w.tensors())]:
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def quantized_weights_digest(model: nn.Module) -> str:
    """sha256 over the quantized weights (method, shape, stored bytes), "" when none are quantized."""
    quantized = {n: w for n, w in packed_weights(model).items() if not isinstance(w, HalfWeight)}
    if not quantized:
        return ""
    h = hashlib.sha256()
    for name, weight in quantized.items():
        h.update(name.encode())
        weight.update_digest(h)
    return h.hexdigest()


def packed_layout_digest(model: nn.Module) -> str:
    """sha256 over how each packed linear weight executes (name, format, group, shape), "" when none is
    packed: with a GGUF file's data digest, it names the weights a GGUF model computes with."""
    layouts = [f"{n}={layout_of(w)}" for n, w in packed_weights(model).items() if not isinstance(w, HalfWeight)]
    return hashlib.sha256("\n".join(layouts).encode()).hexdigest() if layouts else ""


def _wrap_half_linears(model: CausalLM) -> None:
    """bfloat16 / float16 linear weights (projections and lm_head) read by the packed-weight kernel."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and isinstance(module.weight, torch.Tensor):
            kind = HALF_WEIGHTS.get(module.weight.dtype)
            if kind is not None and module.weight.is_contiguous():
                set_linear_weight(model, f"{name}.weight", kind(module.weight.detach()))


def _materialise(
    parts: list[_Source], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The tensor in `dtype` on `device`, each part copied (and converted) into its rows, then released."""
    if len(parts) == 1 and parts[0].owned:
        src = parts[0].read()
        if src.dtype == dtype and src.device == device and tuple(src.shape) == shape and src.is_contiguous():
            parts[0].release(None)
            return src
    out = torch.empty(shape, dtype=dtype, device=device)
    if not shape:
        out.copy_(parts[0].read())
        parts[0].release(None)
        return out
    row = 0
    for part in parts:
        src = part.read()
        step = max(1, COPY_CHUNK_BYTES // max(1, src[0].numel() * src.element_size())) if src.dim() else 1
        for r0 in range(0, part.shape[0], step):  # NOTE: row chunks, each released once copied
            r1 = min(part.shape[0], r0 + step)
            out[row + r0 : row + r1].copy_(src[r0:r1])
            part.release((r0, r1))
        row += part.shape[0]
    return out


def _quantized(part: _Source, method: str, group: int | None, device: torch.device) -> PackedWeight:
    weight = quantize(part.read().to(device), method, group)
    part.release(None)
    return weight


def _quantized_head(part: _Source, method: str, device: torch.device) -> PackedWeight:
    weight = lm_head_weight(part.read().to(device), method)
    part.release(None)
    return weight


def _fused_shape(parts: list[_Source]) -> tuple[int, ...]:
    first = parts[0].shape
    return first if len(parts) == 1 else (sum(p.shape[0] for p in parts), *first[1:])


def _dummy_sources(expected: dict[str, tuple[int, ...]], seed: int) -> dict[str, list[_Source]]:
    """Deterministic random weights (drawn on CPU, in float32, so every device and dtype gets the same values)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def draw(name: str, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        if name.endswith("norm.weight"):
            return lambda: torch.ones(shape)
        if name.endswith(".bias"):
            return lambda: torch.zeros(shape)
        # NOTE: scaled in place: one float32 copy of the tensor at a time (the 8B embedding is 2 GiB)
        return lambda: torch.randn(shape, generator=gen).mul_(DUMMY_STD)

    return {name: [_Source(shape, draw(name, shape))] for name, shape in expected.items()}


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


def _checkpoint_sources(files: list[MappedSafetensors], spec: ModelSpec) -> dict[str, _Source]:
    """Every checkpoint tensor by model name (no "model." prefix), ignored ones dropped."""
    sources: dict[str, _Source] = {}
    for f in files:
        for name, info in f.infos.items():
            if name.endswith(_IGNORED_SUFFIXES) or (spec.tie_word_embeddings and name == "lm_head.weight"):
                continue
            sources[name.removeprefix("model.")] = _Source(info.shape, _bind(f.view, name), _bind_release(f, name))
    return sources


def _gguf_source(gguf: GGUFWeights, name: str, shape: tuple[int, ...]) -> _Source:
    """A GGUF tensor: read (a new tensor, the model may keep it) or packed from its blocks, on demand."""
    return _Source(shape, _bind(gguf.read, name), owned=True, packed=gguf.packer(name))


def _bind(fn: Callable[[str], _T], name: str) -> Callable[[], _T]:
    return lambda: fn(name)


def _bind_release(f: MappedSafetensors, name: str) -> Callable[[tuple[int, int] | None], None]:
    return lambda rows: f.release(name, rows)


def _fuse(spec: ModelSpec, tensors: dict[str, _Source]) -> dict[str, list[_Source]]:
    """Map checkpoint names to the model's, grouping q/k/v and gate/up; leftovers stay for _check_state."""
    out = {name: [src] for name, src in tensors.items()}
    for i in range(spec.num_layers):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        for kind in ("weight", "bias"):
            _group(out, [f"{attn}{p}_proj.{kind}" for p in "qkv"], f"{attn}qkv_proj.{kind}")
            _group(out, [f"{mlp}{p}_proj.{kind}" for p in ("gate", "up")], f"{mlp}gate_up_proj.{kind}")
    return out


def _group(sources: dict[str, list[_Source]], parts: list[str], fused: str) -> None:
    """Replace `parts` by one entry holding all of them, in order, when all are present (else leave them)."""
    if all(p in sources for p in parts):
        widths = {tuple(sources[p][0].shape[1:]) for p in parts}
        if len(widths) > 1:
            shapes = ", ".join(f"{p}: {sources[p][0].shape}" for p in parts)
            raise ValueError(
                f"tensor shape mismatch between fused parts ({shapes}); config.json does not match the weights"
            )
        sources[fused] = [sources.pop(p)[0] for p in parts]


def _check_state(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], model_dir: Path) -> None:
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise ValueError(
            f"weights in {str(model_dir)!r} lack {len(missing)} tensor(s) the config needs, e.g. {_hf_names(missing[:5])}"
        )
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise ValueError(
            f"weights in {str(model_dir)!r} hold tensors this model does not use: {_hf_names(unexpected[:5])}"
        )
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(
                f"tensor {_hf_names([name])[0]!r} in {str(model_dir)!r} has shape {tuple(shapes[name])}, config.json implies {shape}"
            )


def _hf_names(names: list[str]) -> list[str]:
    """Names as the checkpoint spells them (fused names kept: they say which projections)."""
    out = []
    for n in names:
        n = n.replace("qkv_proj", "{q,k,v}_proj").replace("gate_up_proj", "{gate,up}_proj")
        out.append(n if n.startswith("lm_head") else f"model.{n}")
    return out

"""Engine start-up: device, weights, tokenizer, KV budget and pool size, model fingerprint."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvpager.core.config import DTYPE_BYTES, EngineConfig, resolve_dtype, resolve_gguf_int8_activations
from kvpager.core.hashing import FingerprintComponent, RequestId, model_fingerprint
from kvpager.core.scheduler import SchedulerOutput
from kvpager.core.sizing import PoolSize, default_cpu_kv_budget, default_cuda_kv_budget, pool_size
from kvpager.engine.host_malloc import keep_freed_memory
from kvpager.engine.paths import resolve_model_dir
from kvpager.gguf import GGUFModel, is_gguf_path, open_gguf
from kvpager.model.backends.bf16_linear import native_bf16_matmul_available
from kvpager.model.backends.quant_dot import DYNAMIC_METHODS, bf16_gemm_prompts, cpu_vendor, dot_kernel_max_rows
from kvpager.model.backends.quant_kernels import quant_kernels_or_none
from kvpager.model.backends.quant_weights import Int8Weight
from kvpager.model.dtypes import TORCH_DTYPES
from kvpager.model.llama import CausalLM
from kvpager.model.lm_head import lm_head_format
from kvpager.model.loader import (
    DUMMY_STD,
    load_model,
    model_weight_bytes,
    packed_layout_digest,
    quantized_weights_digest,
)
from kvpager.model.parallel import TensorParallel
from kvpager.model.spec import ModelSpec, load_model_spec, spec_from_gguf
from kvpager.text.gguf_tokenizer import tokenizer_from_gguf
from kvpager.text.tokenizer import Tokenizer
from kvpager.worker.runner import ModelRunner
from kvpager.worker.structured import GrammarCompiler

logger = logging.getLogger("kvpager")

# Activations and allocator slack kept free on CUDA when the budget is derived from free memory.
CUDA_ACTIVATION_RESERVE = 1 << 30
# The seed `load_model` draws dummy weights from (its default; named here for the fingerprint).
DUMMY_WEIGHTS_SEED = 0
# config.json keys that never change the forward pass, so never the KV: metadata and generation
# defaults. Every other key (rope, norms, heads, dims, window, quantization, ...) is fingerprinted.
CONFIG_KEYS_NOT_FINGERPRINTED = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
    }
)


@dataclass(frozen=True)
class LoadedModel:
    model_dir: Path
    spec: ModelSpec
    model: CausalLM
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    weight_bytes: int
    fingerprint: bytes
    max_model_len: int
    pool: PoolSize
    weights_digest: str = ""  # what the fingerprint names the weights by ("dummy-<seed and shapes>" for dummy)
    config: EngineConfig | None = None  # the configuration with dtype resolved ("auto" -> the checkpoint's)


def build_runner(
    lm: LoadedModel,
    config: EngineConfig,
    parallel: TensorParallel | None,
    *,
    eos_token_ids: tuple[int, ...] = (),
    grammar: GrammarCompiler | None = None,
    on_step: Callable[[SchedulerOutput, dict[RequestId, int]], None] | None = None,
) -> ModelRunner:
    """The runner over a loaded model and its KV pool: the one construction rank 0 (the engine) and
    every tensor-parallel worker share. The keywords are rank 0's (it samples, stops requests and
    broadcasts each step); a worker passes none."""
    return ModelRunner(
        lm.model,
        lm.spec,
        num_blocks=lm.pool.num_blocks,
        block_size=config.block_size,
        kv_dtype=lm.kv_dtype,
        device=lm.device,
        eos_token_ids=eos_token_ids,
        fp32_matmul_precision=config.fp32_matmul_precision,
        seed=config.seed,
        grammar=grammar,
        parallel=parallel,
        on_step=on_step,
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return device


def model_spec_of(config: EngineConfig) -> ModelSpec:
    """The model's spec from config.json (or a GGUF file's metadata), without loading weights."""
    model_dir = resolve_model_dir(config.model)
    if config.load_format != "safetensors" and is_gguf_path(model_dir):
        return spec_from_gguf(open_gguf(model_dir))
    return load_model_spec(str(model_dir))


def load(config: EngineConfig, parallel: TensorParallel | None = None) -> LoadedModel:
    """Load everything the engine needs, in the order that fails fastest on bad input.

    With `parallel` (tensor parallelism, every rank calls this) the model is this rank's shard, the
    pool is sized from this rank's KV heads and every rank takes the smallest block count of all.
    """
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    model_dir = resolve_model_dir(config.model)
    gguf_model = open_gguf(model_dir) if config.load_format != "safetensors" and is_gguf_path(model_dir) else None
    spec = spec_from_gguf(gguf_model) if gguf_model is not None else load_model_spec(str(model_dir))
    tokenizer = load_tokenizer(config.tokenizer, model_dir, gguf_model)
    max_model_len = resolve_max_model_len(config, spec)
    device = resolve_device(config.device)
    if device.type == "cpu":
        logger.info("host memory: %s", keep_freed_memory(os.environ))
    int8_activations = resolve_gguf_int8_activations(
        config.gguf_int8_activations,
        gguf=gguf_model is not None,
        quantization=config.quantization,
        tensor_parallel_size=config.tensor_parallel_size,
        cpu_kernels=device.type == "cpu" and quant_kernels_or_none() is not None,
    )
    config = replace(
        config,
        dtype=resolve_dtype(config.dtype, spec.torch_dtype, device.type),
        gguf_int8_activations=int8_activations,
    )
    dtype = TORCH_DTYPES[config.dtype]
    kv_dtype = TORCH_DTYPES[config.resolved_kv_cache_dtype]
    model = load_model(
        str(model_dir),
        dtype=dtype,
        device=device,
        load_format=config.load_format,
        kernel_backend=config.kernel_backend,
        kv_dtype=kv_dtype,
        gguf_model=gguf_model,
        quantization=config.quantization,
        quantization_group_size=config.resolved_quantization_group_size,
        quantize_lm_head=config.quantize_lm_head,
        parallel=parallel,
        gguf_int8_activations=int8_activations,
    )
    model.eval()
    log_weight_format(config, spec, device, lm_head_format(model), gguf=gguf_model is not None)
    weight_bytes = model_weight_bytes(model)
    budget = kv_budget(config, device, weight_bytes)
    # NOTE: model.spec is this rank's shard (its KV heads) under tensor parallelism, else the model's
    pool = pool_size(model.spec.kv_shape(DTYPE_BYTES[config.resolved_kv_cache_dtype]), config.block_size, budget)
    if parallel is not None:
        pool = replace(pool, num_blocks=parallel.min_int(pool.num_blocks))
    if pool.num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block of {pool.bytes_per_block} bytes; "
            "raise --kv-cache-memory or lower --block-size"
        )
    if config.load_format == "dummy":
        weights_digest = dummy_weights_digest(model, DUMMY_WEIGHTS_SEED)
    elif gguf_model is not None:
        weights_digest = f"gguf:{gguf_model.digest()}"  # tensor data and hyper-parameters (kvpager.gguf)
        if config.quantization is None and (layout := packed_layout_digest(model)):
            weights_digest += f"+packed:{layout}"  # blocks executed as they are (not dequantized floats)
    else:
        # NOTE: only rank 0 names the KV (the other ranks of tensor parallelism never hash blocks)
        weights_digest = weights_file_digest(model_dir) if parallel is None or parallel.rank == 0 else ""
    if config.quantization is not None:
        # NOTE: KV computed with quantized weights is not the float model's: the weights the fingerprint
        # names are the quantized ones (method, group size and a digest of the quantized bytes).
        group = config.resolved_quantization_group_size or "channel"
        weights_digest += f"+{config.quantization}-g{group}:{quantized_weights_digest(model)}"
        if isinstance(model.lm_head.weight, Int8Weight):
            # NOTE: the digest above covers the int8 lm_head's bytes too; the tag names the choice outright
            weights_digest += "+lm_head-int8"
    components = base_fingerprint_components(
        config, spec, model_dir, weights_digest, tokenizer.tokenizer_digest(), config_in_weights=gguf_model is not None
    )
    # NOTE: no tensor-parallel size: a block's K/V is the same (to float rounding, as across machines)
    # whatever the layout; where shards are kept (a directory per rank, store keys naming the KV heads)
    # the layout is named, and KV packs hold whole blocks, so a TP=2 pack loads at TP=1.
    fingerprint = model_fingerprint(components)
    return LoadedModel(
        model_dir,
        spec,
        model,
        tokenizer,
        device,
        dtype,
        kv_dtype,
        weight_bytes,
        fingerprint,
        max_model_len,
        pool,
        weights_digest,
        config,
    )


def log_weight_format(
    config: EngineConfig,
    spec: ModelSpec,
    device: torch.device,
    lm_head: str | None = None,
    gguf: bool = False,
) -> None:
    """One start-up line: the dtype chosen and why, the quantization, the linear layers' code path and
    the lm_head's format (`lm_head`: kvpager.model.lm_head.lm_head_format; `gguf`: a GGUF file's)."""
    if device.type != "cpu":
        path = "torch on " + device.type + (" (packed weights dequantized per call)" if config.quantization else "")
    elif config.quantization is not None or config.dtype in ("bfloat16", "float16") or gguf:
        kernels = quant_kernels_or_none()
        path = kernels.describe() if kernels is not None else "torch (no compiler for the packed-weight kernels)"
        path += " up to its batch limit"
        # NOTE: a GGUF file's int8-activation parts are int8 and int4 weights (each type's form: below)
        dot_formats = [DYNAMIC_METHODS[config.quantization]] if config.quantization in DYNAMIC_METHODS else []
        if gguf and config.gguf_int8_activations and config.quantization is None:
            dot_formats = ["int8", "int4"]
        if kernels is not None and dot_formats:
            level = kernels.default_level
            dot_level = int(kernels.dot_level(level))
            bf16 = native_bf16_matmul_available()
            limits = {f: dot_kernel_max_rows(f, level, dot_level, cpu_vendor(), bf16) for f in dot_formats}
            dot = kernels.describe_dot()
            if all(rows is None for rows in limits.values()):
                path = f"{dot} at every batch size"
            else:
                rows_text = " / ".join(
                    f"{'every batch' if rows is None else f'up to {rows} rows'} ({f})" for f, rows in limits.items()
                )
                if bf16_gemm_prompts(dot_level, bf16):
                    path = "bf16 GEMM (oneDNN) over the weights dequantized to bfloat16"
                path = f"{dot} for {rows_text}, then the {path}"
        path += f"; CPU {torch.backends.cpu.get_cpu_capability()}, native bf16 GEMM: "
        path += "yes" if native_bf16_matmul_available() else "no (AVX512-BF16/AMX absent: bf16 prefill emulated)"
    else:
        path = f"{config.dtype} (CPU {torch.backends.cpu.get_cpu_capability()})"
    quant = config.quantization or ("the GGUF file's own types (per type below)" if gguf else "none")
    if config.quantization is not None:
        quant += f", group {config.resolved_quantization_group_size or 'per output channel'}"
    logger.info(
        "weights: dtype %s (checkpoint %s), quantization %s; linear layers: %s%s",
        config.dtype,
        spec.torch_dtype,
        quant,
        path,
        f"; lm_head: {lm_head}" if lm_head is not None else "",
    )


def load_tokenizer(override: str | None, model_dir: Path, gguf_model: GGUFModel | None) -> Tokenizer:
    """--tokenizer DIR (or another GGUF model) wins; else the GGUF metadata's vocabulary, else model_dir's files."""
    if override is not None:
        if is_gguf_path(override):
            return tokenizer_from_gguf(open_gguf(override))
        return Tokenizer.from_dir(str(Path(override)))
    if gguf_model is not None:
        return tokenizer_from_gguf(gguf_model)
    return Tokenizer.from_dir(str(model_dir))


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    if config.max_model_len is None:
        return spec.max_position_embeddings
    if config.max_model_len > spec.max_position_embeddings:
        raise ValueError(
            f"max_model_len {config.max_model_len} is larger than the model's "
            f"max_position_embeddings {spec.max_position_embeddings}; lower --max-model-len"
        )
    return config.max_model_len


def kv_budget(config: EngineConfig, device: torch.device, weight_bytes: int) -> int:
    """The KV pool budget in bytes: the configured one, or a default share of free memory."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return default_cuda_kv_budget(free, total, config.gpu_memory_utilization, CUDA_ACTIVATION_RESERVE)
    # Weights are already resident, so MemAvailable no longer counts them. NOTE: the ranks of a
    # tensor-parallel engine on one machine (one node) share its RAM, so each takes its share.
    return default_cpu_kv_budget(available_ram_bytes(), 0, config.cpu_kv_fraction / config.ranks_per_node)


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def base_fingerprint_components(
    config: EngineConfig,
    spec: ModelSpec,
    model_dir: Path,
    weights_digest: str,
    tokenizer_digest: str,
    *,
    config_in_weights: bool = False,
) -> list[FingerprintComponent]:
    """What the KV contents of a token prefix depend on, as named components for `model_fingerprint`.

    NOTE: a loader that changes the KV further (a quantization scheme, a GGUF file) appends its own
    component, e.g. ("quantization", digest), to this list before the fingerprint is taken.
    """
    return [
        ("architecture", spec.architecture),
        # a GGUF file has no config.json: its hyper-parameters are part of its weights digest
        ("config", "in-weights" if config_in_weights else config_digest(model_dir)),
        ("weights", weights_digest),
        ("compute_dtype", config.dtype),
        ("fp32_matmul_precision", config.fp32_matmul_precision),
        ("kv_cache_dtype", config.resolved_kv_cache_dtype),
        ("block_size", str(config.block_size)),
        ("tokenizer", tokenizer_digest),
    ]


def config_digest(model_dir: Path) -> str:
    """sha256 of config.json's canonical JSON without the keys that never change the forward pass."""
    path = model_dir / "config.json"
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {str(path)!r} for the model fingerprint: {error}") from error
    kept = (
        {k: v for k, v in fields.items() if k not in CONFIG_KEYS_NOT_FINGERPRINTED}
        if isinstance(fields, dict)
        else fields
    )
    return hashlib.sha256(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


def dummy_weights_digest(model: CausalLM, seed: int) -> str:
    """Dummy weights are a function of their seed, std and the parameter shapes: name them by those."""
    h = hashlib.sha256(f"dummy seed={seed} std={DUMMY_STD}".encode())
    for name, param in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    return "dummy-" + h.hexdigest()


def weights_file_digest(model_dir: Path) -> str:
    """sha256 over every safetensors file's bytes (names sorted), so a cache key names exact weights."""
    h = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def log_pool(pool: PoolSize, max_model_len: int) -> None:
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB); max concurrency at max_model_len %d: %d",
        pool.num_blocks,
        pool.block_size,
        pool.num_tokens,
        pool.num_bytes / (1 << 20),
        max_model_len,
        pool.max_concurrency(max_model_len),
    )

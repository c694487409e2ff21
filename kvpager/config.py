"""Engine configuration: validated once, frozen; derived values come from functions.

Torch-free on purpose: the planner, the scheduler and the CLI read it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
}

LOAD_FORMATS = ("auto", "safetensors", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. Names follow vLLM's flags where the concept is the same.

    `kv_cache_memory` is the KV pool budget in bytes. When it is None the engine picks a default:
    a fraction (`gpu_memory_utilization`) of free device memory on CUDA, or `cpu_kv_fraction` of
    the available RAM on CPU (see `kvpager.kv.sizing.default_kv_budget`).
    """

    model: str | None = None  # None: the bundled demo model
    tokenizer: str | None = None  # None: same directory as the model
    load_format: str = "auto"
    dtype: str = "float32"  # compute dtype
    kv_cache_dtype: str = "auto"  # "auto": same as dtype
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_fraction: float = 0.25
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None: leave torch's default

    def __post_init__(self) -> None:
        _check(self.load_format in LOAD_FORMATS, f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _check(
            self.dtype in ("float32", "float16", "bfloat16"),
            f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}",
        )
        _check(
            self.kv_cache_dtype == "auto" or self.kv_cache_dtype in ("float32", "float16", "bfloat16"),
            f"kv_cache_dtype must be 'auto', float32, float16 or bfloat16, got {self.kv_cache_dtype!r}",
        )
        _check(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _check(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}",
        )
        _check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _check(0.0 < self.cpu_kv_fraction <= 1.0, f"cpu_kv_fraction must be in (0, 1], got {self.cpu_kv_fraction}")
        _check(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1, got {self.max_model_len}",
        )
        _check(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check(
            self.max_num_batched_tokens >= 1, f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
        )
        _check(self.num_threads is None or self.num_threads >= 1, f"num_threads must be >= 1, got {self.num_threads}")

    @property
    def resolved_kv_cache_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)

"""Engine configuration: validated once, frozen; derived values come from functions.

Torch-free on purpose: the planner, the scheduler and the CLI read it without importing torch.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field

from kvpager.core.limits import RequestLimits

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
}

# NOTE: the one list of each: the CLI's choices, the loader and the benchmarks all read these.
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = ("auto", *DTYPES)
COMPUTE_DTYPES = DTYPES
# Weight quantization (vLLM's --quantization): int8 symmetric per output channel (or per group), int4
# asymmetric per group, both exact (kvpager.model.backends.quant_weights); w8a8_int8 / w4a8_int8 (SGLang's
# name) store the same weights and quantize the activations to int8 per block of 32 at each matmul for
# integer dot products: faster, not exact (kvpager.model.backends.quant_dot).
QUANTIZATIONS = ("int8", "int4", "w8a8_int8", "w4a8_int8")
# the packed weight format each quantization stores (what the planner counts)
QUANTIZATION_WEIGHTS = {"int8": "int8", "int4": "int4", "w8a8_int8": "int8", "w4a8_int8": "int4"}
DYNAMIC_ACTIVATION_QUANTIZATIONS = ("w8a8_int8", "w4a8_int8")
ACTIVATION_BLOCK = 32  # activations per int8 scale in the dynamic quantizations
INT4_GROUP_MULTIPLE = 16
DEFAULT_INT4_GROUP_SIZE = 128
KERNEL_BACKENDS = ("auto", "torch", "cpu")
FP32_MATMUL_PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's
# NOTE: must equal kvpager.kvstore.codec.available_codecs() (kept here so config stays torch-free; a test pins it).
KV_CODECS = tuple(
    f"{base}{suffix}" for suffix in ("", "+zstd") for base in ("lossless", "fp16", "bf16", "int8", "int4")
)
DEFAULT_KV_CACHE_DIR_MAX_BYTES = 10 << 30


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. Names follow vLLM's flags where the concept is the same.

    `kv_cache_memory` is the KV pool budget in bytes. When it is None the engine picks a default:
    a fraction (`gpu_memory_utilization`) of free device memory on CUDA, or `cpu_kv_fraction` of
    the available RAM on CPU (see `kvpager.core.sizing.default_kv_budget`).

    KV tiers and packs (docs/kv-memory.md): `host_kv_cache_memory` bounds the host RAM tier that
    keeps blocks the device pool evicts; `kv_cache_dir` enables the persistent disk tier (bounded by
    `kv_cache_dir_max_bytes`, 10 GiB when None); `kv_codec` encodes tier blocks (lossless unless a
    lossy codec is chosen); `kv_packs` are pack files loaded and pinned in the prefix cache at start.
    """

    model: str | None = None  # None: the bundled demo model
    tokenizer: str | None = None  # None: same directory as the model
    load_format: str = "auto"
    dtype: str = "auto"  # compute dtype; "auto": the checkpoint's torch_dtype (resolve_dtype)
    quantization: str | None = None  # None | QUANTIZATIONS (weights quantized at load, round-to-nearest)
    quantization_group_size: int | None = None  # None: int8 per output channel, int4 groups of 128
    # With `quantization` (safetensors / dummy weights): the lm_head int8 per output channel in every mode (a
    # tied embedding keeps its table in `dtype`, the lm_head gets its own int8 copy); False: lm_head in `dtype`.
    # Without `quantization` (or for a GGUF file, whose lm_head keeps its own form) it has no effect.
    quantize_lm_head: bool = True
    # GGUF only: the file's Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K blocks times activations quantized to int8 per
    # block of 32 (llama.cpp's arithmetic); False: exact; None: on where the file's blocks reach the CPU
    # integer-dot kernels (resolve_gguf_int8_activations)
    gguf_int8_activations: bool | None = None
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
    kernel_backend: str = "auto"  # "auto" | "torch" | "cpu": fused C++ kernels for float32 on CPU (model/ops.py)
    # float32 matmuls while the model runs: "highest" exact; "high" TF32 on CUDA; "medium" bf16 inputs with
    # float32 accumulation (AMX / oneDNN on CPU): torch.set_float32_matmul_precision, scoped to the forward.
    fp32_matmul_precision: str = "highest"
    host_kv_cache_memory: int | None = None  # bytes of host RAM for the host KV tier; None: no host tier
    kv_cache_dir: str | None = None  # persistent disk KV tier; None: no disk tier
    kv_cache_dir_max_bytes: int | None = None  # None: DEFAULT_KV_CACHE_DIR_MAX_BYTES
    kv_codec: str = "lossless"  # codec of host/disk tier blocks (lossy ones are opt-in)
    kv_packs: tuple[str, ...] = ()  # KV pack files pinned in the prefix cache at start
    kv_cache_remote: str | None = None  # redis://HOST:PORT of a Redis/Valkey store shared by replicas; None: off
    kv_cache_remote_timeout: float = 1.0  # seconds per store call; a slower store is a miss (recompute)
    request_limits: RequestLimits = field(default_factory=RequestLimits)  # per-request work bounds (admission)
    # Tensor parallelism (docs/scale-out.md): rank 0 is the engine; the other ranks are worker processes,
    # `tensor_parallel_size / nnodes` of them per node (vLLM's --nnodes / --node-rank): node 0 starts ranks
    # 1..L-1, node R (headless) ranks R*L..R*L+L-1. The rendezvous address: these, else MASTER_ADDR /
    # MASTER_PORT, else (one node only) 127.0.0.1 and a free port; with several nodes both must be given.
    # `distributed_timeout` bounds the rendezvous and a collective (a rank that stops answering fails the engine).
    tensor_parallel_size: int = 1
    distributed_master_addr: str | None = None
    distributed_master_port: int | None = None
    distributed_timeout: float = 60.0
    nnodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        _check(self.load_format in LOAD_FORMATS, f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _check(
            self.dtype == "auto" or self.dtype in COMPUTE_DTYPES,
            f"dtype must be 'auto', float32, float16 or bfloat16, got {self.dtype!r}",
        )
        _check(
            self.quantization is None or self.quantization in QUANTIZATIONS,
            f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset), got {self.quantization!r}",
        )
        group = self.quantization_group_size
        _check(group is None or group >= 1, f"quantization_group_size must be >= 1, got {group}")
        _check(
            group is None or self.quantization is not None,
            "quantization_group_size is set but quantization is not; set --quantization too",
        )
        _check(
            group is None or self.quantization != "int4" or group % INT4_GROUP_MULTIPLE == 0,
            f"int4 quantization_group_size must be a multiple of {INT4_GROUP_MULTIPLE} (e.g. 32, 64, 128), got {group}",
        )
        _check(
            group is None or self.quantization not in DYNAMIC_ACTIVATION_QUANTIZATIONS or group % ACTIVATION_BLOCK == 0,
            f"{self.quantization} quantization_group_size must be a multiple of {ACTIVATION_BLOCK} (its activation "
            f"block; e.g. 32, 64, 128), got {group}",
        )
        _check(
            not (self.gguf_int8_activations and self.quantization is not None),
            "--gguf-int8-activations computes with the GGUF file's own blocks; it cannot be combined with "
            "--quantization (which requantizes them)",
        )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _check(
            self.kernel_backend in KERNEL_BACKENDS,
            f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}",
        )
        _check(
            self.fp32_matmul_precision in FP32_MATMUL_PRECISIONS,
            f"fp32_matmul_precision must be one of {FP32_MATMUL_PRECISIONS}, got {self.fp32_matmul_precision!r}",
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
        self._check_kv_storage()
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        n = self.tensor_parallel_size
        _check(n >= 1, f"tensor_parallel_size must be >= 1, got {n}")
        port = self.distributed_master_port
        _check(port is None or 0 < port < 65536, f"distributed_master_port must be in 1..65535, got {port}")
        _check(self.distributed_timeout > 0, f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        self._check_nodes()
        if n == 1:
            return
        # NOTE: every KV tier and KV packs work under tensor parallelism (each rank keeps its shards:
        # kvpager/kvstore/sharded.py); only the fused CPU kernels do not.
        _check(
            self.kernel_backend != "cpu",
            "--kernel-backend cpu cannot be combined with --tensor-parallel-size > 1 (the fused kernels do not "
            "all-reduce between layers); use auto or torch",
        )
        _check(
            not self.gguf_int8_activations,
            "--gguf-int8-activations cannot be combined with --tensor-parallel-size > 1 (each rank slices "
            "dequantized GGUF weights, so the file's blocks never reach the integer-dot kernels)",
        )

    def _check_nodes(self) -> None:
        n, nodes = self.tensor_parallel_size, self.nnodes
        _check(nodes >= 1, f"nnodes must be >= 1, got {nodes}")
        _check(
            0 <= self.node_rank < nodes, f"node_rank must be in 0..{nodes - 1} (--nnodes {nodes}), got {self.node_rank}"
        )
        _check(
            n % nodes == 0,
            f"--tensor-parallel-size {n} is not a multiple of --nnodes {nodes}: every node runs the same number "
            f"of ranks (tensor_parallel_size / nnodes); use a tensor-parallel size of {nodes}, {2 * nodes}, ...",
        )
        if nodes > 1:
            _check(
                self.distributed_master_addr is not None and self.distributed_master_port is not None,
                f"--nnodes {nodes} needs --master-addr (node 0's address, reachable from every node) and "
                "--master-port, the same on every node",
            )

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks each node runs (node 0's first is the engine itself)."""
        return self.tensor_parallel_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    def _check_kv_storage(self) -> None:
        _check(
            self.host_kv_cache_memory is None or self.host_kv_cache_memory > 0,
            f"host_kv_cache_memory must be > 0 bytes, got {self.host_kv_cache_memory}",
        )
        _check(self.kv_cache_dir is None or bool(self.kv_cache_dir), "kv_cache_dir must be a non-empty path or None")
        _check(
            self.kv_cache_dir_max_bytes is None or self.kv_cache_dir is not None,
            "kv_cache_dir_max_bytes is set but kv_cache_dir is not; set --kv-cache-dir too",
        )
        _check(
            self.kv_cache_dir_max_bytes is None or self.kv_cache_dir_max_bytes > 0,
            f"kv_cache_dir_max_bytes must be > 0 bytes, got {self.kv_cache_dir_max_bytes}",
        )
        _check(self.kv_codec in KV_CODECS, f"kv_codec must be one of {', '.join(KV_CODECS)}; got {self.kv_codec!r}")
        if isinstance(self.kv_packs, list):  # NOTE: normalised once at construction; the field stays a tuple
            object.__setattr__(self, "kv_packs", tuple(self.kv_packs))
        _check(
            isinstance(self.kv_packs, tuple) and all(isinstance(p, str) and p for p in self.kv_packs),
            f"kv_packs must be a tuple of file paths, got {self.kv_packs!r}",
        )
        _check_remote(self.kv_cache_remote, self.kv_cache_remote_timeout)
        uses_cache = (
            bool(self.kv_packs)
            or self.host_kv_cache_memory is not None
            or self.kv_cache_dir is not None
            or self.kv_cache_remote is not None
        )
        _check(
            self.enable_prefix_caching or not uses_cache,
            "KV tiers and KV packs need prefix caching; drop --no-enable-prefix-caching or the tier/pack flags",
        )

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """The KV cache dtype; with dtype "auto" too, only after the engine resolved dtype (resolve_dtype)."""
        if self.kv_cache_dtype != "auto":
            return self.kv_cache_dtype
        _check(self.dtype != "auto", "dtype 'auto' is resolved when the model loads; call resolve_dtype first")
        return self.dtype

    @property
    def resolved_quantization_group_size(self) -> int | None:
        """The group size the quantized weights use (None: int8 per output channel)."""
        if self.quantization is not None and QUANTIZATION_WEIGHTS[self.quantization] == "int4":
            return self.quantization_group_size or DEFAULT_INT4_GROUP_SIZE
        return self.quantization_group_size

    @property
    def resolved_kv_cache_dir_max_bytes(self) -> int:
        """The disk tier's size bound in bytes (the default when unset)."""
        return self.kv_cache_dir_max_bytes or DEFAULT_KV_CACHE_DIR_MAX_BYTES


def _check_remote(url: str | None, timeout_s: float) -> None:
    _check(timeout_s > 0, f"kv_cache_remote_timeout must be > 0 seconds, got {timeout_s}")
    if url is None:
        return
    parsed = urllib.parse.urlsplit(url)
    try:
        port_ok = parsed.port is None or parsed.port > 0
    except ValueError:
        port_ok = False
    _check(
        parsed.scheme in ("redis", "rediss") and bool(parsed.hostname) and port_ok,
        f"--kv-cache-remote must look like redis://HOST:PORT (rediss:// for TLS), got {url!r}",
    )


def resolve_dtype(requested: str, checkpoint_dtype: str, device_type: str) -> str:
    """The compute dtype for `requested` ("auto" or a dtype) given the checkpoint's torch_dtype.

    "auto" follows vLLM on CPU: a bfloat16 checkpoint runs in bfloat16 (every x86-64 CPU has a
    bfloat16 path; the start-up log says whether it is native), a float16 checkpoint is cast to
    bfloat16 on the CPU (float16 on CUDA). Unlike vLLM a float32 checkpoint stays float32 (vLLM
    downcasts it to 16 bits): kvpager's fused kernels are float32 and its references are exact there.
    """
    if requested != "auto":
        return requested
    name = checkpoint_dtype.strip().lower().removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        name, name
    )
    if name == "float16" and device_type == "cpu":
        return "bfloat16"
    return name if name in COMPUTE_DTYPES else "float32"


def resolve_gguf_int8_activations(
    requested: bool | None, *, gguf: bool, quantization: str | None, tensor_parallel_size: int, cpu_kernels: bool
) -> bool:
    """Whether a model runs its GGUF blocks times int8 activations: `requested` where given, else (None)
    whenever it can, as llama.cpp (and vLLM's GGUF kernels) always compute those types: a GGUF file
    whose blocks reach the CPU integer-dot kernels (`cpu_kernels`: the device is the CPU and the
    kernels built), not requantized (--quantization) and not sliced across ranks."""
    if requested is not None:
        return requested
    return gguf and quantization is None and tensor_parallel_size == 1 and cpu_kernels


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)

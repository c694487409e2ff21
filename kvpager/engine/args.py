"""Engine flags shared by `kvpager serve`, `generate`, `chat`, `bench` and `kv`, spelled like vLLM's (its engine/arg_utils)."""

from __future__ import annotations

import argparse

from kvpager.core import units
from kvpager.core.config import (
    DTYPES,
    FP32_MATMUL_PRECISIONS,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    KV_CODECS,
    LOAD_FORMATS,
    QUANTIZATIONS,
    EngineConfig,
)
from kvpager.core.limits import (
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    DEFAULT_MAX_STOP_STRING_CHARS,
    DEFAULT_MAX_STOP_STRINGS,
    DEFAULT_MAX_STOP_TOKEN_IDS,
    RequestLimits,
)


def parse_bytes(text: str) -> int:
    """A positive size in bytes by the one rule of `kvpager.core.units` ('4GiB' = '4G', '2GB' = 2e9)."""
    value = units.parse_bytes(text)
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


KV_CACHE_DTYPE_CHOICES = KV_CACHE_DTYPES


def bytes_arg(text: str) -> int:
    """`parse_bytes` as an argparse `type` (a bad size is a usage error naming the flag)."""
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(parser: argparse.ArgumentParser, *, model_required: bool = False) -> None:
    """Add the engine flags (vLLM spellings) to a subcommand's parser."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        required=model_required,
        help="Hugging Face checkpoint directory, or a GGUF model: a .gguf file (any part of a split one) or a directory holding one (default: bundled demo)",
    )
    g.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (default: the model's; a GGUF model's is its metadata)"
    )
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    add_weight_format_args(g)
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES)
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=bytes_arg, default=None, help="KV pool budget, e.g. 2GiB")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-threads", type=int, default=None, help="torch threads on CPU")
    g.add_argument(
        "--kernel-backend",
        choices=KERNEL_BACKENDS,
        default="auto",
        help="auto: kvpager's fused C++ kernels for float32 on CPU (built once with the system compiler), "
        "torch otherwise; torch: plain torch ops; cpu: the kernels or an error",
    )
    g.add_argument(
        "--fp32-matmul-precision",
        choices=FP32_MATMUL_PRECISIONS,
        default="highest",
        help="float32 matmuls (torch.set_float32_matmul_precision, while the model runs): highest: exact; "
        "high: TF32 on CUDA; medium: bfloat16 inputs, float32 accumulation (AMX on recent Xeons: several "
        "times faster batched steps, ~3 significant digits per product)",
    )
    add_parallel_args(parser)
    add_kv_storage_args(parser)
    add_request_limit_args(parser)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """Tensor parallelism (docs/scale-out.md): vLLM's flag plus the rendezvous address."""
    g = parser.add_argument_group("tensor parallelism")
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks the model is split over (Megatron-style; must divide the attention heads); the engine "
        "starts ranks 1..N-1 as worker processes (gloo on CPU, nccl on CUDA)",
    )
    g.add_argument(
        "--master-addr",
        "--distributed-master-addr",
        dest="distributed_master_addr",
        default=None,
        help="rendezvous address of rank 0 on node 0, reachable from every node (default: $MASTER_ADDR, "
        "else 127.0.0.1 with one node; required with --nnodes > 1)",
    )
    g.add_argument(
        "--master-port",
        "--distributed-master-port",
        dest="distributed_master_port",
        type=int,
        default=None,
        help="rendezvous port (default: $MASTER_PORT, else a free port with one node; required with --nnodes > 1)",
    )
    g.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="machines the tensor-parallel ranks span; each runs tensor_parallel_size / nnodes ranks (default 1)",
    )
    g.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's place among --nnodes: 0 runs the engine (scheduler, API server) and ranks 0..L-1; "
        "R > 0 runs ranks R*L..R*L+L-1 and needs --headless (kvpager serve)",
    )
    g.add_argument(
        "--distributed-timeout",
        type=float,
        default=60.0,
        help="seconds a collective may wait for a rank before the engine fails (default 60)",
    )


def add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    """Per-request work bounds (kvpager.core.limits): a request over one is refused naming the flag."""
    g = parser.add_argument_group("per-request limits")
    g.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS, help="top logprobs per token")
    g.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS, help="stop strings per request")
    g.add_argument(
        "--max-stop-string-chars", type=int, default=DEFAULT_MAX_STOP_STRING_CHARS, help="characters per stop string"
    )
    g.add_argument(
        "--max-stop-token-ids", type=int, default=DEFAULT_MAX_STOP_TOKEN_IDS, help="stop_token_ids per request"
    )
    g.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        help="prompts x n of one request",
    )


DTYPE_CHOICES = ("auto", *DTYPES)


def add_weight_format_args(g: argparse._ActionsContainer) -> None:
    """--dtype, --quantization, --quantization-group-size (vLLM's names; bench commands share them)."""
    g.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="compute dtype; auto (default): the checkpoint's torch_dtype (float16 runs as bfloat16 on CPU)",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=QUANTIZATIONS,
        help="weight quantization at load (round-to-nearest): int8 per output channel, int4 in groups "
        "(asymmetric), both exact; w8a8_int8 / w4a8_int8: the same weights, activations quantized to int8 per "
        "block of 32 at each matmul (integer dot products: faster, not exact; groups a multiple of 32); "
        "the lm_head int8 per output channel (see --quantize-lm-head); embedding and norms stay in --dtype",
    )
    g.add_argument(
        "--quantize-lm-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --quantization: the lm_head int8 per output channel in every mode (a tied embedding keeps its "
        "--dtype table and the lm_head gets an int8 copy; w8a8_int8 / w4a8_int8 multiply it with int8 "
        "activations); --no-quantize-lm-head keeps it in --dtype. No effect without --quantization or on GGUF",
    )
    g.add_argument(
        "--quantization-group-size",
        type=int,
        default=None,
        help="input features per scale: int4 default 128 (a multiple of 16; of 32 for w4a8_int8); int8 default: "
        "per output channel",
    )
    g.add_argument(
        "--gguf-int8-activations",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GGUF files: multiply the file's Q8_0 / Q4_0 / Q4_K / Q5_K / Q6_K blocks with activations quantized to int8 "
        "per block of 32, llama.cpp's arithmetic (integer dot products: faster, not exact; docs/precision.md); other "
        "tensor types stay exact. Default: on where the CPU kernels run the file's blocks (not with --quantization, "
        "--tensor-parallel-size > 1 or a GPU); --no-gguf-int8-activations computes them exactly",
    )


def add_kv_storage_args(parser: argparse.ArgumentParser) -> None:
    """KV tiers and packs: host RAM tier, persistent disk tier, tier codec, packs pinned at start."""
    g = parser.add_argument_group("KV tiers and packs")
    g.add_argument(
        "--host-kv-cache-memory", type=bytes_arg, default=None, help="host RAM tier for evicted KV blocks, e.g. 4GiB"
    )
    g.add_argument("--kv-cache-dir", default=None, help="persistent disk tier directory (survives restarts)")
    g.add_argument(
        "--kv-cache-dir-max-bytes", type=bytes_arg, default=None, help="disk tier size bound (default 10GiB)"
    )
    g.add_argument(
        "--kv-codec", default="lossless", choices=list(KV_CODECS), help="tier block codec (lossy ones are opt-in)"
    )
    g.add_argument(
        "--kv-cache-remote",
        default=None,
        metavar="redis://HOST:PORT",
        help="shared Redis/Valkey KV store below host and disk (bound it with maxmemory + allkeys-lru)",
    )
    g.add_argument(
        "--kv-cache-remote-timeout",
        type=float,
        default=1.0,
        help="seconds per KV store call; a store that is down or slower is a miss (default 1.0)",
    )
    g.add_argument(
        "--kv-pack", action="append", default=None, dest="kv_packs", help="KV pack pinned at start (repeatable)"
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the frozen EngineConfig from parsed flags (ValueError names a bad value)."""
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        load_format=args.load_format,
        dtype=args.dtype,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        quantize_lm_head=args.quantize_lm_head,
        gguf_int8_activations=args.gguf_int8_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        num_threads=args.num_threads,
        kernel_backend=args.kernel_backend,
        fp32_matmul_precision=args.fp32_matmul_precision,
        host_kv_cache_memory=args.host_kv_cache_memory,
        kv_cache_dir=args.kv_cache_dir,
        kv_cache_dir_max_bytes=args.kv_cache_dir_max_bytes,
        kv_codec=args.kv_codec,
        kv_packs=tuple(args.kv_packs or ()),
        kv_cache_remote=args.kv_cache_remote,
        kv_cache_remote_timeout=args.kv_cache_remote_timeout,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_master_addr=args.distributed_master_addr,
        distributed_master_port=args.distributed_master_port,
        distributed_timeout=args.distributed_timeout,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        request_limits=RequestLimits(
            max_logprobs=args.max_logprobs,
            max_stop_strings=args.max_stop_strings,
            max_stop_string_chars=args.max_stop_string_chars,
            max_stop_token_ids=args.max_stop_token_ids,
            max_sequences_per_request=args.max_sequences_per_request,
        ),
    )

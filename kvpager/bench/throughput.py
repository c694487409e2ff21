"""`kvpager bench throughput`: one-request-at-a-time versus continuous batching, same engine, same run.

Prompts are seeded random token ids; every request generates exactly `--output-len` tokens
(ignore_eos, greedy). The sequential phase runs `--sequential-requests` requests, each alone to
completion (requests of identical shape cost the same, so the rate of a few is the rate of all);
the batched phase submits all `--num-requests` at once. KV pool utilisation is measured after every
batched step as tokens stored ÷ token slots of the owned blocks (a shared block counted once).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvpager.bench import report
from kvpager.core.config import DTYPE_BYTES, KERNEL_BACKENDS, EngineConfig, resolve_dtype
from kvpager.core.kv_cache_manager import cdiv
from kvpager.core.sampling_params import SamplingParams
from kvpager.core.scheduler import Scheduler
from kvpager.engine.args import KV_CACHE_DTYPE_CHOICES, add_weight_format_args, bytes_arg
from kvpager.gguf import is_gguf_path, open_gguf
from kvpager.model.spec import load_model_spec

ISSUE_TARGETS = {"speedup_issue2": 4.0, "speedup_issue6": 8.0, "kv_utilisation": 0.95}


@dataclass(frozen=True)
class PhaseResult:
    """One phase: how many requests and tokens, how long, and the resulting rate."""

    num_requests: int
    output_tokens: int
    seconds: float
    num_steps: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpager bench throughput", description=__doc__)
    report.add_common_args(p)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--sequential-requests", type=int, default=8, help="requests run one at a time (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks, as `kvpager serve`'s (worker processes on this machine)",
    )
    p.add_argument(
        "--kernel-backend", default="auto", choices=KERNEL_BACKENDS, help="as `kvpager serve`'s (default auto)"
    )
    p.add_argument(
        "--kv-cache-memory",
        type=bytes_arg,
        default=None,
        help="KV pool budget, e.g. 2GiB (default: room for every request)",
    )
    report.add_precision_arg(p)
    add_weight_format_args(p)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPE_CHOICES,
        help="KV cache dtype, as `kvpager serve`'s (default auto: the model's)",
    )
    return p


def kv_utilisation(scheduler: Scheduler) -> tuple[int, int]:
    """(tokens stored, token slots in owned blocks) right now.

    Tokens stored are the running requests' computed positions, counted per physical block, so a
    block shared by several requests (prefix hit, n > 1) counts once.
    """
    kv = scheduler.kv_manager
    block_size = kv.block_size
    block_to_tokens: dict[int, int] = {}
    for request in scheduler.running:
        for index, block_id in enumerate(kv.block_ids(request.request_id)):
            filled = min(block_size, max(0, request.num_computed_tokens - index * block_size))
            block_to_tokens[block_id] = max(block_to_tokens.get(block_id, 0), filled)
    return sum(block_to_tokens.values()), kv.block_pool.num_owned_blocks * block_size


def make_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Seeded random token-id prompts (ids 1..vocab-1; id 0 is often a special token)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab_size) for _ in range(length)] for _ in range(num)]


def run_sequential(engine: Any, prompts: Sequence[list[int]], params: SamplingParams) -> PhaseResult:
    """Each request alone, to completion, before the next is submitted."""
    tokens = steps = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"seq-{i}", prompt, params)
        while engine.has_unfinished_requests():
            steps += 1
            tokens += sum(len(o.outputs[0].delta_token_ids) for o in engine.step())
    return PhaseResult(len(prompts), tokens, time.perf_counter() - start, steps)


def run_batched(
    engine: Any, prompts: Sequence[list[int]], params: SamplingParams
) -> tuple[PhaseResult, list[float], int]:
    """All requests submitted at once; returns (phase, per-step utilisation, max running)."""
    utilisation: list[float] = []
    tokens = steps = max_running = 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"batch-{i}", prompt, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        tokens += sum(len(o.outputs[0].delta_token_ids) for o in outputs)
        stored, slots = kv_utilisation(engine.scheduler)
        max_running = max(max_running, engine.scheduler.num_running)
        if slots:
            utilisation.append(stored / slots)
    return PhaseResult(len(prompts), tokens, time.perf_counter() - start, steps), utilisation, max_running


def default_kv_budget(model_dir: str, args: argparse.Namespace) -> int:
    """Bytes for every request's whole sequence at once (so the batched phase never preempts)."""
    spec = load_model_spec(model_dir)
    kv_dtype = (
        resolve_dtype(args.dtype, spec.torch_dtype, "cpu") if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    )
    shape = spec.kv_shape(DTYPE_BYTES[kv_dtype])
    blocks = args.num_requests * cdiv(args.input_len + args.output_len, args.block_size)
    return blocks * shape.bytes_per_block(args.block_size)


def gguf_tensor_types(model: str) -> str | None:
    """A GGUF model's ggml tensor types ("F32 x5, Q5_K x13, Q6_K x3"; the start-up log says how each
    runs), None for a checkpoint directory."""
    if not is_gguf_path(model):
        return None
    return ", ".join(f"{kind} x{n}" for kind, n in open_gguf(model).type_counts().items())


def validate(args: argparse.Namespace) -> None:
    for name in ("num_requests", "input_len", "output_len", "sequential_requests"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from kvpager.engine.engine import Engine

    validate(args)
    report.set_threads(args.num_threads)
    choice = report.choose_model(args)
    config = EngineConfig(
        model=choice.model_dir,
        load_format=choice.load_format,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory or default_kv_budget(choice.model_dir, args),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.num_threads,
        seed=args.seed,
        fp32_matmul_precision=args.fp32_matmul_precision,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        quantize_lm_head=args.quantize_lm_head,
        gguf_int8_activations=args.gguf_int8_activations,
        tensor_parallel_size=args.tensor_parallel_size,
        kernel_backend=args.kernel_backend,
    )
    engine = Engine(config)
    try:
        return _measure(engine, args, argv, choice)
    finally:
        engine.shutdown()  # NOTE: stops the tensor-parallel workers


def _measure(engine: Any, args: argparse.Namespace, argv: Sequence[str], choice: Any) -> dict[str, Any]:
    vocab = engine.model_spec.vocab_size
    prompts = make_prompts(args.num_requests + args.sequential_requests, args.input_len, vocab, args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    report.log(args, f"sequential: {args.sequential_requests} requests, one at a time ...")
    seq = run_sequential(engine, prompts[args.num_requests :], params)
    report.log(args, f"  {seq.output_tokens_per_s:.1f} output tok/s; batched: {args.num_requests} requests ...")
    batched, utilisation, max_running = run_batched(engine, prompts[: args.num_requests], params)
    report.log(args, f"  {batched.output_tokens_per_s:.1f} output tok/s")
    return build_result(args, argv, engine, choice, seq, batched, utilisation, max_running)


def build_result(
    args: argparse.Namespace,
    argv: Sequence[str],
    engine: Any,
    choice: report.ModelChoice,
    seq: PhaseResult,
    batched: PhaseResult,
    utilisation: list[float],
    max_running: int,
) -> dict[str, Any]:
    stats = engine.stats()
    speedup = batched.output_tokens_per_s / seq.output_tokens_per_s if seq.output_tokens_per_s else 0.0
    mean_util = sum(utilisation) / len(utilisation) if utilisation else 0.0
    return {
        "bench": "throughput",
        "command": report.command_line("throughput", argv),
        "machine": report.machine_info(),
        "model": {"dir": choice.model_dir, "load_format": choice.load_format, "dummy_smollm2": choice.is_default_dummy},
        "workload": {
            "num_requests": args.num_requests,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "sequential_requests": args.sequential_requests,
            "block_size": args.block_size,
            "num_blocks": engine.pool.num_blocks,
            "fp32_matmul_precision": args.fp32_matmul_precision,
            "kv_cache_dtype": str(engine.runner.kv_cache.dtype).removeprefix("torch."),
            "dtype": engine.config.dtype,
            "quantization": engine.config.quantization,
            "quantization_group_size": engine.config.resolved_quantization_group_size,
            "tensor_parallel_size": engine.config.tensor_parallel_size,
            "kernel_ops": engine.runner.model.ops.name,
            "weight_bytes": engine.loaded.weight_bytes,
            "gguf_tensor_types": gguf_tensor_types(choice.model_dir),
        },
        "sequential": {**asdict(seq), "output_tokens_per_s": seq.output_tokens_per_s},
        "batched": {**asdict(batched), "output_tokens_per_s": batched.output_tokens_per_s, "max_running": max_running},
        "speedup": speedup,
        "kv_utilisation": {"mean": mean_util, "min": min(utilisation, default=0.0), "num_steps": len(utilisation)},
        "num_preemptions": stats.num_preemptions,
        "prefix_cache_hit_tokens": stats.prefix_cache_hits,
        "owned_blocks_after": stats.num_owned_blocks,
        "peak_rss_bytes": report.peak_rss_bytes(),
        "targets": {
            "speedup_ge_4x_issue2": speedup >= ISSUE_TARGETS["speedup_issue2"],
            "speedup_ge_8x_issue6": speedup >= ISSUE_TARGETS["speedup_issue6"],
            "kv_utilisation_ge_95pct": mean_util >= ISSUE_TARGETS["kv_utilisation"],
        },
    }


def render(result: dict[str, Any]) -> str:
    seq, bat, util = result["sequential"], result["batched"], result["kv_utilisation"]
    w = result["workload"]
    rows = [
        [
            "one request at a time",
            seq["num_requests"],
            seq["output_tokens"],
            seq["seconds"],
            seq["output_tokens_per_s"],
        ],
        ["continuous batching", bat["num_requests"], bat["output_tokens"], bat["seconds"], bat["output_tokens_per_s"]],
    ]
    table = report.markdown_table(["mode", "requests", "output tokens", "seconds", "output tok/s"], rows)
    return "\n".join(
        [
            f"workload: prompt {w['input_len']}, output {w['output_len']} (ignore_eos), {w['num_requests']} requests "
            f"batched; one-at-a-time rate from {w['sequential_requests']} requests run alone (same shape, same rate); "
            f"matmul precision {w.get('fp32_matmul_precision', 'highest')}, KV cache {w.get('kv_cache_dtype', 'float32')}, "
            f"weights {w.get('dtype', 'float32')} / quantization {w.get('quantization') or 'none'}"
            + (f" / GGUF {w['gguf_tensor_types']}" if w.get("gguf_tensor_types") else ""),
            table,
            f"speedup: {result['speedup']:.2f}x (targets: >= 4x issue 2, >= 8x issue 6)",
            f"KV pool utilisation (tokens stored / slots in owned blocks, mean over {util['num_steps']} steps): "
            f"{util['mean']:.2%} (min {util['min']:.2%}; target >= 95%)",
            f"max running: {bat['max_running']}, preemptions: {result['num_preemptions']}, "
            f"peak RSS: {result['peak_rss_bytes'] / 2**20:.0f} MiB",
        ]
    )


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    result = run(args, argv)
    report.emit(result, render(result), args)
    return 0

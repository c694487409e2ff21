"""`kvpager bench roofline`: this machine's limits, and how close real decode steps come to them.

Measured with the torch and thread count the engine uses: memory bandwidth (read: the better of a
sum over one large fp32 tensor and a dot product over two; copy: STREAM counting, 2 words per element) and fp32 matmul GFLOP/s (square GEMMs).
For the throughput benchmark's decode steps (batch B at context ~`--context-len`), per step:
- bytes moved = weights read once, as the engine holds them (its --dtype, --quantization or GGUF
  format: every linear layer + lm_head + norms, i.e. every weight but an embedding table that is not
  also the lm_head) + KV read (B x context x bytes per token, in the KV cache's dtype) + KV written
  (B x bytes per token);
- FLOPs = 2 x matmul params per token x B + attention (4 x layers x heads x head_dim x context x B).
The memory bound is bytes / read bandwidth; the compute bound FLOPs / matmul throughput. Real
decode steps run through the engine: B requests are prefilled, then `--decode-steps` steps timed one by one
(the median step is reported: one stalled step on a shared machine moves a short mean a lot).

Two readings of each fraction: against the machine's best figures measured up front (best of
`--reps`), and paired: after every timed step one read of the bandwidth (a sum over the bandwidth
tensor) and one GEMM of the largest `--gemm-sizes` are timed once each, each step is set against the
figures measured right after it, and the median over the steps is reported. On a shared machine the
bandwidth moves by tens of percent within minutes; the paired figure compares a step with what the
machine gave at that moment.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpager.bench import report
from kvpager.core.config import DTYPE_BYTES, EngineConfig
from kvpager.core.kv_cache_manager import cdiv
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.args import add_weight_format_args
from kvpager.model.spec import ModelSpec, load_model_spec

TARGETS = {"batch1_memory_fraction": 0.70, "largest_batch_compute_fraction": 0.50}


def best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_operands(m: int, precision: str) -> tuple[Any, Any, Any]:
    """x, y, out of an m x m x m GEMM. NOTE: at "medium" they are bfloat16: the peak of the bf16
    units, without the per-call conversion a float32 GEMM at "medium" pays (the engine packs its
    weights once), so the roofline is not understated."""
    import torch

    dtype = torch.bfloat16 if precision == "medium" else torch.float32
    return torch.randn(m, m, dtype=dtype), torch.randn(m, m, dtype=dtype), torch.empty(m, m, dtype=dtype)


def measure_machine(
    bandwidth_mib: int, gemm_sizes: Sequence[int], reps: int, precision: str = "highest"
) -> dict[str, Any]:
    """Read and copy bandwidth (GB/s) and the best fp32 GEMM GFLOP/s, at torch's current threads."""
    read, copy = measure_bandwidth(bandwidth_mib * 2**20 // 4, reps)
    gemm = {str(m): measure_gemm(m, reps, precision) for m in gemm_sizes}
    return {"read_gbs": read, "copy_gbs": copy, "gemm_gflops": max(gemm.values()), "gemm_by_size": gemm}


def measure_bandwidth(n: int, reps: int) -> tuple[float, float]:
    """(read GB/s, copy GB/s) over fp32 tensors of `n` elements. Read is the better of a sum over one
    tensor and a dot product streaming two; copy counts 2 words per element (STREAM)."""
    import torch

    a, b = torch.rand(n), torch.rand(n)
    read = max(
        n * 4 / best_seconds(lambda: a.sum(), reps) / 1e9,
        2 * n * 4 / best_seconds(lambda: torch.dot(a, b), reps) / 1e9,
    )
    copy = 2 * n * 4 / best_seconds(lambda: b.copy_(a), reps) / 1e9
    return read, copy


def measure_gemm(m: int, reps: int, precision: str = "highest") -> float:
    """GFLOP/s of an m x m x m matmul at `precision` (see gemm_operands)."""
    import torch

    x, y, z = gemm_operands(m, precision)
    return 2 * m**3 / best_seconds(lambda: torch.mm(x, y, out=z), reps) / 1e9


def decode_weight_bytes(model: Any) -> int:
    """Bytes of the weights one decode step reads, in the dtype and format the model holds them: every
    weight (model_weight_bytes) but an embedding table that is not also the lm_head (a step looks up a
    few of its rows; a tied lm_head reads it whole)."""
    from kvpager.model.backends.quant_weights import PackedWeight
    from kvpager.model.loader import model_weight_bytes

    table, head = model.embed_tokens.weight, model.lm_head.weight
    head_tensors = head.tensors() if isinstance(head, PackedWeight) else (head,)
    total = int(model_weight_bytes(model))
    if all(t.data_ptr() != table.data_ptr() for t in head_tensors):
        total -= table.numel() * table.element_size()
    return total


def step_cost(spec: ModelSpec, batch: int, context: float, weight_bytes: int, kv_dtype_bytes: int) -> dict[str, float]:
    """Bytes moved and FLOPs of one decode step of `batch` sequences at mean context `context`, the
    weights read being `weight_bytes` (decode_weight_bytes) and the KV cache `kv_dtype_bytes` wide."""
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    linear_per_layer = h * (spec.q_size + 2 * spec.kv_size) + spec.q_size * h + 3 * h * i
    matmul_params = spec.num_layers * linear_per_layer + v * h  # + lm_head (tied or not, it is read)
    kv_per_token = spec.kv_shape(kv_dtype_bytes).bytes_per_token
    kv_read = batch * context * kv_per_token
    kv_write = batch * kv_per_token
    attn_flops = 4 * spec.num_layers * spec.num_heads * spec.head_dim * context * batch
    return {
        "weight_bytes": weight_bytes,
        "kv_read_bytes": kv_read,
        "kv_write_bytes": kv_write,
        "bytes": weight_bytes + kv_read + kv_write,
        "matmul_params_per_token": matmul_params,
        "flops": 2 * matmul_params * batch + attn_flops,
    }


@dataclass
class StepTimes:
    """Seconds of each timed decode step, and the machine probes read right after each."""

    seconds: list[float]
    read_gbs: list[float] = field(default_factory=list)
    gemm_gflops: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.seconds)


@dataclass
class Probes:
    """One-shot machine probes run between timed steps: read bandwidth and fp32 GEMM throughput."""

    read: Callable[[], float]
    gemm: Callable[[], float]


def make_probes(bandwidth_mib: int, gemm_size: int, precision: str = "highest") -> Probes:
    import torch

    from kvpager.model.precision import fp32_matmul_precision

    n = bandwidth_mib * 2**20 // 4
    a = torch.rand(n)
    x, y, z = gemm_operands(gemm_size, precision)

    def once(fn: Callable[[], object]) -> float:
        with fp32_matmul_precision(precision):
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

    return Probes(
        read=lambda: n * 4 / once(lambda: a.sum()) / 1e9,
        gemm=lambda: 2 * gemm_size**3 / once(lambda: torch.mm(x, y, out=z)) / 1e9,
    )


def time_decode_steps(
    engine: Any, batch: int, context_len: int, steps: int, seed: int, probes: Probes | None = None
) -> StepTimes:
    """Prefill `batch` distinct prompts of `context_len`, then time `steps` decode steps one by one,
    reading the machine `probes` (when given) after each.

    NOTE: the median step is the headline figure: on a shared machine one stalled step moves the
    mean of a few steps by tens of percent.
    """
    rng = random.Random(seed)
    vocab = engine.model_spec.vocab_size
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True, temperature=0.0)
    ids = [f"roof-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(1, vocab) for _ in range(context_len)], params)
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked) until every request has its first token
        started.update(o.request_id for o in engine.step())
    engine.step()  # one decode step untimed (warm-up at this batch shape)
    result = StepTimes([])
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        result.seconds.append(time.perf_counter() - start)
        if probes is not None:
            result.read_gbs.append(probes.read())
            result.gemm_gflops.append(probes.gemm())
    for rid in ids:
        engine.abort_request(rid)
    return result


def analyse(
    spec: ModelSpec,
    machine: dict[str, float],
    batch: int,
    context: float,
    times: StepTimes,
    bytes_held: tuple[int, int],
) -> dict[str, Any]:
    """One batch's row; `bytes_held`: (decode_weight_bytes, the KV cache's bytes per element)."""
    cost = step_cost(spec, batch, context, *bytes_held)
    seconds = times.median
    t_mem = cost["bytes"] / (machine["read_gbs"] * 1e9)
    t_comp = cost["flops"] / (machine["gemm_gflops"] * 1e9)
    bound_tok_s = batch / max(t_mem, t_comp)
    achieved_tok_s = batch / seconds
    paired: dict[str, Any] = {}
    if times.read_gbs:
        paired = {
            "paired_read_gbs_median": statistics.median(times.read_gbs),
            "paired_gemm_gflops_median": statistics.median(times.gemm_gflops),
            "paired_fraction_of_memory_roofline": statistics.median(
                cost["bytes"] / (gbs * 1e9) / t for gbs, t in zip(times.read_gbs, times.seconds, strict=True)
            ),
            "paired_fraction_of_compute_roofline": statistics.median(
                cost["flops"] / (gf * 1e9) / t for gf, t in zip(times.gemm_gflops, times.seconds, strict=True)
            ),
        }
    return {
        "batch": batch,
        "mean_context": context,
        **cost,
        "memory_bound_tok_s": batch / t_mem,
        "compute_bound_tok_s": batch / t_comp,
        "bound": "memory" if t_mem >= t_comp else "compute",
        "roofline_tok_s": bound_tok_s,
        "seconds_per_step": seconds,  # median over the timed steps
        "mean_seconds_per_step": times.mean,
        "step_seconds": times.seconds,
        "achieved_tok_s": achieved_tok_s,
        "achieved_gbs": cost["bytes"] / seconds / 1e9,
        "achieved_gflops": cost["flops"] / seconds / 1e9,
        "fraction_of_memory_roofline": t_mem / seconds,
        "fraction_of_compute_roofline": t_comp / seconds,
        "fraction_of_roofline": achieved_tok_s / bound_tok_s,
        **paired,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpager bench roofline", description=__doc__)
    report.add_common_args(p)
    p.add_argument("--batch-sizes", default="1,64", help="decode batch sizes to time (the last is 'largest')")
    p.add_argument("--context-len", type=int, default=256, help="prompt length before the timed decode steps")
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps timed (the median is reported)")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="tensor size for the bandwidth test")
    p.add_argument("--gemm-sizes", default="1024,2048")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    report.add_precision_arg(p)
    add_weight_format_args(p)
    p.add_argument(
        "--no-paired-probes",
        action="store_true",
        help="skip the bandwidth and GEMM probes read after every timed step (the paired fractions)",
    )
    return p


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from kvpager.engine.engine import Engine
    from kvpager.model.precision import fp32_matmul_precision

    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    if not batches or min(batches) < 1 or args.decode_steps < 1 or args.context_len < 1:
        raise ValueError("--batch-sizes, --decode-steps and --context-len must be positive")
    report.set_threads(args.num_threads)
    with fp32_matmul_precision(args.fp32_matmul_precision):  # the GEMM roofline at the precision the engine runs
        machine = measure_machine(
            args.bandwidth_mib, [int(m) for m in args.gemm_sizes.split(",") if m], args.reps, args.fp32_matmul_precision
        )
    machine["fp32_matmul_precision"] = args.fp32_matmul_precision
    report.log(args, f"machine: {machine['read_gbs']:.1f} GB/s read, {machine['gemm_gflops']:.0f} GFLOP/s fp32")
    choice = report.choose_model(args)
    spec = load_model_spec(choice.model_dir)
    tokens_per_seq = args.context_len + args.decode_steps + 8
    blocks = max(batches) * cdiv(tokens_per_seq, 16)
    config = EngineConfig(
        model=choice.model_dir,
        load_format=choice.load_format,
        kv_cache_memory=blocks * spec.kv_shape(DTYPE_BYTES["float32"]).bytes_per_block(16),
        max_num_seqs=max(batches),
        num_threads=args.num_threads,
        enable_prefix_caching=False,
        fp32_matmul_precision=args.fp32_matmul_precision,
        dtype=args.dtype,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        quantize_lm_head=args.quantize_lm_head,
        gguf_int8_activations=args.gguf_int8_activations,
    )
    engine = Engine(config)
    bytes_held = (decode_weight_bytes(engine.loaded.model), engine.loaded.kv_dtype.itemsize)
    gemm_sizes = [int(m) for m in args.gemm_sizes.split(",")]
    probes = (
        None if args.no_paired_probes else make_probes(args.bandwidth_mib, max(gemm_sizes), args.fp32_matmul_precision)
    )
    rows = []
    for batch in batches:
        report.log(args, f"batch {batch}: prefill {args.context_len} x {batch}, then {args.decode_steps} steps ...")
        times = time_decode_steps(engine, batch, args.context_len, args.decode_steps, args.seed + batch, probes)
        context = args.context_len + 1 + args.decode_steps / 2
        rows.append(analyse(spec, machine, batch, context, times, bytes_held))
    return build_result(args, argv, choice, machine, rows)


def build_result(
    args: argparse.Namespace, argv: Sequence[str], choice: report.ModelChoice, machine: dict[str, Any], rows: list
) -> dict[str, Any]:
    first, last = rows[0], rows[-1]
    return {
        "bench": "roofline",
        "command": report.command_line("roofline", argv),
        "machine": report.machine_info(),
        "model": {"dir": choice.model_dir, "load_format": choice.load_format, "dummy_smollm2": choice.is_default_dummy},
        "measured": machine,
        "decode": rows,
        "targets": {
            "batch1_memory_fraction": first["fraction_of_memory_roofline"],
            "batch1_ge_70pct_of_memory_roofline": first["batch"] == 1
            and first["fraction_of_memory_roofline"] >= TARGETS["batch1_memory_fraction"],
            "largest_batch_compute_fraction": last["fraction_of_compute_roofline"],
            "largest_batch_ge_50pct_of_matmul_roofline": last["fraction_of_compute_roofline"]
            >= TARGETS["largest_batch_compute_fraction"],
            "batch1_paired_memory_fraction": first.get("paired_fraction_of_memory_roofline"),
            "largest_batch_paired_compute_fraction": last.get("paired_fraction_of_compute_roofline"),
        },
        "peak_rss_bytes": report.peak_rss_bytes(),
    }


def render(result: dict[str, Any]) -> str:
    m = result["measured"]
    head = (
        f"measured: memory read {m['read_gbs']:.1f} GB/s, copy {m['copy_gbs']:.1f} GB/s, "
        f"fp32 GEMM {m['gemm_gflops']:.0f} GFLOP/s (best of sizes {', '.join(m['gemm_by_size'])}; "
        f"matmul precision {m.get('fp32_matmul_precision', 'highest')})"
    )
    headers = ["batch", "context", "MB/step", "GFLOP/step", "mem-bound tok/s", "compute-bound tok/s", "bound"]
    headers += ["achieved tok/s", "% of mem roofline", "% of matmul roofline", "% of bound"]
    rows = [
        [r["batch"], r["mean_context"], r["bytes"] / 1e6, r["flops"] / 1e9, r["memory_bound_tok_s"]]
        + [r["compute_bound_tok_s"], r["bound"], r["achieved_tok_s"], f"{r['fraction_of_memory_roofline']:.1%}"]
        + [f"{r['fraction_of_compute_roofline']:.1%}", f"{r['fraction_of_roofline']:.1%}"]
        for r in result["decode"]
    ]
    t = result["targets"]
    lines = [
        head,
        report.markdown_table(headers, rows),
        f"targets: batch-1 decode >= 70% of memory roofline: {t['batch1_memory_fraction']:.1%}; "
        f"largest batch >= 50% of matmul roofline: {t['largest_batch_compute_fraction']:.1%}",
    ]
    if t["batch1_paired_memory_fraction"] is not None:
        first, last = result["decode"][0], result["decode"][-1]
        lines.append(
            f"paired (each step against the machine read right after it, median over steps): batch {first['batch']} "
            f"{t['batch1_paired_memory_fraction']:.1%} of memory roofline "
            f"(read {first['paired_read_gbs_median']:.1f} GB/s), batch {last['batch']} "
            f"{t['largest_batch_paired_compute_fraction']:.1%} of matmul roofline "
            f"({last['paired_gemm_gflops_median']:.0f} GFLOP/s)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    result = run(args, argv)
    report.emit(result, render(result), args)
    return 0

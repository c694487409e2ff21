"""Per-layer attention time: kvpager's CPU kernels against the torch path, side by side in one process.

Builds one step's metadata over a shuffled block pool (as a long-running engine has it) and times
`CpuKernelOps.attention` (decode rows: the paged decode kernel; prefill chunks: the prefill kernel up
to `PREFILL_KERNEL_MAX_CONTEXT`, SDPA beyond) against `TorchOps.attention` (gathered blocks + SDPA),
alternating, and prints the medians and the largest difference of the outputs. Over a bfloat16 cache
on a CPU whose build runs the AMX prefill kernel, a third contender is the same kernels with the AMX
kernel off (the float32 prefill kernel). `--max-context` moves the kernels' context limit, to time
them where SDPA would otherwise run.

Usage:
  python scripts/compare_attention_paths.py --heads 9,3,64 --prefill 200,350,480,130,300,512
  python scripts/compare_attention_paths.py --heads 9,3,64 --prefill 64,64 --cached 600,900
  python scripts/compare_attention_paths.py --heads 9,3,64 --decode 64x300
  python scripts/compare_attention_paths.py --heads 32,8,64 --prefill 1500 --kv-cache-dtype bfloat16 --max-context 2048
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpager.model.attention import build_attention_metadata  # noqa: E402
from kvpager.model.backends import cpu_ops  # noqa: E402
from kvpager.model.backends.kernels.build import load_cpu_kernels  # noqa: E402
from kvpager.model.backends.ops import CpuKernelOps, TorchOps  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim")
    parser.add_argument("--prefill", default="", help="comma-separated prompt chunk lengths")
    parser.add_argument("--cached", default="", help="cached positions before each prefill chunk")
    parser.add_argument("--decode", default="", help="BATCHxCONTEXT decode rows, e.g. 64x300")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--max-context", type=int, default=None, help="the kernels' prefill context limit")
    args = parser.parse_args()
    if args.max_context is not None:
        cpu_ops.PREFILL_KERNEL_MAX_CONTEXT = args.max_context
    torch.set_num_threads(args.threads)
    num_heads, num_kv_heads, head_dim = (int(a) for a in args.heads.split(","))
    query_lens = [int(a) for a in args.prefill.split(",") if a]
    cached = [int(a) for a in args.cached.split(",") if a] or [0] * len(query_lens)
    seq_lens = [n + c for n, c in zip(query_lens, cached, strict=True)]
    if args.decode:
        batch, context = (int(a) for a in args.decode.split("x"))
        query_lens += [1] * batch
        seq_lens += [context] * batch
    if not query_lens:
        parser.error("give --prefill and/or --decode")

    bs = args.block_size
    needed = [-(-s // bs) for s in seq_lens]
    pool = list(range(sum(needed)))
    random.Random(0).shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in needed]
    dtype = getattr(torch, args.kv_cache_dtype)
    cache = torch.randn(2, sum(needed), bs, num_kv_heads, head_dim).to(dtype)
    meta = build_attention_metadata(query_lens, seq_lens, tables, bs, "cpu")
    q = torch.randn(sum(query_lens), num_heads, head_dim)
    scale = head_dim**-0.5

    kernels, reference = CpuKernelOps(load_cpu_kernels()), TorchOps()
    contenders: dict[str, CpuKernelOps | TorchOps] = {"kernels": kernels, "torch": reference}
    if kernels._prefill_attention_amx is not None and dtype == torch.bfloat16 and any(n > 1 for n in query_lens):
        float32_prefill = CpuKernelOps(kernels.kernels)
        float32_prefill._prefill_attention_amx = None
        contenders["kernels, AMX off"] = float32_prefill
    for ops in contenders.values():
        ops.begin_step()
    expected = reference.attention(q, cache, meta, scale)
    diffs = {
        name: (ops.attention(q, cache, meta, scale) - expected).abs().max().item() for name, ops in contenders.items()
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.reps):
        for name, ops in contenders.items():
            start = time.perf_counter()
            ops.attention(q, cache, meta, scale)
            times[name].append(time.perf_counter() - start)
    medians = ", ".join(f"{name} {statistics.median(t) * 1e3:.2f} ms" for name, t in times.items())
    worst = max(diffs.values())
    print(
        f"{sum(query_lens)} query rows, heads {args.heads}, KV {args.kv_cache_dtype}: {medians} per layer "
        f"(median of {args.reps}); max |difference| from torch {worst:.2e}"
    )


if __name__ == "__main__":
    main()

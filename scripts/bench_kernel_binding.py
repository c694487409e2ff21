"""Per-call cost of the kernels' checked binding: each kernel called through it and through the raw
ctypes function on the same tensors, alternating, medians in microseconds.

The difference is what the argument checks (kvpager/model/backends/kernels/abi.py) add to every call;
small inputs, so the call dominates. Usage:
  python scripts/bench_kernel_binding.py [--reps 2000] [--isa native|portable]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpager.model.backends.kernels.build import load_cpu_kernels  # noqa: E402


def _time(fn: Callable[[], object], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--isa", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    k = load_cpu_kernels(args.isa)
    x, w = torch.randn(4, 576), torch.randn(576)
    out = torch.empty_like(x)
    q, o = torch.randn(4, 8, 64), torch.empty(4, 8, 64)
    cache = torch.randn(2, 40, 16, 2, 64)
    tables, seq_lens = torch.randint(0, 40, (4, 8)), torch.tensor([5, 9, 100, 120])
    kc, vc = cache[0], cache[1]
    cases = {
        "rms_norm": (
            lambda: k.fn("kvp_rms_norm")(x=x, w=w, out=out, eps=1e-6),
            lambda: k.lib.kvp_rms_norm(x.data_ptr(), 576, w.data_ptr(), out.data_ptr(), 576, 4, 576, 1e-6),
        ),
        "paged_decode": (
            lambda: k.fn("kvp_paged_decode")(
                q=q, out=o, rows=None, k_cache=kc, v_cache=vc, block_tables=tables, seq_lens=seq_lens,
                window=0, scale=0.125, partition=256,
            ),
            lambda: k.lib.kvp_paged_decode(
                q.data_ptr(), 512, o.data_ptr(), 512, None, 4, 8, 2, 64, kc.data_ptr(), vc.data_ptr(), 16,
                tables.data_ptr(), 8, seq_lens.data_ptr(), 0, 0.125, 256, 0,
            ),
        ),
    }  # fmt: skip
    print(f"kernels: {k.isa} build, {args.rounds} rounds of {args.reps} calls, 1 thread")
    for name, (checked, raw) in cases.items():
        c, r = [], []
        for _ in range(args.rounds):
            c.append(_time(checked, args.reps))
            r.append(_time(raw, args.reps))
        mc, mr = statistics.median(c), statistics.median(r)
        print(f"{name:>14}: checked {mc:8.2f} us, raw {mr:8.2f} us, checks add {mc - mr:7.2f} us per call")


if __name__ == "__main__":
    main()

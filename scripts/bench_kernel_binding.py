"""Per-call cost of the kernels' checked binding: each kernel called on the same tensors three ways,
alternating in one process, medians in microseconds:

- full: every check run (`KernelFunction.checked`, what the first call of a signature pays);
- cached: the usual call, whose structural checks were cached for this signature (only the index
  values are checked again);
- raw: the bare ctypes function.

full - raw and cached - raw are what the argument checks (kvpager/model/backends/kernels/abi.py) add
per call; small inputs (decode over contexts of 1-4 positions), so the call dominates. Times are
the CPU time of the calling thread (time.thread_time), so waiting for a core on a shared machine
does not count. Usage:
  python scripts/bench_kernel_binding.py [--reps 2000] [--rounds 7] [--isa native|portable]
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
    start = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - start) / reps * 1e6


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
    tables, seq_lens = torch.randint(0, 40, (4, 8)), torch.tensor([1, 2, 3, 4])
    kc, vc = cache[0], cache[1]
    rms_norm, paged_decode = k.fn("kvp_rms_norm"), k.fn("kvp_paged_decode")
    decode_args = {"q": q, "out": o, "rows": None, "k_cache": kc, "v_cache": vc, "block_tables": tables}
    decode_args |= {"seq_lens": seq_lens, "window": 0, "scale": 0.125, "partition": 256, "kv_format": 0}
    cases = {
        "rms_norm": (
            lambda: rms_norm.checked(x=x, w=w, out=out, eps=1e-6),
            lambda: rms_norm(x=x, w=w, out=out, eps=1e-6),
            lambda: k.lib.kvp_rms_norm(x.data_ptr(), 576, w.data_ptr(), out.data_ptr(), 576, 4, 576, 1e-6),
        ),
        "paged_decode": (
            lambda: paged_decode.checked(**decode_args),
            lambda: paged_decode(**decode_args),
            lambda: k.lib.kvp_paged_decode(
                q.data_ptr(), 512, o.data_ptr(), 512, None, 4, 8, 2, 64, kc.data_ptr(), vc.data_ptr(), 16,
                tables.data_ptr(), 8, seq_lens.data_ptr(), 0, 0.125, 256, 0,
            ),
        ),
    }  # fmt: skip
    print(f"kernels: {k.isa} build, {args.rounds} rounds of {args.reps} calls, 1 thread")
    for name, (full, cached, raw) in cases.items():
        times: tuple[list[float], list[float], list[float]] = ([], [], [])
        for _ in range(args.rounds):
            for fn, out_times in zip((full, cached, raw), times, strict=True):
                out_times.append(_time(fn, args.reps))
        mf, mc, mr = (statistics.median(t) for t in times)
        print(
            f"{name:>14}: full {mf:8.2f} us, cached {mc:8.2f} us, raw {mr:8.2f} us; checks add "
            f"{mf - mr:7.2f} us in full, {mc - mr:7.2f} us cached ({(mc - mr) / (mf - mr):.2f} of full)"
        )


if __name__ == "__main__":
    main()

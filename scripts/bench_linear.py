"""Packed-weight linear kernels against torch and against a memory-read probe of the same bytes.

For each weight format (float32 torch, kvpager's bfloat16 / int8 / int4, the same int8 / int4 weights
with int8 activations and integer dot products (w8a8_int8 / w4a8_int8: not exact), torch's
`_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu`; on request, w8a8_int8_dot / w4a8_int8_dot: the
integer-dot kernel at every M, where w8a8_int8 / w4a8_int8 hand batches past `dot_kernel_max_rows` to
the exact path, or to the bf16 GEMM on CPUs with native bf16 matmul; w4a8_int8_plain / w8a8_int8_plain: w4a8_int8 / w8a8_int8 with their rows stored plain, not interleaved;
bf16_onednn: bf16 with the AMX tile kernel off, oneDNN's GEMM past two rows), each K x N shape (input x output features;
by default the linear shapes of Llama-3.2-1B: q/o, k/v, gate/up, down and a tied 32000-row lm_head)
and each batch of M input rows, the script times y = x @ W.T and reports weight GB/s (weight bytes
read per call / time), GFLOP/s (2 M N K / time) and the ratio to a read probe that sums a float32
buffer of the same byte count in the same process.

Each candidate rotates through enough copies of its weight to exceed --min-mb (so the weights stream
from memory, as in a model, instead of sitting in the last-level cache). Candidates are timed in
alternating order (A B ... B A) for --rounds rounds, best round kept, so a shared machine's noise
hits them alike; use the ratios, not the absolute figures, on a loaded machine.

The "1B tok/s" lines add up one decoder layer's projections x 16 layers + the lm_head at each M:
the tokens per second the linears alone allow (M tokens per step).

Usage (from a clone): python scripts/bench_linear.py [--threads 2] [--rows 1,4,16,64]
    [--shapes 2048x2048,...] [--formats f32,bf16,int8,int4,w8a8_int8,w4a8_int8,torch_int8,torch_int4]
    [--max-level avx512|avx2|portable] [--int8-group 32] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpager.model.backends.quant_dot import Int4DotWeight, Int8DotWeight  # noqa: E402
from kvpager.model.backends.quant_kernels import LEVEL_AVX2, LEVEL_AVX512, LEVEL_PORTABLE, load_quant_kernels  # noqa: E402
from kvpager.model.backends.quant_weights import Bf16Weight, Int4Weight, Int8Weight, PackedWeight  # noqa: E402

SHAPES_1B = "2048x2048,2048x512,2048x8192,8192x2048,2048x32000"
# one Llama-3.2-1B decoder layer: q, k, v, o, gate, up, down (K x N); 16 layers + the lm_head
LAYER_1B = [(2048, 2048), (2048, 512), (2048, 512), (2048, 2048), (2048, 8192), (2048, 8192), (8192, 2048)]
LAYERS_1B, LM_HEAD_1B = 16, (2048, 32000)
FORMATS = ("f32", "bf16", "int8", "int4", "w8a8_int8", "w4a8_int8", "torch_int8", "torch_int4")
# Not in the default list: the integer-dot kernel at every M, whatever dot_kernel_max_rows says (the
# numbers that rule is set from).
DOT_ONLY = ("w8a8_int8_dot", "w4a8_int8_dot")
# Also not in the default list: w4a8_int8 / w8a8_int8 with their rows stored plain instead of interleaved
# four at a time (kernels/int4_rows.h), the layout's before/after (w8a8_int8 interleaves only where the
# integer dot's path is below VNNI).
PLAIN = ("w4a8_int8_plain", "w8a8_int8_plain")
# Also not in the default list: kvpager's bfloat16 weight with the AMX tile kernel off (capped at the AVX2
# path): oneDNN's bf16 GEMM past NATIVE_BF16_AFTER_ROWS rows on CPUs with native bfloat16 matmul, the AMX
# kernel's before/after.
AMX_OFF = ("bf16_onednn",)
LEVELS = {"avx512": LEVEL_AVX512, "avx2": LEVEL_AVX2, "portable": LEVEL_PORTABLE}  # --max-level


@dataclass
class Candidate:
    name: str
    nbytes: int  # weight bytes read per call
    call: Callable[[torch.Tensor, int], object]  # (x, copy index) -> y
    copies: int


def _copies(nbytes: int, min_mb: int) -> int:
    return max(1, -(-min_mb * 2**20 // max(1, nbytes)))


def _packed(
    weight: PackedWeight, min_mb: int, max_level: int | None = None
) -> tuple[int, Callable[[torch.Tensor, int], object], int]:
    weight.max_level = max_level
    n = _copies(weight.nbytes, min_mb)
    ws = [weight] + [copy.deepcopy(weight) for _ in range(n - 1)]
    return weight.nbytes, lambda x, i: ws[i].matmul(x, None), n


def _dot_only(
    weight: Int8DotWeight | Int4DotWeight, min_mb: int, max_level: int | None = None
) -> tuple[int, Callable[[torch.Tensor, int], object], int]:
    weight.max_level = max_level
    n = _copies(weight.nbytes, min_mb)
    ws = [weight] + [copy.deepcopy(weight) for _ in range(n - 1)]
    return weight.nbytes, lambda x, i: ws[i].dot_kernel(x), n


def candidates(
    fmt: str, w: torch.Tensor, group: int, min_mb: int, max_level: int | None = None, int8_group: int | None = None
) -> Candidate:
    """One format's candidate for the float weight w [N, K]; kvpager's formats capped at kernel path
    `max_level` (None: the CPU's best); int4 in groups of `group`, int8 of `int8_group` (None: per channel)."""
    g8 = "" if int8_group is None else f"_g{int8_group}"
    if fmt == "f32":
        n = _copies(w.numel() * 4, min_mb)
        ws = [w.clone() for _ in range(n)]
        return Candidate(fmt, w.numel() * 4, lambda x, i: torch.nn.functional.linear(x, ws[i]), n)
    if fmt == "bf16":
        return Candidate(fmt, *_packed(Bf16Weight(w.to(torch.bfloat16)), min_mb, max_level))
    if fmt == "bf16_onednn":
        return Candidate(fmt, *_packed(Bf16Weight(w.to(torch.bfloat16)), min_mb, LEVEL_AVX2))
    if fmt == "int8":
        return Candidate(fmt + g8, *_packed(Int8Weight.from_float(w, int8_group), min_mb, max_level))
    if fmt == "int4":
        return Candidate(f"int4_g{group}", *_packed(Int4Weight.from_float(w, group), min_mb, max_level))
    if fmt == "w8a8_int8":
        return Candidate(fmt + g8, *_packed(Int8DotWeight.from_float(w, int8_group), min_mb, max_level))
    if fmt == "w8a8_int8_plain":
        return Candidate(fmt + g8, *_packed(Int8DotWeight.from_float(w, int8_group, False), min_mb, max_level))
    if fmt == "w4a8_int8":
        return Candidate(f"w4a8_int8_g{group}", *_packed(Int4DotWeight.from_float(w, group), min_mb, max_level))
    if fmt == "w4a8_int8_plain":
        return Candidate(
            f"w4a8_int8_plain_g{group}", *_packed(Int4DotWeight.from_float(w, group, False), min_mb, max_level)
        )
    if fmt == "w8a8_int8_dot":
        return Candidate(fmt + g8, *_dot_only(Int8DotWeight.from_float(w, int8_group), min_mb, max_level))
    if fmt == "w4a8_int8_dot":
        return Candidate(f"w4a8_int8_dot_g{group}", *_dot_only(Int4DotWeight.from_float(w, group), min_mb, max_level))
    if fmt == "torch_int8":
        q = Int8Weight.from_float(w)
        n = _copies(q.nbytes, min_mb)
        qs = [(q.qweight.clone(), q.scales.view(-1).clone()) for _ in range(n)]
        return Candidate(fmt, q.nbytes, lambda x, i: torch._weight_int8pack_mm(x, qs[i][0], qs[i][1]), n)
    if fmt == "torch_int4":
        q4 = Int4Weight.from_float(w, group)
        codes = q4.codes().to(torch.int32)
        # torch's int4: w = (code - 8) * scale + zero, so zero = offset + 8 scale
        sz = torch.stack([q4.scales, q4.group_offsets() + 8 * q4.scales], dim=-1).transpose(0, 1).contiguous()
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
        nbytes = packed.numel() + sz.numel() * 4
        n = _copies(nbytes, min_mb)
        ps = [(packed.clone(), sz.clone()) for _ in range(n)]
        return Candidate(
            f"torch_int4_g{group}",
            nbytes,
            lambda x, i: torch._weight_int4pack_mm_for_cpu(x, ps[i][0], group, ps[i][1]),
            n,
        )
    raise ValueError(f"unknown format {fmt!r}; choose from {FORMATS + DOT_ONLY + PLAIN + AMX_OFF}")


def probe(nbytes: int, min_mb: int) -> Candidate:
    """A pure read of nbytes (a float32 sum), rotating copies like the weights."""
    n = _copies(nbytes, min_mb)
    bufs = [torch.rand(max(1, nbytes // 4)) for _ in range(n)]
    return Candidate(f"read_{nbytes}", nbytes, lambda x, i: bufs[i].sum(), n)


def time_abba(cands: list[Candidate], x: torch.Tensor, rounds: int, min_s: float) -> dict[str, float]:
    """Seconds per call, best round, the candidates in A B .. B A order (alternating each round)."""
    best = {c.name: float("inf") for c in cands}
    for c in cands:  # warm-up: page in every copy, first-call costs
        for i in range(c.copies):
            c.call(x, i)
    for r in range(rounds):
        order = cands if r % 2 == 0 else cands[::-1]
        for c in order:
            calls, start = 0, time.perf_counter()
            while True:
                c.call(x, calls % c.copies)
                calls += 1
                elapsed = time.perf_counter() - start
                if elapsed >= min_s and calls >= c.copies:
                    break
            best[c.name] = min(best[c.name], elapsed / calls)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--shapes", default=SHAPES_1B, help="K x N list (input x output features)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--group", type=int, default=32, help="int4 group size")
    parser.add_argument("--int8-group", type=int, default=None, help="int8 group size (default: per channel)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--min-s", type=float, default=0.05, help="seconds per candidate per round")
    parser.add_argument("--min-mb", type=int, default=64, help="MiB of weight copies per candidate")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one round (a smoke test)")
    parser.add_argument(
        "--max-level",
        choices=sorted(LEVELS),
        default=None,
        help="cap kvpager's kernels at this path (default: the best)",
    )
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.rows, args.rounds, args.min_s, args.min_mb = "256x64,96x160", "1,3", 2, 0.002, 1
    torch.set_num_threads(args.threads)
    kernels = load_quant_kernels()
    print(f"kernel path: {kernels.describe()}; threads {args.threads}; torch {torch.__version__}")
    print(f"w8a8_int8 / w4a8_int8: {kernels.describe_dot()}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    formats = args.formats.split(",")
    results: list[dict[str, object]] = []
    print(f"{'K x N':>12} {'M':>3} {'candidate':>16} {'us/call':>10} {'GB/s':>7} {'GFLOP/s':>8} {'% read':>7}")
    for k, n in shapes:
        w = torch.randn(n, k) * 0.02
        level = None if args.max_level is None else LEVELS[args.max_level]
        cands = [candidates(f, w, args.group, args.min_mb, level, args.int8_group) for f in formats]
        probes = {c.nbytes: probe(c.nbytes, args.min_mb) for c in cands}
        for m in rows:
            x = torch.randn(m, k)
            pr = list(probes.values())
            secs = time_abba([*cands, *pr], x, args.rounds, args.min_s)
            probe_gbs = {p.nbytes: p.nbytes / secs[p.name] / 1e9 for p in pr}
            for c in cands:
                t = secs[c.name]
                gbs, gflops = c.nbytes / t / 1e9, 2 * m * n * k / t / 1e9
                pct = 100 * gbs / probe_gbs[c.nbytes]
                print(f"{k:>5} x {n:<5} {m:>3} {c.name:>16} {t * 1e6:>10.1f} {gbs:>7.2f} {gflops:>8.1f} {pct:>6.0f}%")
                results.append(
                    {
                        "K": k,
                        "N": n,
                        "M": m,
                        "candidate": c.name,
                        "seconds": t,
                        "GBps": gbs,
                        "GFLOPs": gflops,
                        "read_probe_GBps": probe_gbs[c.nbytes],
                    }  # fmt: skip
                )
        del cands, probes
    _print_model_estimate(results, rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


def _print_model_estimate(results: list[dict[str, object]], rows: list[int]) -> None:
    """tok/s of the 1B model's linears alone, where every shape it needs was measured."""
    times = {(r["K"], r["N"], r["M"], r["candidate"]): float(r["seconds"]) for r in results}  # type: ignore[arg-type]
    names = sorted({str(r["candidate"]) for r in results})
    needed = [*LAYER_1B, LM_HEAD_1B]
    for m in rows:
        for name in names:
            if all((k, n, m, name) in times for k, n in needed):
                step = LAYERS_1B * sum(times[(k, n, m, name)] for k, n in LAYER_1B) + times[(*LM_HEAD_1B, m, name)]
                print(f"1B linears, M={m:>3}, {name:>16}: {m / step:8.2f} tok/s ({step * 1e3:.1f} ms per step)")


if __name__ == "__main__":
    sys.exit(main())

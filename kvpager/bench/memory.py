"""`kvpager bench memory`: the paging study. One seeded trace, three allocation modes, one KV budget.

The trace: log-normal prompt and output lengths (clipped so prompt + output <= max_model_len),
Poisson arrivals. Time advances in decode steps: at its admission a request stores its whole prompt
(prefill in one step, a simplification), then every step each running request stores one more
token until it holds prompt + output tokens, and is released. Admission is first come, first
served (the head of the queue blocks the rest), the same in every mode. A paged request that cannot
grow preempts the most recently admitted one (recomputed at re-admission, as the engine does).
Then, for real on the model, the engine runs with `max_num_seqs` = each mode's mean concurrency.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpager.bench import report
from kvpager.bench.allocators import FirstFitAllocator, KVAllocator, PagedAllocator, SlotAllocator


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: int
    arrival_step: int
    prompt_len: int
    output_len: int

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass
class ModeResult:
    """One allocation mode replayed over the trace: per-step series and summary counts."""

    mode: str
    utilisation: list[float] = field(default_factory=list)  # stored / reserved, per step
    concurrency: list[int] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)  # queue length after admission, per step
    num_refused: int = 0  # can never fit the budget
    num_queued: int = 0  # waited at least one step before admission
    total_wait_steps: int = 0
    max_queue: int = 0
    num_preemptions: int = 0
    num_fragmentation_refusals: int = 0
    num_completed: int = 0

    def summary(self, budget_tokens: int) -> dict[str, Any]:
        steps = max(1, len(self.concurrency))
        busy = [u for u, s in zip(self.utilisation, self.stored, strict=True) if s > 0]
        # NOTE: while requests wait, memory (not demand) limits concurrency: the mode's capacity.
        saturated = [c for c, w in zip(self.concurrency, self.waiting, strict=True) if w > 0]
        return {
            "mode": self.mode,
            "utilisation_mean": sum(busy) / len(busy) if busy else 0.0,
            "budget_utilisation_mean": sum(self.stored) / steps / budget_tokens,
            "concurrency_mean": sum(self.concurrency) / steps,
            "concurrency_max": max(self.concurrency, default=0),
            "concurrency_saturated_mean": sum(saturated) / len(saturated) if saturated else 0.0,
            "num_refused": self.num_refused,
            "num_queued": self.num_queued,
            "mean_wait_steps": self.total_wait_steps / max(1, self.num_completed),
            "max_queue": self.max_queue,
            "num_preemptions": self.num_preemptions,
            "num_fragmentation_refusals": self.num_fragmentation_refusals,
            "num_completed": self.num_completed,
            "makespan_steps": len(self.concurrency),
        }


def make_trace(
    num_requests: int,
    seed: int,
    arrival_rate: float,
    max_model_len: int,
    prompt_median: float = 256.0,
    output_median: float = 128.0,
    sigma: float = 1.0,
) -> list[TraceRequest]:
    """Seeded trace; arrival_rate is requests per decode step (exponential inter-arrival times)."""
    if num_requests < 1 or arrival_rate <= 0 or max_model_len < 2:
        raise ValueError("need num_requests >= 1, arrival_rate > 0 and max_model_len >= 2")
    rng = random.Random(seed)
    clock, trace = 0.0, []
    for i in range(num_requests):
        clock += rng.expovariate(arrival_rate)
        prompt = min(max(1, round(rng.lognormvariate(math.log(prompt_median), sigma))), max_model_len - 1)
        output = min(max(1, round(rng.lognormvariate(math.log(output_median), sigma))), max_model_len - prompt)
        trace.append(TraceRequest(i, int(clock), prompt, output))
    return trace


def simulate(trace: Sequence[TraceRequest], allocator: KVAllocator, check: bool = False) -> ModeResult:
    """Replay `trace` through `allocator`; with check=True verify its accounting after every step."""
    result = ModeResult(allocator.name)
    pending = deque(sorted(trace, key=lambda r: r.arrival_step))
    queue: deque[TraceRequest] = deque()
    running: dict[int, int] = {}  # request id -> tokens stored, in admission order
    by_id = {r.request_id: r for r in trace}
    progress: dict[int, int] = {}  # tokens reached so far (kept across preemption)
    step = 0
    while pending or queue or running:
        while pending and pending[0].arrival_step <= step:
            request = pending.popleft()
            if allocator.can_ever_fit(request.max_len):
                queue.append(request)
            else:
                result.num_refused += 1
        result.max_queue = max(result.max_queue, len(queue))
        _admit(queue, running, progress, allocator, result, step)
        _grow(running, progress, by_id, allocator, queue, result)
        result.stored.append(allocator.stored_tokens())
        reserved = allocator.reserved_tokens()
        result.utilisation.append(result.stored[-1] / reserved if reserved else 0.0)
        result.concurrency.append(len(running))
        result.waiting.append(len(queue))
        if check:
            _check(allocator, running)
        for request_id in [rid for rid, n in running.items() if n >= by_id[rid].max_len]:
            allocator.release(request_id)
            del running[request_id]
            result.num_completed += 1
        step += 1
    result.num_fragmentation_refusals = getattr(allocator, "num_fragmentation_refusals", 0)
    return result


def _admit(
    queue: deque[TraceRequest],
    running: dict[int, int],
    progress: dict[int, int],
    allocator: KVAllocator,
    result: ModeResult,
    step: int,
) -> None:
    while queue:
        request = queue[0]
        length = progress.get(request.request_id, request.prompt_len)
        if not allocator.reserve(request.request_id, length, request.max_len):
            return
        queue.popleft()
        if request.request_id not in progress:  # first admission (not a resumed preemption)
            wait = step - request.arrival_step
            result.num_queued += wait > 0
            result.total_wait_steps += wait
        running[request.request_id] = length


def _grow(
    running: dict[int, int],
    progress: dict[int, int],
    by_id: dict[int, TraceRequest],
    allocator: KVAllocator,
    queue: deque[TraceRequest],
    result: ModeResult,
) -> None:
    """Every running request stores one more token; a paged pool that runs dry preempts LIFO."""
    for request_id in list(running):
        if request_id not in running:
            continue  # preempted earlier in this step
        new_len = min(running[request_id] + 1, by_id[request_id].max_len)
        while not allocator.grow(request_id, new_len):
            victim = next(reversed(running))
            allocator.release(victim)
            progress[victim] = running.pop(victim)
            queue.appendleft(by_id[victim])
            result.num_preemptions += 1
            if victim == request_id:
                break
        if request_id in running:
            running[request_id] = new_len
            progress[request_id] = new_len


def _check(allocator: KVAllocator, running: dict[int, int]) -> None:
    allocator.check()
    if allocator.stored_tokens() != sum(running.values()):
        raise ValueError(
            f"{allocator.name}: allocator stores {allocator.stored_tokens()} tokens, "
            f"live requests hold {sum(running.values())}"
        )


def make_allocators(budget_tokens: int, max_model_len: int, block_sizes: Sequence[int]) -> list[KVAllocator]:
    allocators: list[KVAllocator] = [SlotAllocator(budget_tokens, max_model_len), FirstFitAllocator(budget_tokens)]
    return allocators + [PagedAllocator(budget_tokens, bs) for bs in block_sizes]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpager bench memory", description=__doc__)
    report.add_common_args(p)
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--arrival-rate", type=float, default=0.2, help="requests per decode step (Poisson)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--budget-tokens", type=int, default=16384, help="KV budget in token positions (all modes)")
    p.add_argument("--prompt-median", type=float, default=256.0)
    p.add_argument("--output-median", type=float, default=128.0)
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of both lengths")
    p.add_argument("--block-sizes", default="16,1,8,32", help="paged block sizes; the first is the main one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="write a PNG of utilisation and concurrency over time")
    p.add_argument("--no-real", action="store_true", help="skip the real engine runs")
    p.add_argument("--real-requests", type=int, default=32)
    p.add_argument("--real-input-len", type=int, default=64)
    p.add_argument("--real-output-len", type=int, default=64)
    return p


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    block_sizes = [int(b) for b in args.block_sizes.split(",") if b]
    trace = make_trace(
        args.num_requests,
        args.seed,
        args.arrival_rate,
        args.max_model_len,
        args.prompt_median,
        args.output_median,
        args.sigma,
    )
    results = [simulate(trace, a) for a in make_allocators(args.budget_tokens, args.max_model_len, block_sizes)]
    summaries = [r.summary(args.budget_tokens) for r in results]
    real: list[dict[str, Any]] = []
    if not args.no_real:
        from kvpager.bench.memory_real import run_real

        real = run_real(args, summaries[:3])
    if args.plot:
        from kvpager.bench.memory_real import plot

        plot(results, args.plot)
    return {
        "bench": "memory",
        "command": report.command_line("memory", argv),
        "machine": report.machine_info(),
        "trace": {
            "num_requests": len(trace),
            "mean_prompt_len": sum(r.prompt_len for r in trace) / len(trace),
            "mean_output_len": sum(r.output_len for r in trace) / len(trace),
            "arrival_rate_per_step": args.arrival_rate,
            "max_model_len": args.max_model_len,
            "budget_tokens": args.budget_tokens,
            "seed": args.seed,
        },
        "modes": summaries,
        "series": {r.mode: _downsample(r) for r in results},
        "real": real,
        "targets": _targets(summaries),
        "peak_rss_bytes": report.peak_rss_bytes(),
    }


def _downsample(result: ModeResult, max_points: int = 400) -> dict[str, list[float]]:
    """Every k-th step of the series, so the JSON stays small (the plot uses every step)."""
    k = max(1, -(-len(result.concurrency) // max_points))
    return {
        "step": list(range(0, len(result.concurrency), k)),
        "utilisation": [round(u, 4) for u in result.utilisation[::k]],
        "concurrency": [float(c) for c in result.concurrency[::k]],
    }


def _targets(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    slots, paged = summaries[0], summaries[2]
    key = "concurrency_saturated_mean"
    ratio = paged[key] / slots[key] if slots[key] else 0.0
    return {
        "paged_utilisation_ge_95pct": paged["utilisation_mean"] >= 0.95,
        "slots_utilisation_lt_40pct": slots["utilisation_mean"] < 0.40,
        "concurrency_ratio_paged_vs_slots": ratio,
        "concurrency_ratio_ge_2_5x": ratio >= 2.5,
    }


def render(result: dict[str, Any]) -> str:
    t = result["trace"]
    head = (
        f"trace: {t['num_requests']} requests, mean prompt {t['mean_prompt_len']:.0f}, mean output "
        f"{t['mean_output_len']:.0f}, {t['arrival_rate_per_step']} arrivals/step, budget {t['budget_tokens']} "
        f"tokens, max_model_len {t['max_model_len']} (prefill at admission; one token per running request per step)"
    )
    headers = ["mode", "KV util (stored/reserved)", "util of budget", "concurrent mean", "while queue non-empty"]
    headers += ["max", "queued"]
    headers += ["mean wait (steps)", "preemptions", "frag. refusals", "refused", "makespan (steps)"]
    rows = [
        [m["mode"], f"{m['utilisation_mean']:.1%}", f"{m['budget_utilisation_mean']:.1%}", m["concurrency_mean"]]
        + [m["concurrency_saturated_mean"]]
        + [m["concurrency_max"], m["num_queued"], m["mean_wait_steps"], m["num_preemptions"]]
        + [m["num_fragmentation_refusals"], m["num_refused"], m["makespan_steps"]]
        for m in result["modes"]
    ]
    parts = [head, report.markdown_table(headers, rows)]
    if result["real"]:
        real_rows = [
            [r["mode"], r["max_num_seqs"], r["output_tokens"], r["seconds"], r["output_tokens_per_s"]]
            for r in result["real"]
        ]
        parts += ["real engine runs (max_num_seqs = the mode's mean concurrency):"]
        parts += [
            report.markdown_table(["mode", "max_num_seqs", "output tokens", "seconds", "output tok/s"], real_rows)
        ]
    tg = result["targets"]
    parts.append(
        f"paged (block 16) vs max-len slots, requests admitted concurrently while the queue is non-empty: "
        f"{tg['concurrency_ratio_paged_vs_slots']:.2f}x (target >= 2.5x)"
    )
    return "\n".join(parts)


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    result = run(args, argv)
    report.emit(result, render(result), args)
    return 0

"""Guided decoding cost: does a grammar slow the unguided requests beside it, and how fast are 32 guided?

Runs one engine (offline, the `Engine` step loop, no HTTP) through three batches of `--batch`
requests, each request decoding exactly `--max-tokens` tokens (ignore_eos, min_tokens), in ABBA
order over `--rounds` rounds so the machine's drift falls on every phase alike:

- plain: every request unguided;
- mixed: one request guided by an open-ended regex, the others unguided (the same batch size, so
  any difference is the guided row's mask work, which every row of the step waits for);
- guided: every request guided by a JSON schema (compiled once, then served from the cache).

Prints tokens/s per phase, the mixed/plain step-time ratio (the slowdown unguided requests see)
and the guided/plain throughput ratio; `--json-out` keeps them. Figures depend on the machine: run
it on an idle one.

    python scripts/bench_guided.py --batch 32 --max-tokens 64 --rounds 2            # demo model
    python scripts/bench_guided.py --model ./my-model --device cuda --batch 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from kvpager.core.config import EngineConfig
from kvpager.core.sampling_params import SamplingParams, StructuredOutputSpec
from kvpager.engine.engine import Engine

OPEN_REGEX = StructuredOutputSpec("regex", r"[A-Za-z ,.;:]*")
SCHEMA = StructuredOutputSpec(
    "json",
    json.dumps(
        {
            "type": "object",
            "properties": {"book": {"type": "string"}, "verses": {"type": "array", "items": {"type": "integer"}}},
            "required": ["book", "verses"],
        }
    ),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--json-out", type=Path, default=None)
    return p.parse_args(argv)


def run_phase(engine: Engine, phase: str, batch: int, max_tokens: int, tag: str) -> tuple[float, int, int]:
    """(seconds, tokens generated, steps) for one batch of the phase."""
    for i in range(batch):
        structured = None
        if phase == "mixed" and i == 0:
            structured = OPEN_REGEX
        elif phase == "guided":
            structured = SCHEMA
        params = SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=max_tokens,
            min_tokens=max_tokens,
            ignore_eos=True,
            structured=structured,
        )
        if structured is not None:
            engine.grammar.compile(structured).result()  # cached after the first: off the clock
        engine.add_request(f"{tag}-{i}", f"And it came to pass in the {i}th year", params)
    start = time.perf_counter()
    tokens = steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        tokens += sum(len(o.delta_token_ids) for out in outputs for o in out.outputs)
    return time.perf_counter() - start, tokens, steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine = Engine(EngineConfig(model=args.model, device=args.device, kv_cache_memory=args.kv_cache_memory))
    run_phase(engine, "guided", min(args.batch, 2), 2, "warmup")  # builds the grammar tokenizer once
    results: dict[str, list[tuple[float, int, int]]] = {"plain": [], "mixed": [], "guided": []}
    order = ["plain", "mixed", "guided"]
    for r in range(args.rounds):
        for phase in order if r % 2 == 0 else list(reversed(order)):
            results[phase].append(run_phase(engine, phase, args.batch, args.max_tokens, f"{phase}{r}"))
    summary: dict[str, float] = {}
    for phase, runs in results.items():
        seconds = sum(s for s, _, _ in runs)
        tokens = sum(t for _, t, _ in runs)
        summary[f"{phase}_tokens_per_s"] = tokens / seconds
        summary[f"{phase}_step_ms"] = statistics.mean(1000 * s / max(n, 1) for s, _, n in runs)
        print(
            f"{phase:7s} {tokens / seconds:9.1f} tokens/s  {summary[f'{phase}_step_ms']:7.2f} ms/step  ({len(runs)} runs)"
        )
    summary["mixed_over_plain_step_time"] = summary["mixed_step_ms"] / summary["plain_step_ms"]
    summary["guided_over_plain_throughput"] = summary["guided_tokens_per_s"] / summary["plain_tokens_per_s"]
    print(f"one guided row slows the batch's step by {100 * (summary['mixed_over_plain_step_time'] - 1):+.1f} %")
    print(f"{args.batch} guided requests: {100 * summary['guided_over_plain_throughput']:.1f} % of unguided throughput")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary}, indent=2))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

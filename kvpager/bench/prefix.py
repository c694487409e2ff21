"""`kvpager bench prefix`: time to first token for a long shared prefix, cold versus prefix-cache hit.

Each request is `--prefix-len` prefix tokens + `--suffix-len` fresh suffix tokens (seeded random ids),
`max_tokens=1`. Cold: prefix caching stays on but every repetition has a fresh prefix, so nothing
can hit. Hit: the shared prefix is computed once (untimed), then every repetition reuses its
cached blocks and computes only the suffix (and the partial block before it). Cold and hit
repetitions alternate, so both see the same machine load. TTFT is wall time
from `add_request` to the step that returns the first token, one request at a time.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from typing import Any

from kvpager.bench import report
from kvpager.core.config import DTYPE_BYTES, EngineConfig
from kvpager.core.kv_cache_manager import cdiv
from kvpager.core.sampling_params import SamplingParams
from kvpager.model.spec import load_model_spec

TARGET_SPEEDUP = 20.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpager bench prefix", description=__doc__)
    report.add_common_args(p)
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--repetitions", type=int, default=20)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    return p


def time_to_first_token(engine: Any, request_id: str, prompt: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft: float | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
    if ttft is None:
        raise ValueError(f"request {request_id} finished without a token")
    return ttft


def summarise(values: list[float]) -> dict[str, Any]:
    return {
        "median_s": report.median(values),
        "p90_s": report.percentile(values, 90),
        "min_s": min(values),
        "max_s": max(values),
        "all_s": values,
    }


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    from kvpager.engine.engine import Engine

    if args.prefix_len < 1 or args.suffix_len < 1 or args.repetitions < 1:
        raise ValueError("--prefix-len, --suffix-len and --repetitions must be >= 1")
    report.set_threads(args.num_threads)
    choice = report.choose_model(args)
    spec = load_model_spec(choice.model_dir)
    seq_len = args.prefix_len + args.suffix_len + 1
    blocks = 4 * cdiv(seq_len, args.block_size)  # the shared prefix stays cached beside the live request
    config = EngineConfig(
        model=choice.model_dir,
        load_format=choice.load_format,
        block_size=args.block_size,
        kv_cache_memory=blocks * spec.kv_shape(DTYPE_BYTES["float32"]).bytes_per_block(args.block_size),
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=args.num_threads,
        enable_prefix_caching=True,
    )
    engine = Engine(config)
    rng = random.Random(args.seed)
    vocab = spec.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    shared = tokens(args.prefix_len)
    time_to_first_token(engine, "warm", shared + tokens(args.suffix_len), params)
    hits_before = engine.stats().prefix_cache_hits
    cold, hit = [], []
    for i in range(args.repetitions):  # NOTE: interleaved, so both see the same machine load
        cold.append(time_to_first_token(engine, f"cold-{i}", tokens(args.prefix_len + args.suffix_len), params))
        hit.append(time_to_first_token(engine, f"hit-{i}", shared + tokens(args.suffix_len), params))
        report.log(args, f"repetition {i + 1}/{args.repetitions}: cold {cold[-1]:.3f} s, hit {hit[-1]:.3f} s")
    hit_tokens = (engine.stats().prefix_cache_hits - hits_before) / args.repetitions
    report.log(args, f"hit median {report.median(hit):.3f} s ({hit_tokens:.0f} cached tokens per request)")
    return build_result(args, argv, choice, cold, hit, hit_tokens)


def build_result(
    args: argparse.Namespace,
    argv: Sequence[str],
    choice: report.ModelChoice,
    cold: list[float],
    hit: list[float],
    hit_tokens: float,
) -> dict[str, Any]:
    speedup = report.median(cold) / report.median(hit)
    return {
        "bench": "prefix",
        "command": report.command_line("prefix", argv),
        "machine": report.machine_info(),
        "model": {"dir": choice.model_dir, "load_format": choice.load_format, "dummy_smollm2": choice.is_default_dummy},
        "workload": {"prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "repetitions": args.repetitions},
        "cold": summarise(cold),
        "hit": summarise(hit),
        "cached_tokens_per_hit": hit_tokens,
        "speedup_median": speedup,
        "targets": {"hit_ge_20x_faster": speedup >= TARGET_SPEEDUP},
        "peak_rss_bytes": report.peak_rss_bytes(),
    }


def render(result: dict[str, Any]) -> str:
    w = result["workload"]
    rows = [
        [name, result[key]["median_s"], result[key]["p90_s"], result[key]["min_s"], result[key]["max_s"]]
        for name, key in (("cold (fresh prefix)", "cold"), ("prefix-cache hit", "hit"))
    ]
    return "\n".join(
        [
            f"prompt: {w['prefix_len']}-token prefix + {w['suffix_len']}-token suffix, {w['repetitions']} repetitions each",
            report.markdown_table(["TTFT", "median s", "p90 s", "min s", "max s"], rows),
            f"cached tokens per hit: {result['cached_tokens_per_hit']:.0f}; "
            f"speedup (median): {result['speedup_median']:.1f}x (target >= 20x)",
        ]
    )


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    result = run(args, argv)
    report.emit(result, render(result), args)
    return 0

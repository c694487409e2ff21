"""Decode tokens/s per model dtype (float32, bfloat16, float16) at batch 1 and batch 8, alternating.

For each shape every dtype's engine is loaded once, then the phases alternate (dtype order reversed
every round, A B C C B A ...), so a change in machine load hits every dtype alike. A phase runs
`batch` prompts of `--input-len` random token ids twice: to 1 output token (prefill) and to
1 + `--output-len` tokens; decode tok/s = batch * output_len / (difference of the two times).
Prefix caching is off so both runs prefill the same way. Prints per-phase rates, the medians and
each dtype's ratio to float32 (ratios are what a shared machine can report; rates need a quiet one).

Shapes: "demo" (the bundled kvpager/demo_model), the random-weight shapes of
kvpager.bench.dummy_models (`llama-3.2-1b`, ...; `load_format="dummy"`, nothing downloaded), or
any checkpoint directory given as a path. A format is a dtype, optionally with a weight
quantization: `bfloat16+int4` is `dtype="bfloat16", quantization="int4"`; any --quantization value
works (`bfloat16+w8a8_int8`, `bfloat16+w4a8_int8`: the same weights, integer dot products).

  python scripts/bench_dtypes.py --shapes demo,llama-3.2-1b --batches 1,8 --rounds 3 --threads 2
  python scripts/bench_dtypes.py --shapes models/llama-1b --dtypes bfloat16,bfloat16+int8,bfloat16+int4
  python scripts/bench_dtypes.py --shapes models/llama-1b --dtypes bfloat16+int8,bfloat16+w8a8_int8,bfloat16+int4,bfloat16+w4a8_int8
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpager import LLM, SamplingParams  # noqa: E402
from kvpager.bench.dummy_models import make_dummy_model_dir  # noqa: E402

DEMO = ROOT / "kvpager" / "demo_model"


def _llm(shape: str, fmt: str, workdir: Path, args: argparse.Namespace) -> LLM:
    dtype, _, quantization = fmt.partition("+")
    common = {
        "dtype": dtype,
        "quantization": quantization or None,
        "kv_cache_memory": args.kv_cache_memory,
        "enable_prefix_caching": False,
        "num_threads": args.threads,
        "max_model_len": args.input_len + args.output_len + 8,
    }
    if shape == "demo":
        return LLM(model=str(DEMO), **common)
    if Path(shape).is_dir():
        return LLM(model=shape, **common)
    path = make_dummy_model_dir(workdir / shape, shape)
    return LLM(model=str(path), load_format="dummy", **common)


def _rates(llm: LLM, batch: int, args: argparse.Namespace, seed: int) -> tuple[float, float]:
    """(decode tok/s, prefill tok/s): the prefill rate is batch * input_len over the 1-token run (as
    llama-bench's pp figure: the prompt's forward pass and one sampled token)."""
    vocab = llm.engine.loaded.spec.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (args.input_len,), generator=g).tolist() for _ in range(batch)]
    times = []
    for tokens in (1, 1 + args.output_len):
        sp = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - start)
    decode_s = times[1] - times[0]
    if decode_s <= 0:
        # Timing noise larger than the decode phase itself: no rate can be read from this phase.
        raise SystemExit(f"decode phase of {args.output_len} tokens took no measurable time; raise --output-len")
    return batch * args.output_len / decode_s, batch * args.input_len / times[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="demo,llama-3.2-1b")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    parser.add_argument("--kv-cache-memory", type=int, default=256 << 20, help="bytes per engine")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    prefill_results: dict[str, dict[str, dict[str, list[float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            llms = {dtype: _llm(shape, dtype, Path(tmp), args) for dtype in dtypes}
            rates: dict[str, dict[str, list[float]]] = {d: {str(b): [] for b in batches} for d in dtypes}
            prefill: dict[str, dict[str, list[float]]] = {d: {str(b): [] for b in batches} for d in dtypes}
            for r in range(args.rounds):
                order = dtypes if r % 2 == 0 else dtypes[::-1]
                for batch in batches:
                    for dtype in order:
                        rate, pp = _rates(llms[dtype], batch, args, seed=r)
                        rates[dtype][str(batch)].append(rate)
                        prefill[dtype][str(batch)].append(pp)
                        print(
                            f"{shape} round {r} batch {batch} {dtype}: {rate:.2f} tok/s decode, {pp:.1f} tok/s prefill",
                            flush=True,
                        )
            results[shape] = rates
            prefill_results[shape] = prefill
            del llms
            gc.collect()
    print(f"\nmedian decode tok/s (ratio to {dtypes[0]})")
    for shape, rates in results.items():
        for batch in batches:
            base = statistics.median(rates[dtypes[0]][str(batch)])
            cells = []
            for dtype in dtypes:
                m = statistics.median(rates[dtype][str(batch)])
                cells.append(f"{dtype} {m:.2f}" + (f" ({m / base:.2f}x)" if base else ""))
            print(f"{shape:>14} batch {batch:>2}: " + ", ".join(cells))
    print(f"\nmedian prefill tok/s ({args.input_len}-token prompts)")
    for shape, pre in prefill_results.items():
        for batch in batches:
            cells = [f"{dtype} {statistics.median(pre[dtype][str(batch)]):.1f}" for dtype in dtypes]
            print(f"{shape:>14} batch {batch:>2}: " + ", ".join(cells))
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "rates": results, "prefill_rates": prefill_results},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()

"""The paging study's torch side: real engine runs per mode, and the PNG plot (matplotlib optional).

Each allocation mode admitted some mean number of requests at once under the shared budget; here the
engine (paged underneath) runs the same real requests with `max_num_seqs` capped at that number, so
output tokens/s shows what the concurrency each mode affords is worth on this machine.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvpager.bench import report

if TYPE_CHECKING:
    from kvpager.bench.memory import ModeResult


def run_real(args: argparse.Namespace, summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run `--real-requests` requests through the engine once per mode; output tok/s per mode."""
    from kvpager.core.config import DTYPE_BYTES, EngineConfig
    from kvpager.core.sampling_params import SamplingParams
    from kvpager.engine.engine import Engine
    from kvpager.engine.loading import load
    from kvpager.model.spec import load_model_spec

    report.set_threads(args.num_threads)
    choice = report.choose_model(args)
    bytes_per_token = load_model_spec(choice.model_dir).kv_shape(DTYPE_BYTES["float32"]).bytes_per_token
    config = EngineConfig(
        model=choice.model_dir,
        load_format=choice.load_format,
        kv_cache_memory=args.budget_tokens * bytes_per_token,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        enable_prefix_caching=False,
    )
    loaded = load(config)
    rng = random.Random(args.seed)
    vocab = loaded.spec.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(args.real_input_len)] for _ in range(args.real_requests)]
    params = SamplingParams(max_tokens=args.real_output_len, ignore_eos=True, temperature=0.0)
    rows = []
    for summary in summaries:
        max_num_seqs = max(1, round(summary["concurrency_mean"]))
        engine = Engine(replace(config, max_num_seqs=max_num_seqs), loaded=loaded)
        report.log(args, f"real run: {summary['mode']}, max_num_seqs {max_num_seqs} ...")
        tokens, seconds = _drive(engine, prompts, params)
        rows.append(
            {
                "mode": summary["mode"],
                "max_num_seqs": max_num_seqs,
                "output_tokens": tokens,
                "seconds": seconds,
                "output_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            }
        )
        del engine
    return rows


def _drive(engine: Any, prompts: Sequence[list[int]], params: Any) -> tuple[int, float]:
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"real-{i}", prompt, params)
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].delta_token_ids) for o in engine.step())
    return tokens, time.perf_counter() - start


def plot(results: Sequence[ModeResult], path: str) -> None:
    """Utilisation (stored / reserved) and concurrency over time, one line per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError(
            "--plot needs matplotlib, which is an optional extra: pip install 'kvpager[bench]' (or drop --plot)"
        ) from e
    fig, (ax_util, ax_conc) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for r in results:
        ax_util.plot(range(len(r.utilisation)), [u * 100 for u in r.utilisation], label=r.mode, linewidth=1)
        ax_conc.plot(range(len(r.concurrency)), r.concurrency, label=r.mode, linewidth=1)
    ax_util.set_ylabel("KV utilisation, % (stored / reserved)")
    ax_util.set_ylim(0, 105)
    ax_conc.set_ylabel("requests admitted concurrently")
    ax_conc.set_xlabel("decode step")
    ax_util.legend(loc="lower right", fontsize=8)
    ax_util.set_title("kvpager bench memory: same trace, same KV budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""`kvpager bench serve`: an OpenAI-compatible load generator (works against any such server).

`--num-prompts K` streaming requests of `--input-len I` prompt tokens and exactly `--output-len O`
output tokens (`ignore_eos`), at most `--concurrency C` in flight. Prompts are random token ids
by default (exact lengths; vLLM, llama-server and kvpager accept them); `--prompt-mode text`
sends plain words for servers that want strings. Reports output tok/s, req/s, TTFT and TPOT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpager.bench import report


@dataclass(frozen=True)
class RequestResult:
    ok: bool
    ttft_s: float | None
    latency_s: float
    num_output_tokens: int
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class BenchResult:
    concurrency: int
    num_prompts: int
    num_failed: int
    input_len: int
    output_len: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    dtype: str | None = None  # the server's weight format as passed (--dtype / --quantization), for the record
    quantization: str | None = None


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values (a run with no successes)."""
    return report.percentile(values, q) if values else float("nan")


def make_prompts(num: int, input_len: int, mode: str, vocab_size: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    if mode == "ids":
        # Skip the lowest ids, where special tokens usually live.
        return [[rng.randrange(min(100, vocab_size // 2), vocab_size) for _ in range(input_len)] for _ in range(num)]
    words = ["alpha", "bravo", "delta", "echo", "golf", "hotel", "india", "kilo", "lima", "mike"]
    return [" ".join(rng.choice(words) for _ in range(input_len)) for _ in range(num)]


async def one_request(session: Any, url: str, body: dict[str, Any]) -> RequestResult:
    """Send one streaming completion; time the first token and the end."""
    start = time.perf_counter()
    ttft = None
    tokens = 0
    usage_tokens = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return RequestResult(
                    False, None, time.perf_counter() - start, 0, f"HTTP {resp.status}: {await resp.text()}"
                )
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                if payload.get("usage"):
                    usage_tokens = payload["usage"].get("completion_tokens")
                if payload.get("choices"):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    tokens += 1
    except Exception as exc:  # network errors count as failed requests, not as a crash
        return RequestResult(False, ttft, time.perf_counter() - start, tokens, repr(exc))
    num_tokens = usage_tokens if usage_tokens is not None else tokens
    return RequestResult(True, ttft, time.perf_counter() - start, num_tokens)


async def run_bench(args: argparse.Namespace) -> BenchResult:
    import aiohttp

    url = args.url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        model = args.model or await first_model(session, url)
        prompts = make_prompts(args.num_prompts, args.input_len, args.prompt_mode, args.vocab_size, args.seed)

        def body(prompt: Any, max_tokens: int) -> dict[str, Any]:
            return {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }

        probe = await one_request(session, url, body(prompts[0], 2))
        if not probe.ok:
            raise RuntimeError(f"the probe request failed: {probe.error}")
        gate = asyncio.Semaphore(args.concurrency)

        async def limited(prompt: Any) -> RequestResult:
            async with gate:
                return await one_request(session, url, body(prompt, args.output_len))

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - start
    return summarize(results, duration, args)


async def first_model(session: Any, url: str) -> str:
    async with session.get(f"{url}/v1/models") as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}/v1/models answered {resp.status}; pass --model")
        return str((await resp.json())["data"][0]["id"])


def summarize(results: list[RequestResult], duration: float, args: argparse.Namespace) -> BenchResult:
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    tpots = [t * 1000 for r in ok if (t := r.tpot_s) is not None]
    return BenchResult(
        concurrency=args.concurrency,
        num_prompts=len(results),
        num_failed=len(results) - len(ok),
        input_len=args.input_len,
        output_len=args.output_len,
        duration_s=duration,
        request_throughput=len(ok) / duration,
        output_throughput=sum(r.num_output_tokens for r in ok) / duration,
        ttft_mean_ms=statistics.fmean(ttfts) if ttfts else float("nan"),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        tpot_mean_ms=statistics.fmean(tpots) if tpots else float("nan"),
        tpot_p50_ms=percentile(tpots, 50),
        tpot_p99_ms=percentile(tpots, 99),
        dtype=getattr(args, "dtype", None),
        quantization=getattr(args, "quantization", None),
    )


def render(result: BenchResult) -> str:
    r = result
    return "\n".join(
        [
            f"concurrency {r.concurrency}, {r.num_prompts} prompts ({r.num_failed} failed), input {r.input_len}, output {r.output_len}",
            f"  duration            {r.duration_s:10.2f} s",
            f"  requests/s          {r.request_throughput:10.2f}",
            f"  output tokens/s     {r.output_throughput:10.1f}",
            f"  TTFT mean/p50/p99   {r.ttft_mean_ms:8.1f} {r.ttft_p50_ms:8.1f} {r.ttft_p99_ms:8.1f} ms",
            f"  TPOT mean/p50/p99   {r.tpot_mean_ms:8.2f} {r.tpot_p50_ms:8.2f} {r.tpot_p99_ms:8.2f} ms",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvpager bench serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first in /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-mode", choices=["ids", "text"], default="ids")
    p.add_argument("--vocab-size", type=int, default=1000, help="random prompt ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="the client's event loop (auto: uvloop if installed)",
    )
    p.add_argument("--dtype", default=None, help="the server's --dtype, recorded in the result (start it with it)")
    p.add_argument(
        "--quantization", default=None, help="the server's --quantization, recorded in the result (start it with it)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    return p


def event_loop_factory(choice: str) -> Any:
    """The client's event loop (uvicorn's `--loop` choices). `auto` takes uvloop where installed:
    the client shares the CPU with the server it measures, so its own per-token cost (an event and
    a JSON parse per streamed token) is kept low."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise RuntimeError("--loop uvloop needs the uvloop package") from None
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark once and print the summary. Returns the process exit code."""
    args = build_parser().parse_args(argv)
    for name in ("concurrency", "num_prompts", "input_len", "output_len", "vocab_size"):
        if getattr(args, name) < 1:
            print(f"kvpager bench serve: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        with asyncio.Runner(loop_factory=event_loop_factory(args.loop)) as runner:
            result = runner.run(run_bench(args))
    except (RuntimeError, OSError) as exc:
        print(f"kvpager bench serve: error: {exc}", file=sys.stderr)
        return 2
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(asdict(result), indent=2) + "\n")
    print(json.dumps(asdict(result), indent=2) if args.json else render(result))
    return 0 if result.num_failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Multi-turn chat on two replicas: KV-aware routing + shared KV store versus round-robin.

Workload (seeded): C conversations of T turns each; every conversation opens with the same system
prompt, and each turn appends a user message to the whole history (previous prompts and answers).
Conversations run concurrently; the turns of one conversation run in order.

For each setting the script reports, side by side:
- prefill tokens: prompt tokens the replicas computed (prompt - cached), summed over all requests;
- TTFT p50 / p90 (arrival to first token, as the engine measures it).

Backends:
- `local` (default): N engines in this process, routed here with the same policy as the Ray Serve
  router (`kvpager.api.replicas.policy.rank` over each engine's KV-event view) — what the routing
  and the shared store save, without Ray's own overhead. `kv-aware` uses a Redis/Valkey store
  (`--kv-cache-remote URL`, or a `redis-server`/`valkey-server` started here on a free port).
- `http`: two running endpoints (`--url-kv-aware`, `--url-baseline`, e.g. `kvpager serve --replicas 2
  --kv-cache-remote URL` and `kvpager serve --replicas 2 --replica-router power-of-two`); the same
  workload is sent to each.

    python scripts/bench_multiturn.py --conversations 32 --turns 6
    python scripts/bench_multiturn.py --conversations 2 --turns 2 --system-tokens 32   # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpager.api.replicas.policy import ReplicaView, hex_chain, matched, rank  # noqa: E402
from kvpager.core.config import EngineConfig  # noqa: E402
from kvpager.core.hashing import hash_prompt_blocks  # noqa: E402
from kvpager.core.kv_events import KVEventLog  # noqa: E402
from kvpager.core.sampling_params import SamplingParams  # noqa: E402


@dataclass
class Result:
    name: str
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def row(self) -> str:
        p50 = statistics.median(self.ttfts) if self.ttfts else float("nan")
        p90 = statistics.quantiles(self.ttfts, n=10)[-1] if len(self.ttfts) >= 2 else p50
        return (
            f"{self.name:<22} prefill tokens {self.prefill_tokens:>8} / {self.prompt_tokens:<8} "
            f"TTFT p50 {p50 * 1e3:8.1f} ms  p90 {p90 * 1e3:8.1f} ms  wall {self.wall_s:6.1f} s"
        )


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and, per conversation, each turn's user message (token ids)."""
    rng = random.Random(args.seed)
    system = [rng.randrange(5, vocab) for _ in range(args.system_tokens)]
    users = [
        [[rng.randrange(5, vocab) for _ in range(args.user_tokens)] for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]
    return system, users


class LocalReplicas:
    """N engines in this process; `route` picks one per request (kv-aware or round-robin)."""

    def __init__(self, config: EngineConfig, num: int, kv_aware: bool) -> None:
        from kvpager.engine.async_engine import AsyncEngine
        from kvpager.engine.engine import Engine

        self.kv_aware = kv_aware
        self.engines: list[Any] = []
        self.logs: list[KVEventLog] = []
        for _ in range(num):
            engine = Engine(config)
            log = KVEventLog(max_pending=0)
            engine.kv_manager.block_pool.add_listener(log)
            self.logs.append(log)
            self.engines.append(AsyncEngine(engine))
        self.fingerprint = self.engines[0].engine.loaded.fingerprint
        self.block_size = config.block_size
        self._routed = [0] * num
        self._round_robin = itertools.cycle(range(num))
        for engine in self.engines:
            engine.start()

    def route(self, prompt: list[int]) -> int:
        if not self.kv_aware:
            return next(self._round_robin)
        chain = hex_chain(hash_prompt_blocks(self.fingerprint, prompt, self.block_size))
        views = []
        for i, (engine, log) in enumerate(zip(self.engines, self.logs, strict=True)):
            held = {h[:8].hex() for h in log.held.copy()}  # NOTE: set.copy is atomic; the engine thread adds
            stats = engine.stats()
            views.append(
                ReplicaView(str(i), matched(chain, held), stats.num_running + stats.num_waiting, self._routed[i])
            )
        choice = int(rank(views)[0].replica)
        self._routed[choice] += 1
        return choice

    async def run(self, prompt: list[int], params: SamplingParams, request_id: str) -> tuple[list[int], int, float]:
        engine = self.engines[self.route(prompt)]
        final = None
        async for out in engine.generate(prompt, params, request_id):
            final = out
        assert final is not None
        return list(final.outputs[0].token_ids), int(final.num_cached_tokens), float(final.metrics.ttft or 0.0)

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()


async def conversation(
    index: int, run: Any, system: list[int], users: list[list[int]], max_tokens: int, result: Result
) -> None:
    history = list(system)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for turn, user in enumerate(users):
        prompt = history + user
        answer, cached, ttft = await run(prompt, params, f"c{index}-t{turn}")
        result.prompt_tokens += len(prompt)
        result.prefill_tokens += len(prompt) - cached
        result.ttfts.append(ttft)
        history = prompt + answer


async def run_setting(name: str, run: Any, system: list[int], users: list[list[list[int]]], max_tokens: int) -> Result:
    result = Result(name)
    start = time.perf_counter()
    await asyncio.gather(*(conversation(i, run, system, u, max_tokens, result) for i, u in enumerate(users)))
    result.wall_s = time.perf_counter() - start
    return result


def http_runner(url: str, model: str) -> Any:
    import httpx

    client = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=600)

    async def run(prompt: list[int], params: SamplingParams, request_id: str) -> tuple[list[int], int, float]:
        body = {"model": model, "prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0}
        body |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        ttft, text, cached = None, "", 0
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and ttft is None:
                    ttft = time.perf_counter() - start
                if event.get("choices"):
                    text += event["choices"][0].get("text", "")
                usage = event.get("usage")
                if usage:
                    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        # NOTE: the answer's token ids are not in the stream; the next turn extends the prompt only
        return [], cached, float(ttft or 0.0)

    return run


def start_store() -> tuple[str, subprocess.Popen[bytes] | None]:
    binary = shutil.which("valkey-server") or shutil.which("redis-server")
    if binary is None:
        raise SystemExit("no valkey-server/redis-server on PATH: pass --kv-cache-remote redis://HOST:PORT")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvpager-bench-store-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru", "--dir", workdir]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return f"redis://127.0.0.1:{port}", proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["local", "http"], default="local")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="64MiB", help="per replica")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--kv-cache-remote", default=None, help="store for kv-aware (default: start one here)")
    p.add_argument("--url-kv-aware", default=None)
    p.add_argument("--url-baseline", default=None)
    p.add_argument("--served-model-name", default="demo")
    args = p.parse_args(argv)

    from kvpager.engine.args import parse_bytes

    base = {
        "model": args.model,
        "device": "cpu",
        "block_size": args.block_size,
        "kv_cache_memory": parse_bytes(args.kv_cache_memory),
        "num_threads": args.num_threads,
    }
    results: list[Result] = []
    store = None
    try:
        if args.backend == "http":
            if not (args.url_kv_aware and args.url_baseline):
                p.error("--backend http needs --url-kv-aware and --url-baseline")
            system, users = workload(args, vocab=4096)
            for name, url in (("kv-aware", args.url_kv_aware), ("baseline", args.url_baseline)):
                runner = http_runner(url, args.served_model_name)
                results.append(asyncio.run(run_setting(name, runner, system, users, args.max_tokens)))
        else:
            url = args.kv_cache_remote
            if url is None:
                url, store = start_store()
            settings = (("kv-aware + store", True, {"kv_cache_remote": url}), ("round-robin", False, {}))
            for name, kv_aware, extra in settings:
                replicas = LocalReplicas(EngineConfig(**base, **extra), args.replicas, kv_aware)
                system, users = workload(args, vocab=replicas.engines[0].engine.model_spec.vocab_size)
                try:
                    results.append(asyncio.run(run_setting(name, replicas.run, system, users, args.max_tokens)))
                finally:
                    replicas.shutdown()
    finally:
        if store is not None:
            store.terminate()
            store.wait(10)
    print(
        f"{args.conversations} conversations x {args.turns} turns, system prompt {args.system_tokens} tokens, "
        f"{args.replicas} replicas ({args.backend})"
    )
    for result in results:
        print(result.row())
    if len(results) == 2 and results[0].prefill_tokens:
        print(f"prefill tokens: round-robin / kv-aware = {results[1].prefill_tokens / results[0].prefill_tokens:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

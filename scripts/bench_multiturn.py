"""Multi-turn chat on replicas: one replica, N with the KV-aware router, N with round-robin or
power-of-two routing, and N with the KV-aware router plus a shared KV store, side by side.

Workload (seeded): C conversations of T turns each; every conversation opens with the same system
prompt, and each turn appends a user message to the whole history (previous prompts and answers).
Conversations run concurrently; the turns of one conversation run in order. `--max-tokens MIN:MAX`
draws each answer's length and `--think-ms MIN:MAX` a pause before each later turn (seeded, the same
for every setting): with one fixed length and no pause the conversations advance in lockstep, and
round-robin then sends every conversation to the same replica turn after turn (request k of each
round goes to replica k mod N), which is sticky routing by accident, not what round-robin does
under real traffic.

For each setting the script reports:
- prefill tokens: prompt tokens the replicas computed (prompt - cached), summed over all requests;
- prefix hit rate: cached / prompt tokens, overall and per turn;
- TTFT p50 / p90 (arrival to first token, as the engine measures it), overall and per turn.

Settings (`--settings`, comma-separated; all by default):
- `single`: one replica;
- `kv-aware`: N replicas routed by exact prefix-cache state (`kvpager.api.replicas.policy.rank`
  over each engine's KV-event view, the rule of the Ray Serve `KVAwareRequestRouter`);
- `round-robin`, `power-of-two`: N replicas, routed by turn or by the shorter queue of two replicas
  picked at random (Ray Serve's default router);
- `kv-aware+store`: `kv-aware` with a shared Redis/Valkey store (`--kv-cache-remote URL`, or a
  `redis-server`/`valkey-server` started here on a free port; a given URL should hold no blocks of
  this model from an earlier run, or they count as hits). The router is `kv-aware`'s (the device
  match); `--router-store-aware` runs the store-aware rule instead (`--replica-router
  kv-aware-store`: a prefix the store holds, as the replicas report it in
  `deployment.store_blocks_of`, favours no replica, so the queue length decides).

The local backend's queue length of a replica is the requests sent there and not yet finished (as
Ray Serve's router counts them), for every router.

Backends:
- `local` (default): the engines run in this process — what routing and the store save, without
  Ray's own overhead;
- `http`: running endpoints, `--url NAME=URL` (repeatable), e.g. `kvpager serve --replicas 2
  --kv-cache-remote URL` and `kvpager serve --replicas 2 --replica-router power-of-two`; the same
  workload goes to each.

    python scripts/bench_multiturn.py --conversations 32 --turns 6
    python scripts/bench_multiturn.py --conversations 32 --turns 6 --max-tokens 8:56 --think-ms 0:400
    python scripts/bench_multiturn.py --conversations 32 --turns 6 --settings kv-aware+store \
        --router-store-aware    # the same workload with the store-aware rule
    python scripts/bench_multiturn.py --conversations 2 --turns 2 --system-tokens 32 --user-tokens 8 \
        --max-tokens 2 --kv-cache-memory 4MiB    # smoke run on the bundled demo model
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
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpager.api.replicas.deployment import store_blocks_of  # noqa: E402
from kvpager.api.replicas.policy import ReplicaView, hex_chain, matched, matched_in_any, rank  # noqa: E402
from kvpager.core.config import EngineConfig  # noqa: E402
from kvpager.core.hashing import hash_prompt_blocks  # noqa: E402
from kvpager.core.kv_events import KVEventLog  # noqa: E402
from kvpager.core.sampling_params import SamplingParams  # noqa: E402

SETTINGS = ("single", "kv-aware", "round-robin", "power-of-two", "kv-aware+store")


def _p50_p90(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    p50 = statistics.median(values)
    return p50, (statistics.quantiles(values, n=10)[-1] if len(values) >= 2 else p50)


@dataclass
class Turn:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)


@dataclass
class Result:
    name: str
    turns: dict[int, Turn] = field(default_factory=lambda: defaultdict(Turn))
    wall_s: float = 0.0
    routed: list[int] = field(default_factory=list)  # requests per replica (local backend)

    def add(self, turn: int, prompt_tokens: int, cached_tokens: int, ttft: float) -> None:
        entry = self.turns[turn]
        entry.prompt_tokens += prompt_tokens
        entry.cached_tokens += cached_tokens
        entry.ttfts.append(ttft)

    @property
    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.turns.values())

    @property
    def prefill_tokens(self) -> int:
        return sum(t.prompt_tokens - t.cached_tokens for t in self.turns.values())

    def as_dict(self) -> dict[str, Any]:
        turns = []
        for index in sorted(self.turns):
            turn = self.turns[index]
            t50, t90 = _p50_p90(turn.ttfts)
            rate = turn.cached_tokens / turn.prompt_tokens if turn.prompt_tokens else 0.0
            turns.append({"turn": index + 1, "prompt_tokens": turn.prompt_tokens, "hit_rate": rate})
            turns[-1] |= {"ttft_p50_s": t50, "ttft_p90_s": t90}
        hit = 1 - self.prefill_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        p50, p90 = _p50_p90([x for t in self.turns.values() for x in t.ttfts])
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefill_tokens": self.prefill_tokens,
            "hit_rate": hit,
            "ttft_p50_s": p50,
            "ttft_p90_s": p90,
            "wall_s": self.wall_s,
            "routed": self.routed,
            "turns": turns,
        }

    def rows(self) -> list[str]:
        ttfts = [x for t in self.turns.values() for x in t.ttfts]
        p50, p90 = _p50_p90(ttfts)
        hit = 1 - self.prefill_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        lines = [
            f"{self.name:<16} prefill tokens {self.prefill_tokens:>8} / {self.prompt_tokens:<8} hit {hit:6.1%}  "
            f"TTFT p50 {p50 * 1e3:8.1f} ms  p90 {p90 * 1e3:8.1f} ms  wall {self.wall_s:6.1f} s"
            + (f"  requests per replica {'/'.join(map(str, self.routed))}" if self.routed else "")
        ]
        for index in sorted(self.turns):
            turn = self.turns[index]
            t50, t90 = _p50_p90(turn.ttfts)
            rate = turn.cached_tokens / turn.prompt_tokens if turn.prompt_tokens else 0.0
            lines.append(
                f"  turn {index + 1:<3} hit {rate:6.1%}  TTFT p50 {t50 * 1e3:8.1f} ms  p90 {t90 * 1e3:8.1f} ms"
            )
        return lines


@dataclass(frozen=True)
class TurnPlan:
    user: list[int]  # the user message's token ids
    answer_tokens: int  # the answer's length (max_tokens, EOS ignored)
    think_s: float  # the pause before this turn is sent (0 for the first)


def span(text: str, name: str) -> tuple[float, float]:
    """ "N" or "MIN:MAX" as (MIN, MAX); ValueError naming the flag otherwise."""
    lo, _, hi = text.partition(":")
    try:
        low, high = float(lo), float(hi or lo)
    except ValueError:
        raise ValueError(f"{name} must be N or MIN:MAX, got {text!r}") from None
    if low < 0 or high < low:
        raise ValueError(f"{name} must be N or MIN:MAX with 0 <= MIN <= MAX, got {text!r}")
    return low, high


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[TurnPlan]]]:
    """The shared system prompt and, per conversation, each turn's plan (seeded)."""
    rng = random.Random(args.seed)
    system = [rng.randrange(5, vocab) for _ in range(args.system_tokens)]
    answer_lo, answer_hi = (int(v) for v in span(args.max_tokens, "--max-tokens"))
    think_lo, think_hi = span(args.think_ms, "--think-ms")
    if answer_lo < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens!r}")
    plans = []
    for _ in range(args.conversations):
        turns = []
        for turn in range(args.turns):
            user = [rng.randrange(5, vocab) for _ in range(args.user_tokens)]
            answer = rng.randint(answer_lo, answer_hi)
            think = rng.uniform(think_lo, think_hi) / 1e3 if turn else 0.0
            turns.append(TurnPlan(user, answer, think))
        plans.append(turns)
    return system, plans


class LocalReplicas:
    """N engines in this process; `route` picks one per request with the setting's router."""

    def __init__(self, config: EngineConfig, num: int, router: str, seed: int = 0, *, store_aware: bool = True) -> None:
        from kvpager.engine.async_engine import AsyncEngine
        from kvpager.engine.engine import Engine

        self.router = router
        self.store_aware = store_aware
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
        self._routed = [0] * num  # the KV-aware router's own count (its tie-break)
        self.routed = [0] * num  # requests sent to each replica, every router
        self._in_flight = [0] * num  # requests sent to each replica and not finished (its queue)
        self._round_robin = itertools.cycle(range(num))
        self._rng = random.Random(seed)
        for engine in self.engines:
            engine.start()

    def _queue(self, index: int) -> int:
        # NOTE: not the engine's stats (as of its last step): requests routed during one step would
        # all see the same queue, and a conversation's next turns arrive together in lockstep runs
        return self._in_flight[index]

    def _store_blocks(self, chain: list[str]) -> int:
        """Leading blocks of `chain` in the shared store, as the replicas would report it."""
        if not self.store_aware:
            return 0
        reports = [store_blocks_of(engine.engine) for engine in self.engines]
        return matched_in_any(chain, [set(r) for r in reports if r is not None])

    def route(self, prompt: list[int]) -> int:
        num = len(self.engines)
        if self.router == "round-robin":
            return next(self._round_robin)
        if self.router == "power-of-two":
            pair = self._rng.sample(range(num), min(2, num))
            return min(pair, key=self._queue)
        chain = hex_chain(hash_prompt_blocks(self.fingerprint, prompt, self.block_size))
        views = []
        for i, log in enumerate(self.logs):
            held = {h[:8].hex() for h in log.held.copy()}  # NOTE: set.copy is atomic; the engine thread adds
            views.append(ReplicaView(str(i), matched(chain, held), self._queue(i), self._routed[i]))
        choice = int(rank(views, store_blocks=self._store_blocks(chain))[0].replica)
        self._routed[choice] += 1
        return choice

    async def run(self, prompt: list[int], params: SamplingParams, request_id: str) -> tuple[list[int], int, float]:
        index = self.route(prompt)
        self.routed[index] += 1
        engine = self.engines[index]
        final = None
        self._in_flight[index] += 1
        try:
            async for out in engine.generate(prompt, params, request_id):
                final = out
        finally:
            self._in_flight[index] -= 1
        assert final is not None
        return list(final.outputs[0].token_ids), int(final.num_cached_tokens), float(final.metrics.ttft or 0.0)

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()


async def conversation(index: int, run: Any, system: list[int], plans: list[TurnPlan], result: Result) -> None:
    history = list(system)
    for turn, plan in enumerate(plans):
        if plan.think_s:
            await asyncio.sleep(plan.think_s)
        params = SamplingParams(temperature=0.0, max_tokens=plan.answer_tokens, ignore_eos=True)
        prompt = history + plan.user
        answer, cached, ttft = await run(prompt, params, f"c{index}-t{turn}")
        result.add(turn, len(prompt), cached, ttft)
        history = prompt + answer


async def run_setting(name: str, run: Any, system: list[int], plans: list[list[TurnPlan]]) -> Result:
    result = Result(name)
    start = time.perf_counter()
    await asyncio.gather(*(conversation(i, run, system, p, result) for i, p in enumerate(plans)))
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
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return f"redis://127.0.0.1:{port}", proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"the store server {binary} did not start on port {port}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["local", "http"], default="local")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"local backend: any of {', '.join(SETTINGS)}")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--user-tokens", type=int, default=48)
    p.add_argument("--max-tokens", default="32", help="answer tokens per turn: N, or MIN:MAX drawn per turn")
    p.add_argument("--think-ms", default="0", help="pause before each later turn: N, or MIN:MAX drawn per turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replicas", type=int, default=2, help="N, for every setting but `single`")
    p.add_argument("--model", default=None, help="checkpoint (default: the bundled demo model)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="64MiB", help="per replica")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--kv-cache-remote", default=None, help="store for kv-aware+store (default: start one here)")
    p.add_argument(
        "--router-store-aware",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="kv-aware+store: rank with the store-aware rule (a prefix the shared store holds favours no "
        "replica; default: the device-only rule, as `--replica-router kv-aware`)",
    )
    p.add_argument("--url", action="append", default=[], metavar="NAME=URL", help="http backend: an endpoint")
    p.add_argument("--url-kv-aware", default=None, help="http backend: same as --url kv-aware=URL")
    p.add_argument("--url-baseline", default=None, help="http backend: same as --url baseline=URL")
    p.add_argument("--served-model-name", default="demo")
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    settings = [name.strip() for name in args.settings.split(",") if name.strip()]
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        p.error(f"unknown --settings {', '.join(unknown)}; pick from {', '.join(SETTINGS)}")
    if args.replicas < 1 or args.conversations < 1 or args.turns < 1:
        p.error("--replicas, --conversations and --turns must be >= 1")
    try:
        workload(args, vocab=16)  # checks --max-tokens / --think-ms before anything starts
    except ValueError as exc:
        p.error(str(exc))

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
            urls = [tuple(u.split("=", 1)) for u in args.url if "=" in u]
            urls += [(n, u) for n, u in (("kv-aware", args.url_kv_aware), ("baseline", args.url_baseline)) if u]
            if not urls:
                p.error("--backend http needs at least one --url NAME=URL")
            system, users = workload(args, vocab=4096)
            for name, url in urls:
                runner = http_runner(url, args.served_model_name)
                results.append(asyncio.run(run_setting(name, runner, system, users)))
        else:
            for name in settings:
                extra: dict[str, Any] = {}
                if name == "kv-aware+store":
                    if args.kv_cache_remote is None and store is None:
                        args.kv_cache_remote, store = start_store()
                    extra["kv_cache_remote"] = args.kv_cache_remote
                router = {"single": "kv-aware", "kv-aware+store": "kv-aware"}.get(name, name)
                num = 1 if name == "single" else args.replicas
                config = EngineConfig(**base, **extra)
                replicas = LocalReplicas(config, num, router, args.seed, store_aware=args.router_store_aware)
                system, users = workload(args, vocab=replicas.engines[0].engine.model_spec.vocab_size)
                try:
                    results.append(asyncio.run(run_setting(name, replicas.run, system, users)))
                    results[-1].routed = list(replicas.routed)
                finally:
                    replicas.shutdown()
    finally:
        if store is not None:
            store.terminate()
            store.wait(10)
    print(
        f"{args.conversations} conversations x {args.turns} turns, system prompt {args.system_tokens} tokens, "
        f"{args.replicas} replicas ({args.backend}), kv-aware+store router "
        f"{'store-aware' if args.router_store_aware else 'device-only'}"
    )
    for result in results:
        print("\n".join(result.rows()))
    if args.json_out:
        report = {"replicas": args.replicas, "router_store_aware": args.router_store_aware}
        report["results"] = {r.name: r.as_dict() for r in results}
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

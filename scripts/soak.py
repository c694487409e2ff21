"""Soak a real kvpager server: many streaming clients, disconnects, bad requests, preemption pressure.

    python scripts/soak.py --model DIR --clients 48 --duration 600 --kv-blocks 32

The server (`kvpager serve`'s own build path, uvicorn on a free local port, on a thread of this
process) gets a small KV pool (`--kv-blocks`) and a host tier, so requests are preempted and blocks
move between device and host. N clients loop until `--duration` seconds have passed, each time
sending one of: a greedy request over prompts that share prefixes (streamed or not), checked
against the greedy text of a cold engine (no prefix cache, a large pool); a random-sampling stream
(n 1..3) that the client drops after a few chunks (`--disconnect-rate`); or a bad request
(`--bad-rate`) that must be refused with a 4xx. At the end the script checks: 0 owned blocks, 0
running and 0 waiting requests, 0 greedy mismatches, 0 server errors (5xx), every bad request
refused, and the process RSS back within `--rss-slack-mib` of its value after warm-up. It prints
the counts (JSON with `--json`) and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kvpager.cli.serve import build_parser, build_server, settings_from_args  # noqa: E402
from kvpager.core.sizing import pool_size  # noqa: E402
from kvpager.engine.paths import resolve_model_dir  # noqa: E402
from kvpager.model.spec import load_model_spec  # noqa: E402

# Bad requests: each must be refused with a 4xx (raw JSON text, so a lone surrogate can be sent).
BAD_BODIES = (
    ("/v1/completions", '{"prompt": "x", "seed": 18446744073709551616, "temperature": 1}'),
    ("/v1/completions", '{"prompt": "x", "seed": -9223372036854775809, "temperature": 1, "n": 2}'),
    ("/v1/completions", '{"prompt": [1000000000], "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "x \\ud800", "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "x", "stop_token_ids": [' + ",".join(["7"] * 5000) + "]}"),
    ("/v1/completions", '{"prompt": "x", "stop": [' + ",".join(['"s"'] * 500) + "]}"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1000000000}'),
    ("/v1/completions", '{"prompt": "x", "n": 0}'),
    ("/v1/completions", '{"prompt": []}'),
    ("/v1/completions", '{"prompt": "x", "temperature": -1}'),
    ("/v1/completions", '{"prompt": "x", "logprobs": 50}'),
    ("/v1/completions", '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}"),
    ("/v1/completions", "not json at all"),
    ("/v1/chat/completions", '{"messages": []}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("/v1/kv/import", "KVPACK"),
)


@dataclass
class Counts:
    requests: int = 0
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    streams_dropped: int = 0
    sampled_completed: int = 0
    bad_requests: int = 0
    bad_refused_4xx: int = 0
    bad_accepted: int = 0
    server_errors_5xx: int = 0
    queue_full_503: int = 0
    client_errors: int = 0
    preemptions: float = 0.0
    host_tier_hits: float = 0.0
    owned_blocks_end: float = -1.0
    running_end: float = -1.0
    waiting_end: float = -1.0
    rss_warm_mib: float = 0.0
    rss_end_mib: float = 0.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--disconnect-rate", type=float, default=0.3)
    p.add_argument("--bad-rate", type=float, default=0.1)
    p.add_argument("--kv-blocks", type=int, default=32, help="device KV pool size in blocks (pressure)")
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--host-kv-blocks", type=int, default=64, help="host tier size in blocks")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=8, help="greedy request length")
    p.add_argument("--rss-slack-mib", type=float, default=256.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    return p.parse_args(argv)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def make_prompts(vocab: int, num: int, rng: random.Random) -> list[list[int]]:
    """Prompts in families that share 2-3 block prefixes, so the prefix cache and tiers are exercised."""
    families = [[rng.randrange(3, vocab) for _ in range(12)] for _ in range(3)]
    return [families[i % 3] + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))] for i in range(num)]


def cold_reference(args: argparse.Namespace, prompts: list[list[int]], bytes_per_block: int) -> list[str]:
    """Greedy texts from a cold engine: no prefix cache, a pool large enough to never preempt."""
    from kvpager.api.llm import LLM
    from kvpager.core.sampling_params import SamplingParams

    blocks = sum(-(-(len(p) + args.max_tokens) // args.block_size) for p in prompts)
    llm = LLM(
        args.model,
        block_size=args.block_size,
        device="cpu",
        enable_prefix_caching=False,
        kv_cache_memory=blocks * bytes_per_block,
        max_num_seqs=len(prompts),
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    texts = [out.outputs[0].text for out in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()
    return texts


class Server:
    """`kvpager serve` built as the CLI builds it, served by uvicorn on a thread of this process."""

    def __init__(self, serve_argv: list[str]) -> None:
        import socket

        import uvicorn

        from kvpager.engine.args import config_from_args

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        args = build_parser().parse_args(serve_argv)
        self.async_engine, app = build_server(args, config_from_args(args), settings_from_args(args))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="soak-uvicorn", daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.async_engine.shutdown()


async def metrics(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics")).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if m and m.group(2) != "NaN":
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


async def greedy(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, stream: bool) -> tuple[int, str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        resp = await client.post("/v1/completions", json=body)
        return resp.status_code, resp.json()["choices"][0]["text"] if resp.status_code == 200 else ""
    text = []
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, ""
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return 500, ""
                text.append(chunk["choices"][0]["text"])
    return 200, "".join(text)


async def dropped_stream(client: httpx.AsyncClient, prompt: list[int], rng: random.Random, counts: Counts) -> int:
    """A sampled stream (n 1..3); dropped after a few chunks with probability `drop`."""
    body = {"prompt": prompt, "max_tokens": 32, "temperature": 1.0, "n": rng.randint(1, 3), "stream": True}
    keep = rng.randint(0, 6)
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code
        seen = 0
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen > keep:
                    counts.streams_dropped += 1
                    return 200  # leaving the block closes the connection: the server must abort
    counts.sampled_completed += 1
    return 200


def record_greedy(counts: Counts, status: int, text: str, expected: str) -> None:
    """Count a greedy answer (only a 200 has one) and whether it differs from the cold reference."""
    if status == 200:
        counts.greedy_checked += 1
        counts.greedy_mismatches += text != expected


async def bad_request(client: httpx.AsyncClient, rng: random.Random, counts: Counts) -> int:
    """One of BAD_BODIES: a 4xx is a refusal, anything below 400 an acceptance (a failure)."""
    counts.bad_requests += 1
    path, raw = rng.choice(BAD_BODIES)
    status = (await client.post(path, content=raw, headers={"content-type": "application/json"})).status_code
    if 400 <= status < 500:
        counts.bad_refused_4xx += 1
    elif status < 400:
        counts.bad_accepted += 1
    return status


def soak_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=120)


async def client_loop(
    cid: int, url: str, args: argparse.Namespace, prompts: list[list[int]], want: list[str], counts: Counts
) -> None:
    """Until the deadline: a bad request (`--bad-rate`), a dropped sampled stream
    (`--disconnect-rate`) or a checked greedy request, each status counted."""
    rng = random.Random(args.seed * 1000 + cid)
    deadline = time.monotonic() + args.duration
    async with soak_client(url) as client:
        while time.monotonic() < deadline:
            counts.requests += 1
            roll = rng.random()
            try:
                if roll < args.bad_rate:
                    status = await bad_request(client, rng, counts)
                elif roll < args.bad_rate + args.disconnect_rate:
                    prompt = rng.choice(prompts) + [rng.randrange(3, 300)]
                    status = await dropped_stream(client, prompt, rng, counts)
                else:
                    index = rng.randrange(len(prompts))
                    status, text = await greedy(client, prompts[index], args.max_tokens, rng.random() < 0.5)
                    record_greedy(counts, status, text, want[index])
                counts.server_errors_5xx += status >= 500 and status != 503
                counts.queue_full_503 += status == 503
            except httpx.HTTPError:
                counts.client_errors += 1


async def warm_up(
    url: str, args: argparse.Namespace, prompts: list[list[int]], want: list[str], counts: Counts
) -> None:
    """One greedy request per prompt before the load: the RSS after it is the run's baseline."""
    async with soak_client(url) as client:
        for prompt, expected in zip(prompts, want, strict=True):
            status, text = await greedy(client, prompt, args.max_tokens, stream=False)
            counts.requests += 1
            record_greedy(counts, status, text, expected)
            counts.server_errors_5xx += status >= 500  # before the load even a 503 is an error


async def settle(url: str, counts: Counts, timeout: float = 60.0) -> None:
    """Wait for the engine to drain, then read the end-of-run gauges."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        deadline = time.monotonic() + timeout
        while True:
            m = await metrics(client)
            idle = m.get("kvpager:num_requests_running", 1) == 0 and m.get("kvpager:num_requests_waiting", 1) == 0
            if (idle and m.get("kvpager:kv_blocks_owned", 1) == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        counts.owned_blocks_end = m.get("kvpager:kv_blocks_owned", -1)
        counts.running_end = m.get("kvpager:num_requests_running", -1)
        counts.waiting_end = m.get("kvpager:num_requests_waiting", -1)
        counts.preemptions = m.get("kvpager:num_preemptions_total", 0)
        counts.host_tier_hits = m.get("kvpager:kv_host_hits_total", 0)


def failures(counts: Counts, slack_mib: float) -> list[str]:
    problems = []
    if counts.owned_blocks_end != 0:
        problems.append(f"{counts.owned_blocks_end:g} KV blocks still owned after the run")
    if counts.running_end != 0 or counts.waiting_end != 0:
        problems.append(f"{counts.running_end:g} running / {counts.waiting_end:g} waiting after the run")
    if counts.greedy_mismatches:
        problems.append(f"{counts.greedy_mismatches} greedy outputs differ from the cold reference")
    if counts.server_errors_5xx:
        problems.append(f"{counts.server_errors_5xx} server errors (5xx)")
    if counts.bad_accepted:
        problems.append(f"{counts.bad_accepted} bad requests were accepted")
    if counts.greedy_checked == 0:
        problems.append("no greedy output was checked")
    if counts.rss_end_mib > counts.rss_warm_mib + slack_mib:
        problems.append(f"RSS grew from {counts.rss_warm_mib:.0f} to {counts.rss_end_mib:.0f} MiB")
    return problems


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    spec = load_model_spec(str(resolve_model_dir(args.model)))
    bytes_per_block = pool_size(spec.kv_shape(4), args.block_size, 1 << 30).bytes_per_block
    prompts = make_prompts(spec.vocab_size, args.num_prompts, rng)
    want = cold_reference(args, prompts, bytes_per_block)
    serve_argv = [
        "--device", "cpu", "--block-size", str(args.block_size),
        "--kv-cache-memory", str(args.kv_blocks * bytes_per_block),
        "--host-kv-cache-memory", str(args.host_kv_blocks * bytes_per_block),
        "--max-num-seqs", "16", "--max-waiting-requests", str(4 * args.clients),
    ]  # fmt: skip
    if args.model is not None:
        serve_argv += ["--model", args.model]
    counts = Counts()
    with Server(serve_argv) as server:
        asyncio.run(warm_up(server.url, args, prompts, want, counts))
        gc.collect()
        counts.rss_warm_mib = rss_mib()
        start = time.monotonic()

        async def run_clients() -> None:
            await asyncio.gather(
                *(client_loop(c, server.url, args, prompts, want, counts) for c in range(args.clients))
            )

        asyncio.run(run_clients())
        asyncio.run(settle(server.url, counts))
        elapsed = time.monotonic() - start
        gc.collect()
        counts.rss_end_mib = rss_mib()
    problems = failures(counts, args.rss_slack_mib)
    report: dict[str, Any] = {**asdict(counts), "seconds": round(elapsed, 1), "clients": args.clients}
    if args.json:
        print(json.dumps({**report, "failures": problems}))
    else:
        print("soak: " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in report.items()))
        for problem in problems:
            print(f"soak: FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""What watching the KV map costs: serving throughput with the /kv page's stream open vs closed.

Starts `kvpager serve` (everything after `--` is its flags), then alternates two phases `--rounds`
times in ABBA order (closed, open, open, closed, ...) so a slow drift of the machine falls on both:

- closed: `kvpager bench serve` at `--concurrency` (default 32), nobody watching;
- open: the same, while a watcher reads `/v1/kv/stream?interval=S` exactly as the page does
  (each event parsed as JSON), so the engine takes a snapshot between steps every S seconds.

Each phase gets its own seed (fresh random prompts, no prefix-cache hits between phases). Prints
output tok/s per phase, the open/closed ratio of the means (the target is >= 0.98) and how many
snapshots the watcher got; `--json-out` keeps them.

    python scripts/bench_kv_page.py --rounds 2 --num-prompts 256 -- \\
        --model MODEL_DIR --max-model-len 2048 --kv-cache-memory 2GiB --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


class Watcher:
    """Reads the KV stream on a thread, parsing each event, until stopped."""

    def __init__(self, url: str, interval: float, api_key: str | None) -> None:
        self.url = f"{url}/v1/kv/stream?interval={interval}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.num_events = 0
        self.num_blocks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.stream("GET", self.url, headers=self.headers, timeout=None) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if self._stop.is_set():
                    return
                if line.startswith("data: "):
                    doc = json.loads(line[len("data: ") :])
                    self.num_events += 1
                    self.num_blocks = doc["num_blocks"]


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not healthy after {timeout} s")


def bench(args: argparse.Namespace, url: str, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvpager", "bench", "serve", "--url", url, "--json"]
    cmd += ["--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts)]
    cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", str(seed)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env()).stdout
    result: dict[str, Any] = json.loads(out[out.index("{") :])
    return result


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each round: one closed and one open phase)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--interval", type=float, default=0.5, help="the watcher's stream interval in seconds")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--api-key", default=None, help="passed to the server and used by the clients")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv[:split])
    serve_flags = argv[split + 1 :]
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "kvpager", "serve", "--port", str(args.port), "--log-level", "warning", *serve_flags]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd, env=_env())
    phases: list[dict[str, Any]] = []
    try:
        wait_healthy(proc, url)
        order = [("closed", "open") if r % 2 == 0 else ("open", "closed") for r in range(args.rounds)]
        for seed, phase in enumerate(p for pair in order for p in pair):
            if phase == "open":
                with Watcher(url, args.interval, args.api_key) as watcher:
                    result = bench(args, url, seed)
                events = watcher.num_events
            else:
                result, events = bench(args, url, seed), 0
            tok_s = float(result["output_throughput"])
            phases.append({"phase": phase, "seed": seed, "output_tok_s": tok_s, "snapshots": events, "result": result})
            print(f"{phase:<7} seed {seed}: {tok_s:9.1f} output tok/s, {events} snapshots read", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    closed = statistics.mean(x["output_tok_s"] for x in phases if x["phase"] == "closed")
    opened = statistics.mean(x["output_tok_s"] for x in phases if x["phase"] == "open")
    ratio = opened / closed if closed else float("nan")
    print(f"open/closed = {ratio:.4f} (target >= 0.98)")
    if args.json_out:
        summary = {"ratio": ratio, "closed_tok_s": closed, "open_tok_s": opened, "phases": phases, "argv": argv}
        Path(args.json_out).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

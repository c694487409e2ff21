"""Time per output token of running servers, one streaming request at a time, servers alternated.

Each round sends `--requests` completions of `--prompt-len` random token ids (seeded, the same ids to
every server in a round, new ids each round: no prefix-cache hit) to each `--url` in turn, A B ... B A,
and records the first chunk's latency and the median gap between streamed chunks (TPOT). No process
sampling runs beside it (the shared load generator reads each server's smaps every 0.5 s, which on a
2-core machine adds 2-3 ms to both engines' TPOT). One JSON line per request on stdout.

    python scripts/stream_tpot.py --url http://127.0.0.1:8101 --url http://127.0.0.1:8103 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request


def one_request(url: str, model: str, ids: list[int], max_tokens: int) -> tuple[float, float, int, int]:
    """(seconds to the first chunk, median seconds between chunks, chunks, completion tokens) of one
    streamed completion (a chunk holds one token unless the detokenizer held text back)."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
    body.update(ignore_eos=True, stream_options={"include_usage": True})
    request = urllib.request.Request(
        url.rstrip("/") + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start, stamps, tokens = time.perf_counter(), [], 0
    with urllib.request.urlopen(request) as response:
        for line in response:
            if not line.startswith(b"data:") or b"[DONE]" in line:
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return stamps[0] - start, statistics.median(gaps) if gaps else 0.0, len(stamps), tokens


def served_model(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/v1/models") as response:
        return str(json.load(response)["data"][0]["id"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", required=True, help="a server's base URL (repeat: alternated)")
    p.add_argument("--prompt-len", type=int, default=320)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=2, help="per server per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vocab", type=int, default=30000, help="token ids are drawn from 100..vocab")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    models = {url: served_model(url) for url in args.url}
    for rnd in range(args.rounds):
        rng = random.Random(args.seed * 1000 + rnd)
        prompts = [[rng.randrange(100, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        order = args.url if rnd % 2 == 0 else args.url[::-1]
        for url in order:
            for ids in prompts:
                ttft, tpot, chunks, tokens = one_request(url, models[url], ids, args.max_tokens)
                record = {"round": rnd, "url": url, "ttft_s": ttft, "tpot_p50_s": tpot, "chunks": chunks}
                record["tokens"] = tokens
                print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

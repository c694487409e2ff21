"""`kvpager kv top --url URL`: the /kv page's picture in a terminal, refreshed (for people on SSH).

Reads `GET /v1/kv/map` (docs/kv-map.md) every `--interval` seconds and redraws: the pool as a grid
of characters, the live requests with their block tables, the tiers and the planner's prediction.
`--once` (or a stdout that is not a terminal) prints one frame without escape codes and exits.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

import httpx

API_KEY_ENV = "KVPAGER_API_KEY"
MAX_GRID_ROWS = 12
COLORS = {".": "2", "c": "34", "o": "32", "P": "35", "s": "33"}  # ANSI SGR codes; "s" = shared
LEGEND = ". free  c cached (evictable)  o owned  2-9/+ shared (ref count)  P pinned"


def add_top_parser(sub: Any) -> None:
    top = sub.add_parser("top", help="the live KV map of a running server, in the terminal")
    top.add_argument("--url", required=True, help="the server's root, e.g. http://127.0.0.1:8000")
    top.add_argument("--api-key", default=None, help=f"the server's API key (default: ${API_KEY_ENV})")
    top.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    top.add_argument("--once", action="store_true", help="print one frame and exit (implied when not a terminal)")


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def block_chars(blocks: dict[str, Any]) -> list[str]:
    """One character per block: the document's state letter, a shared block's ref count, P for pinned."""
    chars = list(blocks["state"].replace("p", "P"))
    for key, ref in blocks["ref"].items():
        if ref >= 2 and chars[int(key)] == "o":
            chars[int(key)] = str(ref) if ref <= 9 else "+"
    return chars


def grid_lines(chars: list[str], width: int, color: bool) -> list[str]:
    """Rows of `width` characters; past MAX_GRID_ROWS rows one character stands for several blocks."""
    per_char = max(1, -(-len(chars) // (width * MAX_GRID_ROWS)))
    if per_char > 1:  # the most common state of each group (shared counts as owned there)
        groups = [chars[i : i + per_char] for i in range(0, len(chars), per_char)]
        chars = [max(set(g), key=g.count) for g in groups]
    rows = ["".join(_paint(c, color) for c in chars[i : i + width]) for i in range(0, len(chars), width)]
    return rows + ([f"(one character = {per_char} blocks)"] if per_char > 1 else [])


def _paint(char: str, color: bool) -> str:
    if not color:
        return char
    code = COLORS.get("s" if char.isdigit() or char == "+" else char)
    return f"\x1b[{code}m{char}\x1b[0m" if code else char


def render(doc: dict[str, Any], width: int = 80, color: bool = False) -> list[str]:
    """One frame of `kvpager kv top` for a /v1/kv/map document."""
    width = max(40, width)
    counts = doc["counts"]
    chars = block_chars(doc["blocks"])
    stamp = time.strftime("%H:%M:%S", time.localtime(doc["time"]))
    lines = [
        f"kvpager kv top · {doc.get('model', '')} · {doc['num_blocks']} blocks × {doc['block_size']} tokens · {stamp}",
        f"usage {pct(doc['point']['usage'])}  free {counts['free']}  cached {counts['cached']}  "
        f"owned {counts['owned']} (shared {counts['shared']})  pinned {counts['pinned']}  "
        f"prefix hits {pct(doc['prefix_cache']['hit_rate'])}  preempted {doc['num_preemptions']}",
        "",
        f"Blocks  {LEGEND}",
        *grid_lines(chars, width, color),
        "",
        f"Requests ({len(doc['requests'])} live)",
        f"{'ID':<20} {'STATUS':<9} {'TOKENS':>11} {'CACHED':>6} {'PRE':>3}  BLOCKS",
    ]
    room = max(8, width - 55)
    for r in doc["requests"]:
        table = "".join(chars[b] for b in r["blocks"])
        table = table if len(table) <= room else table[: room - 1] + "…"
        tokens = f"{r['computed_tokens']}/{r['prompt_tokens'] + r['output_tokens']}"
        lines.append(
            f"{r['id'][:20]:<20} {r['status']:<9} {tokens:>11} {r['cached_tokens']:>6} {r['preemptions']:>3}  "
            + "".join(_paint(c, color) for c in table)
        )
    lines += [
        "",
        "Tiers",
        f"{'TIER':<7}{'BLOCKS':>8}{'HELD':>11}{'USE':>8}{'HITS':>9}{'MISSES':>8}{'IN':>11}{'OUT':>11}{'EVICT':>7}",
    ]
    for t in doc["tiers"]:
        lines.append(
            f"{t['name']:<7}{t['num_blocks']:>8}{fmt_bytes(t['bytes_held']):>11}{pct(t['occupancy']):>8}"
            f"{t['hits']:>9}{t['misses']:>8}{fmt_bytes(t['bytes_in']):>11}{fmt_bytes(t['bytes_out']):>11}"
            f"{t['evictions']:>7}" + ("  (hits/misses in tokens)" if t["unit"] == "tokens" else "")
        )
    planner = doc.get("planner")
    if planner:
        lines += [
            "",
            f"Planner: {planner['num_blocks']} blocks, max concurrency {planner['max_concurrency']} at "
            f"{planner['max_model_len']} tokens; pool: {planner['measured_num_blocks']} blocks, "
            f"{planner['measured_max_concurrency']}",
        ]
    return lines


def fetch(client: httpx.Client) -> dict[str, Any]:
    response = client.get("/v1/kv/map")
    if response.status_code == 401:
        raise ValueError(f"the server needs its API key: pass --api-key or set ${API_KEY_ENV}")
    if response.status_code != 200:
        raise ValueError(f"GET /v1/kv/map answered {response.status_code}: {response.text[:200]}")
    doc: dict[str, Any] = response.json()
    return doc


def main_top(args: argparse.Namespace) -> int:
    if not 0.25 <= args.interval <= 60:
        raise ValueError(f"--interval must be in [0.25, 60] seconds, got {args.interval}")
    key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    interactive = sys.stdout.isatty() and not args.once
    try:
        with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=10.0) as client:
            while True:
                doc = fetch(client)
                size = shutil.get_terminal_size((100, 40))
                lines = render(doc, size.columns, color=interactive)
                if not interactive:
                    print("\n".join(lines))
                    return 0
                sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(lines[: size.lines - 1]) + "\n")
                sys.stdout.flush()
                time.sleep(args.interval)
    except httpx.HTTPError as error:
        raise ValueError(f"cannot reach {args.url}: {error}") from error
    except KeyboardInterrupt:
        return 0

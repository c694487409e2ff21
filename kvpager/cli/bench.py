"""`kvpager bench throughput | serve | memory | roofline | prefix | kv-ttft`: each bench owns its parser."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

BENCHES: dict[str, tuple[str, str]] = {
    "throughput": ("kvpager.bench.throughput", "offline output tok/s: one request at a time vs continuous batching"),
    "serve": ("kvpager.bench.serve", "load generator against a running kvpager server"),
    "memory": ("kvpager.bench.memory", "paging study: contiguous slots / exact-size / paged KV, same budget"),
    "roofline": ("kvpager.bench.roofline", "memory bandwidth, matmul GFLOP/s, and decode's fraction of each"),
    "prefix": ("kvpager.bench.prefix", "TTFT for a 2,000-token shared prefix: cold vs prefix-cache hit"),
    "kv-ttft": ("kvpager.bench.kv_ttft", "TTFT of a 2,000-token context: cold vs device/host/disk/pack; codec bytes"),
}


def usage() -> str:
    lines = ["usage: kvpager bench BENCH [options]", "", "benches:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in BENCHES.items()]
    lines.append("\n`kvpager bench BENCH --help` for a bench's options.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the bench's own `main(argv)` (imported lazily: torch loads only when needed)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    if args[0] not in BENCHES:
        print(f"kvpager bench: unknown bench {args[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHES[args[0]][0])
    try:
        return int(module.main(args[1:]))
    except ValueError as e:
        print(f"kvpager bench {args[0]}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

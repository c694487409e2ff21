"""`kvpager serve | generate | chat | plan | bench | kv …` — each subcommand owns its parser."""

from __future__ import annotations

import importlib
import os
import sys

from kvpager.engine.host_malloc import keep_freed_memory

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvpager.cli.serve", "OpenAI-compatible HTTP server"),
    "generate": ("kvpager.cli.generate", "generate text from a prompt (argument, file or stdin), streamed"),
    "chat": ("kvpager.cli.chat", "interactive terminal chat"),
    "plan": ("kvpager.cli.plan", "capacity planner: will it fit, how much context, how fast"),
    "bench": ("kvpager.cli.bench", "benchmarks: throughput, serve, memory, roofline, prefix"),
    "kv": ("kvpager.cli.kv", "KV packs and the live KV map: save, inspect, top"),
}


def usage() -> str:
    lines = ["usage: kvpager COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\n`kvpager COMMAND --help` for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from kvpager import __version__

        print(__version__)
        return 0
    if argv[0] not in COMMANDS:
        print(f"kvpager: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    keep_freed_memory(os.environ)  # NOTE: before any thread starts (the engine loading logs what it did)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())

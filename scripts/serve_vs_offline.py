"""Serving versus offline throughput, interleaved in one server process (issue 6's serving target).

Starts `kvpager serve` in this process (uvicorn + uvloop, exactly as the CLI builds it) and
alternates two phases on the same engine, `--rounds` times each, in ABBA order so a slow drift of
the machine falls on both alike:

- offline: the requests go straight into the engine, stepped on the main thread until they are
  done (the loop of `kvpager bench throughput`'s batched phase, on the thread it runs on; the event
  loop and the engine's own thread wait meanwhile);
- serve: `kvpager bench serve` runs as a separate process against the server (streaming, one HTTP
  request per prompt, at most `--concurrency` in flight).

Per phase it also prints the main thread's CPU (the event loop in a serve phase, the engine in an
offline one), the client's CPU (its start-up included) and this process's minor page faults.
Each phase gets fresh random prompts (a seed per phase), so no phase hits the prefix cache of
another. Why one process: the earlier method (a server, then `kvpager bench throughput`, two
45-second processes minutes apart) compared different processes at different moments and moved by
±7 points; here both phases share one engine and its memory, and ABBA order with
several rounds spreads the machine's drift (offline phases of one run still span ~15 %) over both.

    python scripts/make_dummy_model.py models/smollm2-135m
    python scripts/serve_vs_offline.py --rounds 4 -- --model models/smollm2-135m --load-format dummy \
        --max-model-len 2048 --kv-cache-memory 2GiB

Everything after `--` is `kvpager serve`'s own flags; `--max-num-seqs` is set to `--concurrency`
(offline submits every prompt at once, and only that limit keeps it to the client's concurrency).
Prints one line per phase and the ratio of each serve phase to the mean of the offline phases
beside it; `--json-out` keeps them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvpager.bench.serve import event_loop_factory, make_prompts
from kvpager.bench.throughput import run_batched
from kvpager.core.sampling_params import SamplingParams


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="serve phases (and offline phases) each")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--client-loop", default="auto", help="`kvpager bench serve --loop` (auto, asyncio, uvloop)")
    p.add_argument("--json-out", default=None)
    split = argv.index("--") if "--" in argv else len(argv)
    return p.parse_args(argv[:split]), argv[split + 1 :]


def offline_phase(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    phase, _, _ = run_batched(engine, prompts, params)
    return {"seconds": phase.seconds, "output_tokens": phase.output_tokens, "tok_s": phase.output_tokens_per_s}


async def serve_phase(args: argparse.Namespace, seed: int, vocab: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serve.json"
        argv = [sys.executable, "-m", "kvpager", "bench", "serve", "--url", f"http://127.0.0.1:{args.port}"]
        argv += ["--concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts)]
        argv += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        argv += ["--vocab-size", str(vocab), "--seed", str(seed), "--json-out", str(out), "--loop", args.client_loop]
        # NOTE: posix_spawn, not fork: a forked child shares the server's pages copy-on-write, and
        # every page the engine then writes (the KV pool, ~1 GB a phase) takes a fault the real
        # server, whose client is started elsewhere, never pays (200,000-540,000 a phase, measured).
        with open(os.devnull, "wb") as devnull:
            pid = os.posix_spawn(
                sys.executable, argv, dict(os.environ), file_actions=[(os.POSIX_SPAWN_DUP2, devnull.fileno(), 1)]
            )
        _, status = await asyncio.to_thread(os.waitpid, pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"kvpager bench serve exited with {os.waitstatus_to_exitcode(status)}")
        r = json.loads(out.read_text())
    tokens = r["output_throughput"] * r["duration_s"]
    return {"seconds": r["duration_s"], "output_tokens": tokens, "tok_s": r["output_throughput"]}


async def orchestrate(args: argparse.Namespace, server: Any, async_engine: Any) -> list[dict[str, Any]]:
    while not server.started:
        await asyncio.sleep(0.1)
    vocab = int(async_engine.engine.model_spec.vocab_size)
    order = []
    for r in range(args.rounds):
        order += ["offline", "serve"] if r % 2 == 0 else ["serve", "offline"]
    # Warm-up, not counted: the first steps of a process pay one-time costs (scratch buffers,
    # thread pools) that would otherwise fall on the first phase only.
    warm = [list(p) for p in make_prompts(min(4, args.num_prompts), args.input_len, "ids", vocab, 999)]
    offline_phase(async_engine.engine, warm, min(4, args.output_len))
    phases: list[dict[str, Any]] = []
    try:
        await _run_phases(args, async_engine, order, vocab, phases)
    finally:
        server.should_exit = True  # a failed phase must not leave the server running forever
    return phases


async def _run_phases(
    args: argparse.Namespace, async_engine: Any, order: list[str], vocab: int, phases: list[dict[str, Any]]
) -> None:
    for i, kind in enumerate(order):
        seed = 1000 + i
        loop_cpu, child = _thread_user_system(), resource.getrusage(resource.RUSAGE_CHILDREN)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if kind == "offline":
            prompts = [list(p) for p in make_prompts(args.num_prompts, args.input_len, "ids", vocab, seed)]
            # NOTE: on this (the main) thread, as `kvpager bench throughput` runs it; the event loop
            # waits meanwhile and the engine's own thread is idle (no request is in flight).
            res = offline_phase(async_engine.engine, prompts, args.output_len)
        else:
            res = await serve_phase(args, seed, vocab)
        after, loop_after = resource.getrusage(resource.RUSAGE_CHILDREN), _thread_user_system()
        res = {
            "phase": kind,
            "index": i,
            "clock": time.strftime("%H:%M:%S"),
            **res,
            # the event loop's CPU in a serve phase; the engine's own in an offline one
            "main_thread_user_s": loop_after[0] - loop_cpu[0],
            "main_thread_system_s": loop_after[1] - loop_cpu[1],
            "client_cpu_s": after.ru_utime + after.ru_stime - child.ru_utime - child.ru_stime,
            "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults,
        }
        print(
            f"{res['clock']} {kind:8s} {res['output_tokens']:6.0f} tokens {res['seconds']:7.2f} s "
            f"{res['tok_s']:7.1f} tok/s  main thread user {res['main_thread_user_s']:5.2f} s "
            f"system {res['main_thread_system_s']:5.2f} s  "
            f"client CPU {res['client_cpu_s']:5.2f} s  page faults {res['minor_faults']}",
            flush=True,
        )
        phases.append(res)


def ratios(phases: list[dict[str, Any]]) -> list[float]:
    """Each serve phase over the mean of the offline phases next to it."""
    out = []
    for i, p in enumerate(phases):
        if p["phase"] != "serve":
            continue
        near = [q["tok_s"] for q in phases[max(0, i - 1) : i + 2] if q["phase"] == "offline"]
        out.append(p["tok_s"] / statistics.fmean(near))
    return out


def _thread_user_system() -> tuple[float, float]:
    """This (the main) thread's user and system CPU seconds so far (Linux; zeros elsewhere)."""
    try:
        fields = Path(f"/proc/self/task/{threading.get_native_id()}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def main(argv: list[str]) -> int:
    import uvicorn

    from kvpager.cli.serve import build_parser, build_server, config_from_args, settings_from_args

    args, serve_argv = parse(argv)
    serve_args = build_parser().parse_args(serve_argv)
    if "--max-num-seqs" not in serve_argv:
        serve_args.max_num_seqs = args.concurrency
    if serve_args.max_num_seqs != args.concurrency:
        # NOTE: offline admits every prompt at once; only the engine's own limit keeps it at the
        # client's concurrency, so the two phases batch alike.
        print(f"serve_vs_offline: --max-num-seqs must equal --concurrency ({args.concurrency})", file=sys.stderr)
        return 2
    async_engine, app = build_server(serve_args, config_from_args(serve_args), settings_from_args(serve_args))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning"))
    phases: list[dict[str, Any]] = []

    async def both() -> None:
        task = asyncio.create_task(orchestrate(args, server, async_engine))
        await server.serve()
        phases.extend(await task)

    try:
        with asyncio.Runner(loop_factory=event_loop_factory("auto")) as runner:  # uvloop, as `kvpager serve` runs
            runner.run(both())
    finally:
        async_engine.shutdown()
    rs = ratios(phases)
    print("serve / offline:", " ".join(f"{r:.1%}" for r in rs), f"median {statistics.median(rs):.1%}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"argv": argv, "phases": phases, "ratios": rs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

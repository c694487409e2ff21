"""Drive several OpenAI-compatible servers side by side under one load generator, phases alternated.

Each `--engine NAME=PORT=COMMAND` is started once (all at the same time, so each sits idle while
another is driven; `NAME=PORT=@PID` names a server already running as process PID, which this
script neither starts nor stops), waited for until `GET /v1/models` answers, then driven by the load generator
(the workplace's shared `loadgen.py`, given with `--loadgen`) at every concurrency in turn. Round r
drives the engines in order for even r and in reverse for odd r (ABBA), every engine of a round
getting the same seeded prompts; rounds use different seeds so no prefix cache is hit across
rounds. Every run appends one JSON line to `--json-out`; the summary prints the best output tok/s
per engine and concurrency and the ratio of the first engine to each other one.

Example (the `1b` model, int4 against llama.cpp's Q4_0; BENCH_DIR is the workplace's shared
benchmark folder, which also makes the model):

    python scripts/side_by_side.py --loadgen BENCH_DIR/loadgen.py --tokenizer models/llama-1b \\
        --concurrency 1:4,16:16 --output-len 64 --rounds 2 --json-out side_by_side_1b.jsonl \\
        --engine "kvpager-int4=8101=kvpager serve --model models/llama-1b --quantization int4 --port 8101" \\
        --engine "llama-q4_0=8102=llama-server -m llama-1b-q4_0.gguf -t 2 -np 16 -c 16384 -cb --port 8102"

Both serving one GGUF file (BENCHMARKS.md converts the `1b` model with llama.cpp's tools); a .gguf
given as `--tokenizer` has its vocabulary written out as a tokenizer.json for the load generator:

    python scripts/side_by_side.py --loadgen BENCH_DIR/loadgen.py --tokenizer llama-1b-Q4_K_M.gguf \\
        --concurrency 1:4,16:16 --output-len 64 --rounds 2 --json-out side_by_side_1b_gguf.jsonl \\
        --engine "kvpager-q4_k_m=8101=kvpager serve --model llama-1b-Q4_K_M.gguf --port 8101" \\
        --engine "llama-q4_k_m=8102=llama-server -m llama-1b-Q4_K_M.gguf -t 2 -np 16 -c 16384 -cb --port 8102"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Engine:
    name: str
    port: int
    command: str  # or "@PID": a server already running as process PID (neither started nor stopped here)

    @property
    def attached_pid(self) -> int | None:
        return int(self.command[1:]) if self.command.startswith("@") else None


def parse_engine(text: str) -> Engine:
    try:
        name, port, command = text.split("=", 2)
        engine = Engine(name, int(port), command)
        engine.attached_pid  # noqa: B018 (checks an "@PID" form)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--engine must be NAME=PORT=COMMAND or NAME=PORT=@PID, got {text!r}"
        ) from None
    return engine


def parse_concurrency(text: str) -> list[tuple[int, int]]:
    """`1:4,16:16` → [(C=1, 4 requests), (C=16, 16 requests)]."""
    pairs = []
    for item in text.split(","):
        c, n = item.split(":")
        pairs.append((int(c), int(n)))
    return pairs


def wait_ready(engine: Engine, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{engine.port}/v1/models"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{engine.name} exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"{engine.name} not ready after {timeout:.0f} s")


def loadgen_tokenizer(path: str, out_dir: Path) -> str:
    """--tokenizer as the load generator reads it (a model directory or a tokenizer.json): a GGUF
    file's vocabulary, rebuilt by kvpager, is written to OUT_DIR/STEM-tokenizer.json."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # kvpager from this checkout
    from kvpager.gguf import is_gguf_path, open_gguf

    if not is_gguf_path(path):
        return path
    from kvpager.text.gguf_tokenizer import tokenizer_from_gguf

    out = out_dir / f"{Path(path).stem}-tokenizer.json"
    out.write_text(tokenizer_from_gguf(open_gguf(path)).backend_json(), encoding="utf-8")
    return str(out)


def drive(args: argparse.Namespace, engine: Engine, pid: int, c: int, n: int, seed: int) -> dict:
    label = f"{engine.name}-c{c}-s{seed}"
    cmd = [
        sys.executable, args.loadgen, "--url", f"http://127.0.0.1:{engine.port}",
        "--tokenizer", args.tokenizer, "-n", str(n), "-c", str(c),
        "--prompt-len", args.prompt_len, "--output-len", str(args.output_len),
        "--seed", str(seed), "--server-pid", str(pid), "--label", label,
        "--json-out", args.json_out,
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    with open(args.json_out) as f:
        record = json.loads(f.readlines()[-1])
    record["engine"] = engine.name
    record["round_seed"] = seed
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--loadgen", required=True, help="path of the shared loadgen.py")
    ap.add_argument(
        "--tokenizer", required=True, help="model directory holding tokenizer.json, or a .gguf (its vocabulary)"
    )
    ap.add_argument("--engine", action="append", type=parse_engine, required=True)
    ap.add_argument("--concurrency", type=parse_concurrency, default=parse_concurrency("1:4,16:16"))
    ap.add_argument("--prompt-len", default="128:512")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--json-out", required=True)
    ap.add_argument("--log-dir", default=".", help="each engine's stdout/stderr goes to NAME.log here")
    args = ap.parse_args()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    args.tokenizer = loadgen_tokenizer(args.tokenizer, Path(args.log_dir))
    from kvpager.bench.report import machine_info

    # the run's first record: the machine (CPU model, family/model, kernel flags) and each engine's command
    with open(args.json_out, "a") as f:
        engines = {e.name: e.command for e in args.engine}
        f.write(json.dumps({"label": "machine", "machine": machine_info(), "engines": engines}) + "\n")

    procs: dict[str, subprocess.Popen[bytes]] = {}
    pids: dict[str, int] = {}
    try:
        for engine in args.engine:
            if engine.attached_pid is not None:  # started beforehand (e.g. an engine that takes long to start)
                pids[engine.name] = engine.attached_pid
                continue
            log = open(Path(args.log_dir) / f"{engine.name}.log", "wb")  # noqa: SIM115
            procs[engine.name] = subprocess.Popen(
                shlex.split(engine.command), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            pids[engine.name] = procs[engine.name].pid
        for engine in args.engine:
            wait_ready(engine, procs.get(engine.name), args.ready_timeout)
        results: list[dict] = []
        for r in range(args.rounds):
            order = args.engine if r % 2 == 0 else list(reversed(args.engine))
            for c, n in args.concurrency:
                seed = args.seed + 1000 * r + c
                for engine in order:
                    results.append(drive(args, engine, pids[engine.name], c, n, seed))
        summarise(args.engine, args.concurrency, results)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def summarise(engines: list[Engine], levels: list[tuple[int, int]], results: list[dict]) -> None:
    print("\nbest output tok/s (ratio = first engine ÷ this one)")
    first = engines[0].name
    for c, _ in levels:
        best = {}
        for engine in engines:
            runs = [x for x in results if x["engine"] == engine.name and x["concurrency"] == c]
            good = [x for x in runs if x["errors"] == 0 and x["output_tok_s"]]
            best[engine.name] = max((x for x in good), key=lambda x: x["output_tok_s"], default=None)
        for name, rec in best.items():
            if rec is None:
                print(f"C={c:>3} {name:<20} no error-free run")
                continue
            ratio = ""
            if name != first and best[first] is not None:
                ratio = f"  {first} ÷ {name} = {best[first]['output_tok_s'] / rec['output_tok_s']:.2f}"
            print(
                f"C={c:>3} {name:<20} {rec['output_tok_s']:8.2f} tok/s  TTFT p50 "
                f"{rec['ttft_s']['p50'] * 1000:7.0f} ms  TPOT p50 {rec['tpot_s']['p50'] * 1000:6.0f} ms  "
                f"peak RSS {rec['peak_rss_mib'] or 0:7.0f} MiB{ratio}"
            )


if __name__ == "__main__":
    main()

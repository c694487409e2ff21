"""`kvpager bench kv-ttft`: time to first token for a long shared context, from every place its KV can live.

The prompt is a `--context-len`-token shared context plus a `--question-len`-token question (seeded
random ids; each request has a fresh question). TTFT is wall time from `add_request` to the step
that returns the first token, one request at a time, on the offline engine:
- cold: nothing cached (the first request, and each filler below);
- device: the context's blocks are in the device pool's prefix cache;
- host: a filler request of the same size (a cold sample too) has pushed the context out of a pool
  sized for one request, so its blocks come back from the host RAM tier;
- disk: a new engine (restart) over the same `--kv-cache-dir`, the context read from disk;
- pack: a new engine started with `--kv-pack` of the context (blocks pinned at start).
Each engine first serves a short unrelated request, so one-off start-up costs stay out of TTFT.
Also: payload bytes per token for each codec (with the lossy codecs' max abs error), and the KV
transfer's share of end-to-end latency in prefill/decode mode, measured in-process with two engines:
prefill engine `export_kv` (cold prefill + encode) → decode engine `import_kv` → decode engine
generates `--decode-tokens` tokens. The transfer is the encode (an export of the now cached
context, which only reads and encodes) plus the import, plus the wire time at `--link-gbps`
(payload bytes / bandwidth; nothing goes over a network in-process).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpager.bench import report
from kvpager.bench.prefix import time_to_first_token
from kvpager.core.config import DTYPE_BYTES, EngineConfig
from kvpager.core.kv_cache_manager import cdiv
from kvpager.core.sampling_params import SamplingParams
from kvpager.model.spec import load_model_spec

TARGET_SPEEDUP = 10.0
CODECS = ("lossless", "fp16", "bf16", "int8", "int4", "lossless+zstd", "int8+zstd")
WARM_PATHS = ("device", "host", "disk", "pack")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpager bench kv-ttft", description=__doc__)
    report.add_common_args(p)
    p.add_argument("--context-len", type=int, default=2000)
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--repetitions", type=int, default=2, help="samples per path (each host sample costs a filler)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens the decode engine generates (transfer)")
    p.add_argument("--link-gbps", type=float, default=10.0, help="assumed network link for the wire time")
    p.add_argument("--host-memory", default="1GiB", help="host tier size")
    p.add_argument("--workdir", default=None, help="directory for the disk tier and the pack (default: temp)")
    p.add_argument("--seed", type=int, default=0)
    return p


class Bench:
    """Shared set-up of one run: model, token generator, engine configs."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        from kvpager.engine.args import parse_bytes

        self.args = args
        self.choice = report.choose_model(args, str(workdir))
        self.spec = load_model_spec(self.choice.model_dir)
        self.rng = random.Random(args.seed)
        self.disk_dir = workdir / "kv-disk"
        self.pack_path = workdir / "context.kvpack"
        self.host_bytes = parse_bytes(args.host_memory)
        bytes_per_block = self.spec.kv_shape(DTYPE_BYTES["float32"]).bytes_per_block(args.block_size)
        self.request_blocks = cdiv(args.context_len + args.question_len + args.decode_tokens, args.block_size) + 1
        self.block_bytes = bytes_per_block

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, self.spec.vocab_size) for _ in range(n)]

    def engine(self, num_blocks: int, **kv: Any) -> Any:
        """A fresh engine whose pool holds `num_blocks`, warmed up by one short request."""
        from kvpager.engine.engine import Engine

        config = EngineConfig(
            model=self.choice.model_dir,
            load_format=self.choice.load_format,
            block_size=self.args.block_size,
            kv_cache_memory=num_blocks * self.block_bytes,
            max_num_batched_tokens=max(2048, self.args.context_len + self.args.question_len),
            num_threads=self.args.num_threads,
            **kv,
        )
        engine = Engine(config)
        ttft(engine, "warm-up", self.tokens(self.args.block_size * 2))
        return engine

    def tiered_engine(self) -> Any:
        """Pool sized for one request (so a filler evicts the context) + host and disk tiers."""
        return self.engine(self.request_blocks, host_kv_cache_memory=self.host_bytes, kv_cache_dir=str(self.disk_dir))


def ttft(engine: Any, request_id: str, prompt: list[int]) -> float:
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    return time_to_first_token(engine, request_id, prompt, params)


def timed(engine: Any, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """(TTFT, num_cached_tokens) of one request; `num_cached_tokens` shows where the prefix came from."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
    first, cached = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first, cached = time.perf_counter() - start, out.num_cached_tokens
    if first is None:
        raise ValueError(f"request {request_id} finished without a token")
    return first, cached


def measure_tiers(b: Bench, context: list[int], log: Any) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Cold, device and host TTFTs on one engine; then the pack file and codec sizes; flush to disk."""
    q = b.args.question_len
    samples: dict[str, list[float]] = {"cold": [], "device": [], "host": []}
    cached: dict[str, int] = {}
    engine = b.tiered_engine()
    t, cached["cold"] = timed(engine, "cold", context + b.tokens(q))
    samples["cold"].append(t)
    for i in range(b.args.repetitions):
        t, _ = timed(engine, f"filler-{i}", b.tokens(len(context) + q))  # cold; evicts the context
        samples["cold"].append(t)
        t, cached["host"] = timed(engine, f"host-{i}", context + b.tokens(q))
        samples["host"].append(t)
        t, cached["device"] = timed(engine, f"device-{i}", context + b.tokens(q))
        samples["device"].append(t)
        log(f"repetition {i + 1}: cold {samples['cold'][-1]:.3f} s, host {samples['host'][-1]:.4f} s, "
            f"device {samples['device'][-1]:.4f} s")  # fmt: skip
    extra = {"cached_tokens": cached, "tiers_after_host_runs": engine.kv_tier_stats().summary()}
    extra["codecs"] = codec_sizes(engine, context)
    b.pack_path.write_bytes(engine.export_kv(context))
    engine.shutdown()  # flushes the device-cached and host blocks to disk
    return samples, extra


def codec_sizes(engine: Any, context: list[int]) -> dict[str, dict[str, float]]:
    """Payload bytes per token of each codec (the context is cached, so this only reads and encodes)."""
    from kvpager.kvstore.pack import decode_payload

    num_tokens = len(context) // engine.config.block_size * engine.config.block_size
    reference = None
    sizes: dict[str, dict[str, float]] = {}
    for codec in CODECS:
        start = time.perf_counter()
        try:
            payload = engine.export_kv(context, codec)
        except (ValueError, ImportError) as error:  # e.g. zstandard not installed
            sizes[codec] = {"error": str(error)}  # type: ignore[dict-item]
            continue
        seconds = time.perf_counter() - start
        blocks = [block.float() for _, block in decode_payload(payload).blocks]
        if reference is None:
            reference = blocks
        max_err = max(float((x - y).abs().max()) for x, y in zip(blocks, reference, strict=True))
        sizes[codec] = {"bytes_per_token": len(payload) / num_tokens, "export_s": seconds, "max_abs_error": max_err}
    return sizes


def measure_restarts(b: Bench, context: list[int], log: Any) -> dict[str, Any]:
    """Disk TTFT after restarts, pack TTFT on an engine started with the pack; prefill/decode transfer."""
    q = b.args.question_len
    disk, disk_cached, disk_hits = [], 0, 0
    for i in range(b.args.repetitions):
        engine = b.tiered_engine()
        t, disk_cached = timed(engine, f"disk-{i}", context + b.tokens(q))
        stats = engine.kv_tier_stats()
        disk_hits = stats.disk.hits if stats.disk is not None else 0
        disk.append(t)
        log(f"restart {i + 1}: disk {t:.4f} s ({disk_cached} cached tokens, {disk_hits} disk hits)")
        del engine
    pack_engine = b.engine(2 * b.request_blocks + 2, kv_packs=(str(b.pack_path),))
    pack_load_s = pack_engine.kv_tier_stats().imported.seconds
    pack, pack_cached = timed(pack_engine, "pack", context + b.tokens(q))
    log(f"pack {pack:.4f} s ({pack_cached} cached tokens; pack loaded at start in {pack_load_s:.3f} s)")
    del pack_engine
    return {
        "disk": disk,
        "pack": [pack],
        "cached_tokens": {"disk": disk_cached, "pack": pack_cached},
        "disk_hits": disk_hits,
        "pack_load_s": pack_load_s,
        "pack_bytes": b.pack_path.stat().st_size,
    }


def measure_transfer(b: Bench, log: Any) -> dict[str, Any]:
    """Prefill on one engine, KV export → import, decode on another (in-process; see the module doc)."""
    prefill = b.engine(b.request_blocks + 2)
    decode = b.engine(b.request_blocks + 2)
    prompt = b.tokens(b.args.context_len + b.args.question_len)
    start = time.perf_counter()
    payload = prefill.export_kv(prompt)  # cold: prefill + read + encode
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    prefill.export_kv(prompt)  # cached: read + encode only (the serialisation part of the export)
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    num_blocks = decode.import_kv(payload)
    import_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=b.args.decode_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    decode_ttft = time_to_first_token(decode, "decode", prompt, params)
    decode_s = time.perf_counter() - start
    wire_s = len(payload) * 8 / (b.args.link_gbps * 1e9)
    e2e = export_s + import_s + decode_s + wire_s
    transfer = encode_s + import_s + wire_s
    log(f"transfer: {len(payload)} bytes, {num_blocks} blocks; share {transfer / e2e:.1%} of {e2e:.2f} s")
    return {
        "payload_bytes": len(payload),
        "blocks": num_blocks,
        "prefill_export_s": export_s,
        "encode_s": encode_s,
        "import_s": import_s,
        "wire_s": wire_s,
        "decode_ttft_s": decode_ttft,
        "decode_total_s": decode_s,
        "e2e_s": e2e,
        "transfer_s": transfer,
        "transfer_share": transfer / e2e,
    }


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    if args.context_len < args.block_size or args.question_len < 1 or args.repetitions < 1:
        raise ValueError("--context-len must be >= --block-size; --question-len and --repetitions >= 1")
    report.set_threads(args.num_threads)
    with tempfile.TemporaryDirectory(prefix="kvpager-kv-ttft-") as tmp:
        workdir = Path(args.workdir) if args.workdir else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        b = Bench(args, workdir)

        def log(message: str) -> None:
            report.log(args, message)

        context = b.tokens(args.context_len)
        samples, extra = measure_tiers(b, context, log)
        restarts = measure_restarts(b, context, log)
        transfer = measure_transfer(b, log)
    return build_result(args, argv, b.choice, samples, extra, restarts, transfer)


def build_result(
    args: argparse.Namespace,
    argv: Sequence[str],
    choice: report.ModelChoice,
    samples: dict[str, list[float]],
    extra: dict[str, Any],
    restarts: dict[str, Any],
    transfer: dict[str, Any],
) -> dict[str, Any]:
    paths = {**samples, "disk": restarts["disk"], "pack": restarts["pack"]}
    cold = report.median(paths["cold"])
    ttft_rows = {name: {"median_s": report.median(v), "samples": v} for name, v in paths.items()}
    speedups = {name: cold / ttft_rows[name]["median_s"] for name in WARM_PATHS}
    return {
        "bench": "kv-ttft",
        "command": report.command_line("kv-ttft", argv),
        "machine": report.machine_info(),
        "model": {"dir": choice.model_dir, "load_format": choice.load_format, "dummy_smollm2": choice.is_default_dummy},
        "workload": {"context_len": args.context_len, "question_len": args.question_len, "block_size": args.block_size},
        "ttft": ttft_rows,
        "cached_tokens": {**extra["cached_tokens"], **restarts["cached_tokens"]},
        "speedup_vs_cold": speedups,
        "targets": {"every_warm_path_ge_10x": all(s >= TARGET_SPEEDUP for s in speedups.values())},
        "codecs": extra["codecs"],
        "pack": {"bytes": restarts["pack_bytes"], "load_s": restarts["pack_load_s"]},
        "disk_hits": restarts["disk_hits"],
        "tiers": extra["tiers_after_host_runs"],
        "transfer": transfer,
        "link_gbps": args.link_gbps,
        "peak_rss_bytes": report.peak_rss_bytes(),
    }


def render(result: dict[str, Any]) -> str:
    w, t = result["workload"], result["transfer"]
    cached = result["cached_tokens"]
    labels = {
        "cold": "cold (nothing cached)",
        "device": "device prefix cache",
        "host": "host RAM tier",
        "disk": "disk tier after restart",
        "pack": "KV pack loaded at start",
    }
    rows = [
        [label, len(result["ttft"][k]["samples"]), result["ttft"][k]["median_s"], cached.get(k, 0),
         "-" if k == "cold" else f"{result['speedup_vs_cold'][k]:.1f}x"]
        for k, label in labels.items()
    ]  # fmt: skip
    codec_rows = [
        [name, v["bytes_per_token"], v["max_abs_error"], v["export_s"]]
        for name, v in result["codecs"].items()
        if "error" not in v
    ]
    return "\n".join(
        [
            f"prompt: {w['context_len']}-token shared context + {w['question_len']}-token question, "
            f"block size {w['block_size']}",
            report.markdown_table(["TTFT from", "samples", "median s", "cached tokens", "vs cold"], rows),
            f"target every warm path >= 10x faster than cold: {result['targets']['every_warm_path_ge_10x']}",
            "",
            report.markdown_table(["codec", "bytes/token", "max abs error", "export s (cached)"], codec_rows),
            f"KV pack: {result['pack']['bytes'] / 2**20:.1f} MiB, loaded at start in {result['pack']['load_s']:.3f} s",
            "",
            f"prefill/decode transfer ({t['blocks']} blocks, {t['payload_bytes'] / 2**20:.1f} MiB lossless): "
            f"prefill+export {t['prefill_export_s']:.2f} s (of which encode {t['encode_s']:.3f} s), "
            f"import {t['import_s']:.3f} s, wire at {result['link_gbps']:g} Gbit/s {t['wire_s']:.3f} s, "
            f"decode of {t['decode_total_s']:.2f} s (TTFT {t['decode_ttft_s']:.3f} s); "
            f"transfer share of end-to-end {t['transfer_share']:.1%} of {t['e2e_s']:.2f} s",
        ]
    )


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    result = run(args, argv)
    report.emit(result, render(result), args)
    return 0

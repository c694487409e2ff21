"""Device facts: memory and bandwidth from the shipped table, from flags, or measured on this machine."""

from __future__ import annotations

import difflib
import json
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvpager.core.units import GIB, parse_bandwidth, parse_bytes


@dataclass(frozen=True)
class Device:
    """Where the model runs: how much memory it has and how fast it can read it."""

    name: str
    kind: str  # "gpu" | "apple" | "cpu" | "custom"
    memory_bytes: int
    bandwidth_bytes_per_s: float
    source: str


@dataclass(frozen=True)
class Reserve:
    """Memory kept back for the runtime, activations and fragmentation."""

    num_bytes: int
    rule: str


def default_reserve(device: Device) -> Reserve:
    """The stated default: 25% on Apple chips, else 10% of memory + 1 GiB (override with --reserve).

    NOTE: 10% mirrors vLLM's gpu_memory_utilization=0.9; the extra GiB covers the CUDA context,
    activations and the sampler. On Apple silicon macOS lets the GPU wire only about 75% of unified
    memory by default (raise it with `sysctl iogpu.wired_limit_mb`, then pass --reserve).
    """
    if device.kind == "apple":
        return Reserve(device.memory_bytes // 4, "25% of unified memory (macOS default GPU limit ≈ 75%)")
    return Reserve(device.memory_bytes // 10 + GIB, "10% of memory + 1 GiB")


def custom_reserve(device: Device, num_bytes: int | None, fraction: float | None) -> Reserve:
    if fraction is not None:
        return Reserve(int(device.memory_bytes * fraction), f"{fraction:.0%} of memory (--reserve)")
    assert num_bytes is not None
    return Reserve(num_bytes, "--reserve")


def shipped_device_entries() -> list[dict[str, Any]]:
    text = resources.files("kvpager.planner").joinpath("data/devices.json").read_text(encoding="utf-8")
    entries: list[dict[str, Any]] = json.loads(text)["devices"]
    return entries


def device_from_entry(entry: dict[str, Any]) -> Device:
    return Device(
        name=entry["name"],
        kind=entry["kind"],
        memory_bytes=parse_bytes(entry["memory"]),
        bandwidth_bytes_per_s=parse_bandwidth(entry["bandwidth"]),
        source=entry["source"],
    )


def find_device(name: str) -> Device:
    """A shipped device by name or alias (case-insensitive); ValueError with close matches otherwise."""
    key = _normalise(name)
    entries = shipped_device_entries()
    for entry in entries:
        if key in {_normalise(entry["name"]), *(_normalise(a) for a in entry["aliases"])}:
            return device_from_entry(entry)
    names = [e["name"] for e in entries]
    lowered = {_normalise(n): n for n in names}
    close = [lowered[c] for c in difflib.get_close_matches(key, list(lowered), n=3, cutoff=0.5)]
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise ValueError(
        f"unknown device {name!r}.{hint} Use --memory and --bandwidth for others. Known devices: {', '.join(names)}."
    )


def _normalise(name: str) -> str:
    return name.strip().lower().replace(" ", "-").replace("_", "-")


def custom_device(memory: str, bandwidth: str | None) -> Device:
    """`--memory 6GiB --bandwidth 192GB/s`."""
    memory_bytes = parse_bytes(memory, what="--memory")
    if memory_bytes == 0:
        raise ValueError("--memory must be positive, e.g. --memory 6GiB")
    if bandwidth is None:
        raise ValueError("--memory needs --bandwidth too (e.g. --bandwidth 192GB/s) for the decode-speed bound")
    return Device("custom", "custom", memory_bytes, parse_bandwidth(bandwidth), "--memory/--bandwidth")


def measure_cpu(meminfo: Path = Path("/proc/meminfo"), seconds: float = 0.5) -> Device:
    """This machine: MemAvailable from /proc/meminfo, bandwidth from a short numpy copy (< 2 s)."""
    available = _mem_available(meminfo)
    bandwidth = _copy_bandwidth(seconds)
    return Device(
        "cpu", "cpu", available, bandwidth, f"measured: MemAvailable in {meminfo}, numpy copy bandwidth (read + write)"
    )


def _mem_available(meminfo: Path) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError as exc:
        raise ValueError(
            f"cannot read {meminfo} ({exc}); use --memory and --bandwidth instead of --device cpu"
        ) from exc
    raise ValueError(f"{meminfo} has no MemAvailable line; use --memory and --bandwidth instead of --device cpu")


def _copy_bandwidth(seconds: float) -> float:
    """Best-of copy rate over 64 MiB arrays, counting the read and the write (2 × size per copy)."""
    import numpy as np

    src = np.ones(64 * 1024**2 // 8, dtype=np.float64)  # 64 MiB, touched so pages are mapped
    dst = np.empty_like(src)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        np.copyto(dst, src)
        elapsed = time.perf_counter() - start
        best = max(best, 2 * src.nbytes / elapsed)
        if time.perf_counter() > deadline:
            return best

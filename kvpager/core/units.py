"""Byte and bandwidth quantities: parsing what users type, formatting what the planner prints.

The one rule for every size flag (`kvpager serve`, `plan`, `bench`, `kv`): binary units (KiB, MiB,
GiB, TiB) and the single letters k/m/g/t (`4G`, as llama.cpp and `free -g` read it) are powers of
1024; decimal units (kB, MB, GB, TB) are powers of 1000, as vendors quote capacity and bandwidth.
A bare number is bytes. So `--kv-cache-memory 4G` = 4 GiB = 4,294,967,296 bytes and `4GB` = 4 x 10^9.
"""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
}
_QUANTITY = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")

GIB = 1024**3


def parse_bytes(text: str, *, what: str = "size") -> int:
    """Parse `6GiB`, `16GB`, `512MiB` or a plain byte count; ValueError naming `what` otherwise.

    NOTE: the single-letter suffixes k/m/g/t are binary (as in `--memory 24G` for a 24 GiB card).
    """
    match = _QUANTITY.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"{what}: cannot read {text!r} as a size in bytes (examples: 4GiB = 4G, 512MiB, 2GB = 2e9, 1073741824)"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 0:
        raise ValueError(f"{what} must not be negative, got {text!r}")
    return int(round(value))


def parse_bandwidth(text: str) -> float:
    """Parse `192GB/s`, `1.5TB/s` or `200GiB/s` into bytes per second."""
    stripped = text.strip()
    if not stripped.lower().endswith("/s"):
        raise ValueError(f"bandwidth {text!r} needs a per-second unit: write e.g. 192GB/s or 1.5TB/s")
    value = parse_bytes(stripped[:-2], what="bandwidth")
    if value == 0:
        raise ValueError(f"bandwidth must be positive, got {text!r}")
    return float(value)


def parse_reserve(text: str) -> tuple[int | None, float | None]:
    """Parse `--reserve`: either bytes (`2GiB`) or a share of memory (`15%`). Returns (bytes, fraction)."""
    stripped = text.strip()
    if stripped.endswith("%"):
        try:
            percent = float(stripped[:-1])
        except ValueError as exc:
            raise ValueError(f"reserve {text!r} is not a percentage: write e.g. 15%") from exc
        if not 0.0 <= percent < 100.0:
            raise ValueError(f"reserve must be in [0%, 100%), got {text!r}")
        return None, percent / 100.0
    return parse_bytes(stripped, what="reserve"), None


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: `1.00 GiB`, `640.0 KiB`, `12 B`."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_bandwidth(bytes_per_s: float) -> str:
    """Decimal bandwidth as vendors write it: `1008 GB/s`, `68.25 GB/s`."""
    return f"{bytes_per_s / 1e9:g} GB/s"


def format_count(count: float) -> str:
    """Parameter counts: `8.03B`, `135M`."""
    for divisor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= divisor:
            return f"{count / divisor:.3g}{suffix}"
    return f"{int(count)}"

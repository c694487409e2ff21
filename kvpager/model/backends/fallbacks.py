"""Counts of the calls CpuKernelOps sent to torch because a kernel's precondition failed.

A fallback is a performance cliff (a strided input, a dtype the kernel does not take, a head size
it has no tiles for), not an error: torch computes the same values. Each (op, reason) is counted and
logged once, at WARNING, with its reason; `as_dict()` is what /metrics and tests read. Calls that go
to torch by design (batches above a kernel's row limit) are not fallbacks: the start-up log states
those routes (CpuKernelOps.paths()).
"""

from __future__ import annotations

import logging
from collections import Counter

logger = logging.getLogger(__name__)


class FallbackCounter:
    """Per-instance counts of (op, reason); reasons are fixed strings, so their number stays small."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()

    def record(self, op: str, reason: str) -> None:
        key = (op, reason)
        if key not in self._counts:
            logger.warning("CPU kernels: %s runs in torch instead (%s); counted from now on", op, reason)
        self._counts[key] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        """{op: {reason: calls}} since the ops were made."""
        out: dict[str, dict[str, int]] = {}
        for (op, reason), n in sorted(self._counts.items()):
            out.setdefault(op, {})[reason] = n
        return out

    def total(self, op: str | None = None) -> int:
        return sum(n for (o, _), n in self._counts.items() if op is None or o == op)

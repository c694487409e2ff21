"""Keeping freed host memory in the C heap for reuse, instead of handing it back to the kernel.

glibc's malloc serves large blocks (above 128 KiB by default, at most 32 MiB once it adapts) with a
fresh `mmap` and unmaps them on free. A prompt's activations are such blocks: a prefill chunk of 2048
rows of the `1b` model writes a 134 MB gate/up output, and every call gets new pages from the kernel,
which faults each 4 KiB page in on first touch: on a 2-core Xeon that cost more than the conversion
of the output to float32 itself (BENCHMARKS.md, "Freed host memory kept for reuse"). With mmap off (M_MMAP_MAX 0) and no
trimming (M_TRIM_THRESHOLD at its maximum), freed blocks stay in the heap and the next step reuses
them, pages already present: what tcmalloc (which vLLM's CPU build preloads) does too. The price is
that the process keeps its peak heap instead of returning it between peaks.

Every thread also allocates from the main heap (M_ARENA_MAX 1). glibc gives other threads arenas of
their own, built of 64 MiB heaps that are unmapped as soon as they empty, whatever the trim threshold:
the server steps the engine on its loop thread, where a prefill step's blocks of tens of MiB spilled
into a second heap, unmapped and faulted in again every step (twice the page faults of the same steps
on the main thread, prefill 1.2-1.3x slower; BENCHMARKS.md, "Freed host memory kept for reuse"). The
arena limit applies to the threads that allocate for the first time after it is set, so the CLI sets
it before starting any thread, and engine loading sets it again for library use.

Left alone where the user chose: GLIBC_TUNABLES naming a `glibc.malloc` setting, or another allocator
preloaded (LD_PRELOAD naming tcmalloc, jemalloc or mimalloc); and off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Mapping

logger = logging.getLogger("kvpager.engine.host_malloc")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD_MAX = 2**31 - 1  # mallopt takes an int
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


def user_choice(environ: Mapping[str, str]) -> str | None:
    """What in `environ` says the user chose the allocator's behaviour, or None."""
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    preload = environ.get("LD_PRELOAD", "")
    for name in OTHER_ALLOCATORS:
        if name in preload:
            return f"LD_PRELOAD names {name}"
    return None


def keep_freed_memory(environ: Mapping[str, str], libc: ctypes.CDLL | None = None) -> str:
    """Turn glibc's mmap-backed blocks and heap trimming off, unless `environ` shows the user's own
    choice; returns what was done, for the start-up log."""
    choice = user_choice(environ)
    if choice is not None:
        return f"left as set ({choice})"
    if libc is None:
        name = ctypes.util.find_library("c")
        if name is None:
            return "left as is (no C library found)"
        libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    gnu_version = getattr(libc, "gnu_get_libc_version", None)
    if mallopt is None or gnu_version is None:
        return "left as is (not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_MAX), (M_ARENA_MAX, 1))
    if any(mallopt(param, value) != 1 for param, value in settings):
        return "left as is (mallopt refused)"
    return (
        "freed blocks kept in the heap for reuse, every thread on the main heap "
        "(glibc mallopt: M_MMAP_MAX 0, M_TRIM_THRESHOLD max, M_ARENA_MAX 1)"
    )

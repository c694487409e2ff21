"""Releasing the calling thread's OpenMP thread pool before another thread takes over the compute.

libgomp (the OpenMP runtime torch and the kernels share) keeps a pool of worker threads for every
thread that has started a parallel region, for the life of that thread. It counts every such worker,
and while the count exceeds the CPUs it may use, all of them spin only briefly (100 iterations instead
of 300,000) before sleeping between parallel regions, so each region starts by waking a sleeping
worker. The server loads the model on its main thread (whose pool then holds a worker) and steps the
engine on its loop thread (which starts its own pool): on 2 CPUs that is 3 threads, and a decode step
of the 1b model, ~170 parallel regions, measured 4-5 ms slower on the loop thread than on the
thread that loaded it (BENCHMARKS.md). `release_thread_pool()` on the loading thread, before the loop
thread starts, hands its workers back (OpenMP 5.0's omp_pause_resource_all, soft pause: the pool is
rebuilt if that thread starts a parallel region again).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

logger = logging.getLogger("kvpager.engine.openmp_pool")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release the threads, keep the runtime's state


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (torch's own copy), or None where there is none."""
    import torch  # noqa: F401  NOTE: torch loads its libgomp first

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "libgomp" in line.rsplit("/", 1)[-1]})
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
    return None


def release_thread_pool() -> bool:
    """Release the OpenMP worker threads the calling thread holds; False where the process has no
    libgomp with OpenMP 5.0's pause API (another OpenMP runtime, or none) or the runtime refused."""
    lib = _libgomp()
    if lib is None:
        logger.debug("no libgomp with omp_pause_resource_all loaded: the thread's OpenMP pool is kept")
        return False
    return int(lib.omp_pause_resource_all(OMP_PAUSE_SOFT)) == 0

"""Freed host memory kept in the C heap for reuse (kvpager/engine/host_malloc.py)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from kvpager.engine.host_malloc import (
    M_ARENA_MAX,
    M_MMAP_MAX,
    M_TRIM_THRESHOLD,
    TRIM_THRESHOLD_MAX,
    keep_freed_memory,
)

# Touches 256 MiB of one block, frees it, prints how much of it the process still holds (KiB).
FREE_AND_MEASURE = """
import sys
from kvpager.engine.host_malloc import keep_freed_memory

def rss_kib():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1])

if sys.argv[1] == 'keep':
    print(keep_freed_memory({}), file=sys.stderr)
before = rss_kib()
block = b'x' * (256 << 20)
del block
print(rss_kib() - before)
"""


# On a thread started after the setting: two live blocks of 40 MiB (more than one 64 MiB heap of a
# thread arena), freed, five times over; prints the page faults of the last four rounds.
THREAD_ROUNDS = """
import resource, sys, threading
from kvpager.engine.host_malloc import keep_freed_memory

if sys.argv[1] == 'keep':
    print(keep_freed_memory({}), file=sys.stderr)
faults = []

def rounds():
    for i in range(5):
        if i == 1:
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        a, b = bytearray(40 << 20), bytearray(40 << 20)
        del a, b
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)

thread = threading.Thread(target=rounds)
thread.start()
thread.join()
print(faults[0])
"""


def _run(script: str, mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True, timeout=60)
    return int(done.stdout.strip())


def _glibc_or_skip() -> None:
    with open("/proc/self/maps") as maps:
        if "libc.so.6" not in maps.read():
            pytest.skip("not glibc: keep_freed_memory leaves other C libraries alone")


def test_a_freed_large_block_stays_with_the_process_only_after_keep_freed_memory() -> None:
    _glibc_or_skip()
    assert _run(FREE_AND_MEASURE, "default") < 64 << 10  # glibc unmaps the block on free
    assert _run(FREE_AND_MEASURE, "keep") > 200 << 10  # kept in the heap for the next allocation


def test_blocks_freed_on_another_thread_are_reused_without_faulting_pages_in_again() -> None:
    _glibc_or_skip()
    # 40 MiB is 10,240 pages: by default every round faults a block's pages in afresh
    assert _run(THREAD_ROUNDS, "default") > 4 * 10_000
    assert _run(THREAD_ROUNDS, "keep") < 1_000


@pytest.mark.parametrize(
    ("environ", "reason"),
    [
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES sets glibc.malloc"),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"}, "LD_PRELOAD names tcmalloc"),
        ({"LD_PRELOAD": "libjemalloc.so.2"}, "LD_PRELOAD names jemalloc"),
    ],
)
def test_the_users_own_allocator_settings_are_left_alone(environ: dict[str, str], reason: str) -> None:
    calls: list[tuple[int, int]] = []
    libc = _fake_libc(calls, result=1)
    assert keep_freed_memory(environ, libc) == f"left as set ({reason})"
    assert calls == []


def test_mmap_is_turned_off_trimming_raised_to_its_maximum_and_threads_share_the_main_heap() -> None:
    calls: list[tuple[int, int]] = []
    said = keep_freed_memory({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, _fake_libc(calls, result=1))
    assert calls == [(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_MAX), (M_ARENA_MAX, 1)]
    assert said.startswith("freed blocks kept in the heap")


def test_a_c_library_without_glibcs_mallopt_or_refusing_it_is_reported_not_changed() -> None:
    assert keep_freed_memory({}, SimpleNamespace()) == "left as is (not glibc)"  # type: ignore[arg-type]
    calls: list[tuple[int, int]] = []
    assert keep_freed_memory({}, _fake_libc(calls, result=0)) == "left as is (mallopt refused)"


def _fake_libc(calls: list[tuple[int, int]], result: int) -> Any:
    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return result

    return SimpleNamespace(mallopt=mallopt, gnu_get_libc_version=lambda: b"2.36")

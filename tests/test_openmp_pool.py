"""Releasing a thread's OpenMP workers before the engine loop thread takes over (kvpager.engine.openmp_pool)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvpager.engine import async_engine as async_engine_module
from kvpager.engine.openmp_pool import release_thread_pool


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _gone(tids: set[str], seconds: float = 5.0) -> bool:
    """Whether the threads `tids` have all left /proc within `seconds`: libgomp's workers are detached,
    so one that has been told to exit may still be listed for a moment."""
    deadline = time.monotonic() + seconds
    while tids & _tids() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not tids & _tids()


def _parallel_sum() -> float:
    # large enough for torch's parallel_for to start an OpenMP team (its grain is 32768 elements)
    return float(torch.ones(1 << 22).sum())


def _release_in_a_fresh_thread() -> dict[str, object]:
    """A fresh thread's pool before and after the release, as the server's loading thread has it."""
    seen: dict[str, object] = {}

    def in_a_fresh_thread() -> None:  # a thread of its own: its pool is the only one it touches
        torch.set_num_threads(2)
        before = _tids()
        seen["sum"] = _parallel_sum()
        workers = _tids() - before  # this thread's new worker
        seen["with_pool"] = len(workers)
        seen["released"] = release_thread_pool()
        seen["workers_gone"] = _gone(workers)
        before_rebuild = _tids()
        seen["sum_again"] = _parallel_sum()  # the pool is rebuilt on demand
        seen["rebuilt"] = len(_tids() - before_rebuild)

    thread = threading.Thread(target=in_a_fresh_thread)
    thread.start()
    thread.join()
    return seen


def test_release_hands_back_the_calling_threads_workers_and_openmp_still_works() -> None:
    if (os.cpu_count() or 1) < 2 or not Path("/proc/self/task").is_dir():
        pytest.skip(f"needs 2+ CPUs and /proc to see OpenMP workers (cpu_count {os.cpu_count()})")
    # NOTE: in a process of its own: in the test run's process, threads and OpenMP state left by other
    # tests (servers, replicas, kernels) made the thread counts of this one unreliable
    code = "import json, test_openmp_pool as t; print(json.dumps(t._release_in_a_fresh_thread()))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["sum"] == seen["sum_again"] == float(1 << 22)
    assert seen["with_pool"] == 1, seen
    assert seen["released"] is True, "torch's libgomp has OpenMP 5.0's omp_pause_resource_all"
    assert seen["workers_gone"] is True, seen
    assert seen["rebuilt"] == 1, seen


def test_a_thread_without_a_pool_releases_nothing_and_fails_nothing() -> None:
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.extend([release_thread_pool(), release_thread_pool()]))
    thread.start()
    thread.join()
    assert results == [True, True]


def test_the_async_engine_releases_the_starting_threads_pool_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(async_engine_module, "release_thread_pool", lambda: calls.append(1) or True)

    class Idle:  # an engine with no work: the loop thread sleeps on its condition
        def has_unfinished_requests(self) -> bool:
            return False

        def stats(self) -> None:
            return None

        def shutdown(self) -> None:
            pass

    engine = async_engine_module.AsyncEngine(Idle())
    engine.start()
    engine.start()  # idempotent: no second thread, no second release
    try:
        assert calls == [1]
    finally:
        engine.shutdown()

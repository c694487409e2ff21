"""A headless node of a multi-node tensor-parallel engine: `kvpager serve ... --headless --node-rank R`.

With `--nnodes M` each node runs L = tensor_parallel_size / M ranks. Node 0 is the engine (scheduler,
API server, ranks 0..L-1); node R > 0 runs no engine and no server, only its ranks R*L..R*L+L-1,
as worker processes (`executor.spawn_ranks`) that join node 0's group at --master-addr:--master-port.
This process waits for them: when every one has exited cleanly (rank 0 told them to stop) it exits
0; when one fails (rank 0 unreachable or gone, a crash) it stops the others and exits 1; SIGTERM or
SIGINT stops them all. Node 0 notices a node that goes away by its ranks' heartbeats.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
from types import FrameType

from kvpager.core.config import EngineConfig
from kvpager.engine.executor import STOP_WAIT_S, exit_story, spawn_ranks

logger = logging.getLogger("kvpager")

POLL_S = 0.2


def run_headless(config: EngineConfig) -> int:
    """Run this node's ranks until they end; returns the process exit code."""
    if config.nnodes < 2 or config.node_rank == 0:
        raise ValueError(
            "--headless runs the worker ranks of a node other than node 0: give --nnodes M (M > 1) and "
            "--node-rank R (1..M-1); node 0 runs the engine and the API server (no --headless)"
        )
    if config.distributed_master_addr is None or config.distributed_master_port is None:
        raise ValueError("--headless needs --master-addr and --master-port (node 0's rendezvous address)")
    addr, port = config.distributed_master_addr, config.distributed_master_port
    ranks = config.node_ranks
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    procs = spawn_ranks(config, ranks, addr, port)
    logger.info(
        "headless node %d of %d: ranks %d..%d joining %s:%d",
        config.node_rank,
        config.nnodes,
        ranks[0],
        ranks[-1],
        addr,
        port,
    )
    try:
        return _wait(procs, stop)
    finally:
        _stop_all([proc for _, proc in procs])


def _wait(procs: list[tuple[int, subprocess.Popen[bytes]]], stop: threading.Event) -> int:
    running = dict(procs)
    while running and not stop.is_set():
        for rank, proc in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[rank]
            if code != 0:
                logger.error(
                    "tensor-parallel worker rank %d (pid %d) %s; stopping this node", rank, proc.pid, exit_story(code)
                )
                return 1
        stop.wait(POLL_S)
    return 0  # NOTE: every rank done, or told to stop (SIGTERM / SIGINT)


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

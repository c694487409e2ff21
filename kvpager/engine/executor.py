"""The tensor-parallel executor: rank 0's side of `--tensor-parallel-size N` (docs/scale-out.md).

The engine process is rank 0: it runs the scheduler once, samples, and before each step broadcasts
the step (`core/step_codec.py`, JSON bytes in a uint8 tensor) to ranks 1..N-1, worker processes it
starts here (`python -m kvpager.engine.tp_worker`, torchrun's environment: MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE, LOCAL_RANK). torch.distributed: gloo on CPU, nccl on CUDA. A monitor thread
watches the workers; one that exits makes the engine dead with the reason (the server answers 503),
and a collective that a rank stops answering fails after `distributed_timeout` seconds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading

import torch

from kvpager.core.config import EngineConfig
from kvpager.core.hashing import RequestId
from kvpager.core.limits import RequestLimits
from kvpager.core.scheduler import SchedulerOutput
from kvpager.core.step_codec import OP_STEP, OP_STOP, StepMessage, encode_step
from kvpager.model.parallel import TensorParallel, join_group, layout_for
from kvpager.model.spec import ModelSpec

logger = logging.getLogger("kvpager")

CONFIG_ENV = "KVPAGER_TP_CONFIG"  # the EngineConfig as JSON, for the worker processes
DEFAULT_MASTER_ADDR = "127.0.0.1"
MONITOR_INTERVAL_S = 0.1
STOP_WAIT_S = 10.0


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> EngineConfig:
    fields = json.loads(text)
    fields["request_limits"] = RequestLimits(**fields["request_limits"])
    fields["kv_packs"] = tuple(fields["kv_packs"])
    return EngineConfig(**fields)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_rank(
    spec: ModelSpec, rank: int, world_size: int, addr: str, port: int, device: torch.device, timeout_s: float
) -> TensorParallel:
    """Join the process group (blocks until every rank has) and return this rank's `TensorParallel`."""
    layout = layout_for(spec, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store, group = join_group(rank, world_size, addr, port, device, timeout_s)
    return TensorParallel(rank, layout, device, group, store)


def threads_per_rank(config: EngineConfig) -> int:
    """--num-threads, else the machine's cores shared evenly by the ranks started on it."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


class TensorParallelExecutor:
    """Starts ranks 1..N-1, joins the group as rank 0, broadcasts steps, watches the workers."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device) -> None:
        n = config.tensor_parallel_size
        layout_for(spec, n)  # NOTE: a layout that does not divide fails here, before any process starts
        addr = config.distributed_master_addr or os.environ.get("MASTER_ADDR") or DEFAULT_MASTER_ADDR
        port = config.distributed_master_port or int(os.environ.get("MASTER_PORT") or 0) or _free_port(addr)
        self.dead_reason: str | None = None
        self._stopping = False
        threads = threads_per_rank(config)
        worker_config = config_to_json(dataclasses.replace(config, num_threads=threads))
        self.workers: list[subprocess.Popen[bytes]] = []
        for rank in range(1, n):
            env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
            env.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(n), OMP_NUM_THREADS=str(threads))
            env[CONFIG_ENV] = worker_config
            self.workers.append(subprocess.Popen([sys.executable, "-m", "kvpager.engine.tp_worker"], env=env))
        logger.info(
            "tensor parallel: %d ranks over %s:%d (%s), %d threads each", n, addr, port, backend_for(device), threads
        )
        self._monitor = threading.Thread(target=self._watch, name="kvpager-tp-monitor", daemon=True)
        self._monitor.start()
        torch.set_num_threads(threads)
        try:
            self.parallel = init_rank(spec, 0, n, addr, port, device, config.distributed_timeout)
        except BaseException:
            self.abort()
            raise

    def send_step(self, out: SchedulerOutput, sampled: dict[RequestId, int]) -> None:
        """Broadcast one step (and the tokens sampled in the last one) to every rank."""
        self.check_alive()
        try:
            self.parallel.broadcast_bytes(encode_step(StepMessage(OP_STEP, out, sampled)))
        except Exception as exc:
            raise RuntimeError(self.dead_reason or f"tensor-parallel broadcast failed: {exc}") from exc

    def failure(self, exc: BaseException) -> RuntimeError:
        """The error a failed step raises: the dead worker's story when there is one (the monitor may
        see the exit a moment after the collective failed, so it is given a second)."""
        for _ in range(10):
            if self.dead_reason is not None:
                return RuntimeError(self.dead_reason)
            threading.Event().wait(MONITOR_INTERVAL_S)
        return RuntimeError(f"tensor-parallel step failed: {exc}")

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise RuntimeError(self.dead_reason)

    def shutdown(self) -> None:
        """Tell the workers to exit, wait for them (killing any that do not), leave the group."""
        if self._stopping:
            return
        self._stopping = True
        if self.dead_reason is None:
            try:
                self.parallel.broadcast_bytes(encode_step(StepMessage(OP_STOP)))
            except Exception:
                logger.exception("tensor parallel: the stop message did not reach every worker")
        for proc in self.workers:
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _watch(self) -> None:
        """Monitor thread: a worker that exits (other than at shutdown) kills the engine, with the reason."""
        while not self._stopping:
            for rank, proc in enumerate(self.workers, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                    self.dead_reason = f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"
                    logger.error("%s; the engine is dead", self.dead_reason)
                    return
            threading.Event().wait(MONITOR_INTERVAL_S)

    def abort(self) -> None:
        """Kill the workers and leave the group (start-up failed)."""
        self._stopping = True
        for proc in self.workers:
            proc.kill()
            proc.wait()


def _free_port(addr: str) -> int:
    """A port free on `addr` now (the rendezvous binds it a moment later)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])

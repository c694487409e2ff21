"""The tensor-parallel executor: rank 0's side of `--tensor-parallel-size N` (docs/scale-out.md).

The engine process is rank 0: it runs the scheduler once, samples, and before each step broadcasts
the step (`core/step_codec.py`, JSON bytes in a uint8 tensor) to ranks 1..N-1. With `--nnodes M`
each node runs L = N / M ranks: node 0 starts its ranks 1..L-1 here, node R > 0 (`kvpager serve
--headless`, `engine/tp_node.py`) starts ranks R*L..R*L+L-1; both with `spawn_ranks`
(`python -m kvpager.engine.tp_worker`, torchrun's environment: MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK). torch.distributed: gloo on CPU, nccl on CUDA.
A monitor thread watches the local workers' processes and every rank's heartbeat in the rendezvous
store: a worker that exits, or a rank (local or on another node) whose heartbeat stops, makes the
engine dead with the reason (the server answers 503); a collective that a rank stops answering fails
after `distributed_timeout` seconds.
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
import time
from typing import Any

import torch

from kvpager.core.config import EngineConfig
from kvpager.core.hashing import RequestId
from kvpager.core.limits import RequestLimits
from kvpager.core.scheduler import SchedulerOutput
from kvpager.core.step_codec import OP_STEP, OP_STOP, StepMessage, TierOps, encode_step
from kvpager.kvstore.offload import TieredBlockStore, build_tiers
from kvpager.kvstore.sharded import RankKV, ShardedBlockIO, ShardedTierStore, build_rank_kv
from kvpager.model.parallel import TensorParallel, join_group, layout_for
from kvpager.model.spec import ModelSpec
from kvpager.worker.runner import ModelRunner

logger = logging.getLogger("kvpager")

CONFIG_ENV = "KVPAGER_TP_CONFIG"  # the EngineConfig as JSON, for the worker processes
LOOPBACK_ADDR = "127.0.0.1"  # one node only: every rank is on this machine
MONITOR_INTERVAL_S = 0.1
STOP_WAIT_S = 10.0
# Every rank but 0 bumps its counter in the rendezvous store this often; rank 0 declares a rank whose
# counter has not moved for HEARTBEAT_DEAD_S dead (its process or its whole node is gone).
HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_DEAD_S = 3.0


class RendezvousError(RuntimeError):
    """The ranks could not meet: a node not started, a wrong or unreachable master address."""


def heartbeat_key(rank: int) -> str:
    return f"kvpager-tp/heartbeat/{rank}"


# What every node's configuration must agree on (each node builds its own from its command line; the
# model path, threads, device and addresses may differ between machines).
AGREED_FIELDS = (
    "tensor_parallel_size",
    "nnodes",
    "load_format",
    "dtype",
    "quantization",
    "quantization_group_size",
    "quantize_lm_head",
    "kv_cache_dtype",
    "block_size",
    "max_model_len",
    "enable_prefix_caching",
    "fp32_matmul_precision",
    "host_kv_cache_memory",
    "kv_codec",
)
CONFIG_KEY = "kvpager-tp/config"
FINGERPRINT_KEY = "kvpager-tp/fingerprint"  # rank 0's model fingerprint (the other ranks do not hash weights)
FINGERPRINT_WAIT_S = 24 * 3600.0  # a worker waits for rank 0's load (hashing big weights takes a while)
FINGERPRINT_POLL_S = 0.05


def share_fingerprint(store: Any, fingerprint: bytes) -> None:
    """Rank 0: publish the model fingerprint its blocks are hashed under (for the ranks' KV tiers)."""
    store.set(FINGERPRINT_KEY, fingerprint.hex())


def rank0_fingerprint(store: Any) -> bytes:
    """A worker: rank 0's model fingerprint (waits until rank 0 has loaded its model).

    NOTE: polls with `check` rather than a blocking `wait`, which would hold the store's client and
    stall the heartbeat thread's calls on it (rank 0 would take the worker for dead).
    """
    deadline = time.monotonic() + FINGERPRINT_WAIT_S
    while not store.check([FINGERPRINT_KEY]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 published no model fingerprint within {FINGERPRINT_WAIT_S:g} s")
        threading.Event().wait(FINGERPRINT_POLL_S)
    return bytes.fromhex(store.get(FINGERPRINT_KEY).decode("ascii"))


def _agreement_key(rank: int) -> str:
    return f"kvpager-tp/config-check/{rank}"


def check_agreement(store: Any, config: EngineConfig, world_size: int) -> None:
    """Rank 0: publish the fields every rank must share, then read each rank's verdict (ValueError
    naming the differences when one disagrees)."""
    store.set(CONFIG_KEY, json.dumps({name: getattr(config, name) for name in AGREED_FIELDS}))
    for rank in range(1, world_size):
        verdict = store.get(_agreement_key(rank)).decode("utf-8")
        if verdict != "ok":
            raise ValueError(verdict)


def agree_with_rank0(store: Any, config: EngineConfig, rank: int) -> str | None:
    """A worker: compare its configuration with rank 0's and report the verdict; the differences, or None."""
    theirs = json.loads(store.get(CONFIG_KEY).decode("utf-8"))
    diffs = [
        f"--{name.replace('_', '-')} {theirs[name]!r} on node 0, {getattr(config, name)!r} here"
        for name in AGREED_FIELDS
        if theirs.get(name) != getattr(config, name)
    ]
    verdict = None
    if diffs:
        node = config.node_rank
        verdict = f"tensor-parallel rank {rank} (node {node}) has another configuration than node 0: " + "; ".join(
            diffs
        )
    store.set(_agreement_key(rank), verdict or "ok")
    return verdict


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> EngineConfig:
    fields = json.loads(text)
    fields["request_limits"] = RequestLimits(**fields["request_limits"])
    fields["kv_packs"] = tuple(fields["kv_packs"])
    return EngineConfig(**fields)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rendezvous_address(config: EngineConfig) -> tuple[str, int]:
    """Node 0's rendezvous address: the flags, else MASTER_ADDR / MASTER_PORT, else (one node) loopback and a free port."""
    addr = config.distributed_master_addr or os.environ.get("MASTER_ADDR")
    port = config.distributed_master_port or int(os.environ.get("MASTER_PORT") or 0)
    if config.nnodes > 1 and (addr is None or not port):  # NOTE: EngineConfig refuses this; env alone is not enough
        raise ValueError("--nnodes > 1 needs --master-addr and --master-port")
    addr = addr or LOOPBACK_ADDR
    return addr, port or _free_port(addr)


def init_rank(
    spec: ModelSpec,
    rank: int,
    world_size: int,
    addr: str,
    port: int,
    device: torch.device,
    connect_timeout_s: float,
    op_timeout_s: float | None = None,
) -> TensorParallel:
    """Join the process group (blocks until every rank has) and return this rank's `TensorParallel`.

    RendezvousError, naming the address, when the ranks do not meet within `connect_timeout_s`.
    """
    layout = layout_for(spec, world_size)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        store, group = join_group(rank, world_size, addr, port, device, connect_timeout_s, op_timeout_s)
    except (RuntimeError, OSError) as exc:  # NOTE: torch's DistStoreError / DistNetworkError are RuntimeErrors
        if rank == 0:
            why = (
                f"not every one of the {world_size} ranks joined within {connect_timeout_s:g} s (start the other "
                "nodes with `kvpager serve ... --headless --node-rank R` and the same --master-addr/--master-port)"
            )
        else:
            why = (
                f"could not reach the tensor-parallel master (node 0) within {connect_timeout_s:g} s (is node 0 "
                "started, with this --master-addr and --master-port, and is the port open?)"
            )
        raise RendezvousError(
            f"tensor-parallel rendezvous at {addr}:{port} failed for rank {rank}: {why}: {exc}"
        ) from exc
    return TensorParallel(rank, layout, device, group, store)


def threads_per_rank(config: EngineConfig) -> int:
    """--num-threads, else the machine's cores shared evenly by the ranks started on it."""
    return config.num_threads or max(1, (os.cpu_count() or 1) // config.ranks_per_node)


def spawn_ranks(config: EngineConfig, ranks: range, addr: str, port: int) -> list[tuple[int, subprocess.Popen[bytes]]]:
    """Start `python -m kvpager.engine.tp_worker` for each rank of `ranks` (on this node), with torchrun's
    environment; returns (rank, process) pairs."""
    threads = threads_per_rank(config)
    worker_config = config_to_json(dataclasses.replace(config, num_threads=threads))
    first = config.node_rank * config.ranks_per_node
    n = config.tensor_parallel_size
    procs = []
    for rank in ranks:
        env = dict(os.environ, MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
        env.update(LOCAL_RANK=str(rank - first), LOCAL_WORLD_SIZE=str(config.ranks_per_node))
        env.update(GROUP_RANK=str(config.node_rank), OMP_NUM_THREADS=str(threads))
        env[CONFIG_ENV] = worker_config
        procs.append((rank, subprocess.Popen([sys.executable, "-m", "kvpager.engine.tp_worker"], env=env)))
    return procs


def exit_story(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class TensorParallelExecutor:
    """Starts node 0's ranks 1..L-1, joins the group as rank 0, broadcasts steps, watches every rank."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, device: torch.device) -> None:
        n = config.tensor_parallel_size
        if config.node_rank != 0:
            raise ValueError(
                f"--node-rank {config.node_rank} runs worker ranks only: start it with `kvpager serve --headless`"
            )
        layout_for(spec, n)  # NOTE: a layout that does not divide fails here, before any process starts
        addr, port = rendezvous_address(config)
        self.dead_reason: str | None = None
        self._stopping = False
        self._ranks_per_node = config.ranks_per_node
        threads = threads_per_rank(config)
        self.workers = [proc for _, proc in spawn_ranks(config, range(1, config.ranks_per_node), addr, port)]
        logger.info(
            "tensor parallel: %d ranks on %d node(s) over %s:%d (%s), %d threads each",
            n,
            config.nnodes,
            addr,
            port,
            backend_for(device),
            threads,
        )
        self._parallel: TensorParallel | None = None
        self._monitor = threading.Thread(target=self._watch, name="kvpager-tp-monitor", daemon=True)
        self._monitor.start()
        torch.set_num_threads(threads)
        try:
            self._parallel = init_rank(spec, 0, n, addr, port, device, config.distributed_timeout)
            check_agreement(self._parallel.store, config, n)
        except BaseException:
            self.abort()
            raise

    @property
    def parallel(self) -> TensorParallel:
        assert self._parallel is not None, "the executor joined no group"
        return self._parallel

    def broadcast_step(
        self, out: SchedulerOutput, sampled: dict[RequestId, int], store: ShardedTierStore | None
    ) -> None:
        """Send a step (with the tier work `store` queued) to every rank, then do rank 0's share of it."""
        ops = store.take_ops() if store is not None else TierOps()
        self.send_step(StepMessage(OP_STEP, out, sampled, ops))
        if store is not None and not ops.is_empty:
            store.run(ops)

    def send_tier_ops(self, ops: TierOps) -> None:
        """Broadcast tier work alone (no step): publishes, KV pack blocks, the persist at shutdown."""
        self.send_step(StepMessage(OP_STEP, tier_ops=ops))

    def send_step(self, message: StepMessage) -> None:
        """Broadcast one step message to every rank."""
        self.check_alive()
        try:
            self.parallel.broadcast_bytes(encode_step(message))
        except Exception as exc:
            raise self.failure(exc) from exc

    def failure(self, exc: BaseException) -> RuntimeError:
        """The error a failed step raises: the dead worker's story when there is one (the monitor may
        see the exit a moment after the collective failed, so it is given a while)."""
        deadline = time.monotonic() + HEARTBEAT_DEAD_S + 1.0
        while time.monotonic() < deadline:
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

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("%s; the engine is dead", reason)

    def _watch(self) -> None:
        """Monitor thread: a local worker that exits, or any rank whose heartbeat stops (once the group
        is up), kills the engine with the reason."""
        beats: dict[int, tuple[int, float]] = {}  # rank -> (last counter, when it last moved)
        while not self._stopping and self.dead_reason is None:
            for rank, proc in enumerate(self.workers, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    self._die(f"tensor-parallel worker rank {rank} (pid {proc.pid}) {exit_story(code)}")
                    return
            if self._parallel is not None:
                stale = self._stale_rank(beats)
                if stale is not None and not self._stopping:
                    self._die(stale)
                    return
            threading.Event().wait(MONITOR_INTERVAL_S)

    def _stale_rank(self, beats: dict[int, tuple[int, float]]) -> str | None:
        """The story of a rank whose heartbeat has not moved for HEARTBEAT_DEAD_S, else None."""
        store, now = self.parallel.store, time.monotonic()
        for rank in range(1, self.parallel.world_size):
            try:
                count = int(store.add(heartbeat_key(rank), 0))
            except Exception as exc:  # NOTE: rank 0 serves the store; failing to read it is not a rank's fault
                logger.warning("tensor parallel: could not read rank %d's heartbeat: %s", rank, exc)
                return None
            last = beats.get(rank)
            if last is None or count != last[0]:
                beats[rank] = (count, now)
            elif now - last[1] > HEARTBEAT_DEAD_S:
                node = rank // self._ranks_per_node
                return (
                    f"tensor-parallel worker rank {rank} (node {node}) sent no heartbeat for "
                    f"{now - last[1]:.1f} s: its process or node is gone"
                )
        return None

    def abort(self) -> None:
        """Kill the workers and leave the group (start-up failed)."""
        self._stopping = True
        for proc in self.workers:
            proc.kill()
            proc.wait()


def build_store(
    config: EngineConfig,
    fingerprint: bytes,
    io: ModelRunner,
    device: torch.device,
    executor: TensorParallelExecutor | None,
) -> TieredBlockStore | ShardedTierStore | None:
    """The KV tiers below the pool: background copies with one rank; under tensor parallelism each
    rank's shards, moved in the steps rank 0 broadcasts (`kvstore/sharded.py`). None without tiers."""
    if executor is None:
        tiers = build_tiers(config, fingerprint)
        return TieredBlockStore(tiers, io, device) if tiers is not None else None
    rank = build_rank_kv(config, fingerprint, io, executor.parallel)
    if rank.tiers is None:
        return None
    return ShardedTierStore(rank, executor.send_tier_ops)


def sharded_block_io(
    executor: TensorParallelExecutor, io: ModelRunner, store: TieredBlockStore | ShardedTierStore | None
) -> ShardedBlockIO:
    """Rank 0's whole-block reads and writes (KV packs, imports) under tensor parallelism."""
    if isinstance(store, ShardedTierStore):
        return ShardedBlockIO(store.rank, executor.send_tier_ops, store)
    return ShardedBlockIO(RankKV(None, io, executor.parallel), executor.send_tier_ops, None)


def _free_port(addr: str) -> int:
    """A port free on `addr` now (the rendezvous binds it a moment later)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])

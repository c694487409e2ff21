"""A tensor-parallel worker: one of ranks 1..N-1 of `--tensor-parallel-size N` (docs/scale-out.md).

`python -m kvpager.engine.tp_worker` with torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK) and the engine's configuration as JSON in KVPAGER_TP_CONFIG. Node 0's
engine starts its local ones, a headless node (`engine/tp_node.py`) its own; the address is node 0's
from the flags, never assumed local. Each worker joins the group (a master it cannot reach within
--distributed-timeout is a clear error and exit 1), loads its shard, allocates its shard of the KV
pool (the block count agreed with every rank), then runs every step rank 0 broadcasts (its share of
the step's KV tier work first) until told to stop, then writes what its shared-store writer holds. A heartbeat thread tells rank 0 it is alive; the
worker exits when rank 0 goes away (a failed collective or heartbeat, or a parent that is gone).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import torch

from kvpager.core.step_codec import OP_STOP, decode_step
from kvpager.engine.executor import (
    CONFIG_ENV,
    HEARTBEAT_INTERVAL_S,
    RendezvousError,
    agree_with_rank0,
    config_from_json,
    heartbeat_key,
    init_rank,
    rank0_fingerprint,
)
from kvpager.engine.loading import build_runner, load, model_spec_of, resolve_device
from kvpager.kvstore.shard_ops import run_tier_ops
from kvpager.kvstore.sharded import build_rank_kv

logger = logging.getLogger("kvpager")

# A worker waits for rank 0's next step as long as the engine is idle; it leaves when rank 0 does.
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
PARENT_CHECK_S = 0.5


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s tp-worker %(levelname)s %(message)s")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = config_from_json(os.environ[CONFIG_ENV])
    _exit_with_parent(os.getppid())
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        # NOTE: the rendezvous is bounded by --distributed-timeout; waiting for the next step is not
        parallel = init_rank(
            model_spec_of(config), rank, world_size, addr, port, device, config.distributed_timeout, IDLE_TIMEOUT_S
        )
    except RendezvousError as exc:
        print(f"kvpager tp-worker: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    _heartbeat(parallel.store, rank)
    disagreement = agree_with_rank0(parallel.store, config, rank)
    if disagreement is not None:
        print(f"kvpager tp-worker: error: {disagreement}", file=sys.stderr, flush=True)
        sys.exit(1)
    lm = load(config, parallel)
    runner = build_runner(lm, config, parallel)
    fingerprint = rank0_fingerprint(parallel.store)  # NOTE: shard records name the model as rank 0 does
    kv = build_rank_kv(config, fingerprint, runner, parallel)  # NOTE: this rank's shards only
    try:
        while True:
            message = decode_step(parallel.broadcast_bytes(None))
            if message.op == OP_STOP:
                break
            runner.apply_sampled(message.sampled)
            if not message.tier_ops.is_empty:
                run_tier_ops(kv, message.tier_ops)
            if message.output is not None:  # NOTE: None: tier work only (publishes, packs, the persist)
                runner.execute(message.output)
    finally:
        if kv.writer is not None:
            kv.writer.close()  # NOTE: what is queued for the shared store is written before exiting


def _heartbeat(store: Any, rank: int) -> None:
    """Bump this rank's counter in rank 0's store every HEARTBEAT_INTERVAL_S (rank 0 watches it); exit
    when the store is gone (rank 0's process or node is)."""

    def beat() -> None:
        key = heartbeat_key(rank)
        while True:
            try:
                store.add(key, 1)
            except Exception as exc:
                print(f"kvpager tp-worker rank {rank}: rank 0 is gone ({exc}); exiting", file=sys.stderr, flush=True)
                os._exit(1)
            threading.Event().wait(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=beat, name="kvpager-tp-heartbeat", daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    """When the process that started this worker is gone (os.getppid changes), exit at once."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="kvpager-tp-parent", daemon=True).start()


if __name__ == "__main__":
    main()

"""A tensor-parallel worker: ranks 1..N-1 of `--tensor-parallel-size N` (docs/scale-out.md).

`python -m kvpager.engine.tp_worker` with torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, LOCAL_RANK) and the engine's configuration as JSON in KVPAGER_TP_CONFIG. The engine
starts these itself; nothing here assumes they share its machine. Each worker loads its shard,
allocates its shard of the KV pool (the block count agreed with every rank), then runs every step
rank 0 broadcasts until told to stop. It exits when rank 0 goes away (a failed collective, or on
the engine's machine a parent that is gone).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from kvpager.core.step_codec import OP_STOP, decode_step
from kvpager.engine.executor import CONFIG_ENV, config_from_json, init_rank
from kvpager.engine.loading import load, model_spec_of, resolve_device
from kvpager.worker.runner import ModelRunner

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
    parallel = init_rank(
        model_spec_of(config),
        rank,
        world_size,
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        device,
        IDLE_TIMEOUT_S,
    )
    lm = load(config, parallel)
    runner = ModelRunner(
        lm.model,
        lm.spec,
        num_blocks=lm.pool.num_blocks,
        block_size=config.block_size,
        kv_dtype=lm.kv_dtype,
        device=lm.device,
        eos_token_ids=(),
        fp32_matmul_precision=config.fp32_matmul_precision,
        parallel=parallel,
    )
    while True:
        message = decode_step(parallel.broadcast_bytes(None))
        if message.op == OP_STOP or message.output is None:
            break
        runner.apply_sampled(message.sampled)
        runner.execute(message.output)


def _exit_with_parent(parent_pid: int) -> None:
    """When the process that started this worker is gone (os.getppid changes), exit at once."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            threading.Event().wait(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="kvpager-tp-parent", daemon=True).start()


if __name__ == "__main__":
    main()

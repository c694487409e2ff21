"""The scheduler's one channel to the runner, prefill-only requests, and waiting for a tier load.

Torch-free: the fake runner of test_scheduler.py keeps its tables and tokens from the SchedulerOutput
diffs alone and "samples" from what it reads back from its slots, so a wrong diff, a wrong shared
block or a wrongly loaded block changes the generated tokens, which are compared with a reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

from test_scheduler import SEED, FakeRunner, add, make, reference, run_all, shape, step

from kvpager.core.hashing import BlockHash, RequestId
from kvpager.core.kv_cache_manager import KVCacheManager
from kvpager.core.request import Request, RequestStatus
from kvpager.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


def wire_ints(out: SchedulerOutput) -> int:
    """How many integers a step sends to the runner."""
    per_step = sum(3 + len(s.new_block_ids) for s in out.scheduled)
    new = sum(1 + len(n.prompt_token_ids) + len(n.block_ids) for n in out.new_requests)
    return per_step + new + len(out.preempted_ids) + len(out.finished_ids)


def test_decode_steps_carry_no_block_ids_unless_a_block_was_allocated() -> None:
    sched, runner = make(num_blocks=64, block_size=4, budget=64)
    prompt = list(range(40))
    add(sched, "a", prompt, max_tokens=40)
    first = step(sched, runner)
    assert [n.block_ids for n in first.new_requests] == [tuple(range(10))]
    assert first.scheduled[0].new_block_ids == ()  # the table came with the new request
    sizes = set()
    for _ in range(38):
        out = step(sched, runner)
        (scheduled,) = out.scheduled
        crosses = scheduled.start_position % 4 == 0  # the position starts a new block
        assert out.new_requests == () and len(scheduled.new_block_ids) == (1 if crosses else 0)
        sizes.add(wire_ints(out))
    assert sizes == {3, 4}, "a decode step's size must not grow with the context (40 -> 78 tokens)"
    run_all(sched, runner)
    runner.execute(sched.schedule())  # an empty step still carries the finished ids
    assert runner.tables == {} and runner.tokens == {}


def test_runner_state_follows_preemption_and_resumption_from_the_diffs() -> None:
    sched, runner = make(num_blocks=4, caching=False)
    a = add(sched, "a", [1, 2, 3, 4], max_tokens=6)
    b = add(sched, "b", [9, 8, 7, 6], max_tokens=6)
    outputs = run_all(sched, runner)
    first = next(i for i, out in enumerate(outputs) if out.preempted_ids)
    (victim,) = outputs[first].preempted_ids
    resumed = next(s for out in outputs[first + 1 :] for s in out.scheduled if s.request_id == victim)
    assert resumed.start_position == 0 and len(resumed.new_block_ids) >= 2  # the whole new table
    assert a.output_token_ids == reference([1, 2, 3, 4], 6)
    assert b.output_token_ids == reference([9, 8, 7, 6], 6)
    runner.execute(sched.schedule())
    assert runner.tables == {} and runner.tokens == {}


def prefill_only(sched: Scheduler, request_id: str, prompt: list[int]) -> Request:
    request = Request(RequestId(request_id), list(prompt), SimpleNamespace(max_tokens=1), prefill_only=True)
    sched.add_request(request)
    return request


def test_prefill_only_request_shares_the_batch_and_holds_its_blocks_until_finished() -> None:
    sched, runner = make(num_blocks=16, budget=8)
    a = add(sched, "a", [7, 7], max_tokens=8)
    step(sched, runner)
    prompt = list(range(20, 32))  # 3 full blocks
    export = prefill_only(sched, "export", prompt)
    shapes = []
    while export.status is not RequestStatus.PREFILLED:
        shapes.append(shape(step(sched, runner)))
    assert shapes == [[("a", 2, 1, True), ("export", 0, 7, False)], [("a", 3, 1, True), ("export", 7, 5, False)]]
    table = sched.kv_manager.block_ids(RequestId("export"))
    assert len(table) == 3 and export not in sched.running
    assert [runner.slots[b * 4 + j] for b in table for j in range(4)] == prompt
    again = prefill_only(sched, "again", prompt)  # every full block is cached: no token to compute
    out = step(sched, runner)
    assert again.status is RequestStatus.PREFILLED and [s.request_id for s in out.scheduled] == ["a"]
    assert sched.kv_manager.block_ids(RequestId("again")) == table
    for request_id in ("export", "again"):
        sched.finish_request(RequestId(request_id), RequestStatus.FINISHED_STOPPED)
    run_all(sched, runner)
    assert a.output_token_ids == reference([7, 7], 8)
    assert sched.kv_manager.block_pool.num_owned_blocks == 0


class FakeStore:
    """A slower tier for the fake runner: keeps evicted blocks' tokens; loads finish when told to."""

    def __init__(self, runner: FakeRunner) -> None:
        self.runner = runner
        self.saved: dict[BlockHash, list[int | None]] = {}
        self.pending: dict[int, list[tuple[BlockHash, int]]] = {}
        self.finished: dict[int, int] = {}

    def _slots(self, block_id: int) -> range:
        size = self.runner.block_size
        return range(block_id * size, (block_id + 1) * size)

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.saved

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        self.saved[block_hash] = [self.runner.slots[i] for i in self._slots(block_id)]

    def start_load(self, job_id: int, blocks: Sequence[tuple[BlockHash, int]]) -> None:
        self.pending[job_id] = list(blocks)

    def complete(self) -> None:
        for job_id, blocks in self.pending.items():
            for block_hash, block_id in blocks:
                for slot, token in zip(self._slots(block_id), self.saved[block_hash], strict=True):
                    self.runner.slots[slot] = token
            self.finished[job_id] = len(blocks)
        self.pending = {}

    def start_lookup(self, job_id: int, hashes: Sequence[BlockHash]) -> bool:
        return False  # NOTE: an in-memory store answers `contains` at once

    def finished_loads(self) -> dict[int, int]:
        finished, self.finished = self.finished, {}
        return finished

    def wait_for_loads(self, timeout: float) -> None:
        pass


def make_tiered(num_blocks: int) -> tuple[Scheduler, FakeRunner, FakeStore]:
    runner = FakeRunner(num_blocks, 4)
    store = FakeStore(runner)
    kv = KVCacheManager(4, num_blocks, hash_seed=SEED, store=store)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512, block_size=4)
    return Scheduler(config, kv), runner, store


def test_request_waits_for_its_prefix_load_while_others_keep_stepping() -> None:
    sched, runner, store = make_tiered(num_blocks=8)
    shared = list(range(100, 112))  # 3 full blocks
    add(sched, "first", shared + [1], max_tokens=2)
    run_all(sched, runner)
    add(sched, "filler", list(range(200, 228)), max_tokens=2)  # the whole pool: pushes the shared ones out
    run_all(sched, runner)
    assert len(store.saved) >= 3
    other = add(sched, "other", [5, 6, 7], max_tokens=6)
    step(sched, runner)
    late = add(sched, "late", shared + [9], max_tokens=3)
    out = step(sched, runner)
    assert late.status is RequestStatus.WAITING_FOR_REMOTE_KVS and shape(out) == [("other", 3, 1, True)]
    assert sched.num_waiting == 1 and sched.num_loading == 1
    for position in (4, 5):  # the load is slow: the other request keeps decoding
        assert shape(step(sched, runner)) == [("other", position, 1, True)]
    store.complete()
    out = step(sched, runner)
    assert ("late", 12, 1, True) in shape(out) and late.num_cached_tokens == 12
    run_all(sched, runner)
    assert late.output_token_ids == reference(shared + [9], 3)
    assert other.output_token_ids == reference([5, 6, 7], 6)
    assert sched.kv_manager.block_pool.num_owned_blocks == 0


def test_aborting_a_request_during_its_load_frees_the_blocks_once_the_load_is_done() -> None:
    sched, runner, store = make_tiered(num_blocks=8)
    shared = list(range(100, 112))
    add(sched, "first", shared + [1], max_tokens=2)
    run_all(sched, runner)
    add(sched, "filler", list(range(200, 228)), max_tokens=2)
    run_all(sched, runner)
    add(sched, "late", shared + [9], max_tokens=3)
    step(sched, runner)
    assert sched.num_loading == 1
    pool = sched.kv_manager.block_pool
    held = pool.num_owned_blocks
    sched.abort_request(RequestId("late"))
    step(sched, runner)
    assert pool.num_owned_blocks == held, "blocks being written by a load must not be reused"
    store.complete()
    step(sched, runner)
    assert pool.num_owned_blocks == 0 and not sched.has_unfinished()

"""Liveness and leaks around prefix loads from a slower KV tier (WAITING_FOR_REMOTE_KVS).

Torch-free and deterministic: the scheduler and KV manager run against the fake runner of
test_scheduler.py and a fake tier whose loads complete a chosen number of steps after they start,
or fail part-way. The driver is the engine's loop (step while `has_unfinished()`); after every step
`kvpager.core.invariants` checks the pool's ref counts and where each request sits, and at the end
every request must have finished (or been aborted) within a bounded number of steps with no block
left owned. Generated tokens are compared with a plain reference loop, so a wrongly loaded or reused
block shows up as a wrong token.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from test_scheduler import SEED, FakeRunner, add, reference, step

from kvpager.core.hashing import BlockHash, RequestId, hash_prompt_blocks
from kvpager.core.invariants import check_scheduler
from kvpager.core.kv_cache_manager import KVCacheManager
from kvpager.core.request import Request, RequestStatus
from kvpager.core.scheduler import Scheduler, SchedulerConfig

BLOCK = 4


class SlowStore:
    """A slower tier: keeps evicted blocks' tokens; a load completes `delay` steps after it starts.

    A load stops at a hash in `bad` (a corrupt record) or one it does not hold, like the real store.
    """

    def __init__(self, runner: FakeRunner, delay: int = 1, rng: random.Random | None = None) -> None:
        self.runner = runner
        self.delay = delay
        self.rng = rng  # when set, each load's delay is drawn from 0..delay and some loads fail
        self.saved: dict[BlockHash, list[int | None]] = {}
        self.bad: set[BlockHash] = set()
        self.pending: dict[int, tuple[int, list[tuple[BlockHash, int]]]] = {}  # job id -> (steps left, blocks)
        self.finished: dict[int, int] = {}
        self.loads_started = 0
        self.loads_failed = 0
        self.aborted_in_load = 0  # counted by the random driver

    def _slots(self, block_id: int) -> range:
        return range(block_id * BLOCK, (block_id + 1) * BLOCK)

    def seed(self, tokens: list[int]) -> None:
        """Hold the full blocks of `tokens`, as if an earlier request's blocks had been evicted here."""
        for index, block_hash in enumerate(hash_prompt_blocks(SEED, tokens, BLOCK)):
            self.saved[block_hash] = list(tokens[index * BLOCK : (index + 1) * BLOCK])

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.saved

    def start_lookup(self, job_id: int, hashes: Sequence[BlockHash]) -> bool:
        return False  # a local tier: `contains` answers at once

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        self.saved[block_hash] = [self.runner.slots[i] for i in self._slots(block_id)]

    def start_load(self, job_id: int, blocks: Sequence[tuple[BlockHash, int]]) -> None:
        self.loads_started += 1
        delay = self.delay if self.rng is None else self.rng.randint(0, self.delay)
        if self.rng is not None and self.rng.random() < 0.15:
            self.bad.add(self.rng.choice(list(blocks))[0])
        self.pending[job_id] = (delay, list(blocks))

    def tick(self) -> None:
        """One engine step passes: loads whose delay is over complete."""
        for job_id, (steps_left, blocks) in list(self.pending.items()):
            if steps_left > 0:
                self.pending[job_id] = (steps_left - 1, blocks)
            else:
                del self.pending[job_id]
                self.finished[job_id] = self._fill(blocks)

    def _fill(self, blocks: list[tuple[BlockHash, int]]) -> int:
        for index, (block_hash, block_id) in enumerate(blocks):
            if block_hash in self.bad or block_hash not in self.saved:
                self.loads_failed += 1
                return index
            for slot, token in zip(self._slots(block_id), self.saved[block_hash], strict=True):
                self.runner.slots[slot] = token
        return len(blocks)

    def finished_loads(self) -> dict[int, int]:
        finished, self.finished = self.finished, {}
        return finished

    def wait_for_loads(self, timeout: float) -> None:
        pass


def make(
    num_blocks: int, delay: int = 1, max_seqs: int = 4, budget: int = 64, rng: random.Random | None = None
) -> tuple[Scheduler, FakeRunner, SlowStore]:
    runner = FakeRunner(num_blocks, BLOCK)
    store = SlowStore(runner, delay, rng)
    kv = KVCacheManager(BLOCK, num_blocks, hash_seed=SEED, store=store)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=512, block_size=BLOCK)
    return Scheduler(config, kv), runner, store


def one_step(sched: Scheduler, runner: FakeRunner, store: SlowStore) -> None:
    store.tick()
    step(sched, runner)
    assert check_scheduler(sched) == []


def drive(sched: Scheduler, runner: FakeRunner, store: SlowStore, max_steps: int = 200) -> int:
    """The engine's loop: step while the scheduler has work; fails when it stops making progress."""
    steps = 0
    while sched.has_unfinished():
        if steps >= max_steps:
            where = {rid: r.status.value for rid, r in sched.requests.items()}
            pytest.fail(
                f"no progress after {max_steps} steps: {where}, {sched.kv_manager.block_pool.num_free_blocks} free"
            )
        one_step(sched, runner, store)
        steps += 1
    return steps


def assert_clean(sched: Scheduler) -> None:
    pool = sched.kv_manager.block_pool
    assert check_scheduler(sched) == []
    assert pool.num_owned_blocks == 0, f"{pool.num_owned_blocks} blocks still owned after every request ended"
    assert not sched.requests and not sched.loading and not sched.kv_manager.has_pending_loads()


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_completed_loads_behind_a_blocked_head_are_released_when_nothing_runs() -> None:
    # 8 blocks. "big" (21 tokens: 6 blocks) finds 1 block in the tier, "small" (13 tokens) finds 3. Both
    # loads complete; "big" is first in line and needs 5 more blocks, but only 4 are free: "small" holds
    # 3 for its completed load and nothing runs that could free any. Released, they stay in the prefix
    # cache (or go back to the tier), and both requests finish.
    sched, runner, store = make(num_blocks=8)
    big, small = tokens(100, 21), tokens(300, 13)
    store.seed(big[:4])
    store.seed(small[:12])
    a = add(sched, "big", big, max_tokens=2)
    b = add(sched, "small", small, max_tokens=2)
    one_step(sched, runner, store)
    assert a.status is b.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    drive(sched, runner, store, max_steps=50)
    assert a.output_token_ids == reference(big, 2) and b.output_token_ids == reference(small, 2)
    assert_clean(sched)


def test_a_load_cancelled_by_an_abort_frees_its_blocks_when_no_request_is_left() -> None:
    # The engine steps only while it has work: an aborted request's load is still being written, so its
    # blocks can only be freed by a later step, which must happen even though no request is left.
    sched, runner, store = make(num_blocks=8, delay=3)
    prompt = tokens(100, 13)
    store.seed(prompt[:12])
    add(sched, "late", prompt, max_tokens=2)
    one_step(sched, runner, store)
    assert sched.num_loading == 1 and sched.kv_manager.block_pool.num_owned_blocks == 3
    sched.abort_request(RequestId("late"))
    assert sched.kv_manager.block_pool.num_owned_blocks == 3, "blocks being written by a load must not be reused"
    drive(sched, runner, store, max_steps=10)
    assert_clean(sched)


def test_a_failed_load_is_recomputed_and_the_request_finishes_exactly() -> None:
    sched, runner, store = make(num_blocks=8)
    prompt = tokens(100, 13)
    store.seed(prompt[:12])
    store.bad.add(hash_prompt_blocks(SEED, prompt, BLOCK)[1])  # the 2nd record is corrupt
    request = add(sched, "r", prompt, max_tokens=3)
    drive(sched, runner, store, max_steps=20)
    assert store.loads_failed == 1 and request.num_cached_tokens == 4  # the 1st block loaded, the rest computed
    assert request.output_token_ids == reference(prompt, 3)
    assert_clean(sched)


def test_abort_after_the_load_completed_but_before_admission_frees_the_held_blocks() -> None:
    sched, runner, store = make(num_blocks=8)
    first, loaded_prompt = tokens(500, 17), tokens(100, 13)
    store.seed(loaded_prompt[:12])
    add(sched, "first", first, max_tokens=8)  # 5 of the 8 blocks, growing to 6
    one_step(sched, runner, store)
    add(sched, "loaded", loaded_prompt, max_tokens=2)  # 2 of its 3 blocks fit beside "first"'s
    for _ in range(3):
        one_step(sched, runner, store)
    loaded = sched.requests[RequestId("loaded")]
    assert loaded.status is RequestStatus.WAITING and sched.kv_manager.has_load(loaded.request_id)
    assert len(sched.kv_manager.loading_block_ids(loaded.request_id)) == 2  # loaded, held, not yet admitted
    sched.abort_request(loaded.request_id)
    assert check_scheduler(sched) == []
    assert sched.kv_manager.block_pool.num_owned_blocks == len(sched.kv_manager.block_ids(RequestId("first")))
    drive(sched, runner, store)
    assert_clean(sched)


def test_a_request_preempted_under_a_small_pool_reloads_its_prefix_and_finishes_exactly() -> None:
    sched, runner, store = make(num_blocks=8, delay=2)
    prompts = {"a": tokens(100, 9), "b": tokens(200, 9), "c": tokens(300, 9)}
    requests = [add(sched, name, prompt, max_tokens=12) for name, prompt in prompts.items()]
    drive(sched, runner, store, max_steps=300)
    assert sched.num_preemptions > 0 and store.loads_started > 0
    for request in requests:
        assert request.output_token_ids == reference(prompts[request.request_id], 12)
    assert_clean(sched)


class _Params:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens


def random_run(seed: int) -> tuple[SlowStore, Scheduler]:
    """120 steps of random arrivals (shared prefixes), aborts (mostly of requests in a load), loads
    that take 0..3 steps or fail part-way, and a pool small enough to preempt; then drained."""
    rng = random.Random(seed)
    sched, runner, store = make(
        rng.randint(6, 12), delay=3, max_seqs=rng.randint(1, 4), budget=rng.choice((8, 16, 64)), rng=rng
    )
    families = [tokens(1000 * (f + 1), 8) for f in range(3)]  # 2 shared blocks each
    requests: dict[str, Request] = {}
    aborted: set[str] = set()
    for t in range(120):
        if rng.random() < 0.35:
            prompt = rng.choice(families) + [rng.randrange(3, 900) for _ in range(rng.randint(1, 9))]
            requests[f"r{t}"] = Request(RequestId(f"r{t}"), prompt, _Params(rng.randint(1, 6)))
            sched.add_request(requests[f"r{t}"])
        if sched.requests and rng.random() < 0.12:
            pool = list(sched.loading) if sched.loading and rng.random() < 0.6 else list(sched.requests)
            victim = rng.choice(pool)
            store.aborted_in_load += victim in sched.loading
            sched.abort_request(victim)
            aborted.add(victim)
        one_step(sched, runner, store)
    drive(sched, runner, store, max_steps=400)
    assert_clean(sched)
    for rid, request in requests.items():
        if rid not in aborted:
            assert request.status is RequestStatus.FINISHED_LENGTH
            assert request.output_token_ids == reference(request.prompt_token_ids, request.max_tokens)
    return store, sched


def test_random_interleavings_of_loads_aborts_and_preemption_end_with_every_request_done_and_no_block_owned() -> None:
    coverage = {"loads": 0, "failed": 0, "aborted_in_load": 0, "preemptions": 0}
    for seed in range(24):
        try:
            store, sched = random_run(seed)
        except BaseException as exc:
            raise AssertionError(f"random interleaving, seed {seed}: {exc}") from exc
        coverage["loads"] += store.loads_started
        coverage["failed"] += store.loads_failed
        coverage["aborted_in_load"] += store.aborted_in_load
        coverage["preemptions"] += sched.num_preemptions
    # the runs must have driven the paths under test
    assert coverage["loads"] >= 200 and coverage["failed"] >= 50, coverage
    assert coverage["aborted_in_load"] >= 20 and coverage["preemptions"] >= 20, coverage

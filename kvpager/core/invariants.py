"""Consistency checks of the scheduler, the KV manager and the block pool, for tests and debugging. Torch-free.

`check_scheduler(scheduler)` returns what is wrong (an empty list when nothing is), reading only
public views, O(blocks + requests). What it checks:
- every block's ref count equals the references held for it (block tables, prefix loads, also
  cancelled ones still being written) plus the pool's pins; a block is in the free queue exactly
  when its ref count is 0; the prefix cache's hash -> block map agrees with the blocks;
- every request the scheduler knows sits in exactly one place that matches its status (running,
  waiting, waiting for its prefix load, prefilled), and a request waiting for its prefix load has a
  load (so it cannot be stranded there);
- the KV manager holds blocks only for requests the scheduler knows.
"""

from __future__ import annotations

from collections import Counter

from kvpager.core.hashing import RequestId
from kvpager.core.request import RequestStatus
from kvpager.core.scheduler import Scheduler

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def check_pool(scheduler: Scheduler) -> list[str]:
    """Ref counts, the free queue and the prefix cache's map against the references held."""
    manager = scheduler.kv_manager
    pool = manager.block_pool
    problems: list[str] = []
    expected = Counter(manager.held_references())
    for block_id, pins in pool.pins().items():
        expected[block_id] += pins
    free = set(pool.free_block_ids())
    if len(free) != pool.num_free_blocks:
        problems.append(f"free queue lists {len(free)} distinct blocks but counts {pool.num_free_blocks}")
    for block_id, ref_cnt in enumerate(pool.ref_counts()):
        if ref_cnt != expected[block_id]:
            problems.append(f"block {block_id}: ref count {ref_cnt}, but {expected[block_id]} references are held")
        if (ref_cnt == 0) != (block_id in free):
            problems.append(f"block {block_id}: ref count {ref_cnt} but {'' if block_id in free else 'not '}free")
    hashes = pool.hashes()
    for block_hash, block_id in pool.cached_blocks():
        if hashes[block_id] != block_hash:
            problems.append(f"block {block_id}: the prefix cache maps a hash to it that it does not hold")
    num_cached = sum(1 for block_hash in hashes if block_hash is not None)
    if num_cached != pool.num_cached_blocks:
        problems.append(f"{num_cached} blocks hold a hash but the prefix cache maps {pool.num_cached_blocks}")
    return problems


def check_requests(scheduler: Scheduler) -> list[str]:
    """Each request in exactly one place, matching its status; no blocks held for unknown requests."""
    manager = scheduler.kv_manager
    problems: list[str] = []
    places: Counter[RequestId] = Counter()
    for request in scheduler.running:
        places[request.request_id] += 1
        if request.status is not RequestStatus.RUNNING:
            problems.append(f"{request.request_id}: in the running list but {request.status.value}")
    for request in scheduler.waiting:
        places[request.request_id] += 1
        if request.status not in _WAITING:
            problems.append(f"{request.request_id}: in the waiting queue but {request.status.value}")
    for request_id, (request, _) in scheduler.loading.items():
        places[request_id] += 1
        if request.status is not RequestStatus.WAITING_FOR_REMOTE_KVS:
            problems.append(f"{request_id}: waiting for its prefix load but {request.status.value}")
        if not manager.has_load(request_id):
            problems.append(f"{request_id}: waiting for its prefix load, but no load is in flight for it")
    for request_id, request in scheduler.requests.items():
        expected = 0 if request.status is RequestStatus.PREFILLED else 1
        if places[request_id] != expected:
            problems.append(f"{request_id} ({request.status.value}) is in {places[request_id]} places, not {expected}")
    for stray in places.keys() - scheduler.requests.keys():
        problems.append(f"{stray}: queued but unknown to the scheduler (finished or aborted)")
    for request_id, blocks in manager.block_tables().items():
        if blocks and request_id not in scheduler.requests:
            problems.append(f"{request_id}: holds {len(blocks)} blocks but is unknown to the scheduler")
    return problems


def check_scheduler(scheduler: Scheduler) -> list[str]:
    """Every check above; an empty list when the state is consistent."""
    return check_pool(scheduler) + check_requests(scheduler)

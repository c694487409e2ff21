"""Scheduler: continuous batching with chunked prefill and recompute preemption. Torch-free.

Each step spends a token budget (`max_num_batched_tokens`) over at most `max_num_seqs` sequences:
1. RUNNING requests, in admission order, get their uncomputed tokens (a decode is 1 token; a
   partially prefilled prompt continues). When one cannot get blocks, the most recently admitted
   running request is preempted (possibly itself) and the allocation retried.
2. WAITING requests, front first, are admitted while budget, sequence slots and blocks allow; a
   prompt longer than the budget left is scheduled in part (chunked prefill). No request is
   admitted in a step that preempted one (as in vLLM v1). A request whose prefix continues in a
   slower KV tier leaves the queue as WAITING_FOR_REMOTE_KVS while the tier loads it in the
   background, and returns to the front once the load completes (`KVCacheManager.poll_loads`).
A prefill-only request (KV export) is scheduled like any other but samples nothing; once its prompt
is computed it leaves the batch as PREFILLED, holding its blocks until its owner finishes it.
The runner receives a frozen `SchedulerOutput` (new requests once, then per-step diffs) and hands
back sampled token ids.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from kvpager.core.hashing import RequestId
from kvpager.core.kv_cache_manager import KVCacheManager, cdiv
from kvpager.core.request import Request, RequestStatus


class SchedulerLimits(Protocol):
    """What the scheduler reads: a `SchedulerConfig` or an `EngineConfig`.

    `max_model_len=None` means only the pool's size limits a request's length.
    """

    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def max_model_len(self) -> int | None: ...
    @property
    def block_size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduler limits with `max_model_len` resolved (the engine builds it from `EngineConfig`)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    block_size: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the runner has not seen: sent once, in the step that first schedules it."""

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    sampling_params: Any  # frozen (`SamplingParams`); opaque to the scheduler
    block_ids: tuple[int, ...]  # its block table at admission (prefix-cache hits + new blocks)


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One sequence's share of a step: compute `num_tokens` positions from `start_position` on.

    The runner knows the tokens (the prompt it was sent plus the tokens it sampled) and the block
    table (the ids it was sent plus `new_block_ids`), so a step's size never grows with context.
    """

    request_id: RequestId
    num_tokens: int  # positions computed this step
    start_position: int  # = num_computed_tokens before the step
    new_block_ids: tuple[int, ...]  # appended to the block table (a resumed request: the whole table)
    needs_sample: bool  # the step reaches the last known token: its logits give the next token

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step, as plain frozen data (the only channel from scheduler to runner).

    Apply in this order: drop `finished_ids` (finished or aborted since the last step), clear the
    block tables of `preempted_ids` (their blocks were freed; sampling state is kept), add
    `new_requests`, then extend each scheduled request's table by its `new_block_ids`.
    """

    scheduled: tuple[ScheduledRequest, ...]
    new_requests: tuple[NewRequestData, ...] = ()
    preempted_ids: tuple[RequestId, ...] = ()
    finished_ids: tuple[RequestId, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int  # total since start
    kv_usage: float  # owned blocks / all blocks
    num_owned_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_evictions: int


class Scheduler:
    """Decides each step's batch. The engine calls add/abort/finish, schedule, update_from_output."""

    def __init__(
        self, config: SchedulerLimits, kv_manager: KVCacheManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if config.block_size != kv_manager.block_size:
            raise ValueError(f"block_size {config.block_size} differs from the KV manager's {kv_manager.block_size}")
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.kv_manager = kv_manager
        self.clock = clock
        self.requests: dict[RequestId, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # NOTE: admission order; the last one is preempted first
        # WAITING_FOR_REMOTE_KVS requests and the status they go back to once their load completes.
        self.loading: dict[RequestId, tuple[Request, RequestStatus]] = {}
        self.num_preemptions = 0
        self._finished_ids: list[RequestId] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests, including those waiting for their prefix to load from a KV tier."""
        return len(self.waiting) + len(self.loading)

    @property
    def num_loading(self) -> int:
        return len(self.loading)

    def has_unfinished(self) -> bool:
        """Requests not finished, or a load of an aborted request still holding blocks until the
        store finishes writing them (only a `schedule()` after that frees them: keep stepping)."""
        return bool(self.requests) or self.kv_manager.has_pending_loads()

    def add_request(self, request: Request) -> None:
        """Queue a new request; ValueError if it can never fit (context length or pool size)."""
        self._validate(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _validate(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use; pick a unique id")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty; it must contain at least one token")
        if any(not 0 <= t < 2**32 for t in request.prompt_token_ids):
            raise ValueError("prompt token ids must be in [0, 2**32)")
        num_prompt, max_tokens = request.num_prompt_tokens, request.max_tokens
        total = num_prompt + max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({num_prompt} in the prompt, {max_tokens} for the completion). "
                "Please reduce the length of the prompt or max_tokens."
            )
        num_blocks = cdiv(request.num_kv_positions, self.kv_manager.block_size)
        # NOTE: pinned blocks (KV packs) are never free, so a request larger than the rest would wait forever.
        num_usable = self.kv_manager.num_usable_blocks
        if num_blocks > num_usable:
            raise ValueError(
                f"The KV cache holds {num_usable * self.kv_manager.block_size} tokens "
                f"({num_usable} blocks{self._pinned_note()}). However, you requested {total} tokens ({num_prompt} in "
                f"the prompt, {max_tokens} for the completion). Reduce max_tokens or give the KV cache more memory."
            )

    def _pinned_note(self) -> str:
        num_pinned = self.kv_manager.block_pool.num_pinned_blocks
        return f" free for requests; {num_pinned} more are pinned by KV packs" if num_pinned else ""

    def schedule(self) -> SchedulerOutput:
        """Build the next step's batch (running requests first, then waiting ones)."""
        self._resume_loaded()
        batch: list[ScheduledRequest] = []
        new: list[NewRequestData] = []
        preempted: list[RequestId] = []
        budget = self._schedule_running(self.max_num_batched_tokens, batch, preempted)
        if not preempted:  # NOTE: blocks are short this step; admitting now would only thrash
            self._schedule_waiting(budget, batch, new)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(tuple(batch), tuple(new), tuple(preempted), finished)

    def _resume_loaded(self) -> None:
        """Requests whose prefix load completed go back to the front of the waiting queue."""
        done = [self.loading.pop(rid) for rid in self.kv_manager.poll_loads() if rid in self.loading]
        for request, status in reversed(done):
            request.status = status
            self.waiting.appendleft(request)

    def _schedule_running(self, budget: int, batch: list[ScheduledRequest], preempted: list[RequestId]) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_block_ids = self._allocate_or_preempt(request, num_new, preempted)
            if new_block_ids is None:
                break  # it preempted itself: it was the last running request
            batch.append(self._scheduled(request, num_new, new_block_ids))
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted: list[RequestId]
    ) -> tuple[int, ...] | None:
        """Get blocks for `request`, preempting from the back of `running`; None if it went itself."""
        while (new_block_ids := self.kv_manager.allocate_slots(request, num_new)) is None:
            # NOTE: victims come from the back, so requests already in this step's batch are safe.
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None
        return tuple(new_block_ids)

    def _preempt(self, request: Request) -> None:
        """Free the blocks and requeue at the front; outputs are kept and recomputed with the prompt."""
        self.kv_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, budget: int, batch: list[ScheduledRequest], new: list[NewRequestData]) -> None:
        released = False
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            cached_blocks, num_cached = self.kv_manager.get_computed_blocks(request)
            if self.kv_manager.start_load(request, cached_blocks):
                # NOTE: the rest of its prefix is in a slower tier: it waits aside while others step.
                self.waiting.popleft()
                self.loading[request.request_id] = (request, request.status)
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                continue
            num_new = min(request.num_tokens - num_cached, budget)
            if self.kv_manager.allocate_slots(request, num_new, cached_blocks) is None:
                if not released and not self.running and self._release_loads_behind_head():
                    released = True
                    continue  # NOTE: retry the head once with the blocks those loads held
                break  # NOTE: first come, first served: no request overtakes the head
            self.waiting.popleft()
            is_new = request.status is RequestStatus.WAITING
            self._admit(request, num_cached)
            if num_new == 0:  # a prefill-only request whose whole prompt was cached
                self._finish_prefill(request)
                continue
            table = self.kv_manager.block_ids(request.request_id)
            if is_new:
                prompt = tuple(request.prompt_token_ids)
                new.append(NewRequestData(request.request_id, prompt, request.sampling_params, table))
            batch.append(self._scheduled(request, num_new, () if is_new else table))
            budget -= num_new

    def _release_loads_behind_head(self) -> bool:
        """Release the blocks that completed loads hold for requests behind the head of the queue.

        Called when the head cannot get blocks and nothing runs: nothing else would ever free them,
        and the head is admitted before those requests anyway. Their blocks stay cached (a later
        admission hits them, or their prefix loads again). Returns whether any were released.
        """
        released = False
        for request in itertools.islice(self.waiting, 1, None):
            released |= self.kv_manager.release_completed_load(request.request_id)
        return released

    def _admit(self, request: Request, num_cached: int) -> None:
        if request.status is RequestStatus.WAITING:  # first admission, not a resumed preemption
            request.num_cached_tokens = num_cached
            request.first_scheduled_time = self.clock()
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _finish_prefill(self, request: Request) -> None:
        """A prefill-only request is complete: it leaves the batch but keeps its blocks (PREFILLED)."""
        self.running.remove(request)
        request.status = RequestStatus.PREFILLED

    def _scheduled(self, request: Request, num_new: int, new_block_ids: tuple[int, ...]) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request_id=request.request_id,
            num_tokens=num_new,
            start_position=start,
            new_block_ids=new_block_ids,
            needs_sample=start + num_new == request.num_tokens and not request.prefill_only,
        )

    def update_from_output(self, output: SchedulerOutput, sampled: dict[RequestId, int]) -> list[Request]:
        """Advance computed counts and append sampled tokens; returns the requests that got a token.

        Stopping is the engine's call (`finish_request`). Requests finished or aborted since
        `schedule()` are skipped. A prefill-only request whose prompt is now computed becomes PREFILLED.
        """
        changed: list[Request] = []
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.num_computed_tokens != scheduled.start_position:
                continue
            request.num_computed_tokens += scheduled.num_tokens
            if request.prefill_only and request.num_computed_tokens == request.num_tokens:
                self._finish_prefill(request)
            if scheduled.needs_sample:
                if scheduled.request_id not in sampled:
                    raise ValueError(f"no sampled token for request {scheduled.request_id!r}, which needed one")
                self._append(request, sampled[scheduled.request_id])
                changed.append(request)
        return changed

    def _append(self, request: Request, token_id: int) -> None:
        if request.first_token_time is None:
            request.first_token_time = self.clock()
        request.append_output_token(token_id)

    def finish_request(self, request_id: RequestId, status: RequestStatus) -> Request | None:
        """Finish a request with a FINISHED_* status and free its blocks; None for an unknown id."""
        if not status.is_finished:
            raise ValueError(f"finish_request needs a FINISHED_* status, got {status}")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request_id in self.loading:
            del self.loading[request_id]
        elif request.status is not RequestStatus.PREFILLED:
            self.waiting.remove(request)
        self.kv_manager.free(request)  # NOTE: also cancels a load in flight (its blocks wait for it)
        request.status = status
        self._finished_ids.append(request_id)
        return request

    def abort_request(self, request_id: RequestId) -> Request | None:
        """Abort a waiting or running request (no-op returning None if it is unknown or finished)."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def stats(self) -> SchedulerStats:
        pool = self.kv_manager.block_pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            num_preemptions=self.num_preemptions,
            kv_usage=self.kv_manager.usage,
            num_owned_blocks=pool.num_owned_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            prefix_cache_queries=pool.queries,
            prefix_cache_hits=pool.hits,
            num_evictions=pool.evictions,
        )

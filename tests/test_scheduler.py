"""Scheduler with a fake runner: budgets, chunked prefill, prefix sharing, preemption, abort.

The fake runner keeps a token id per KV slot: it writes each step's tokens through the block tables
(all writes before any read, like every attention layer), then "samples" a token that is a pure
function of the context it *reads back from its slots*. A block shared or reused wrongly therefore
changes the generated tokens, which are compared with a plain reference loop.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpager.core.hashing import RequestId
from kvpager.core.kv_cache_manager import KVCacheManager
from kvpager.core.request import Request, RequestStatus
from kvpager.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

SEED = b"\x02" * 32


def next_token(context: list[int]) -> int:
    value = len(context)
    for token in context:
        value = (value * 31 + token) % 997
    return value


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeRunner:
    """Keeps its own tokens and block tables per request from the SchedulerOutput diffs alone."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.tokens: dict[RequestId, list[int]] = {}
        self.tables: dict[RequestId, list[int]] = {}
        self.step_tokens: dict[RequestId, tuple[int, ...]] = {}  # what the last step computed

    def slot(self, block_ids: list[int] | tuple[int, ...], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, out: SchedulerOutput) -> dict[RequestId, int]:
        for rid in out.finished_ids:
            self.tokens.pop(rid, None)
            self.tables.pop(rid, None)
        for rid in out.preempted_ids:
            self.tables[rid] = []
        for new in out.new_requests:
            self.tokens[new.request_id] = list(new.prompt_token_ids)
            self.tables[new.request_id] = list(new.block_ids)
        self.step_tokens = {}
        for s in out.scheduled:
            table = self.tables[s.request_id]
            table.extend(s.new_block_ids)
            tokens = self.tokens[s.request_id][s.start_position : s.start_position + s.num_tokens]
            assert len(tokens) == s.num_tokens
            self.step_tokens[s.request_id] = tuple(tokens)
            for offset, token in enumerate(tokens):
                self.slots[self.slot(table, s.start_position + offset)] = token
        sampled: dict[RequestId, int] = {}
        for s in out.scheduled:
            if s.needs_sample:
                end = s.start_position + s.num_tokens
                table = self.tables[s.request_id]
                context = [self.slots[self.slot(table, p)] for p in range(end)]
                assert None not in context
                sampled[s.request_id] = next_token([t for t in context if t is not None])
                self.tokens[s.request_id].append(sampled[s.request_id])
        return sampled


def make(
    num_blocks: int, block_size: int = 4, budget: int = 64, max_seqs: int = 8, caching: bool = True
) -> tuple[Scheduler, FakeRunner]:
    kv = KVCacheManager(block_size, num_blocks, enable_caching=caching, hash_seed=SEED)
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=512, block_size=block_size
    )
    return Scheduler(config, kv), FakeRunner(num_blocks, block_size)


def add(sched: Scheduler, request_id: str, prompt: list[int], max_tokens: int) -> Request:
    request = Request(RequestId(request_id), list(prompt), SimpleNamespace(max_tokens=max_tokens))
    sched.add_request(request)
    return request


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    """One engine step; finishes requests that reached max_tokens (the engine's job)."""
    out = sched.schedule()
    for request in sched.update_from_output(out, runner.execute(out)):
        if request.num_output_tokens >= request.max_tokens:
            sched.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    return out


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> list[SchedulerOutput]:
    outputs: list[SchedulerOutput] = []
    while sched.has_unfinished():
        assert len(outputs) < max_steps
        outputs.append(step(sched, runner))
    return outputs


def shape(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(s.request_id, s.start_position, s.num_tokens, s.needs_sample) for s in out.scheduled]


def test_prefill_then_decode_with_exact_block_tables() -> None:
    sched, runner = make(num_blocks=8)
    a = add(sched, "a", [1, 2, 3, 4, 5, 6], max_tokens=3)
    out = step(sched, runner)
    assert runner.step_tokens["a"] == (1, 2, 3, 4, 5, 6)
    assert shape(out) == [("a", 0, 6, True)] and runner.tables["a"] == [0, 1]
    out = step(sched, runner)
    assert runner.step_tokens["a"] == (a.output_token_ids[0],)
    assert shape(out) == [("a", 6, 1, True)] and runner.tables["a"] == [0, 1]
    out = step(sched, runner)
    assert shape(out) == [("a", 7, 1, True)]
    assert a.status is RequestStatus.FINISHED_LENGTH and a.output_token_ids == reference([1, 2, 3, 4, 5, 6], 3)
    assert sched.kv_manager.block_pool.num_owned_blocks == 0
    assert sched.schedule().finished_ids == ("a",)


def test_chunked_prefill_spreads_a_long_prompt_and_never_starves_a_decode() -> None:
    sched, runner = make(num_blocks=16, budget=8)
    add(sched, "a", [7, 7], max_tokens=10)
    step(sched, runner)
    add(sched, "b", list(range(20)), max_tokens=2)
    shapes = [shape(step(sched, runner)) for _ in range(4)]
    assert shapes == [
        [("a", 2, 1, True), ("b", 0, 7, False)],
        [("a", 3, 1, True), ("b", 7, 7, False)],
        [("a", 4, 1, True), ("b", 14, 6, True)],
        [("a", 5, 1, True), ("b", 20, 1, True)],
    ]


def test_budget_and_max_num_seqs_limit_admission() -> None:
    sched, runner = make(num_blocks=32, budget=10, max_seqs=2)
    for offset, name in enumerate("abc"):
        add(sched, name, [offset * 10 + t for t in range(6)], max_tokens=2)
    out = sched.schedule()
    assert shape(out) == [("a", 0, 6, True), ("b", 0, 4, False)]
    assert (sched.num_running, sched.num_waiting) == (2, 1)


def test_identical_prompts_admitted_together_share_blocks_and_match_the_reference() -> None:
    sched, runner = make(num_blocks=16)
    prompt = list(range(30, 40))
    a, b = add(sched, "a", prompt, 4), add(sched, "b", prompt, 4)
    out = step(sched, runner)
    assert shape(out) == [("a", 0, 10, True), ("b", 8, 2, True)]
    assert runner.tables["a"] == [0, 1, 2] and runner.tables["b"] == [0, 1, 3]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    run_all(sched, runner)
    assert a.output_token_ids == b.output_token_ids == reference(prompt, 4)
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_owned_blocks) == (20, 8, 0)


def test_a_prompt_waits_until_its_blocks_can_be_had_and_reuses_freed_blocks_lru() -> None:
    sched, runner = make(num_blocks=4)
    add(sched, "a", list(range(12)), max_tokens=1)  # 3 blocks: 0, 1, 2
    add(sched, "b", list(range(50, 58)), max_tokens=2)  # needs 2 blocks, only 1 free
    out = step(sched, runner)
    assert shape(out) == [("a", 0, 12, True)] and sched.num_waiting == 1
    out = step(sched, runner)  # a finished: its blocks were freed tail-first -> queue 3, 2, 1, 0
    assert shape(out) == [("b", 0, 8, True)] and runner.tables["b"] == [3, 2]
    assert sched.kv_manager.block_pool.free_block_ids() == [1, 0]
    assert sched.kv_manager.block_pool.evictions == 1  # block 2 held a's third full block


def test_out_of_blocks_preempts_the_most_recent_request_and_recompute_matches_reference() -> None:
    sched, runner = make(num_blocks=4, caching=False)
    a = add(sched, "a", [1, 2, 3, 4], max_tokens=6)
    b = add(sched, "b", [9, 8, 7, 6], max_tokens=6)
    step(sched, runner)  # a: block 0, b: block 1, both prefilled
    step(sched, runner)  # a: +block 2, b: +block 3
    for _ in range(3):
        step(sched, runner)
    out = step(sched, runner)  # both need a third block: b (admitted last) goes
    assert out.preempted_ids == ("b",) and shape(out) == [("a", 8, 1, True)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.waiting[0] is b and b.num_preemptions == 1
    run_all(sched, runner)
    assert a.output_token_ids == reference([1, 2, 3, 4], 6)
    assert b.output_token_ids == reference([9, 8, 7, 6], 6)
    assert sched.num_preemptions == 1 and sched.kv_manager.block_pool.num_owned_blocks == 0


def test_a_request_that_is_itself_the_most_recent_preempts_itself() -> None:
    sched, runner = make(num_blocks=3, caching=False)
    add(sched, "a", [1, 2, 3], max_tokens=1)  # finishes after its prefill
    b = add(sched, "b", [4, 5, 6, 7], max_tokens=6)
    c = add(sched, "c", [8, 9, 10, 11], max_tokens=6)
    step(sched, runner)  # a, b, c admitted; a finishes
    out = step(sched, runner)  # b takes the freed block; c needs one more: none left, c is last
    assert shape(out) == [("b", 4, 1, True)] and out.preempted_ids == ("c",)
    assert c.status is RequestStatus.PREEMPTED
    run_all(sched, runner)
    assert c.output_token_ids == reference([8, 9, 10, 11], 6) and b.output_token_ids == reference([4, 5, 6, 7], 6)


def test_no_request_is_admitted_in_a_step_that_preempted() -> None:
    sched, runner = make(num_blocks=4, budget=9, caching=False)
    a = add(sched, "a", [1, 2, 3, 4], max_tokens=6)
    b = add(sched, "b", [5, 6, 7, 8, 9, 10, 11, 12], max_tokens=4)
    assert shape(step(sched, runner)) == [("a", 0, 4, True), ("b", 0, 5, False)]
    assert shape(step(sched, runner)) == [("a", 4, 1, True), ("b", 5, 3, True)]  # a took the last block
    out = step(sched, runner)  # b needs a block: it preempts itself; its 8-token chunk would fit now
    assert out.preempted_ids == ("b",) and shape(out) == [("a", 5, 1, True)]
    assert sched.kv_manager.block_pool.num_free_blocks == 2
    run_all(sched, runner)
    assert a.output_token_ids == reference([1, 2, 3, 4], 6)
    assert b.output_token_ids == reference([5, 6, 7, 8, 9, 10, 11, 12], 4)


def test_abort_frees_every_block_of_running_and_waiting_requests() -> None:
    sched, runner = make(num_blocks=4, max_seqs=1)
    add(sched, "a", list(range(10)), max_tokens=5)
    add(sched, "b", list(range(10)), max_tokens=5)
    step(sched, runner)
    assert sched.kv_manager.block_pool.num_owned_blocks == 3
    assert sched.abort_request(RequestId("a")) is not None
    aborted = sched.abort_request(RequestId("b"))
    assert aborted is not None and aborted.status is RequestStatus.FINISHED_ABORTED
    assert sched.abort_request(RequestId("b")) is None
    assert sched.kv_manager.block_pool.num_owned_blocks == 0 and not sched.has_unfinished()
    assert sched.schedule().finished_ids == ("a", "b")


def test_requests_that_can_never_fit_are_rejected_with_the_lengths() -> None:
    sched, _ = make(num_blocks=4)
    with pytest.raises(ValueError) as info:
        add(sched, "long", [1] * 500, max_tokens=20)
    assert str(info.value).startswith(
        "This model's maximum context length is 512 tokens. However, you requested 520 tokens "
        "(500 in the prompt, 20 for the completion)."
    )
    with pytest.raises(ValueError, match=r"KV cache holds 16 tokens \(4 blocks\)"):
        add(sched, "big", [1] * 10, max_tokens=8)
    add(sched, "fits", [1] * 10, max_tokens=7)  # 16 positions need K/V: exactly the pool
    with pytest.raises(ValueError, match="already in use"):
        add(sched, "fits", [1], max_tokens=1)
    with pytest.raises(ValueError, match="empty"):
        add(sched, "empty", [], max_tokens=1)
    assert sched.num_waiting == 1


def check_step(sched: Scheduler, runner: FakeRunner, out: SchedulerOutput, before: list[RequestId]) -> None:
    """Invariants after one step (see docs/architecture.md)."""
    assert out.num_scheduled_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.max_num_seqs and sched.num_running <= sched.max_num_seqs
    assert all(s.num_tokens >= 1 for s in out.scheduled)
    # Running requests come first, in admission order; one is skipped only when the budget ran out.
    kept = [rid for rid in before if rid not in out.preempted_ids]
    ids = [s.request_id for s in out.scheduled]
    assert ids[: len(kept)] == kept or out.num_scheduled_tokens == sched.max_num_batched_tokens
    for request in sched.running:  # the runner's tables, kept from the diffs alone, are the scheduler's
        assert runner.tables[request.request_id] == list(sched.kv_manager.block_ids(request.request_id))
    pool = sched.kv_manager.block_pool
    free = pool.free_block_ids()
    tables = [sched.kv_manager.block_ids(r.request_id) for r in sched.running]
    for block_id in range(pool.num_blocks):
        owners = sum(table.count(block_id) for table in tables)
        assert pool.ref_cnt(block_id) == owners and (owners == 0) == (block_id in free)
    for request in sched.running:  # cached blocks hold the tokens their hash names
        table = sched.kv_manager.block_ids(request.request_id)
        for index in range(request.num_computed_tokens // runner.block_size):
            if pool.block_hash(table[index]) is not None:
                written = [
                    runner.slots[runner.slot(table, index * runner.block_size + j)] for j in range(runner.block_size)
                ]
                assert written == request.token_ids_between(index * runner.block_size, (index + 1) * runner.block_size)


@settings(max_examples=100, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=6),
    max_tokens=st.lists(st.integers(1, 8), min_size=6, max_size=6),
    num_blocks=st.integers(3, 10),
    budget=st.integers(1, 12),
    max_seqs=st.integers(1, 4),
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5)), max_size=3),
    caching=st.booleans(),
)
def test_random_workloads_keep_invariants_and_match_the_reference(
    prompts: list[list[int]],
    max_tokens: list[int],
    num_blocks: int,
    budget: int,
    max_seqs: int,
    aborts: list[tuple[int, int]],
    caching: bool,
) -> None:
    sched, runner = make(num_blocks, block_size=2, budget=budget, max_seqs=max_seqs, caching=caching)
    fits = [i for i, p in enumerate(prompts) if -(-(len(p) + max_tokens[i] - 1) // 2) <= num_blocks]
    requests = [add(sched, f"r{i}", prompts[i], max_tokens[i]) for i in fits]
    for step_index in range(500):
        if not sched.has_unfinished():
            break
        for when, which in aborts:
            if when == step_index and which < len(requests):
                sched.abort_request(requests[which].request_id)
        before = [r.request_id for r in sched.running]
        out = step(sched, runner)
        check_step(sched, runner, out, before)
    assert not sched.has_unfinished()
    assert sched.kv_manager.block_pool.num_owned_blocks == 0
    for request in requests:
        if request.status is RequestStatus.FINISHED_LENGTH:
            assert request.output_token_ids == reference(request.prompt_token_ids, request.max_tokens)
        else:
            assert request.status is RequestStatus.FINISHED_ABORTED

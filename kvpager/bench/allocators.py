"""KV allocators for the paging study (`kvpager bench memory`), all over one token budget. Torch-free.

- `SlotAllocator`: contiguous preallocation of `max_model_len` tokens per request slot (llama.cpp
  slots, Ollama): `budget // max_model_len` slots, each request takes a whole slot.
- `FirstFitAllocator`: contiguous exact-size reservations (prompt + max_tokens) carved first-fit from
  one token arena; freed ranges merge with free neighbours; holes fragment the arena.
- `PagedAllocator`: the engine's own `KVCacheManager`/`BlockPool`, blocks allocated on demand.

Each allocator keeps its own record of what it stores so the study can check it against the
requests' lengths (`stored_tokens`) and that no two reservations overlap (`check`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Protocol

from kvpager.core.hashing import RequestId
from kvpager.core.kv_cache_manager import KVCacheManager, cdiv
from kvpager.core.request import Request


class KVAllocator(Protocol):
    """What the study needs from an allocation mode. Lengths are token positions stored."""

    name: str
    budget_tokens: int

    def can_ever_fit(self, max_len: int) -> bool: ...
    def reserve(self, request_id: int, length: int, max_len: int) -> bool: ...
    def grow(self, request_id: int, new_len: int) -> bool: ...
    def release(self, request_id: int) -> None: ...
    def reserved_tokens(self) -> int: ...
    def stored_tokens(self) -> int: ...
    def check(self) -> None: ...


@dataclass(slots=True)
class Reservation:
    """A contiguous token range [start, start + capacity) of which `used` positions hold tokens."""

    start: int
    capacity: int
    used: int

    @property
    def end(self) -> int:
        return self.start + self.capacity


def check_disjoint(reservations: list[Reservation], arena_tokens: int) -> None:
    """ValueError if two ranges overlap, one leaves the arena, or one stores more than it reserved."""
    last_end = 0
    for r in sorted(reservations, key=lambda r: r.start):
        if r.start < last_end or r.end > arena_tokens:
            raise ValueError(f"reservation [{r.start}, {r.end}) overlaps another or leaves the arena")
        if not 0 <= r.used <= r.capacity:
            raise ValueError(f"reservation at {r.start} stores {r.used} tokens in {r.capacity} slots")
        last_end = r.end


class SlotAllocator:
    """Fixed slots of `max_model_len` tokens each; a request holds a whole slot for its lifetime."""

    def __init__(self, budget_tokens: int, max_model_len: int) -> None:
        self.name = "contiguous max-len slots"
        self.budget_tokens = budget_tokens
        self.max_model_len = max_model_len
        self.num_slots = budget_tokens // max_model_len
        self._free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() gives the lowest slot
        self._live: dict[int, Reservation] = {}

    def can_ever_fit(self, max_len: int) -> bool:
        return self.num_slots > 0 and max_len <= self.max_model_len

    def reserve(self, request_id: int, length: int, max_len: int) -> bool:
        if not self._free_slots or max_len > self.max_model_len:
            return False
        slot = self._free_slots.pop()
        self._live[request_id] = Reservation(slot * self.max_model_len, self.max_model_len, length)
        return True

    def grow(self, request_id: int, new_len: int) -> bool:
        reservation = self._live[request_id]
        if new_len > reservation.capacity:
            raise ValueError(f"request {request_id} outgrew its slot ({new_len} > {reservation.capacity})")
        reservation.used = new_len
        return True

    def release(self, request_id: int) -> None:
        self._free_slots.append(self._live.pop(request_id).start // self.max_model_len)

    def reserved_tokens(self) -> int:
        return len(self._live) * self.max_model_len

    def stored_tokens(self) -> int:
        return sum(r.used for r in self._live.values())

    def check(self) -> None:
        check_disjoint(list(self._live.values()), self.num_slots * self.max_model_len)
        if len(self._live) + len(self._free_slots) != self.num_slots:
            raise ValueError("slot accounting broken: live + free != number of slots")


class FirstFitAllocator:
    """Exact-size contiguous reservations from one arena, first fit, with coalescing on free."""

    def __init__(self, budget_tokens: int) -> None:
        self.name = "contiguous exact-size first-fit"
        self.budget_tokens = budget_tokens
        self._holes: list[tuple[int, int]] = [(0, budget_tokens)] if budget_tokens > 0 else []  # (start, size)
        self._live: dict[int, Reservation] = {}
        self.num_fragmentation_refusals = 0  # refused although the free total would have fit

    def can_ever_fit(self, max_len: int) -> bool:
        return max_len <= self.budget_tokens

    def free_tokens(self) -> int:
        return sum(size for _, size in self._holes)

    def reserve(self, request_id: int, length: int, max_len: int) -> bool:
        for index, (start, size) in enumerate(self._holes):
            if size >= max_len:
                if size == max_len:
                    del self._holes[index]
                else:
                    self._holes[index] = (start + max_len, size - max_len)
                self._live[request_id] = Reservation(start, max_len, length)
                return True
        if self.free_tokens() >= max_len:
            self.num_fragmentation_refusals += 1
        return False

    def grow(self, request_id: int, new_len: int) -> bool:
        reservation = self._live[request_id]
        if new_len > reservation.capacity:
            raise ValueError(f"request {request_id} outgrew its reservation ({new_len} > {reservation.capacity})")
        reservation.used = new_len
        return True

    def release(self, request_id: int) -> None:
        r = self._live.pop(request_id)
        index = bisect.bisect_left(self._holes, (r.start, 0))
        self._holes.insert(index, (r.start, r.capacity))
        self._merge(index)

    def _merge(self, index: int) -> None:
        """Coalesce the hole at `index` with its right, then its left neighbour."""
        start, size = self._holes[index]
        if index + 1 < len(self._holes) and self._holes[index + 1][0] == start + size:
            size += self._holes.pop(index + 1)[1]
            self._holes[index] = (start, size)
        if index > 0 and sum(self._holes[index - 1]) == start:
            prev_start, prev_size = self._holes[index - 1]
            self._holes[index - 1] = (prev_start, prev_size + size)
            del self._holes[index]

    def reserved_tokens(self) -> int:
        return sum(r.capacity for r in self._live.values())

    def stored_tokens(self) -> int:
        return sum(r.used for r in self._live.values())

    def check(self) -> None:
        holes = [Reservation(start, size, 0) for start, size in self._holes]
        check_disjoint(list(self._live.values()) + holes, self.budget_tokens)
        if self.reserved_tokens() + self.free_tokens() != self.budget_tokens:
            raise ValueError("arena accounting broken: reserved + free != budget")


@dataclass(frozen=True, slots=True)
class _MaxTokens:
    max_tokens: int


class PagedAllocator:
    """The engine's block allocator (prefix caching off: the study's prompts share nothing)."""

    def __init__(self, budget_tokens: int, block_size: int) -> None:
        self.name = f"paged, block {block_size}"
        self.block_size = block_size
        self.num_blocks = budget_tokens // block_size
        self.budget_tokens = self.num_blocks * block_size
        self.kv = KVCacheManager(block_size=block_size, num_blocks=self.num_blocks, enable_caching=False)
        self._live: dict[int, Request] = {}

    def can_ever_fit(self, max_len: int) -> bool:
        return cdiv(max_len, self.block_size) <= self.num_blocks

    def reserve(self, request_id: int, length: int, max_len: int) -> bool:
        request = Request(RequestId(str(request_id)), [0] * length, _MaxTokens(max_len - length))
        if self.kv.allocate_slots(request, length) is None:
            return False
        request.num_computed_tokens = length
        self._live[request_id] = request
        return True

    def grow(self, request_id: int, new_len: int) -> bool:
        request = self._live[request_id]
        num_new = new_len - request.num_computed_tokens
        for _ in range(request.num_tokens, new_len):
            request.append_output_token(0)
        if self.kv.allocate_slots(request, num_new) is None:
            return False
        request.num_computed_tokens = new_len
        return True

    def release(self, request_id: int) -> None:
        self.kv.free(self._live.pop(request_id))

    def reserved_tokens(self) -> int:
        return self.kv.block_pool.num_owned_blocks * self.block_size

    def stored_tokens(self) -> int:
        return sum(r.num_computed_tokens for r in self._live.values())

    def check(self) -> None:
        seen: set[int] = set()
        for request in self._live.values():
            blocks = self.kv.block_ids(request.request_id)
            if len(blocks) != cdiv(request.num_computed_tokens, self.block_size):
                raise ValueError(
                    f"request {request.request_id} holds {len(blocks)} blocks for {request.num_computed_tokens} tokens"
                )
            if seen.intersection(blocks) or len(set(blocks)) != len(blocks):
                raise ValueError(f"request {request.request_id} shares a block with another reservation")
            seen.update(blocks)
        if len(seen) != self.kv.block_pool.num_owned_blocks:
            raise ValueError(f"{self.kv.block_pool.num_owned_blocks} blocks owned but {len(seen)} in block tables")

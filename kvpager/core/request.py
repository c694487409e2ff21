"""Request: one sequence's record as the scheduler sees it. Torch-free.

The scheduler and the KV manager mutate it; the runner never sees it (it gets a frozen
`SchedulerOutput` and keeps its own state per request). Counts follow the project's vocabulary: `num_tokens` = prompt + output so far,
`num_computed_tokens` = positions whose K/V is in the cache, `num_cached_tokens` = prompt positions
served by the prefix cache at (first) admission.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpager.core.hashing import RequestId

__all__ = ["Request", "RequestId", "RequestStatus", "HasMaxTokens"]


class HasMaxTokens(Protocol):
    """All the scheduler needs from sampling params (`kvpager.core.sampling_params.SamplingParams`)."""

    @property
    def max_tokens(self) -> int: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # NOTE: its prefix is being copied from a slower KV tier into device blocks (vLLM's
    # WAITING_FOR_REMOTE_KVS); it is out of the waiting queue until the load completes.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # A prefill-only request whose prompt K/V is complete: it holds its blocks until its owner
    # (KV export) reads them and finishes it.
    PREFILLED = "prefilled"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """vLLM's finish_reason string ("stop" | "length" | "abort"), None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence. `sampling_params` is opaque here except for `max_tokens`.

    A `prefill_only` request (KV export) samples nothing: it needs the K/V of every prompt position,
    may reuse every cached full block, and becomes PREFILLED once its prompt is computed.
    """

    request_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: Any
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    skip_reading_prefix_cache: bool = False  # computes every prompt position (prompt logprobs need logits)
    prefill_only: bool = False

    @property
    def id(self) -> RequestId:
        """Alias of `request_id`."""
        return self.request_id

    @property
    def max_tokens(self) -> int:
        return 0 if self.prefill_only else int(self.sampling_params.max_tokens)

    @property
    def num_kv_positions(self) -> int:
        """Positions that ever need K/V: the last sampled token is never fed back."""
        total = self.num_prompt_tokens + self.max_tokens
        return total if self.prefill_only else total - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output, a new list each call (see `token_ids_between` for a cheap slice)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without copying the whole history."""
        return token_ids_between(self.prompt_token_ids, self.output_token_ids, start, end)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)


def token_ids_between(prompt_token_ids: list[int], output_token_ids: list[int], start: int, end: int) -> list[int]:
    """`(prompt + output)[start:end]` without concatenating the whole history."""
    num_prompt = len(prompt_token_ids)
    if end <= num_prompt:
        return prompt_token_ids[start:end]
    if start >= num_prompt:
        return output_token_ids[start - num_prompt : end - num_prompt]
    return prompt_token_ids[start:] + output_token_ids[: end - num_prompt]

"""What the engine hands back: vLLM-shaped output records. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

# One generated position's logprobs: the sampled token's logprob and the top-k alternatives.
TokenLogprob = tuple[int, float]


@dataclass(slots=True)
class PositionLogprobs:
    token_id: int
    logprob: float
    top: list[TokenLogprob]  # sorted by logprob, highest first
    rank: int | None = None  # 1 + the number of tokens more likely than `token_id` (when computed)


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds between output tokens

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def tpot(self, num_output_tokens: int) -> float | None:
        """Mean time per output token after the first, seconds."""
        if self.first_token_time is None or self.last_token_time is None or num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # One entry per prompt token (None for the first, which has no context), when asked for.
    prompt_logprobs: list[PositionLogprobs | None] | None = None

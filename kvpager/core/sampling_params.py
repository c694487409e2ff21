"""SamplingParams: how one request picks its next tokens. Torch-free.

Names and defaults follow vLLM so that OpenAI-style requests and vLLM scripts map over one to one.
The batched torch `Sampler` that applies these lives in `kvpager/worker/sampler.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

# Below this temperature a request is greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """A decoding constraint (vLLM's structured outputs): `kind` and its text.

    kind: "json" (a JSON schema, serialised), "json_object" (any JSON object; `spec` unused),
    "regex", "choice" (a JSON list of strings) or "grammar" (Lark or GBNF). The grammar engine
    (`kvpager/worker/structured.py`) compiles it; the text is also its cache key.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        _check(
            self.kind in STRUCTURED_KINDS,
            f"structured output kind must be one of {STRUCTURED_KINDS}, got {self.kind!r}",
        )


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (vLLM's names and defaults), validated once at construction.

    NOTE: `stop` is normalised to a list of strings and `stop_token_ids` to a list of ints
    (None becomes []), so readers never branch on the input shape. The object is frozen: use
    `dataclasses.replace` to derive a variant (e.g. with `max_tokens` resolved by the engine).
    """

    n: int = 1
    best_of: int | None = None  # accepted for vLLM compatibility; ignored
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len (the engine resolves it)
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # k >= 0: the sampled token's logprob plus the top-k alternatives
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    prompt_logprobs: int | None = None  # k >= 0: each prompt token's logprob plus the top-k (vLLM)
    structured: StructuredOutputSpec | None = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        object.__setattr__(self, "stop", stop)
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        object.__setattr__(self, "stop_token_ids", [int(t) for t in (self.stop_token_ids or [])])
        self._validate()

    def _validate(self) -> None:
        _check(self.n >= 1, f"n must be >= 1, got {self.n}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, f"top_k must be >= 1, or 0 or -1 to disable it, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1 or None, got {self.max_tokens}"
        )
        _check(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        _check(
            self.repetition_penalty > 0.0,
            f"repetition_penalty must be > 0 (1.0 means off), got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs}",
        )
        bias = self.logit_bias or {}
        _check(all(t >= 0 for t in bias), f"logit_bias token ids must be >= 0, got {sorted(bias)[:5]}")
        _check(
            all(-MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in bias.values()),
            f"logit_bias values must be in [-100, 100], got {sorted(bias.values())[:1] + sorted(bias.values())[-1:]}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop_strings),
            f"stop strings must be non-empty strings, got {self.stop!r}",
        )
        _check(
            all(t >= 0 for t in self.stop_token_ids or []), f"stop_token_ids must be >= 0, got {self.stop_token_ids}"
        )

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list (empty when there are none)."""
        return cast(list[str], self.stop)

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax (temperature below 1e-5)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def top_k_enabled(self) -> bool:
        """True when top-k filtering applies (top_k >= 1)."""
        return self.top_k >= 1

    @property
    def has_penalties(self) -> bool:
        """True when any repetition, presence or frequency penalty changes the logits."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def resolve_max_tokens(self, max_model_len: int, num_prompt_tokens: int) -> int:
        """The output-token limit for a prompt of `num_prompt_tokens` under `max_model_len`.

        `max_tokens=None` means "until the context is full"; an explicit value is also capped by it.
        """
        room = max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens, which leaves no room to generate under "
                f"max_model_len={max_model_len}; shorten the prompt or raise max_model_len"
            )
        return room if self.max_tokens is None else min(self.max_tokens, room)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)

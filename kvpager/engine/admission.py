"""Admission: a request is checked completely before the engine changes any state for it.

`admit` is pure: it tokenizes the prompt, checks every sampling parameter against what the sampler,
the runner and the output processor will do with it (types, finite floats, the seed range of
`torch.Generator.manual_seed`, token ids inside the vocabulary and int64, list sizes under the
engine's `RequestLimits`, ids not in use) and builds the scheduler requests. Only then does the
engine queue them; `Engine.add_request` undoes a partial enqueue should anything still fail, so a
refused request leaves the engine exactly as it was.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvpager.core.hashing import RequestId
from kvpager.core.limits import MAX_SEED, MAX_TOKEN_ID, MIN_SEED, RequestLimits
from kvpager.core.request import Request
from kvpager.core.sampling_params import SamplingParams

_INT_FIELDS = ("n", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs", "best_of")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


@dataclass(frozen=True)
class AdmissionContext:
    """What admission reads from the engine (all of it read-only)."""

    vocab_size: int
    max_model_len: int
    limits: RequestLimits
    encode: Callable[[str], list[int]]
    parent_in_use: Callable[[str], bool]  # a live request already has this id
    sequence_in_use: Callable[[str], bool]  # a live sequence (scheduler or output side) has this id


@dataclass(frozen=True)
class Admission:
    """A request that passed every check: its prompt, resolved params and one scheduler request per sample."""

    request_id: str
    prompt_text: str | None
    prompt_ids: list[int]
    params: SamplingParams  # max_tokens resolved
    max_tokens: int
    requests: list[Request]
    arrival_time: float

    @property
    def seq_ids(self) -> list[str]:
        return [str(r.request_id) for r in self.requests]


def admit(
    ctx: AdmissionContext,
    request_id: str,
    prompt: str | list[int],
    params: SamplingParams,
    arrival_time: float | None = None,
) -> Admission:
    """Check a request completely; ValueError naming the first problem. Changes nothing."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request id must be a non-empty string, got {request_id!r}")
    if ctx.parent_in_use(request_id):
        raise ValueError(f"request id {request_id!r} is already in use")
    check_params(params, ctx.limits)
    check_logit_bias(params, ctx.vocab_size)
    prompt_text, prompt_ids = tokenize(ctx, prompt)
    check_prompt_ids(prompt_ids, ctx.vocab_size, ctx.max_model_len)
    max_tokens = params.max_tokens if params.max_tokens is not None else ctx.max_model_len - len(prompt_ids)
    if max_tokens < 1:
        raise ValueError(
            f"This model's maximum context length is {ctx.max_model_len} tokens and the prompt has "
            f"{len(prompt_ids)} tokens, which leaves no room for output"
        )
    resolved = replace(params, max_tokens=max_tokens)
    seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
    for seq_id in seq_ids:
        if ctx.sequence_in_use(seq_id):
            raise ValueError(
                f"request id {request_id!r} collides with the running sequence {seq_id!r}; pick another id"
            )
    arrival = time.monotonic() if arrival_time is None else float(arrival_time)
    requests = [
        Request(RequestId(seq_id), list(prompt_ids), child_params(resolved, i), arrival_time=arrival)
        for i, seq_id in enumerate(seq_ids)
    ]
    for req in requests:
        # NOTE: a cached prefix has no logits: prompt logprobs recompute the whole prompt (as vLLM).
        req.skip_reading_prefix_cache = req.sampling_params.prompt_logprobs is not None
    return Admission(request_id, prompt_text, prompt_ids, resolved, max_tokens, requests, arrival)


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Every biased token id must index the model's logits (the sampler adds the bias by id)."""
    for token_id in (params.logit_bias or {}).keys():
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"logit_bias token id {token_id} is out of vocabulary (valid ids are 0..{vocab_size - 1})")


def check_params(params: SamplingParams, limits: RequestLimits) -> None:
    """ValueError unless every field has the type and range the engine can act on."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    for name in _INT_FIELDS:
        _check_int(name, getattr(params, name))
    for name in _OPTIONAL_INT_FIELDS:
        if getattr(params, name) is not None:
            _check_int(name, getattr(params, name))
    for name in _FLOAT_FIELDS:
        value = getattr(params, name)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    for name in _BOOL_FIELDS:
        if not isinstance(getattr(params, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(params, name)!r}")
    if params.seed is not None and not MIN_SEED <= params.seed <= MAX_SEED:
        raise ValueError(f"seed must be in [{MIN_SEED}, {MAX_SEED}] (a 64-bit integer), got {params.seed}")
    if params.n > limits.max_sequences_per_request:
        raise ValueError(
            f"n is {params.n}, over the limit of {limits.max_sequences_per_request} sequences per request "
            "(--max-sequences-per-request)"
        )
    if params.logprobs is not None and params.logprobs > limits.max_logprobs:
        raise ValueError(f"logprobs is {params.logprobs}, over the limit of {limits.max_logprobs} (--max-logprobs)")
    if params.prompt_logprobs is not None and params.prompt_logprobs > limits.max_logprobs:
        raise ValueError(
            f"prompt_logprobs is {params.prompt_logprobs}, over the limit of {limits.max_logprobs} (--max-logprobs)"
        )
    stops = params.stop_strings
    if len(stops) > limits.max_stop_strings:
        raise ValueError(f"{len(stops)} stop strings, over the limit of {limits.max_stop_strings} (--max-stop-strings)")
    for stop in stops:
        if len(stop) > limits.max_stop_string_chars:
            raise ValueError(
                f"a stop string has {len(stop)} characters, over the limit of {limits.max_stop_string_chars} "
                "(--max-stop-string-chars)"
            )
        check_text(stop, "stop")
    stop_ids = params.stop_token_ids or []
    if len(stop_ids) > limits.max_stop_token_ids:
        raise ValueError(
            f"{len(stop_ids)} stop_token_ids, over the limit of {limits.max_stop_token_ids} (--max-stop-token-ids)"
        )
    if any(t > MAX_TOKEN_ID for t in stop_ids):
        raise ValueError(f"stop_token_ids must be in [0, {MAX_TOKEN_ID}]")


def tokenize(ctx: AdmissionContext, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """The prompt's text (None for token ids) and its token ids; ValueError on a bad type."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        check_text(prompt, "prompt")
        return prompt, list(ctx.encode(prompt))
    if not isinstance(prompt, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError("prompt must be a string or a list of integer token ids")
    return None, [int(t) for t in prompt]


def check_prompt_ids(prompt_ids: Sequence[int], vocab_size: int, max_model_len: int) -> None:
    if not prompt_ids:
        raise ValueError("prompt is empty (0 tokens)")
    bad = [t for t in prompt_ids if t < 0 or t >= vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is out of vocabulary (valid ids are 0..{vocab_size - 1})")
    if len(prompt_ids) > max_model_len:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"has {len(prompt_ids)} tokens. Please reduce the length of the prompt."
        )


def check_text(text: str, name: str) -> None:
    """ValueError on text the tokenizer cannot encode as UTF-8 (a lone surrogate such as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} is not valid Unicode text: character {exc.object[exc.start : exc.end]!r} at position "
            f"{exc.start} is a lone surrogate"
        ) from None


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample i of n: the seed is offset by i (modulo 2**64, the generator's range) so seeded samples
    differ yet stay reproducible; only sample 0 computes prompt logprobs (the others may then share
    the prompt's cached blocks)."""
    if index == 0:
        return params
    seed = None if params.seed is None else (params.seed + index) % 2**64
    return replace(params, seed=seed, prompt_logprobs=None)


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")

"""Per-request work bounds: what one request may ask of the engine. Torch-free, validated once.

Each bound caps work that runs on the engine thread for every step of a request (stop token ids
are checked per token, stop strings per detokenized piece) or that multiplies one HTTP request into
many engine sequences (prompts × n), so that one request cannot stall every other stream. The flag
names follow vLLM where vLLM has the concept (`--max-logprobs`); the others are kvpager's.
"""

from __future__ import annotations

from dataclasses import dataclass

# What torch.Generator.manual_seed accepts: any int64 or uint64 value (negative seeds wrap modulo 2**64).
MIN_SEED = -(2**63)
MAX_SEED = 2**64 - 1
# Token ids anywhere in a request (stop_token_ids, prompts) must fit an int64 tensor.
MAX_TOKEN_ID = 2**63 - 1

DEFAULT_MAX_LOGPROBS = 20
DEFAULT_MAX_STOP_STRINGS = 64
DEFAULT_MAX_STOP_STRING_CHARS = 1024
DEFAULT_MAX_STOP_TOKEN_IDS = 256
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256


@dataclass(frozen=True)
class RequestLimits:
    """Bounds checked at admission; a request over one is refused with a ValueError naming the flag."""

    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # --max-logprobs (vLLM's name and default)
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS  # --max-stop-strings
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS  # --max-stop-string-chars (each string)
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS  # --max-stop-token-ids
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST  # --max-sequences-per-request (prompts × n)

    def __post_init__(self) -> None:
        minimums = {
            "max_logprobs": 0,
            "max_stop_strings": 0,
            "max_stop_string_chars": 1,
            "max_stop_token_ids": 0,
            "max_sequences_per_request": 1,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
